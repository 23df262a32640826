# Flow-GRPO: online RL for flow-matching models. An SDE with the ODE's marginals makes every denoising step a
# Gaussian policy with a log-prob; a PPO-style clipped ratio of those log-probs, on advantages relative to the K
# samples of each prompt, trains it. Flow-GRPO-Fast (--sde-window-size): SDE and training only on a random window
# of consecutive steps, the Euler ODE elsewhere.
# Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470.
# Siblings: grpo_guard.py (regulated ratio), mixgrpo.py (sliding window). Math: docs/algorithms.md §2–4.
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
from recipes import flowfactory
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
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
    sde_window_range: tuple[int, int] | None = None
    """(lo, hi): the window starts uniformly in [lo, hi − size] (unset: (0, num_steps // 2))"""
    clip_range: float | None = None
    """PPO clip ε > 0 on the ratio (unset: 1e-4; 1e-5 with the SDE window); tiny because log-probs are means. 0 is
    refused: the ratio clamped to [1, 1] stops training after each epoch's first optimizer step"""
    kl_beta: float = 0.0
    """weight ≥ 0 of the KL to the reference model (0: off; 0.01 PickScore, 0.04 GenEval/OCR)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (reward std < 1e-12: advantage 0); they carry
    no policy gradient, so by default they are dropped before training, as Flow-GRPO does"""
    offload_trajectories: bool = False
    """keep the stored rollout steps on the CPU between rollout and training"""


