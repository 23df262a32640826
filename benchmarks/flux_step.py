# Benchmark: one LoRA Flow-GRPO training step on a FLUX.1-dev-sized transformer (random weights), with and
# without gradient checkpointing, at several resolutions. A step is what algos/grpo.py does per optimizer
# step ("3. policy update") for one micro-batch at one denoising step: the rollout forward without grad
# (x -> x', log-prob), then forward with grad, ratio, clipped surrogate, backward, grad clipping, AdamW.
# Printed: median rollout-forward and train-step times, and peak GPU memory per variant (n/a on a CPU).
#   python benchmarks/flux_step.py --size tiny --resolutions 64 128       (seconds on a CPU)
#   python benchmarks/flux_step.py --json-out flux_step.json              (FLUX.1-dev size: one big GPU)
import gc
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import tyro
from diffusers import FluxTransformer2DModel

from common.dynamics import sde_step
from common.models import load_adapter, tiny_model_path
from common.models.flux import FluxAdapter
from common.sampling import sample_generators
from common.training import add_lora, trainable_parameters
from common.utils import avoid_cudnn_attention, quiet_libraries, resolve_dtype

# black-forest-labs/FLUX.1-dev transformer/config.json (≈11.9B parameters).
FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))
# algos/grpo.py, preset flux1-flowgrpo: 6 steps, η 0.9, clip 1e-4, AdamW lr 3e-4 / wd 1e-4, grad norm 1.
NUM_STEPS, STEP, NOISE_LEVEL, CLIP_RANGE, LR, WEIGHT_DECAY, MAX_GRAD_NORM = 6, 2, 0.9, 1e-4, 3e-4, 1e-4, 1.0


@dataclass
class Args:
    size: Literal["flux1-dev", "tiny"] = "flux1-dev"
    """transformer config: FLUX.1-dev's, or the tiny pipeline's (CPU smoke runs)"""
    resolutions: list[int] = field(default_factory=lambda: [512, 1024])
    """image sizes; (res/16)^2 image tokens each"""
    batch_size: int = 1
    """samples per micro-batch"""
    text_tokens: int = 512
    """T5 prompt length (random embeddings)"""
    repeats: int = 5
    """timed repetitions per variant (median reported)"""
    warmup: int = 2
    """untimed repetitions first"""
    lora_rank: int = 64
    """LoRA rank (flux1-flowgrpo preset: 64)"""
    lora_alpha: float = 128
    """LoRA alpha (flux1-flowgrpo preset: 128)"""
    dtype: str = "bfloat16"
    """model dtype: bfloat16, float32, or auto (bf16 on GPU, float32 on CPU)"""
    json_out: str | None = None
    """write every number to this JSON file"""


