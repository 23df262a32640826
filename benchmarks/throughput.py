# Benchmark: each script's step time and model-FLOPs utilisation at real widths, on random weights, in one run.
# It builds one FLUX.1 pipeline with FLUX.1-dev's transformer widths (3072 wide, 24 heads × 128, T5-XXL's 4096-wide
# text states, 768-wide pooled CLIP, FLUX.1's VAE) but --double-layers / --single-layers blocks instead of 19 / 38
# (a block's cost is that of the real one; a whole step scales with the blocks), then runs every script of algos/
# for --epochs epochs on it (bf16 on a GPU) and reads metrics.jsonl's last epoch: rollout and training seconds, the
# optimizer steps, `tflops` and `mfu` (the scripts' own FLOPs count) and peak memory. grpo's `ratio_dev_first` is
# the bf16 ratio drift: how far the ratio moved from 1 before the first update (0 in float32). Two more grpo runs
# give the embedding cache's effect on an epoch (prompts read from the cache against encoded online).
# Prints one markdown table; --json-out writes the rows.
#   python benchmarks/throughput.py --size tiny --resolution 64 --scripts grpo nft   (a CPU smoke run, ~1 minute)
#   python benchmarks/throughput.py --json-out throughput.json                      (one GPU, a few minutes)
#   python benchmarks/throughput.py --scripts grpo --sequence-parallel 2           (2 GPUs: grpo split over both too)
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

REPO = Path(__file__).resolve().parent.parent
# opd distils teachers' LoRAs, which a random pipeline does not have: left out.
SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py") if p.stem != "opd")
# black-forest-labs/FLUX.1-dev transformer/config.json, but the block counts (set by --double/--single-layers).
FLUX1_DEV = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
                 joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# The tiny FLUX.1's widths (`build_tiny_flux1` in common/models/flux.py), for a CPU smoke run.
TINY = dict(patch_size=1, in_channels=16, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))


@dataclass
class Args:
    size: Literal["flux1-dev", "tiny"] = "flux1-dev"
    """transformer widths: FLUX.1-dev's, or tiny ones (a CPU smoke run)"""
    double_layers: int = 2
    """double-stream blocks (FLUX.1-dev: 19)"""
    single_layers: int = 4
    """single-stream blocks (FLUX.1-dev: 38)"""
    resolution: int = 512
    """image size: (resolution / 16)² image tokens"""
    scripts: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """scripts of algos/ to run"""
    epochs: int = 2
    """epochs per run; the last one is reported (the first warms up)"""
    prompts_per_epoch: int = 2
    group_size: int = 4
    batch_size: int = 4
    max_sequence_length: int = 64
    output_dir: str = "runs/bench-throughput"
    json_out: str | None = None
    peak_tflops: float | None = None
    """the GPU's peak for mfu (unset: the scripts' default for a known GPU; on a CPU no mfu)"""
    timeout_s: float = 60.0
    """a run still going after this many seconds is stopped and reported as failed (the table still prints)"""
    sequence_parallel: int = 1
    """N > 1: one more grpo run, its transformer split over N processes (`accelerate launch --num_processes N
    ... --sequence-parallel N`: N GPUs, or N gloo processes on a CPU), as the row `grpo --sequence-parallel N`; its
    TFLOP/s are the N processes' together, its MFU against N peaks"""
    extra_args: str = ""
    """more flags for every run, e.g. "--attention-backend flash --gradient-checkpointing" """


