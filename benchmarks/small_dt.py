"""How strongly each SDE step's log-prob answers the model, on the real image and video schedules (algorithms.md §4,
"Small steps"). At a step's own sample x' = μ + S·z the per-element gradient of its log-prob w.r.t. the velocity
output is ∂ log p / ∂v = −k·z / (elements), with k = |∂μ/∂v| / S for flow-sde and dance-sde (∝ √(−dt): ∂μ/∂v ∝ dt,
S ∝ √(−dt)) and k = 2·S·|∂μ/∂v| for cps's unnormalised log-prob (`common.dynamics.log_prob_velocity_scale`). The
policy gradient of the coupled scripts (grpo, grpo_guard, mixgrpo, dppo) carries k of each trained step. A large
time shift (video: Wan2.1 3–5, Wan2.2 A14B 12) keeps σ near 1 and dt small on most steps, so k is small there.

Part 1 (schedule only, no model): per trained step (every step but the last) σ, −dt, k of each dynamics and k
relative to the schedule's largest, for each setting; then a summary against FLUX.1's. The schedules come from the
adapters' own `sigmas` on the published scheduler configs (FLUX.1-dev's dynamic shift at 512², SD3.5's static 3,
Wan's UniPC flow schedule at flow_shift 3, 5, 12; HunyuanVideo-1.5's shift 5; LTX-2's token-fitted shift).

Part 2 (autograd): the tiny Wan2.1 (random weights, real classes; common/models/wan.py), a fresh LoRA, rolled out with
flow-sde on two real Wan schedules; per step the autograd norm of ∂ log p / ∂v (× elements / ‖z‖: must equal k) and
of ∂ log p / ∂θ over the LoRA weights, each relative to the schedule's largest step. Part 3: the same on the toy
video world's Wan model with grpo.py's toy-video preset.

Usage: OMP_NUM_THREADS=1 python benchmarks/small_dt.py [--skip-autograd]
"""
import argparse
import math
import sys
from types import SimpleNamespace

import numpy as np
import torch

from common.dynamics import log_prob_velocity_scale, sde_step

# η of each dynamics: grpo.py's flow-sde default and its FLUX.1 / Wan2.2 presets (0.9), DanceGRPO's 0.3, and
# Flow-GRPO-Fast's cps setting (0.8).
NOISE_LEVEL = {"flow-sde": 0.9, "dance-sde": 0.3, "cps": 0.8}


def flux_sigmas(num_steps: int, resolution: int = 512) -> torch.Tensor:
    """FLUX.1-dev's schedule (its scheduler config: dynamic shift from the image token count)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.models.flux import FluxAdapter

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    latent = 2 * (resolution // 16)  # the VAE's 8× and FLUX's 2×2 packing
    return FluxAdapter.sigmas(SimpleNamespace(scheduler=scheduler, latent_h=latent, latent_w=latent, device="cpu"),
                              num_steps)


def sd3_sigmas(num_steps: int) -> torch.Tensor:
    """SD3.5's schedule (its scheduler config: static shift 3, no dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.models.sd3 import SD3Adapter

    return SD3Adapter.sigmas(SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), device="cpu"),
                             num_steps)


def wan_scheduler(flow_shift: float):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift)


def wan_sigmas(num_steps: int, flow_shift: float) -> torch.Tensor:
    """Wan's UniPC flow schedule at `flow_shift`, as WanAdapter builds it (Wan2.1, Wan2.2 A14B and TI2V-5B alike)."""
    from common.models.wan import WanAdapter

    return WanAdapter.sigmas(SimpleNamespace(scheduler=wan_scheduler(flow_shift), device="cpu"), num_steps)


def hunyuan_video15_sigmas(num_steps: int) -> torch.Tensor:
    """HunyuanVideo-1.5's schedule (flow shift 5, its 480p checkpoints' scheduler config), as its adapter builds it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.models.hunyuan_video15 import HunyuanVideo15Adapter

    return HunyuanVideo15Adapter.sigmas(SimpleNamespace(scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                                                        device="cpu"), num_steps)


def ltx2_sigmas(num_steps: int, video_tokens: tuple[int, int, int]) -> torch.Tensor:
    """LTX-2's schedule: μ fitted to the video token count (base 0.95 at 1024 tokens, max 2.05 at 4096), terminal σ
    stretched to 0.1, as its adapter builds it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.models.ltx2 import LTX2Adapter

    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    return LTX2Adapter.sigmas(SimpleNamespace(scheduler=scheduler, video_tokens=video_tokens, device="cpu"),
                              num_steps)


