# MixGRPO: Flow-GRPO's clipped objective on a sliding window of SDE steps, the Euler ODE elsewhere; only the window
# is stored and trained. MixGRPO-Flash (--flash) integrates the steps after the window with a compressed
# DPM-Solver++ 2M schedule.
# Paper: Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", arXiv:2507.21802.
# Differs from grpo.py: the window schedule (state saved in checkpoints), one initial noise per group, the Flash
# tail. Differs from the reference code, on purpose: advantages use Flow-GRPO's population std + 1e-4 (the
# reference: unbiased std + 1e-8, larger by √(K/(K−1))), several rewards combine by `sum` or `gdpo` (the
# reference adds per-reward group advantages with no final normalisation), the transformer sees the exact σ (the
# reference: int(1000σ)/1000), and the window never sits at the empty start S − 2. Math: docs/algorithms.md §4.
import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from common.advantages import compute_advantages, trained_samples
from common.cli import TrainArgs, parse_args
from common.data import epoch_draw, epoch_samples
from common.distributed import micro_step
from common.dynamics import log_prob_velocity_scale, sde_kl, sde_step
from common.sampling import sample_generators
from common.solvers import dpm_solver_sample
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
    num_steps: int = 25
    """S: sampling steps of a rollout (steps 0..S−3 can be in the window; the last two never are)"""

    # Algorithm specific arguments
    dynamics: Literal["flow-sde", "dance-sde", "cps"] = "flow-sde"
    """stochastic step inside the window (ode has no log-prob)"""
    noise_level: float = 0.7
    """η of the SDE inside the window"""
    step_weighting: Literal["none", "equalize"] = "none"
    """per-step weight of the policy loss (docs/algorithms.md §4, "Small steps"). equalize: step j's policy
    loss is multiplied by k_max / k_j, k_j the scale of its log-prob's gradient w.r.t. the model output
    (`log_prob_velocity_scale`; ∝ √(−dt) for flow-sde and dance-sde), k_max the largest over every step but the last.
    With a large time shift (video) σ stays near 1 and k_j is small on most steps"""
    window_size: int = 4
    """W: consecutive SDE (and trained) steps; it shrinks where it would reach step S − 2"""
    window_schedule: Literal["progressive", "random", "decay", "exp_decay"] = "progressive"
    """where the window starts each epoch"""
    iters_per_window: int | None = None
    """τ ≥ 1: epochs the window stays at one start (progressive; exp_decay's base) (unset: 25, 20 with --flash)"""
    window_stride: int = 1
    """how many steps the window moves when it moves (progressive, decay, exp_decay)"""
    noises_per_group: int = 1
    """N: a group's K samples start from N initial noises, K/N samples each. 1 is the reference's --init_same_noise:
    before the window every step is ODE, so rewards in a group differ only through the window's SDE noise; K gives
    each sample its own noise"""
    flash: bool = False
    """MixGRPO-Flash: after the window, a compressed schedule integrated with DPM-Solver++ 2M"""
    flash_compress_ratio: float = 0.4
    """Flash: the steps after the window shrink to max(⌊(S − L)·ratio⌋, 2) σ points (L: last window step)"""
    clip_range: float = 1e-4
    """PPO clip ε > 0 on the ratio; tiny because log-probs are means over elements. 0 is refused: the ratio clamped
    to [1, 1] stops training after each epoch's first optimizer step"""
    kl_beta: float = 0.0
    """weight ≥ 0 of the KL to the reference model (0: off; the paper uses 0)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (reward std < 1e-12: advantage 0); they carry
    no policy gradient, so by default they are dropped before training, as Flow-GRPO does"""
    offload_trajectories: bool = False
    """keep the stored rollout steps on the CPU between rollout and training"""