def build_pipeline(path: Path, args: Args) -> int:
    """A FLUX.1 pipeline of random weights at the chosen widths, saved like a real checkpoint; its transformer's
    parameter count."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from common.models.tiny_parts import tiny_clip_tokenizer, tiny_t5_tokenizer

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    widths = FLUX1_DEV if args.size == "flux1-dev" else TINY
    real = args.size == "flux1-dev"
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer(max_length=512)
    with torch.device(device):
        transformer = FluxTransformer2DModel(num_layers=args.double_layers, num_single_layers=args.single_layers,
                                             **widths).to(dtype)
        # T5-XXL's layer (4096 wide, 64 heads × 64, FF 10240) and CLIP-L's width, two and one layers deep
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=widths["joint_attention_dim"], d_kv=64 if real else 16,
            num_heads=64 if real else 2, d_ff=10240 if real else 64, num_layers=2 if real else 1,
            relative_attention_num_buckets=32 if real else 8, feed_forward_proj="gated-gelu")).to(dtype)
        clip_width = widths["pooled_projection_dim"]
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=clip_width, intermediate_size=4 * clip_width, num_hidden_layers=1,
            num_attention_heads=12 if real else 2, max_position_embeddings=77, projection_dim=clip_width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)).to(dtype)
        channels = widths["in_channels"] // 4
        # FLUX.1's VAE (black-forest-labs/FLUX.1-dev vae/config.json); a small one for the smoke run
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=channels,
                            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                            block_out_channels=[128, 256, 512, 512] if real else [8, 8, 8, 8],
                            layers_per_block=2 if real else 1, norm_num_groups=32 if real else 4,
                            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                            use_post_quant_conv=False).to(dtype)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer).save_pretrained(path)
    return sum(p.numel() for p in transformer.parameters())


def train(script: str, model: Path, out: Path, args: Args, *flags, processes: int = 1) -> dict:
    """One run of `algos/<script>.py` on the pipeline (on `processes` processes: `accelerate launch`); its last
    metrics line and wall seconds."""
    if out.exists():
        shutil.rmtree(out)
    launch = [sys.executable] + (["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
                                 if processes > 1 else [])
    command = [*launch, str(REPO / "algos" / f"{script}.py"), "--preset", "tiny", "--model-path", str(model),
               "--resolution", str(args.resolution), "--max-sequence-length", str(args.max_sequence_length),
               "--epochs", str(args.epochs), "--prompts-per-epoch", str(args.prompts_per_epoch),
               "--group-size", str(args.group_size), "--batch-size", str(args.batch_size), "--eval-every", "0",
               "--save-every", "0", "--output-dir", str(out), "--cache-dir", str(out.parent / "cache"),
               *args.extra_args.split(),
               *(["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []), *map(str, flags)]
    start = time.time()
    try:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"still running after {args.timeout_s:.0f} s (--timeout-s)"}
    if result.returncode != 0:
        tail = " ".join(result.stderr.strip().splitlines()[-2:])[-300:]
        return {"error": f"exit {result.returncode}: {tail}"}
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {**json.loads(lines[-1]), "wall_s": time.time() - start}


def cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if isinstance(row.get(key), (int, float)) else "–"


if __name__ == "__main__":
    args = tyro.cli(Args)
    unknown = sorted(set(args.scripts) - set(SCRIPTS))
    if unknown:
        sys.exit(f"error: unknown script(s) {', '.join(unknown)}; choose from: {', '.join(SCRIPTS)}")
    root = Path(args.output_dir).resolve()
    model = root / f"pipeline-{args.size}-{args.double_layers}x{args.single_layers}"
    if not (model / "model_index.json").exists():
        start = time.time()
        count = build_pipeline(model, args)
        print(f"built {model.name}: transformer {count / 1e9:.2f}B parameters ({time.time() - start:.0f} s)")
    cache = root / "cache"  # every run reads its prompts from the embedding cache, as the scripts do by default
    subprocess.run([sys.executable, str(REPO / "preprocess.py"), "--model-path", str(model), "--max-sequence-length",
                    str(args.max_sequence_length), "--cache-dir", str(cache)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    rows = {}
    for script in args.scripts:
        rows[script] = train(script, model, root / script, args)
        print(f"{script}: {rows[script].get('error') or 'done in %.0f s' % rows[script]['wall_s']}", flush=True)
    # the embedding cache: grpo's epoch with prompts encoded online (text encoders loaded) against cached
    rows["grpo --no-cache"] = train("grpo", model, root / "grpo-online", args, "--no-cache")
    if args.sequence_parallel > 1:  # one micro-batch split over N processes (common/parallel.py)
        split = f"grpo --sequence-parallel {args.sequence_parallel}"
        rows[split] = train("grpo", model, root / "grpo-sp", args, "--sequence-parallel", args.sequence_parallel,
                            processes=args.sequence_parallel)
        outcome = rows[split].get("error") or f"done in {rows[split]['wall_s']:.0f} s"
        print(f"{split}: {outcome}", flush=True)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}; FLUX.1 at {args.size} widths with {args.double_layers} + {args.single_layers} blocks "
          f"(FLUX.1-dev: 19 + 38), {args.resolution} px, {args.prompts_per_epoch} prompts × {args.group_size}, "
          f"micro-batch {args.batch_size}, {args.max_sequence_length} text tokens; the last of {args.epochs} epochs\n")
    print("| run | rollout s | train s | optimizer steps | train s / step | TFLOP/s | MFU | peak GB "
          "| bf16 ratio drift |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | failed: {row['error']} |||||||")
            continue
        steps = row["optimizer_steps"] / args.epochs
        per_step = row["train_time_s"] / steps if steps else float("nan")
        print(f"| {name} | {cell(row, 'rollout_time_s', '.2f')} | {cell(row, 'train_time_s', '.2f')} | {steps:g} | "
              f"{per_step:.3f} | {cell(row, 'tflops', '.3g')} | {cell(row, 'mfu', '.3f')} | "
              f"{cell(row, 'peak_memory_gb', '.1f')} | {cell(row, 'ratio_dev_first', '.2e')} |")
    cached, online = rows.get("grpo", {}), rows["grpo --no-cache"]
    if "epoch_time_s" in cached and "epoch_time_s" in online:
        print(f"\nembedding cache: grpo epoch {online['epoch_time_s']:.2f} s online, {cached['epoch_time_s']:.2f} s "
              f"cached ({online['epoch_time_s'] / cached['epoch_time_s']:.2f}x); peak "
              f"{online['peak_memory_gb']:.1f} GB against {cached['peak_memory_gb']:.1f} GB")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    sys.exit(1 if any("error" in row for row in rows.values()) else 0)
