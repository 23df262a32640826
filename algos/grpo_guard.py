# GRPO-Guard: Flow-GRPO with a regulated importance ratio, so that the clip acts evenly over the denoising steps.
# Paper: Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
# Clipping", arXiv:2510.22319; built on Flow-GRPO (Liu et al., arXiv:2505.05470).
# Differs from grpo.py: the rollout also stores μ_old of every trained step, the ratio is regulated, flow-sde
# only, no SDE window. Math: docs/algorithms.md §4 "GRPO-Guard".
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from common.advantages import compute_advantages, trained_samples
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.dynamics import sde_kl, sde_step, velocity_coefficient
from common.sampling import sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    updates_per_epoch: int = 2
    """optimizer steps per epoch; gradients accumulate over the micro-batches and trained steps in between"""
    num_steps: int = 6
    """sampling steps of a rollout"""

    # Algorithm specific arguments
    dynamics: Literal["flow-sde"] = "flow-sde"
    """stochastic step of the rollout: the regulated ratio is defined for the Gaussian flow-SDE step"""
    noise_level: float = 0.9
    """η of the flow-SDE (0.9 FLUX, 0.7 SD3.5)"""
    step_weighting: Literal["none", "equalize"] = "none"
    """per-step weight of the policy loss (docs/algorithms.md §4, "Small steps"). equalize: step j's policy
    loss is multiplied by k_max / k_j, k_j = |∂μ/∂v| the scale of the regulated log-ratio's gradient w.r.t. the model
    output (∝ −dt: the regulation's S cancels the log-prob's 1/S), k_max the largest over every step but the last.
    With a large time shift (video) σ stays near 1 and k_j is small on most steps"""
    clip_range: float = 1e-4
    """PPO clip ε > 0 on the regulated ratio; tiny because log-probs are means over elements. 0 is refused: the
    ratio clamped to [1, 1] stops training after each epoch's first optimizer step"""
    kl_beta: float = 0.0
    """weight ≥ 0 of the KL to the reference model (0: off; 0.01 PickScore, 0.04 GenEval/OCR)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (reward std < 1e-12: advantage 0); they carry
    no policy gradient, so by default they are dropped before training, as Flow-GRPO does"""
    offload_trajectories: bool = False
    """keep the stored rollout steps on the CPU between rollout and training"""


# What each preset is, why, and what it measured: docs/algorithms/grpo_guard.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): grpo's toy setting on 6 steps, all SDE and trained (no window), at lr
    # 1e-3 (grpo's 3e-4 left it flat).
    "toy": dict(TOY_WORLD, epochs=30, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                num_steps=6, noise_level=0.7, learning_rate=1e-3, lora_rank=16, lora_alpha=16, clip_range=1e-3,
                kl_beta=0.04, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting, untuned (nft.py and grpo.py carry tuned ones).
    "toy-edit": dict(TOY_EDIT_WORLD, epochs=30, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                     num_steps=6, noise_level=0.7, learning_rate=1e-3, lora_rank=16, lora_alpha=16, clip_range=1e-3,
                     kl_beta=0.04, eval_every=10, save_every=10),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=30, prompts_per_epoch=8, group_size=16, batch_size=32,
                      updates_per_epoch=2, num_steps=6, noise_level=0.7, learning_rate=1e-3, lora_rank=16,
                      lora_alpha=16, clip_range=1e-3, kl_beta=0.04, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU: as grpo.py's tiny preset (docs/tiny-models.md).
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=8, noise_level=0.8,
                 learning_rate=3e-2, lora_rank=8, lora_alpha=8, clip_range=1e-2, global_std=False,
                 eval_every=50, eval_num_prompts=8, save_every=50),
    # Flow-GRPO's FLUX.1-dev PickScore setting with the regulated ratio and no KL (the paper regulates
    # the clip instead of leaning on a KL).
    "flux1-grpo-guard": dict(reward=["pickscore"], resolution=512, num_steps=6, eval_num_steps=28, noise_level=0.9,
                             group_size=24, prompts_per_epoch=48, batch_size=8, learning_rate=3e-4, clip_range=1e-4,
                             kl_beta=0.0, lora_rank=64, lora_alpha=128, epochs=1000, eval_every=20, save_every=20),
}