# (name, schedule). Step counts are the presets' (grpo.py) or, where no preset exists, the reference trainer's.
SETTINGS = [
    ("FLUX.1-dev 512², 6 steps (flux1-flowgrpo)", lambda: flux_sigmas(6)),
    ("SD3.5-M, shift 3, 10 steps (Flow-GRPO)", lambda: sd3_sigmas(10)),
    ("Wan2.1 T2V 480p, shift 3, 20 steps (Flow-GRPO's Wan2.1 trainer)", lambda: wan_sigmas(20, 3.0)),
    ("Wan2.1 T2V 720p, shift 5, 20 steps", lambda: wan_sigmas(20, 5.0)),
    # Wan2.2 I2V-A14B samples at the same shift 5: the same schedule.
    ("Wan2.2 TI2V-5B, shift 5, 10 steps (wan2.2-5b-flowfactory)", lambda: wan_sigmas(10, 5.0)),
    ("Wan2.2 T2V-A14B, shift 12, 10 steps (wan2.2-flowfactory)", lambda: wan_sigmas(10, 12.0)),
    ("Wan2.2 T2V-A14B, shift 12, 40 steps (its sampling default)", lambda: wan_sigmas(40, 12.0)),
    ("HunyuanVideo-1.5 480p, shift 5, 10 steps (hunyuan-video-1.5-flowfactory)", lambda: hunyuan_video15_sigmas(10)),
    # 512², 121 frames: 16 latent frames of 16×16 (the VAE's 8× time and 32× space), 4096 tokens: μ at its maximum
    ("LTX-2 512², 121 frames, 24 steps (ltx2-flowfactory)", lambda: ltx2_sigmas(24, (16, 16, 16))),
]


def step_scales(sigmas, dynamics: str, noise_level: float) -> np.ndarray:
    """k of every trained step (all but the last) of the schedule."""
    s = sigmas.double().tolist()
    return np.array([log_prob_velocity_scale(dynamics, s[j], s[j + 1], noise_level) for j in range(len(s) - 2)])


def print_schedule_table(name: str, sigmas) -> dict[str, np.ndarray]:
    scales = {d: step_scales(sigmas, d, eta) for d, eta in NOISE_LEVEL.items()}
    print(f"\n### {name}\n")
    print("| step | σ | −dt | " + " | ".join(f"k {d} | ÷ max" for d in scales) + " |")
    print("|---:|---:|---:|" + "---:|---:|" * len(scales))
    s = sigmas.double().tolist()
    for j in range(len(s) - 2):
        cells = " | ".join(f"{k[j]:.4f} | {k[j] / k.max():.3f}" for k in scales.values())
        print(f"| {j} | {s[j]:.4f} | {s[j] - s[j + 1]:.4f} | {cells} |")
    return scales


def print_summary(results: dict[str, dict[str, np.ndarray]]) -> None:
    reference = next(iter(results))
    print(f"\n### Summary (k over the trained steps; last column: median k ÷ {reference.split(',')[0]}'s median k)\n")
    print("| setting | dynamics | median k | min k ÷ max k | steps with k < 0.1·max | median ÷ image |")
    print("|---|---|---:|---:|---:|---:|")
    for name, scales in results.items():
        for dynamics, k in scales.items():
            small = int((k < 0.1 * k.max()).sum())
            ratio = np.median(k) / np.median(results[reference][dynamics])
            print(f"| {name} | {dynamics} | {np.median(k):.4f} | {k.min() / k.max():.3f} | {small} of {len(k)} | "
                  f"{ratio:.3f} |")


def autograd_gradients(adapter, cond, sigmas, dynamics: str, noise_level: float, seeds, guidance: float = 1.0):
    """One rollout per seed along `sigmas`; at every trained step the autograd gradient of the step's log-prob
    (re-evaluated at the sampled x', as the scripts' training does) w.r.t. the velocity output and w.r.t. the trained
    (LoRA) weights. Returns per step: σ, analytic k, mean over samples of ‖∂ log p/∂v‖·elements/‖z‖ and of
    ‖∂ log p/∂θ‖ (each sample's own gradient)."""
    from common.sampling import sample_generators

    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    generators = sample_generators(seeds, "cpu")
    x, rows = adapter.noise(generators), []
    s = sigmas.double().tolist()
    for j in range(len(s) - 2):
        grad_v, grad_theta = [], []
        for b in range(x.shape[0]):
            c = {key: value[b:b + 1] for key, value in cond.items()}
            v = adapter.velocity(x[b:b + 1], sigmas[j], c, guidance)
            with torch.no_grad():
                x_next = sde_step(dynamics, v, x[b:b + 1], sigmas[j], sigmas[j + 1], noise_level,
                                  generator=[generators[b]])[0]
            _, log_prob, mean, std = sde_step(dynamics, v, x[b:b + 1], sigmas[j], sigmas[j + 1], noise_level,
                                              prev_sample=x_next)
            z = (x_next - mean.detach()) / std.detach() if dynamics != "cps" else (x_next - mean.detach()) / std
            g_v, *g_theta = torch.autograd.grad(log_prob.sum(), [v, *params], allow_unused=True)
            grad_v.append(float(g_v.norm() * g_v.numel() / z.norm()))
            grad_theta.append(math.sqrt(sum(float((g**2).sum()) for g in g_theta if g is not None)))
            with torch.no_grad():
                x[b:b + 1] = x_next
        rows.append((s[j], log_prob_velocity_scale(dynamics, s[j], s[j + 1], noise_level), np.mean(grad_v),
                     np.mean(grad_theta)))
        x = x.detach()
    return rows