def build_transformer(config: dict, device: torch.device, dtype: torch.dtype) -> FluxTransformer2DModel:
    """Random weights initialised on `device` directly in `dtype`: no float32 copy (48 GB at full size)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return FluxTransformer2DModel.from_config(config).requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


def flux_adapter(transformer, resolution: int, args: Args, device, dtype) -> FluxAdapter:
    """The project's FLUX.1 adapter (packing, ids, guidance, σ schedule) over `transformer`. The tiny pipeline
    supplies the rest; its VAE downsamples 8x and its scheduler is FLUX.1-dev's, so geometry and σs match."""
    adapter = load_adapter("flux1", "tiny", device, dtype, resolution, args.text_tokens, load_text_encoders=False)
    adapter.transformer = adapter.pipe.transformer = transformer
    adapter.config = transformer.config  # velocity reads guidance_embeds, noise the channel count from it
    adapter.num_channels = transformer.config.in_channels // 4
    assert adapter.vae_scale_factor == 8 and adapter.image_ids.shape[0] == (resolution // 16) ** 2
    return adapter


def measure(adapter, params, optimizer, args: Args, device) -> dict:
    """Rollout forward and train step, `warmup` + `repeats` times; medians, peak memory, last loss/grad norm."""
    cfg, batch = adapter.config, args.batch_size
    x = adapter.noise(sample_generators(range(batch), device))
    cond = {"prompt_embeds": torch.randn(batch, args.text_tokens, cfg.joint_attention_dim, device=device,
                                         dtype=adapter.dtype),
            "pooled_prompt_embeds": torch.randn(batch, cfg.pooled_projection_dim, device=device, dtype=adapter.dtype)}
    advantages = torch.randn(batch, device=device)
    sigmas = adapter.sigmas(NUM_STEPS)
    sigma, sigma_next, guidance = sigmas[STEP], sigmas[STEP + 1], adapter.default_guidance_scale

    @torch.no_grad()
    def rollout():
        adapter.transformer.eval()
        v = adapter.velocity(x, sigma, cond, guidance)
        return sde_step("flow-sde", v, x, sigma, sigma_next, NOISE_LEVEL)[:2]

    def train(x_next, log_prob_old):
        adapter.transformer.train()
        v = adapter.velocity(x, sigma, cond, guidance)
        _, log_prob, _, _ = sde_step("flow-sde", v, x, sigma, sigma_next, NOISE_LEVEL, prev_sample=x_next)
        ratio = torch.exp(log_prob - log_prob_old)
        clipped = torch.clamp(ratio, 1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE)
        loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm.item()

    def timed(fn, *inputs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rollout_times, train_times = [], []
    for i in range(args.warmup + args.repeats):
        rollout_s, (x_next, log_prob_old) = timed(rollout)
        train_s, (loss, grad_norm) = timed(train, x_next, log_prob_old)
        if i >= args.warmup:
            rollout_times.append(rollout_s)
            train_times.append(train_s)
    if not (torch.isfinite(log_prob_old).all() and math.isfinite(loss) and math.isfinite(grad_norm)):
        raise RuntimeError(f"non-finite output (log-prob {log_prob_old.tolist()}, loss {loss}, grad {grad_norm})")
    return dict(rollout_s=statistics.median(rollout_times), train_s=statistics.median(train_times),
                rollout_times=rollout_times, train_times=train_times, loss=loss, grad_norm=grad_norm,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)


if __name__ == "__main__":
    args = tyro.cli(Args)
    quiet_libraries()
    avoid_cudnn_attention()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    torch.manual_seed(0)
    start = time.perf_counter()
    config = FLUX1_DEV if args.size == "flux1-dev" else \
        FluxTransformer2DModel.load_config(tiny_model_path("flux1"), subfolder="transformer")
    transformer = build_transformer(config, device, dtype)
    total_params = sum(p.numel() for p in transformer.parameters())
    add_lora(transformer, args.lora_rank, args.lora_alpha, FluxAdapter.lora_target_modules)
    params = trainable_parameters(transformer)  # float32 master weights, as in grpo.py
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=WEIGHT_DECAY, eps=1e-8)
    build_s = time.perf_counter() - start
    lora_params = sum(p.numel() for p in params)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, {args.size}, {dtype}, batch {args.batch_size}, {args.text_tokens} text tokens, "
          f"{args.warmup} warm-up + {args.repeats} timed (median)")
    print(f"transformer: {total_params:,} parameters; LoRA r{args.lora_rank}/α{args.lora_alpha:g}: "
          f"{lora_params:,} trainable; built in {build_s:.1f} s\n")

    # Each row is printed, and the JSON rewritten, as soon as it is measured: a run cut short keeps its numbers.
    print("| resolution | image+text tokens | grad ckpt | rollout fwd s | train step s | peak GiB "
          "| time ckpt/no | mem ckpt/no |\n|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for resolution in args.resolutions:
        adapter = flux_adapter(transformer, resolution, args, device, dtype)
        for checkpointing in (False, True):
            if checkpointing:
                transformer.enable_gradient_checkpointing()
            else:
                transformer.disable_gradient_checkpointing()
            row = dict(resolution=resolution, image_tokens=adapter.image_ids.shape[0],
                       gradient_checkpointing=checkpointing)
            try:
                row.update(measure(adapter, params, optimizer, args, device), oom=False)
            except torch.cuda.OutOfMemoryError:
                row["oom"] = True
            optimizer.zero_grad(set_to_none=True)  # an OOM mid-backward leaves gradients behind
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)

            base = rows[-2] if checkpointing else row  # the same resolution without checkpointing
            cells = [resolution, f"{row['image_tokens']}+{args.text_tokens}", "on" if checkpointing else "off"]
            if row["oom"]:
                cells += ["OOM"] * 3 + [""] * 2
            else:
                cells += [f"{row['rollout_s']:.3f}", f"{row['train_s']:.3f}",
                          "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"]
                for key in ("train_s", "peak_gib"):
                    comparable = checkpointing and not base["oom"] and row[key] is not None
                    cells.append(f"{row[key] / base[key]:.2f}" if comparable else "")
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            if args.json_out:
                with open(args.json_out, "w") as f:
                    json.dump(dict(device=name, size=args.size, dtype=str(dtype), batch_size=args.batch_size,
                                   text_tokens=args.text_tokens, lora_rank=args.lora_rank,
                                   lora_alpha=args.lora_alpha, total_params=total_params, lora_params=lora_params,
                                   build_s=build_s, rows=rows), f, indent=1)