# What each preset is, why, and what it measured: docs/algorithms/grpo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): Flow-GRPO-Fast's window pinned on the first 2 of 8 steps, where count,
    # shape and place are decided; a KL to the pretrained model.
    "toy": dict(TOY_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                num_steps=8, noise_level=0.7, sde_window_size=2, sde_window_range=(0, 2), learning_rate=3e-4,
                lora_rank=16, lora_alpha=16, clip_range=1e-3, kl_beta=0.04, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the strict edit reward, evaluated with an EMA of the weights
    # (without it the gain falls back).
    "toy-edit": dict(TOY_EDIT_WORLD, reward=["toy_edit,mode=strict"], epochs=180, prompts_per_epoch=8, group_size=16,
                     batch_size=32, updates_per_epoch=2, num_steps=8, noise_level=0.7, sde_window_size=2,
                     sde_window_range=(0, 2), learning_rate=1e-3, lora_rank=16, lora_alpha=16, clip_range=1e-2,
                     kl_beta=0.01, ema=True, ema_decay=0.98, eval_every=20, save_every=20),
    # The toy video world (docs/toy-video-world.md): the toy-edit setting at η 1.0 with a cosine decay of the
    # rate (at a constant rate one seed collapsed).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=150, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=2, num_steps=8, noise_level=1.0, sde_window_size=2, sde_window_range=(0, 2),
                      learning_rate=1e-3, lr_schedule="cosine", lora_rank=16, lora_alpha=16, clip_range=1e-2,
                      kl_beta=0.01, ema=True, ema_decay=0.98, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): its log-prob averages only 256 elements, hence a
    # 100× clip range and lr 3e-2.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=8, noise_level=0.8,
                 learning_rate=3e-2, lora_rank=8, lora_alpha=8, clip_range=1e-2, global_std=False,
                 eval_every=50, eval_num_prompts=8, save_every=50),
    # Flow-GRPO's FLUX.1-dev PickScore setting (the paper's).
    "flux1-flowgrpo": dict(reward=["pickscore"], resolution=512, num_steps=6, eval_num_steps=28, noise_level=0.9,
                           group_size=24, prompts_per_epoch=48, batch_size=8, learning_rate=3e-4, clip_range=1e-4,
                           kl_beta=0.01, lora_rank=64, lora_alpha=128, epochs=1000, eval_every=20, save_every=20),
    **flowfactory.GRPO,  # Flow-Factory's examples, one model each (recipes/flowfactory.py, docs/recipes.md)
}
# The guard's demonstration (docs/guard.md): the toy setting trained on a hackable reward, the share of the canvas in
# the prompt's colour, with the toy world's strict checks as the held-out judge.
PRESETS["toy-hack"] = dict(PRESETS["toy"], reward=["toy_colour_share"], judge=["toy,mode=strict"],
                           epochs=40, eval_every=5, save_every=10)


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "Flow-GRPO (arXiv:2505.05470): PPO-style clipped ratio of SDE step log-probs.")
    window = args.sde_window_size > 0
    lo, hi = args.sde_window_range or (0, args.num_steps // 2)
    if window and not (0 <= lo <= hi - args.sde_window_size and hi <= args.num_steps):
        raise UserError(f"--sde-window-range ({lo}, {hi}) cannot hold a window of {args.sde_window_size} steps "
                        f"within {args.num_steps} steps")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if args.clip_range is not None and not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive, got {args.clip_range}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    clip_range = args.clip_range if args.clip_range is not None else (1e-5 if window else 1e-4)
    run = setup(args, load_run_rewards(args), reference_copy=args.kl_beta > 0)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    # --step-weighting equalize: w_j = k_max / k_j, k_j the step's gradient scale (algorithms.md §4); none: 1
    scales = [log_prob_velocity_scale(args.dynamics, float(sigmas[j]), float(sigmas[j + 1]), args.noise_level)
              for j in range(args.num_steps)]
    step_weights = [max(scales[:-1]) / k if args.step_weighting == "equalize" and k > 0 else 1.0 for k in scales]
    store = "cpu" if args.offload_trajectories else device
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="grpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        if window:  # Flow-GRPO-Fast: one window of SDE steps for the whole epoch
            start = int(np.random.default_rng([args.seed, epoch, 0x3D]).integers(lo, hi - args.sde_window_size + 1))
            sde_steps = train_steps = list(range(start, start + args.sde_window_size))
        else:  # every step stochastic; the last (σ' = 0) is not trained
            sde_steps, train_steps = list(range(args.num_steps)), list(range(args.num_steps - 1))

        # ---- 2. rollout: x_{j+1} = sde_step(x_j); keep (x_j, x_{j+1}, log p_old(x_{j+1} | x_j)) of trained steps --
        cond = run.encode(records)
        run.transformer.eval()
        stored = {"x": [], "x_next": [], "log_prob_old": []}
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        with torch.no_grad():
            for index in rollout_batches:
                c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
                x, steps = adapter.noise(generators), {"x": [], "x_next": [], "log_prob_old": []}
                for j in range(args.num_steps):
                    v = adapter.velocity(x, sigmas[j], c, guidance)
                    x_next, log_prob, _, _ = sde_step(args.dynamics if j in sde_steps else "ode", v, x, sigmas[j],
                                                      sigmas[j + 1], args.noise_level, generator=generators)
                    if j in train_steps:
                        for key, value in zip(steps, (x, x_next, log_prob)):
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
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "approx_kl", "clipfrac", "ratio_mean", "grad_norm")}
        ratio_dev_first = torch.zeros((), device=device)
        for update, micro_batches in enumerate(plan):
            for mb in micro_batches:
                c, adv, weight, real = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                        mb.weight.to(device), mb.real.to(device))
                for i, j in enumerate(train_steps):
                    x, x_next, log_prob_old = (stored[key][mb.index, i].to(device) for key in stored)
                    with micro_step(run.accelerator, run.transformer, mb.last and i == len(train_steps) - 1):
                        v = adapter.velocity(x, sigmas[j], c, guidance)
                        _, log_prob, mean, std = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1],
                                                          args.noise_level, prev_sample=x_next)
                        # Flow-GRPO eq. 6: ratio of the new to the rollout policy's step density, clipped as in PPO.
                        ratio = torch.exp(log_prob - log_prob_old)
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
                                           ("clipfrac", ((ratio - 1).abs() > clip_range).float())):
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