# What each preset is, why, and what it measured: docs/algorithms/mixgrpo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): grpo's toy setting with a 2-step window that starts at step 0 and moves
    # one step every 50 epochs.
    "toy": dict(TOY_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32, updates_per_epoch=2,
                num_steps=8, noise_level=0.7, window_size=2, iters_per_window=50, learning_rate=3e-4, lora_rank=16,
                lora_alpha=16, clip_range=1e-3, kl_beta=0.04, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the strict reward, an EMA for evaluation, the whole
    # transformer, a 3-step window held at steps 0–2 (the only setting that passed in every seed).
    "toy-edit": dict(TOY_EDIT_WORLD, reward=["toy_edit,mode=strict"], epochs=200, prompts_per_epoch=8, group_size=16,
                     batch_size=32, updates_per_epoch=2, num_steps=8, noise_level=0.7, window_size=3,
                     iters_per_window=200, full_finetune=True, learning_rate=1e-4, clip_range=1e-2, kl_beta=0.01,
                     ema=True, ema_decay=0.99, eval_every=20, save_every=20),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=100, prompts_per_epoch=8, group_size=16, batch_size=32,
                      updates_per_epoch=2, num_steps=8, noise_level=0.7, window_size=2, iters_per_window=50,
                      learning_rate=3e-4, lora_rank=16, lora_alpha=16, clip_range=1e-3, kl_beta=0.04, eval_every=10,
                      save_every=10),
    # The embedded tiny FLUX.1 on a CPU: as grpo.py's tiny preset (docs/tiny-models.md), on 12 steps so that the
    # window sweeps steps 0..9 once in 100 epochs.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=12, noise_level=0.8,
                 iters_per_window=10, learning_rate=3e-2, lora_rank=8, lora_alpha=8, clip_range=1e-2,
                 global_std=False, eval_every=50, eval_num_prompts=8, save_every=50),
    # The paper's FLUX.1-dev setting (its finetune_flux_grpo_MixGRPO.sh), on PickScore: its HPS-v2.1 is
    # not shipped.
    "flux1-mixgrpo": dict(reward=["pickscore"], resolution=720, num_steps=25, noise_level=0.7, window_size=4,
                          iters_per_window=25, full_finetune=True, learning_rate=1e-5, clip_range=1e-4,
                          prompts_per_epoch=32, group_size=12, batch_size=1, updates_per_epoch=4, global_std=False,
                          epochs=300, eval_every=25, save_every=25),
    # MixGRPO-Flash: the same with the compressed DPM-Solver++ tail and 20 iterations per window
    # position.
    "flux1-mixgrpo-flash": dict(reward=["pickscore"], resolution=720, num_steps=25, noise_level=0.7, window_size=4,
                                iters_per_window=20, flash=True, full_finetune=True, learning_rate=1e-5,
                                clip_range=1e-4, prompts_per_epoch=32, group_size=12, batch_size=1,
                                updates_per_epoch=4, global_std=False, epochs=300, eval_every=25, save_every=25),
}


