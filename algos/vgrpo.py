# V-GRPO: GRPO whose likelihood is an ELBO surrogate of the whole generation, log π(x0 | c) ≈ −L̂(x0), the weighted
# flow-matching loss of the clean rollout sample at N_MC noise levels and noises (σ, ε) that the K samples of a group
# share; so any deterministic sampler rolls out and no step is stored. Likelihood-free like DiffusionNFT.
# Paper: V-GRPO, arXiv:2604.23380 (followed as the third-party VisualRL reads it: the authors' code was not
# available, so the defaults are VisualRL's).
# Copied from nft.py. Differs: one PPO ratio per sample, exp(L̂_old − L̂_θ), on soft-clipped advantages instead of the
# implicit v⁺/v⁻ policies; (σ, ε) shared by a group; zero-advantage samples dropped; a two-pass backward (no N_MC live
# graphs); θ_old ← θ after each epoch. Math: docs/algorithms.md §8.
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
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import check_time_sampling, sample_train_noise, sample_train_sigmas, training_generators
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    num_steps: int = 10
    """sampling steps of a rollout"""

    # Algorithm specific arguments
    dynamics: Literal["dpm", "ode", "flow-sde", "dance-sde", "cps"] = "ode"
    """rollout sampler of θ_old: ode (Euler, the paper's deterministic rollout), dpm (DPM-Solver++ 2M) or an SDE;
    only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout"""
    time_sampling: Literal["uniform", "discrete"] = "uniform"
    """the group's N_MC σ's: uniform (u_j = (j + U_j)/N_MC, then σ = shift(u)) or discrete (stratified rollout steps)"""
    train_timesteps: int = 4
    """N_MC ≥ 1: (σ, ε) pairs of the ELBO estimate, shared by the K samples of a group"""
    timestep_range: tuple[float, float] = (0.0, 1.0)
    """(f_lo, f_hi) fractions along the denoising axis (discrete: rollout steps [⌊f_lo·N⌋, ⌊f_hi·N⌋))"""
    time_shift: float = 3.0
    """shift s of uniform: σ = s·u/(1 + (s − 1)·u)"""
    adv_soft_clip: float = 3.0
    """η of the soft clip Ã = η·tanh(A/η) (after the ±--adv-clip-max clamp; 0: off)"""
    clip_range: float | None = None
    """PPO clip ε > 0 on the per-sample ratio (unset: no clip; with one optimizer step per epoch ρ ≡ 1 anyway)"""
    kl_old: float = 0.0
    """λ ≥ 0: weight of mean((x̂0_θ − x̂0_old)²), the KL to θ_old (the paper's multi-step stages: 0.3)"""
    kl_beta: float = 0.0
    """weight ≥ 0 of mean((v_θ − v_ref)²) to the reference model (not in the paper; 0: off)"""
    adaptive_weight: bool = True
    """divide each pair's x0 error by its mean absolute value (DiffusionNFT's weighting; --no-adaptive-weight: 1)"""
    keep_zero_advantage: bool = False
    """also train on the samples of groups whose K rewards are equal (A = 0: no policy gradient; dropped by default)"""


# What each preset is, why, and what it measured: docs/algorithms/vgrpo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): nft's toy geometry with N_MC 4 pairs per group and the KL to θ_old of
    # the paper's multi-step stages.
    "toy": dict(TOY_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                num_steps=8, dynamics="dpm", train_timesteps=4, learning_rate=1e-3, lora_rank=16, lora_alpha=16,
                kl_old=0.3, kl_beta=0.1, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the strict reward, the whole transformer at lr 1e-4
    # (nft's edit setting), 4 prompts × 16.
    "toy-edit": dict(TOY_EDIT_WORLD, reward=["toy_edit,mode=strict"], epochs=200, prompts_per_epoch=4, group_size=16,
                     batch_size=16, updates_per_epoch=4, num_steps=8, dynamics="dpm", train_timesteps=4,
                     full_finetune=True, learning_rate=1e-4, kl_old=0.3, kl_beta=0.1, eval_every=20, save_every=20),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=4, num_steps=8, dynamics="dpm", train_timesteps=4, learning_rate=1e-3,
                      lora_rank=16, lora_alpha=16, kl_old=0.3, kl_beta=0.1, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): nft's tiny setting, one optimizer step per epoch
    # (the paper's Stage 1).
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=1, num_steps=6, train_timesteps=3,
                 learning_rate=5e-2, lora_rank=8, lora_alpha=8, global_std=False, eval_every=25,
                 eval_num_prompts=8, save_every=25),
    # Stage 1 of the paper's SD3.5-M setting as VisualRL reads it, on PickScore + CLIP (its HPSv2.1 is not
    # available).
    "sd3-vgrpo": dict(model="sd3", reward=["pickscore", "clip"], resolution=512, num_steps=40, guidance_scale=1.0,
                      dynamics="ode", group_size=24, prompts_per_epoch=48, batch_size=8, updates_per_epoch=1,
                      train_timesteps=4, adv_soft_clip=3.0, kl_old=0.0, kl_beta=0.0, learning_rate=3e-4,
                      lora_rank=32, lora_alpha=64, global_std=False, epochs=1000, eval_every=20, save_every=20),
}