def regulated_log_ratio(x_next: torch.Tensor, mean: torch.Tensor, mean_old: torch.Tensor, std) -> torch.Tensor:
    """log of GRPO-Guard's regulated ratio, per sample: S·(logp − logp_old) + mean((μ_θ − μ_old)²)/(2S), which for
    two Gaussians of the same std S equals mean(z ⊙ (μ_θ − μ_old)) with z = (x' − μ_old)/S the noise the rollout
    drew (from the STORED, dtype-rounded x'). The raw log-ratio is that divided by S, minus a term in m/S² that is
    always ≤ 0: the regulated one removes the 1/S scale, which varies across steps, and the downward shift."""
    z = (x_next.float() - mean_old) / std
    return (z * (mean - mean_old)).flatten(1).mean(1)


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "GRPO-Guard (arXiv:2510.22319): Flow-GRPO with a regulated ratio.")
    if not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive, got {args.clip_range}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    clip_range = args.clip_range
    run = setup(args, load_run_rewards(args), reference_copy=args.kl_beta > 0)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    # --step-weighting equalize: w_j = k_max / k_j, k_j the step's gradient scale (algorithms.md §4); none: 1
    scales = [abs(velocity_coefficient(args.dynamics, float(sigmas[j]), float(sigmas[j + 1]), args.noise_level)[0])
              for j in range(args.num_steps)]
    step_weights = [max(scales[:-1]) / k if args.step_weighting == "equalize" and k > 0 else 1.0 for k in scales]
    store = "cpu" if args.offload_trajectories else device
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="grpo_guard")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        train_steps = list(range(args.num_steps - 1))  # every step stochastic; the last (σ' = 0) is not trained

        # ---- 2. rollout: x_{j+1} = sde_step(x_j); keep x_j, x_{j+1}, log p_old and μ_old of the trained steps ---
        cond = run.encode(records)
        run.transformer.eval()
        stored = {"x": [], "x_next": [], "log_prob_old": [], "mean_old": []}
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        with torch.no_grad():
            for index in rollout_batches:
                c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
                x, steps = adapter.noise(generators), {key: [] for key in stored}
                for j in range(args.num_steps):
                    v = adapter.velocity(x, sigmas[j], c, guidance)
                    x_next, log_prob, mean, _ = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1],
                                                         args.noise_level, generator=generators)
                    if j in train_steps:
                        for key, value in zip(steps, (x, x_next, log_prob, mean)):
                            steps[key].append(value.to(store))
                    x = x_next
                for key in stored:
                    stored[key].append(torch.stack(steps[key], dim=1))  # (batch, trained steps, ...)
                scoring.submit(adapter.decode(x, c).cpu())
        stored = {key: torch.cat(values) for key, values in stored.items()}
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and group-relative advantages over the whole epoch (all processes) ----------------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # A group whose K rewards are equal (A = 0) has no policy gradient: drop it, keeping equal micro-step counts.
        keep = trained_samples(adv_stats, args.keep_zero_advantage)
        plan = plan_micro_batches(keep, run.data.num_processes, run.data.process_index,
                                  args.batch_size, args.updates_per_epoch)
        advantages = advantages[run.local].float().to(device)
        reward_time = time.time() - reward_start

        # ---- 4. update: the clipped surrogate on every stored step ----------------------------------------------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "ratio_mean", "raw_ratio_mean",
                                 "grad_norm")}
        ratio_dev_first = torch.zeros((), device=device)
        for update, micro_batches in enumerate(plan):
            for mb in micro_batches:
                c, adv, weight, real = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                        mb.weight.to(device), mb.real.to(device))
                for i, j in enumerate(train_steps):
                    x, x_next, log_prob_old, mean_old = (stored[key][mb.index, i].to(device) for key in stored)
                    with micro_step(run.accelerator, run.transformer, mb.last and i == len(train_steps) - 1):
                        v = adapter.velocity(x, sigmas[j], c, guidance)
                        _, log_prob, mean, std = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1],
                                                          args.noise_level, prev_sample=x_next)
                        # GRPO-Guard's regulated ratio exp(S·(logp − logp_old) + ‖μ_θ − μ_old‖²/(2S)), in its equal,
                        # cancellation-free form exp(mean(z ⊙ (μ_θ − μ_old))), z the rollout noise.
                        ratio = torch.exp(regulated_log_ratio(x_next, mean, mean_old, std))
                        clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_range, 1 + clip_range))
                        policy_loss = step_weights[j] * clipped  # 1 unless --step-weighting equalize
                        kl = torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # KL to the reference step, in Flow-GRPO's form (sde_kl)
                            v_ref = run.reference.velocity(x, sigmas[j], c, guidance)
                            _, _, mean_ref, _ = sde_step(args.dynamics, v_ref, x, sigmas[j], sigmas[j + 1],
                                                         args.noise_level, prev_sample=x_next)
                            kl = sde_kl(args.dynamics, mean, mean_ref, std, sigmas[j], sigmas[j + 1])
                        loss = policy_loss + args.kl_beta * kl
                        # weight: 1 / (kept samples of this optimizer step), so the step averages samples and steps
                        run.accelerator.backward((weight * loss).sum() / len(train_steps))
                    if not real.any():  # a padding-only micro-batch (see plan_micro_batches)
                        continue
                    with torch.no_grad():  # statistics over this micro-batch's kept samples
                        if update == 0:  # invariant: θ = θ_old before the first optimizer step, so ratio ≡ 1
                            ratio_dev_first = torch.maximum(ratio_dev_first, (ratio[real] - 1).abs().max())
                        for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                           ("approx_kl", 0.5 * (log_prob - log_prob_old) ** 2), ("ratio_mean", ratio),
                                           ("clipfrac", ((ratio - 1).abs() > clip_range).float()),
                                           ("raw_ratio_mean", torch.exp(log_prob - log_prob_old))):
                            stats[key].append(value[real].mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            del stats["kl"]

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(ratio_dev_first=float(run.accelerator.reduce(ratio_dev_first, "max")),
                       zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "clipfrac",
                                 "approx_kl", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