def window_dwell(schedule: str, start: int, num_steps: int, iters_per_window: int) -> int:
    """τ(t): how many epochs the window stays at start t."""
    if schedule == "decay":
        # ⌊10·(1 − t/(S − 2)) + 1·t/(S − 2)⌋ (from 10 epochs at t = 0 to 1 at the end), in exact integers
        return max(1, (10 * (num_steps - 2) - 9 * start) // (num_steps - 2))
    if schedule == "exp_decay":
        return math.ceil(iters_per_window * math.exp(-0.1 * max(start - 13, 0)))
    return iters_per_window


def noise_subgroups(draw: np.ndarray, group_size: int, noises_per_group: int) -> list[int]:
    """Which of its group's N noises each sample of the epoch's draw starts from: the k-th occurrence of a prompt
    in the draw takes noise ⌊k·N/K⌋, so each noise is shared by K/N samples."""
    seen: dict[int, int] = {}
    subgroups = []
    for prompt in draw.tolist():
        subgroups.append(seen.get(prompt, 0) * noises_per_group // group_size)
        seen[prompt] = seen.get(prompt, 0) + 1
    return subgroups


def initial_noise_seeds(seed: int, epoch: int, group_keys: list[int], subgroups: list[int]) -> torch.Tensor:
    """One seed per (group, noise j), from (seed, epoch, group key, j); noise 0 keeps the seed a whole group shared
    before groups could hold several noises."""
    return torch.tensor([int(np.random.default_rng([seed, epoch, key, 0x6E0] + [j] * (j > 0)).integers(2**62))
                         for key, j in zip(group_keys, subgroups)])


def advance_window(state: dict, schedule: str, num_steps: int, iters_per_window: int, stride: int) -> dict:
    """The window state {start, epochs_at_start} after one more epoch. Past the last trainable start S − 3
    it wraps to 0. (The reference first spends τ epochs at t = S − 2, where the window is empty and nothing
    trains; we skip that state.)"""
    if schedule == "random":
        return state
    start, spent = state["start"], state["epochs_at_start"] + 1
    if spent >= window_dwell(schedule, start, num_steps, iters_per_window):
        start, spent = start + stride, 0
        if start > num_steps - 3:
            start = 0
    return {"start": start, "epochs_at_start": spent}


def random_window_start(seed: int, epoch: int, num_steps: int, window_size: int) -> int:
    """`random`: uniform in {0, …, S − 2 − W}, a function of (seed, epoch) only (so resume repeats it)."""
    return int(np.random.default_rng([seed, epoch, 0x3D1]).integers(0, num_steps - 2 - window_size + 1))


def window_steps(start: int, num_steps: int, window_size: int) -> list[int]:
    """{t, …, min(t + W, S − 2) − 1}: the window shrinks near the end."""
    return list(range(start, min(start + window_size, num_steps - 2)))


def flash_sigmas(adapter, sigmas: torch.Tensor, last: int, ratio: float) -> torch.Tensor:
    """MixGRPO-Flash schedule: σ_0 … σ_{L+1} of the base schedule, then the n − 1 remaining points of
    shift(linspace(1 − (L+1)/S, 0, n)), n = max(⌊(S − L)·ratio⌋, 2), so the tail still ends at 0.

    The base schedule is adapter.sigmas(S) = shift(1 − j/S). Every tail point is shift(1 − j'/M) for an integer
    j' on the finer grid M = S·(n − 1), so we read the tail off adapter.sigmas(M): the same diffusers call, no
    re-derived shift."""
    num_steps = len(sigmas) - 1
    n = max(math.floor((num_steps - last) * ratio), 2)
    fine = adapter.sigmas(num_steps * (n - 1)).to(sigmas.device)
    tail = fine[(last + 1) * (n - 1)::num_steps - last - 1]
    if len(tail) != n or abs(float(tail[0] - sigmas[last + 1])) > 1e-6 or float(tail[-1]) != 0.0:
        raise UserError(f"--flash needs a base schedule of the form shift(linspace(1, 0, S + 1)), which "
                        f"{type(adapter).__name__}'s is not; run without --flash")
    return torch.cat([sigmas[: last + 2], tail[1:]])



@torch.no_grad()
def mixed_rollout(velocity, x, generators, sigmas, window, dynamics, noise_level, flash_tail=None, store=None):
    """MixGRPO's rollout of noise x at σ_0 = 1 with velocity(x, σ): Euler ODE steps before the window, `dynamics`
    inside it, keeping x_j, x_{j+1} and log p_old(x_{j+1} | x_j) of each window step, then the Euler ODE to σ = 0, or
    with Flash (flash_tail: the compressed σ's from the step after the window on) DPM-Solver++ 2M seeded with the last
    window step's x̂0. Returns (x0, {"x": (B, W, ...), "x_next": (B, W, ...), "log_prob_old": (B, W)})."""
    end = window[-1] + 1 if flash_tail is not None else len(sigmas) - 1
    stored, history = {"x": [], "x_next": [], "log_prob_old": []}, None
    for j in range(end):
        v = velocity(x, sigmas[j])
        x_next, log_prob, _, _ = sde_step(dynamics if j in window else "ode", v, x, sigmas[j], sigmas[j + 1],
                                          noise_level, generator=generators)
        if j in window:
            for key, value in zip(stored, (x, x_next, log_prob)):
                stored[key].append(value if store is None else value.to(store))
        history = (sigmas[j], x.float() - sigmas[j] * v)  # x̂0 = x − σ·v: the multistep solver's memory
        x = x_next
    if flash_tail is not None:
        x = dpm_solver_sample(velocity, x, flash_tail, history).to(x.dtype)
    return x, {key: torch.stack(values, dim=1) for key, values in stored.items()}


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "MixGRPO (arXiv:2507.21802): Flow-GRPO on a sliding window of SDE steps.")
    if args.num_steps < 3:
        raise UserError("--num-steps must be at least 3 (the last two steps are never in the window)")
    if not 1 <= args.window_size <= args.num_steps - 2:
        raise UserError(f"--window-size must be in [1, {args.num_steps - 2}] (num_steps − 2) for {args.num_steps} steps")
    iters_per_window = args.iters_per_window
    if iters_per_window is None:
        iters_per_window = 20 if args.flash else 25
    if iters_per_window < 1 or args.window_stride < 1:
        raise UserError("--iters-per-window and --window-stride must be at least 1")
    if not 0.0 < args.flash_compress_ratio <= 1.0:
        raise UserError("--flash-compress-ratio must be in (0, 1]")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive, got {args.clip_range}")
    if args.noises_per_group < 1 or args.group_size % args.noises_per_group:
        raise UserError(f"--noises-per-group must divide --group-size {args.group_size}, got {args.noises_per_group}")
    own_noise = args.noises_per_group == args.group_size  # N = K: each sample from its own seed's noise
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    clip_range = args.clip_range
    run = setup(args, load_run_rewards(args), reference_copy=args.kl_beta > 0)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    # --step-weighting equalize: w_j = k_max / k_j, k_j the step's gradient scale (algorithms.md §4); none: 1
    scales = [log_prob_velocity_scale(args.dynamics, float(sigmas[j]), float(sigmas[j + 1]), args.noise_level)
              for j in range(args.num_steps)]
    step_weights = [max(scales[:-1]) / k if args.step_weighting == "equalize" and k > 0 else 1.0 for k in scales]
    window = run.meta.get("window", {"start": 0, "epochs_at_start": 0})  # the schedule's state, saved with checkpoints
    store = "cpu" if args.offload_trajectories else device
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="mixgrpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        # each sample's initial-noise seed, from (seed, epoch, group key, which of the group's N noises): the same on
        # any number of processes. Noise 0 of a group is the one the whole group shares when N = 1.
        subgroups = noise_subgroups(epoch_draw(len(run.train_prompts), args.prompts_per_epoch, args.group_size,
                                               args.seed, epoch), args.group_size, args.noises_per_group)[run.local]
        noise_seeds = initial_noise_seeds(args.seed, epoch, [r.key for r in records], subgroups)
        # the epoch's window: SDE and training on its steps only, the Euler ODE elsewhere
        if args.window_schedule == "random":
            window_start = random_window_start(args.seed, epoch, args.num_steps, args.window_size)
        else:
            window_start = window["start"]
        train_steps = window_steps(window_start, args.num_steps, args.window_size)
        # Flash: the steps after the window (L = its last step) run on a compressed schedule with DPM-Solver++.
        epoch_sigmas = flash_sigmas(adapter, sigmas, train_steps[-1], args.flash_compress_ratio) if args.flash else sigmas
        flash_tail = epoch_sigmas[train_steps[-1] + 1:] if args.flash else None

        # ---- 2. rollout: SDE in the window, keeping (x_j, x_{j+1}, log p_old) of its steps; ODE / Flash elsewhere --
        cond = run.encode(records)
        run.transformer.eval()
        stored = {"x": [], "x_next": [], "log_prob_old": []}
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            noise = adapter.noise(generators if own_noise else sample_generators(noise_seeds[index], device))
            x0, steps = mixed_rollout(lambda x, sigma: adapter.velocity(x, sigma, c, guidance), noise, generators,
                                      sigmas, train_steps, args.dynamics, args.noise_level, flash_tail, store)
            for key in stored:
                stored[key].append(steps[key])
            scoring.submit(adapter.decode(x0, c).cpu())
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
        window = advance_window(window, args.window_schedule, args.num_steps, iters_per_window, args.window_stride)
        metrics.update(window_start=window_start, window_len=len(train_steps), nfe=len(epoch_sigmas) - 1)
        metrics.update(ratio_dev_first=float(run.accelerator.reduce(ratio_dev_first, "max")),
                       zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "clipfrac",
                                 "window_start", "approx_kl", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch, meta={"window": window})
    finish(run)
