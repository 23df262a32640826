# Benchmark: the cost of our rollout (with log-probs) against diffusers' own `FluxPipeline.__call__` on the
# same model, steps, batch and prompt embeddings, and against the floor: the transformer calls alone.
# Each variant is timed in one run side by side, interleaved, after a warm-up; medians are printed.
#   python benchmarks/overhead.py                       (the tiny FLUX.1 on a CPU)
#   python benchmarks/overhead.py --model-path black-forest-labs/FLUX.1-dev --resolution 512 --batch-size 8
import statistics
import time
from dataclasses import dataclass

import torch
import tyro

from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample, sample_generators
from common.utils import quiet_libraries, resolve_dtype


@dataclass
class Args:
    model_path: str = "tiny"
    """FLUX.1 pipeline (hub id, folder, or `tiny`)"""
    resolution: int = 64
    """image size"""
    batch_size: int = 8
    """samples per call"""
    num_steps: int = 8
    """sampling steps"""
    repeats: int = 20
    """timed repetitions of each variant"""
    max_sequence_length: int = 32
    """T5 prompt length"""
    dtype: str = "auto"
    """model dtype (auto: bf16 on GPU, float32 on CPU)"""


def grpo_rollout(adapter, cond, sigmas, generators):
    """algos/grpo.py's rollout loop: flow-sde at every step, x_j, x_{j+1} and log p of all but the last kept."""
    x, stored = adapter.noise(generators), []
    for j in range(len(sigmas) - 1):
        v = adapter.velocity(x, sigmas[j], cond, 3.5)
        x_next, log_prob, _, _ = sde_step("flow-sde", v, x, sigmas[j], sigmas[j + 1], 0.9, generator=generators)
        if j < len(sigmas) - 2:
            stored.append((x, x_next, log_prob))
        x = x_next
    return x, stored


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    args = tyro.cli(Args)
    quiet_libraries()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    adapter = load_adapter("flux1", args.model_path, device, resolve_dtype(args.dtype, device), args.resolution,
                           args.max_sequence_length)
    pipe = adapter.pipe
    with adapter.text_encoders_on_device():
        cond = adapter.encode_prompts(["a photo of a cat"] * args.batch_size)
    sigmas = adapter.sigmas(args.num_steps)
    seeds = list(range(args.batch_size))
    latents = adapter.noise(sample_generators(seeds, device))

    variants = {
        "diffusers FluxPipeline (latents out)": lambda: pipe(
            prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_prompt_embeds"],
            height=args.resolution, width=args.resolution, num_inference_steps=args.num_steps, guidance_scale=3.5,
            generator=sample_generators(seeds, device), output_type="latent", max_sequence_length=args.max_sequence_length),
        "ours: ODE rollout": lambda: sample(lambda x, sigma: adapter.velocity(x, sigma, cond, 3.5),
                                            adapter.noise(sample_generators(seeds, device)), sigmas, "ode"),
        "ours: flow-sde rollout, log-probs of all steps stored": lambda: grpo_rollout(
            adapter, cond, sigmas, sample_generators(seeds, device)),
        "floor: the transformer calls alone": lambda: [adapter.velocity(latents, float(s), cond) for s in sigmas[:-1]],
    }
    with torch.no_grad():
        for fn in variants.values():  # warm-up: first calls are ~10x slower
            fn(), fn()
        times = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():
                times[name].append(timed(fn, device))
    floor = statistics.median(times["floor: the transformer calls alone"])
    reference = statistics.median(times["diffusers FluxPipeline (latents out)"])
    print(f"{device.type}, {args.model_path}, {args.resolution}px, batch {args.batch_size}, {args.num_steps} steps, "
          f"{args.repeats} repeats (median)\n")
    print("| variant | time (ms) | / diffusers | / floor |\n|---|---|---|---|")
    for name, values in times.items():
        t = statistics.median(values)
        print(f"| {name} | {1000 * t:.2f} | {t / reference:.2f} | {t / floor:.2f} |")
