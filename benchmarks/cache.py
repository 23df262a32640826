# Benchmark: Flow-GRPO epoch time and peak memory with prompts encoded online vs read from the embedding
# cache (preprocess.py), from one run of each side by side, on a tiny FLUX.1 whose text encoders have
# FLUX.1-dev's size relative to its transformer (T5-XXL 4.7B + CLIP-L 0.12B against 12B: 0.39 and 0.01).
#   python benchmarks/cache.py            (CPU: peak memory is the process's peak RSS)
#   python benchmarks/cache.py --scale 8  (GPU: larger models, peak memory is torch's peak allocation)
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    epochs: int = 5
    """epochs per run; the first `warmup` are not timed"""
    warmup: int = 2
    """epochs left out of the timing (first-call overheads)"""
    scale: int = 1
    """width multiplier of every model (1: a few million parameters, for CPUs)"""
    max_sequence_length: int = 64
    """T5 prompt length"""
    output_dir: str = "runs/bench-cache"
    """where the pipeline, the cache and both runs go"""
    dtype: str = "auto"
    """model dtype (auto: bf16 on GPU, float32 on CPU)"""


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_pipeline(path: Path, scale: int) -> dict:
    """FLUX.1-like pipeline with text encoders in FLUX.1-dev's proportion to the transformer."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from common.models.tiny_parts import tiny_clip_tokenizer, tiny_t5_tokenizer

    torch.manual_seed(0)
    width = 64 * scale
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer(max_length=512)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=32,
        num_attention_heads=width // 32 * 2, joint_attention_dim=width, pooled_projection_dim=width // 2,
        guidance_embeds=True, axes_dims_rope=(8, 12, 12))
    target = 4.7 / 12 * count(transformer)
    t5_config = dict(vocab_size=len(tokenizer_2), d_model=width, d_kv=32, num_heads=width // 32,
                     relative_attention_num_buckets=8, num_layers=1, d_ff=4 * width)
    per_layer = count(T5EncoderModel(T5Config(**{**t5_config, "num_layers": 2}))) - count(T5EncoderModel(T5Config(**t5_config)))
    t5_config["num_layers"] = max(1, round((target - count(T5EncoderModel(T5Config(**t5_config)))) / per_layer) + 1)
    text_encoder_2 = T5EncoderModel(T5Config(**t5_config))
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width // 2, intermediate_size=width, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77, projection_dim=width // 2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        block_out_channels=[8, 8, 8, 8], layers_per_block=1, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                        use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer).save_pretrained(path)
    return {"transformer": count(transformer), "t5": count(text_encoder_2), "clip": count(text_encoder)}


def run(*args) -> None:
    subprocess.run([sys.executable, *map(str, args)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    args = tyro.cli(Args)
    out = Path(args.output_dir).resolve()
    model = out / f"pipeline-x{args.scale}"
    sizes = build_pipeline(model, args.scale) if not (model / "model_index.json").exists() else None
    if sizes:
        print(f"parameters: transformer {sizes['transformer']:,}  T5 {sizes['t5']:,} "
              f"({sizes['t5'] / sizes['transformer']:.2f}x)  CLIP {sizes['clip']:,} "
              f"({sizes['clip'] / sizes['transformer']:.3f}x)")
    common = ["--preset", "tiny", "--model-path", model, "--max-sequence-length", args.max_sequence_length,
              "--epochs", args.epochs, "--eval-every", 0, "--save-every", 0, "--dtype", args.dtype]
    run("preprocess.py", "--model-path", model, "--max-sequence-length", args.max_sequence_length,
        "--cache-dir", out / "cache", "--dtype", args.dtype)
    results = {}
    for name, flags in {"online": ["--no-cache"], "cache": ["--cache-dir", out / "cache"]}.items():
        run_dir = out / f"run-{name}"
        if run_dir.exists():
            import shutil
            shutil.rmtree(run_dir)
        run("algos/grpo.py", *common, *flags, "--output-dir", run_dir)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = metrics[args.warmup:]
        results[name] = {"epoch_time_s": statistics.median(m["epoch_time_s"] for m in timed),
                         "rollout_time_s": statistics.median(m["rollout_time_s"] for m in timed),
                         "peak_memory_gb": metrics[-1]["peak_memory_gb"]}
    device = "GPU" if torch.cuda.is_available() else "CPU"
    memory = "peak allocated" if device == "GPU" else "peak RSS"
    print(f"\n| prompts | epoch time (s) | rollout time (s) | {memory} (GB) |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['epoch_time_s']:.3f} | {r['rollout_time_s']:.3f} | {r['peak_memory_gb']:.3f} |")
    on, ca = results["online"], results["cache"]
    print(f"\nspeed-up per epoch (online / cache): {on['epoch_time_s'] / ca['epoch_time_s']:.2f}x; "
          f"peak memory cut: {100 * (1 - ca['peak_memory_gb'] / on['peak_memory_gb']):.1f}% "
          f"({device}, scale {args.scale}, {args.epochs - args.warmup} timed epochs, median)")
    os.makedirs(out, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