def print_autograd_table(title: str, rows) -> None:
    k_max = max(r[1] for r in rows)
    theta_max = max(r[3] for r in rows)
    print(f"\n### {title}\n")
    print("| step | σ | k (analytic) | ‖∂logp/∂v‖·n/‖z‖ (autograd) | ‖∂logp/∂θ‖ LoRA (autograd) | k ÷ max | "
          "‖∂logp/∂θ‖ ÷ max |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for j, (sigma, k, g_v, g_theta) in enumerate(rows):
        print(f"| {j} | {sigma:.4f} | {k:.4f} | {g_v:.4f} | {g_theta:.3e} | {k / k_max:.3f} | "
              f"{g_theta / theta_max:.3f} |")


def tiny_wan(flow_shift: float):
    """The tiny Wan2.1 pipeline (common/models/wan.py) with a fresh LoRA and the real checkpoints' scheduler at
    `flow_shift` (the tiny build keeps shift 3)."""
    from common.models import load_adapter
    from common.models import tiny_model_path
    from common.training import add_lora

    adapter = load_adapter("wan", str(tiny_model_path("wan")), "cpu", torch.float32, 32, max_sequence_length=32,
                           num_frames=5)
    adapter.scheduler = wan_scheduler(flow_shift)
    torch.manual_seed(0)
    add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
    return adapter


def autograd_part(num_samples: int = 2) -> None:
    from common.cache import PromptEncoder
    from common.data import Prompt

    for title, flow_shift, num_steps in (("Wan2.1 480p schedule (shift 3, 20 steps)", 3.0, 20),
                                         ("Wan2.2 T2V-A14B schedule (shift 12, 10 steps)", 12.0, 10)):
        adapter = tiny_wan(flow_shift)
        cond = PromptEncoder(adapter)([Prompt("a red ball rolls to the left", "")] * num_samples)
        rows = autograd_gradients(adapter, cond, adapter.sigmas(num_steps), "flow-sde", NOISE_LEVEL["flow-sde"],
                                  list(range(num_samples)))
        print_autograd_table(f"Autograd, tiny Wan2.1 + fresh LoRA r4, flow-sde η {NOISE_LEVEL['flow-sde']}, "
                             f"no CFG: {title}", rows)


def toy_video_part(num_samples: int = 4) -> None:
    """The toy video world's Wan model (docs/toy-video-world.md) on grpo.py's toy-video preset: its schedule (the
    model's UniPC flow shift 5, 8 steps), flow-sde η 0.7, a fresh LoRA r16/α16, no CFG, training prompts. Without the
    pretrained model (data/toy_video/model/, made by worlds/toy_video/pretrain.py) the same pipeline at random init,
    saved and reloaded through from_pretrained, stands in, and the table says so."""
    import tempfile
    from pathlib import Path

    from common.cache import PromptEncoder
    from common.data import Prompt
    from common.models import load_adapter
    from common.training import add_lora
    from worlds.toy.world import toy_model_path
    from worlds.toy_video.world import build_toy_video_pipeline, video_split

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "algos"))
    from grpo import PRESETS  # the preset's values, not a copy of them

    preset = PRESETS["toy-video"]
    path, tmp = toy_model_path("wan"), None
    what = "the pretrained toy video model"
    if not (path / "model_index.json").exists():
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "toy_video_random"
        build_toy_video_pipeline(seed=0).save_pretrained(path, safe_serialization=True)
        what = "the toy video pipeline at RANDOM INIT (data/toy_video/model/ is not there)"
    adapter = load_adapter("wan", str(path), "cpu", torch.float32, preset["resolution"],
                           max_sequence_length=preset["max_sequence_length"], num_frames=preset["num_frames"])
    torch.manual_seed(0)
    add_lora(adapter.transformer, preset["lora_rank"], preset["lora_alpha"], adapter.lora_target_modules)
    train = video_split()[0]
    cond = PromptEncoder(adapter)([Prompt(str(p), "") for p in train[:num_samples]])
    rows = autograd_gradients(adapter, cond, adapter.sigmas(preset["num_steps"]), "flow-sde", preset["noise_level"],
                              list(range(num_samples)), preset["guidance_scale"])
    lo, hi = preset["sde_window_range"]
    print_autograd_table(f"Autograd, {what}, toy-video preset: {preset['num_steps']} steps at its shift, flow-sde "
                         f"η {preset['noise_level']}, LoRA r{preset['lora_rank']}, {num_samples} training prompts "
                         f"(the preset trains a window of {preset['sde_window_size']} in steps {lo}..{hi - 1})", rows)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-autograd", action="store_true", help="only the schedule tables (no model)")
    args = parser.parse_args()
    print("η: " + ", ".join(f"{d} {eta}" for d, eta in NOISE_LEVEL.items()) + ". k: ∂ log p/∂v = −k·z/elements.")
    results = {name: print_schedule_table(name, build()) for name, build in SETTINGS}
    print_summary(results)
    if not args.skip_autograd:
        autograd_part()
        toy_video_part()
