# Flow-DPPO: Flow-GRPO with the PPO ratio clip replaced by a trust region on the exact KL between the current and the
# rollout policy's Gaussian step. A trained step is masked (loss and gradient 0) only when that KL is at least a
# threshold AND the ratio has moved further in the advantage's direction; corrective moves always pass.
# Paper: Flow-DPPO, arXiv:2606.11025; reference code: UniRL, Flow-Factory, verl-omni.
# Copied from grpo.py. Differs: the rollout also stores μ_old; the surrogate −A·ρ unclipped, with the KL mask;
# --num-sde-steps (k distinct stochastic = trained steps per epoch, the references' sparse SDE). Math:
# docs/algorithms.md §8.
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from common.advantages import compute_advantages, trained_samples
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.dynamics import log_prob_velocity_scale, sde_kl, sde_step
from common.sampling import sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    infinity_allowed = ("kl_mask_threshold",)  # --kl-mask-threshold inf: nothing masked (grpo without a clip)
    updates_per_epoch: int = 2
    """optimizer steps per epoch; gradients accumulate over the micro-batches and trained steps in between"""
    num_steps: int = 6
    """sampling steps of a rollout"""

    # Algorithm specific arguments
    dynamics: Literal["flow-sde", "dance-sde", "cps"] = "flow-sde"
    """stochastic step of the rollout and of its log-probs (ode has no log-prob)"""
    noise_level: float = 0.9
    """η of the SDE (flow-sde 0.9 FLUX / 0.7 SD3.5, dance-sde ~0.3, cps in [0, 1])"""
    step_weighting: Literal["none", "equalize"] = "none"
    """per-step weight of the policy loss (docs/algorithms.md §4, "Small steps"). equalize: step j's policy
    loss is multiplied by k_max / k_j, k_j the scale of its log-prob's gradient w.r.t. the model output
    (`log_prob_velocity_scale`; ∝ √(−dt) for flow-sde and dance-sde), k_max the largest over every step but the last.
    With a large time shift (video) σ stays near 1 and k_j is small on most steps"""
    sde_window_size: int = 0
    """Flow-GRPO-Fast: > 0 makes only a random window of this many consecutive steps stochastic and trained"""
    num_sde_steps: int = 0
    """> 0: only this many distinct steps, drawn anew each epoch from --sde-window-range, are stochastic and trained
    (the references: 3 of the first half); exclusive with --sde-window-size"""
    sde_window_range: tuple[int, int] | None = None
    """(lo, hi): the window starts uniformly in [lo, hi − size], or the --num-sde-steps are drawn from [lo, hi)
    (unset: (0, num_steps // 2))"""
    kl_mask_threshold: float = 1e-5
    """τ ≥ 0: a trained step whose KL D to the rollout step is ≥ τ and whose ratio moved in the advantage's direction
    gets no loss (inf: never). 1e-5 is calibrated on SD3.5 latents: D is a mean over elements, its scale depends on
    the model and lr (log divergence_mean / masked_frac and calibrate)"""
    kl_beta: float = 0.0
    """weight ≥ 0 of the KL to the reference model (0: off; 0.01 PickScore, 0.04 GenEval/OCR)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (reward std < 1e-12: advantage 0); they carry
    no policy gradient, so by default they are dropped before training, as Flow-GRPO does"""
    offload_trajectories: bool = False
    """keep the stored rollout steps on the CPU between rollout and training"""


# What each preset is, why, and what it measured: docs/algorithms/dppo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): grpo's toy setting, τ set to mask a few per cent of the steps.
    "toy": dict(TOY_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                num_steps=8, noise_level=0.7, sde_window_size=2, sde_window_range=(0, 2), learning_rate=3e-4,
                lora_rank=16, lora_alpha=16, kl_mask_threshold=3e-7, kl_beta=0.04, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting, untuned (nft.py and grpo.py carry tuned ones).
    "toy-edit": dict(TOY_EDIT_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                     num_steps=8, noise_level=0.7, sde_window_size=2, sde_window_range=(0, 2), learning_rate=3e-4,
                     lora_rank=16, lora_alpha=16, kl_mask_threshold=3e-7, kl_beta=0.04, eval_every=10, save_every=10),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32,
                      updates_per_epoch=2, num_steps=8, noise_level=0.7, sde_window_size=2, sde_window_range=(0, 2),
                      learning_rate=3e-4, lora_rank=16, lora_alpha=16, kl_mask_threshold=3e-7, kl_beta=0.04,
                      eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): grpo's tiny setting, τ set for its larger D.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=8, noise_level=0.8,
                 learning_rate=3e-2, lora_rank=8, lora_alpha=8, kl_mask_threshold=1e-3, global_std=False,
                 eval_every=50, eval_num_prompts=8, save_every=50),
    # The reference code's SD3.5-M PickScore setting (UniRL's sd3_flowdppo example).
    "sd3-flowdppo": dict(model="sd3", reward=["pickscore"], resolution=512, num_steps=10, guidance_scale=1.0,
                         dynamics="flow-sde", noise_level=0.7, num_sde_steps=3, sde_window_range=(0, 5),
                         group_size=16, prompts_per_epoch=48, batch_size=8, updates_per_epoch=2, learning_rate=3e-4,
                         weight_decay=0.0, lora_rank=32, lora_alpha=64, kl_mask_threshold=1e-5, kl_beta=0.0,
                         epochs=1000, eval_every=20, save_every=20),
}