def group_pairs(seed: int, epoch: int, keys, strategy: str, num_pairs: int, sigmas: torch.Tensor, timestep_range,
                shift: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The N_MC (σ, ε) pairs of each sample: (B, N_MC) σ's and (B, N_MC, ...) ε's drawn from a generator seeded by
    (seed, epoch, group key), so the K samples of a group share them bitwise (the paper's variance fix; unlike §5's
    per-sample draws) and any process count, micro-batch or resume draws the same."""
    seeds = [int(np.random.default_rng([seed, epoch, 0x76F0, int(k)]).integers(0, 2**62)) for k in keys]
    train_sigmas = sample_train_sigmas(strategy, num_pairs, training_generators(seeds), sigmas, timestep_range, shift)
    return train_sigmas, sample_train_noise(num_pairs, training_generators(seeds), like)


def elbo_term(v, x_sigma, x0, sigma, adaptive: bool = True):
    """ℓ (B,) of one pair: mean((x̂0 − x0)²)/w with x̂0 = x_σ − σ·v and w = stopgrad(max(mean|x̂0 − x0|, 1e-5)) in
    float64 (DiffusionNFT's adaptive weighting, the paper's Eq. 14), or w = 1."""
    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    error = (x_sigma - sig * v) - x0
    loss = (error ** 2).flatten(1).mean(1)
    if not adaptive:
        return loss
    with torch.no_grad():
        w = error.detach().double().abs().flatten(1).mean(1).clamp_min(1e-5)
    return loss / w.to(loss.dtype)


def ratio_coefficients(elbo_theta, elbo_old, soft_advantages, clip_range: float | None):
    """Pass 1 of the backward: ρ = exp(L̂_old − L̂_θ) per sample; L = −min(ρ·Ã, clip(ρ, 1 ± ε)·Ã); c = Ã·ρ, 0 where
    the clip holds (Ã > 0 ∧ ρ > 1 + ε, or Ã < 0 ∧ ρ < 1 − ε), so that backpropagating c·L̂_θ gives ∇L.
    Returns (ρ, c, clipped, L), all (B,) and detached."""
    ratio = torch.exp(elbo_old.detach() - elbo_theta.detach())
    if clip_range is None:
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
        loss = -ratio * soft_advantages
    else:
        clipped = (((soft_advantages > 0) & (ratio > 1 + clip_range)) |
                   ((soft_advantages < 0) & (ratio < 1 - clip_range)))
        loss = -torch.minimum(ratio * soft_advantages, ratio.clamp(1 - clip_range, 1 + clip_range) * soft_advantages)
    return ratio, torch.where(clipped, 0.0, soft_advantages * ratio), clipped, loss


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "V-GRPO (arXiv:2604.23380): GRPO on an ELBO surrogate of the likelihood.")
    if args.train_timesteps < 1:
        raise UserError(f"--train-timesteps must be at least 1, got {args.train_timesteps}")
    if args.adv_soft_clip < 0:
        raise UserError(f"--adv-soft-clip must be >= 0 (0: off), got {args.adv_soft_clip}")
    if args.clip_range is not None and not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive (unset: no clip), got {args.clip_range}")
    if args.kl_old < 0 or args.kl_beta < 0:
        raise UserError(f"--kl-old and --kl-beta must be >= 0, got {args.kl_old} and {args.kl_beta}")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    # θ_old: a second LoRA adapter "old" (or a frozen copy when fully fine-tuning), equal to θ at the start.
    run = setup(args, load_run_rewards(args), shadows=("old",), reference_copy=args.kl_beta > 0, cfg_free=True)
    adapter, sigmas, guidance, device, old = run.adapter, run.sigmas, run.guidance, run.device, run.shadows["old"]
    num_pairs = args.train_timesteps
    check_time_sampling(args.time_sampling, num_pairs, sigmas, args.timestep_range)
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)
    # With one optimizer step per epoch θ = θ_old throughout it: ρ ≡ 1 and nothing clips, so pass 1 is skipped.
    two_pass = args.updates_per_epoch > 1

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="vgrpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])

        # ---- 2. rollout with θ_old (= θ: θ_old ← θ after every epoch), keeping only x0 ------------------------------
        cond = run.encode(records)
        run.transformer.eval()
        clean = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            x0 = sample(lambda x, sigma: old.velocity(x, sigma, c, guidance), adapter.noise(generators), sigmas,
                        args.dynamics, args.noise_level, generators)
            clean.append(x0)
            scoring.submit(adapter.decode(x0, c).cpu())
        clean = torch.cat(clean)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards, group-relative advantages over the whole epoch (all processes), soft clip ---------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # A group whose K rewards are equal (A = 0) has no policy gradient: drop it, keeping equal micro-step counts.
        keep = trained_samples(adv_stats, args.keep_zero_advantage)
        plan = plan_micro_batches(keep, run.data.num_processes, run.data.process_index,
                                  args.batch_size, args.updates_per_epoch)
        advantages = advantages[run.local].float().to(device)
        soft = args.adv_soft_clip * torch.tanh(advantages / args.adv_soft_clip) if args.adv_soft_clip > 0 \
            else advantages  # Eq. 17: Ã = η·tanh(A/η)
        reward_time = time.time() - reward_start

        # ---- 4. update: per-sample ratio of ELBO surrogates on the group's shared (σ, ε) pairs, two passes --------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "kl_old", "elbo_loss", "approx_kl", "clipfrac",
                                 "ratio_mean", "grad_norm")}
        extremes = {k: torch.full((), v, device=device) for k, v in (("ratio_dev_first", 0.0), ("ratio_max", 0.0),
                                                                      ("ratio_min", float("inf")))}
        for update, micro_batches in enumerate(plan):
            for mb in micro_batches:
                c, adv, weight, real, x0 = ({k: v[mb.index] for k, v in cond.items()}, soft[mb.index],
                                            mb.weight.to(device), mb.real.to(device), clean[mb.index])
                # The N_MC pairs of each sample's group (shared by its K samples), then the forward process.
                train_sigmas, train_noise = group_pairs(args.seed, epoch, group_ids[mb.index], args.time_sampling,
                                                        num_pairs, sigmas, args.timestep_range, args.time_shift, x0)
                sig = train_sigmas.reshape(*train_sigmas.shape, *([1] * (x0.ndim - 1)))
                x_sigmas = (1 - sig) * x0[:, None] + sig * train_noise  # (B, N_MC, ...), target v* = ε − x0
                # frozen policies first (no graph touched): θ_old's velocity and L̂_old, the reference's velocity
                v_old = [old.velocity(x_sigmas[:, j], train_sigmas[:, j], c, guidance) for j in range(num_pairs)]
                elbo_old = torch.stack([elbo_term(v_old[j], x_sigmas[:, j], x0, train_sigmas[:, j],
                                                  args.adaptive_weight) for j in range(num_pairs)]).mean(0)
                v_ref = [run.reference.velocity(x_sigmas[:, j], train_sigmas[:, j], c, guidance)
                         for j in range(num_pairs)] if args.kl_beta > 0 else None
                # Pass 1 (no graph): L̂_θ, ρ = exp(L̂_old − L̂_θ) and each sample's coefficient c = Ã·ρ (0 if clipped).
                if two_pass:
                    with torch.no_grad():
                        elbo_theta = torch.stack([elbo_term(adapter.velocity(x_sigmas[:, j], train_sigmas[:, j], c,
                                                                             guidance), x_sigmas[:, j], x0,
                                                            train_sigmas[:, j], args.adaptive_weight)
                                                  for j in range(num_pairs)]).mean(0)
                else:  # θ = θ_old: ρ ≡ 1
                    elbo_theta = elbo_old
                ratio, coefficient, clipped, policy_loss = ratio_coefficients(elbo_theta, elbo_old, adv,
                                                                              args.clip_range)
                # Pass 2: backpropagate c·ℓ_θ,j/N_MC (+ the KL terms) pair by pair: the exact gradient of L.
                pass2 = {"elbo": [], "kl_old": [], "kl": []}
                for j in range(num_pairs):
                    x_sigma, sigma = x_sigmas[:, j], train_sigmas[:, j]
                    with micro_step(run.accelerator, run.transformer, mb.last and j == num_pairs - 1):
                        v_theta = adapter.velocity(x_sigma, sigma, c, guidance)
                        elbo = elbo_term(v_theta, x_sigma, x0, sigma, args.adaptive_weight)
                        # Eq. 16's KL to θ_old in x0 space: x̂0_θ − x̂0_old = −σ·(v_θ − v_old)
                        kl_old_j = (sig[:, j] ** 2 * (v_theta - v_old[j]) ** 2).flatten(1).mean(1)
                        kl_j = ((v_theta - v_ref[j]) ** 2).flatten(1).mean(1) if args.kl_beta > 0 \
                            else torch.zeros_like(elbo)
                        loss = coefficient * elbo + args.kl_old * kl_old_j + args.kl_beta * kl_j
                        # weight: 1 / (kept samples of this optimizer step), so the step averages samples and pairs
                        run.accelerator.backward((weight * loss).sum() / num_pairs)
                    for key, value in zip(pass2, (elbo, kl_old_j, kl_j)):
                        pass2[key].append(value.detach())
                elbo_pass2, kl_old, kl = (torch.stack(pass2[key]).mean(0) for key in pass2)  # as L̂_old: ρ ≡ 1 exactly
                if not real.any():  # a padding-only micro-batch (see plan_micro_batches)
                    continue
                with torch.no_grad():  # statistics over this micro-batch's kept samples
                    if not two_pass:
                        ratio = torch.exp(elbo_old - elbo_pass2)  # logged: exactly 1 (θ = θ_old)
                    r = ratio[real]
                    if update == 0:  # invariant: θ = θ_old before the first optimizer step, so ρ ≡ 1
                        extremes["ratio_dev_first"] = torch.maximum(extremes["ratio_dev_first"], (r - 1).abs().max())
                    extremes["ratio_max"] = torch.maximum(extremes["ratio_max"], r.max())
                    extremes["ratio_min"] = torch.minimum(extremes["ratio_min"], r.min())
                    total = policy_loss + args.kl_old * kl_old + args.kl_beta * kl
                    for key, value in (("loss", total), ("policy_loss", policy_loss), ("kl", kl), ("kl_old", kl_old),
                                       ("elbo_loss", elbo_pass2), ("approx_kl", 0.5 * (elbo_pass2 - elbo_old) ** 2),
                                       ("clipfrac", clipped.float()), ("ratio_mean", ratio)):
                        stats[key].append(value[real].float().mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            del stats["kl"]
        old.blend(0.0)  # θ_old ← θ: the next epoch's rollout policy and ratio denominator

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        extremes["ratio_min"] = -extremes["ratio_min"]  # accelerate reduces by max, not min
        extremes = {key: float(run.accelerator.reduce(value, "max")) for key, value in extremes.items()}
        extremes["ratio_min"] = -extremes["ratio_min"]
        if extremes["ratio_min"] == float("inf"):  # every sample dropped on every process: no step was trained
            extremes = {k: v for k, v in extremes.items() if k == "ratio_dev_first"}
        metrics.update(extremes)
        metrics.update(zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")),
                       soft_adv_abs_mean=float(run.accelerator.reduce(soft.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "elbo_loss",
                                 "ratio_mean", "clipfrac", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