def dppo_surrogate(log_prob, log_prob_old, mean, mean_old, std, advantages, threshold: float):
    """Flow-DPPO's per-sample loss of one trained step. Returns (loss (B,), D (B,), masked (B,) bool).

    D = mean_elements((μ_θ − μ_old)²)/(2S²) is the exact KL between the two Gaussian steps (equal std S, sde_step's
    full std) over the element count: sde_kl/(−dt) for flow-sde and dance-sde, sde_kl for cps. A step is masked when
    D ≥ τ and the ratio has moved in the advantage's direction (ρ > 1 with A > 0, or ρ < 1 with A < 0); elsewhere the
    loss is −A·ρ, no clip. ρ is compared with 1 as the float32 exp(Δ), as the references do: for
    0 < |Δ| < 2⁻²⁴ it rounds to exactly 1 and the step is kept (the sign of Δ would mask it). The masked log-ratio
    is zeroed BEFORE the exp: a where() after it would give 0·∞ = NaN gradients where a masked ratio overflowed."""
    s = std.flatten() if torch.is_tensor(std) else torch.as_tensor(std, device=mean.device)
    log_ratio = log_prob - log_prob_old
    with torch.no_grad():  # the mask is a constant of the loss
        divergence = (mean.float() - mean_old.float()).pow(2).flatten(1).mean(1) / (2 * s.float() ** 2)
        unmasked_ratio = torch.exp(log_ratio.float())
        moved = ((unmasked_ratio > 1) & (advantages > 0)) | ((unmasked_ratio < 1) & (advantages < 0))
        masked = (divergence >= threshold) & moved
    ratio = torch.exp(torch.where(masked, torch.zeros_like(log_ratio), log_ratio))
    loss = torch.where(masked, torch.zeros_like(ratio), -advantages * ratio)
    return loss, divergence, masked


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "Flow-DPPO (arXiv:2606.11025): GRPO with a KL-masked trust region, no clip.")
    window, sparse = args.sde_window_size > 0, args.num_sde_steps > 0
    lo, hi = args.sde_window_range or (0, args.num_steps // 2)
    if window and sparse:
        raise UserError("--num-sde-steps and --sde-window-size are exclusive (sparse steps or one contiguous window)")
    if window and not (0 <= lo <= hi - args.sde_window_size and hi <= args.num_steps):
        raise UserError(f"--sde-window-range ({lo}, {hi}) cannot hold a window of {args.sde_window_size} steps "
                        f"within {args.num_steps} steps")
    if sparse and not (0 <= lo and lo + args.num_sde_steps <= hi <= args.num_steps):
        raise UserError(f"--sde-window-range ({lo}, {hi}) cannot hold {args.num_sde_steps} distinct --num-sde-steps "
                        f"within {args.num_steps} steps")
    if args.num_sde_steps < 0 or args.sde_window_size < 0:
        raise UserError("--num-sde-steps and --sde-window-size must be >= 0")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if not args.kl_mask_threshold >= 0:
        raise UserError(f"--kl-mask-threshold must be >= 0 (inf: no mask), got {args.kl_mask_threshold}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    run = setup(args, load_run_rewards(args), reference_copy=args.kl_beta > 0)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    # --step-weighting equalize: w_j = k_max / k_j, k_j the step's gradient scale (algorithms.md §4); none: 1
    scales = [log_prob_velocity_scale(args.dynamics, float(sigmas[j]), float(sigmas[j + 1]), args.noise_level)
              for j in range(args.num_steps)]
    step_weights = [max(scales[:-1]) / k if args.step_weighting == "equalize" and k > 0 else 1.0 for k in scales]
    store = "cpu" if args.offload_trajectories else device
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="dppo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        if window:  # Flow-GRPO-Fast: one window of SDE steps for the whole epoch
            start = int(np.random.default_rng([args.seed, epoch, 0x3D]).integers(lo, hi - args.sde_window_size + 1))
            sde_steps = train_steps = list(range(start, start + args.sde_window_size))
        elif sparse:  # the references' sparse SDE: k distinct steps of [lo, hi) for the whole epoch
            draw = np.random.default_rng([args.seed, epoch, 0xD990]).choice(hi - lo, args.num_sde_steps, replace=False)
            sde_steps = train_steps = sorted(lo + int(j) for j in draw)
        else:  # every step stochastic; the last (σ' = 0) is not trained
            sde_steps, train_steps = list(range(args.num_steps)), list(range(args.num_steps - 1))

        # ---- 2. rollout: x_{j+1} = sde_step(x_j); keep (x_j, x_{j+1}, log p_old, μ_old) of trained steps ----------
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
                    x_next, log_prob, mean, _ = sde_step(args.dynamics if j in sde_steps else "ode", v, x, sigmas[j],
                                                         sigmas[j + 1], args.noise_level, generator=generators)
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

        # ---- 4. update: the KL-masked surrogate on every stored step --------------------------------------------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "approx_kl", "masked_frac", "masked_pos_frac",
                                 "masked_neg_frac", "over_threshold_frac", "divergence_mean", "ratio_mean",
                                 "grad_norm")}
        extremes = {k: torch.full((), v, device=device) for k, v in (
            ("ratio_dev_first", 0.0), ("divergence_first", 0.0), ("divergence_max", 0.0), ("ratio_max", 0.0),
            ("ratio_min", float("inf")))}
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
                        # Flow-DPPO: −A·ρ, except steps past the KL trust region that moved in A's direction (0).
                        policy_loss, divergence, masked = dppo_surrogate(log_prob, log_prob_old, mean, mean_old, std,
                                                                         adv, args.kl_mask_threshold)
                        policy_loss = step_weights[j] * policy_loss  # 1 unless --step-weighting equalize
                        kl = torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # KL to the reference step, in Flow-GRPO's form (sde_kl)
                            v_ref = run.reference.velocity(x, sigmas[j], c, guidance)
                            _, _, mean_ref, _ = sde_step(args.dynamics, v_ref, x, sigmas[j], sigmas[j + 1],
                                                         args.noise_level, prev_sample=x_next)
                            kl = sde_kl(args.dynamics, mean, mean_ref, std, sigmas[j], sigmas[j + 1])
                        loss = policy_loss + args.kl_beta * kl
                        # weight: 1 / (kept samples of this optimizer step); masked steps count as zeros in the mean
                        run.accelerator.backward((weight * loss).sum() / len(train_steps))
                    if not real.any():  # a padding-only micro-batch (see plan_micro_batches)
                        continue
                    with torch.no_grad():  # statistics over this micro-batch's kept samples
                        ratio = torch.exp(log_prob - log_prob_old)[real]  # the unmasked ratio
                        d, m, a = divergence[real], masked[real].float(), adv[real]
                        if update == 0:  # invariant: θ = θ_old before the first optimizer step: ρ ≡ 1, D ≡ 0
                            extremes["ratio_dev_first"] = torch.maximum(extremes["ratio_dev_first"],
                                                                        (ratio - 1).abs().max())
                            extremes["divergence_first"] = torch.maximum(extremes["divergence_first"], d.max())
                        for key, value in (("divergence_max", d.max()), ("ratio_max", ratio.max())):
                            extremes[key] = torch.maximum(extremes[key], value)
                        extremes["ratio_min"] = torch.minimum(extremes["ratio_min"], ratio.min())
                        for key, value in (("loss", loss[real]), ("policy_loss", policy_loss[real]), ("kl", kl[real]),
                                           ("approx_kl", 0.5 * (log_prob - log_prob_old)[real] ** 2),
                                           ("masked_frac", m), ("masked_pos_frac", m * (a > 0)),
                                           ("masked_neg_frac", m * (a < 0)),
                                           ("over_threshold_frac", (d >= args.kl_mask_threshold).float()),
                                           ("divergence_mean", d), ("ratio_mean", ratio)):
                            stats[key].append(value.mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            del stats["kl"]

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        extremes["ratio_min"] = -extremes["ratio_min"]  # accelerate reduces by max, not min
        extremes = {key: float(run.accelerator.reduce(value, "max")) for key, value in extremes.items()}
        extremes["ratio_min"] = -extremes["ratio_min"]
        if extremes["ratio_min"] == float("inf"):  # every sample dropped on every process: no step was trained
            extremes = {k: v for k, v in extremes.items() if k not in ("ratio_min", "ratio_max", "divergence_max")}
        metrics.update(extremes)
        metrics.update(zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "masked_frac",
                                 "divergence_mean", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
