# Centered Reward Distillation (CRD): online RL on the FORWARD process. The implicit reward of θ, a flow-matching
# log-ratio against a trailing "old" snapshot, is regressed onto the external reward; both are centred within each
# prompt's group, which cancels the unknown log-partition term of the KL-regularised optimum. No likelihoods.
# Paper: Zhu, Wang, Lathuilière, Kalogeiton, "Diffusion Reinforcement Learning via Centered Reward Distillation",
# arXiv:2603.14128 (reference code: Flow-Factory's trainers/crd.py). Copied from nft.py; what differs: two
# snapshots trail θ, "old" (the implicit reward's baseline) and "sampler" (rolls out, Euler ODE), each with its own
# (k0, v0, slope, v_end) decay; NFT's implicit policies are replaced by the centred reward regression; the KL goes
# to the reference at the model's inference guidance, weighted by r̂; σ is shared within a group (ε per sample) and
# T may exceed the eligible rollout steps; every micro-batch holds whole groups. Math: docs/algorithms.md §7.
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.advantages import compute_advantages
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import (check_time_sampling, eligible_steps, sample_train_noise, sample_train_sigmas,
                                 training_generators, training_seeds)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    adv_clip_max: float = 5.0
    """A_max: advantages are clamped to ±this, mapped to the target r̂ ∈ [0, 1], and the loss is scaled by A_max/β"""
    group_size: int = 24
    """K: samples per prompt (one group; the reference: 24)"""
    batch_size: int = 24
    """largest per-process micro-batch, for rollout and training: a multiple of --group-size (r_θ is centred over
    each group inside its micro-batch)"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch (the reference: 2)"""

    # Algorithm specific arguments
    dynamics: Literal["ode", "dpm", "flow-sde", "dance-sde", "cps"] = "ode"
    """rollout sampler of the sampler snapshot: ode (Euler, the reference's), dpm (DPM-Solver++ 2M) or an SDE;
    only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout"""
    time_sampling: Literal["discrete", "discrete_wo_init", "discrete_random", "uniform", "logit_normal"] = "discrete"
    """training σ's, drawn once per GROUP (its samples share them, each with its own ε): discrete (stratified over
    the eligible rollout steps, the reference's; a T above their number repeats steps), discrete_wo_init,
    discrete_random, uniform, logit_normal"""
    train_timesteps: int = 20
    """T: σ's trained per sample (the reference: 20; at 10 rollout steps each eligible step comes about twice)"""
    timestep_range: tuple[float, float] = (0.0, 0.99)
    """(f_lo, f_hi) fractions along the denoising axis (discrete kinds: rollout steps [⌊f_lo·N⌋, ⌊f_hi·N⌋))"""
    time_shift: float = 3.0
    """shift s of the continuous strategies: σ = s·u/(1 + (s − 1)·u)"""
    crd_beta: float = 1.0
    """β: β·(centred r_θ) is matched to the centred r̂; the loss is scaled by A_max/β"""
    crd_loss: Literal["mse", "bce"] = "mse"
    """mse: (β·R̃θ − R̃)²; bce: BCE-with-logits(β·R̃θ, sigmoid(R̃))"""
    adaptive_logp: bool = True
    """r_θ with each squared velocity error divided by its stop-gradient mean |error| (the reference's default);
    --no-adaptive-logp: r_θ = ℓ_old − ℓ_θ"""
    kl_beta: float = 0.1
    """β_KL of mean((v_θ − v_ref)²) to the reference (0: off)"""
    kl_cfg: float | None = None
    """guidance of the reference in the KL (unset: the model's inference value: true CFG 4.5 on SD3.5, the paper's,
    and Wan, 4.0 on Qwen-Image; FLUX.1 has only its guidance embedding, 3.5, which its rollouts already use)"""
    reward_adaptive_kl: bool = True
    """weight sample i's KL by β_KL·(m + r̂_i·(1 − m)), m = 1e-4/β_KL: 1e-4 at r̂ = 0 up to β_KL at r̂ = 1"""
    old_decay: tuple[int, float, float, float] = (0, 0.25, 0.005, 0.999)
    """(k0, v0, slope, v_end) of the old snapshot: d = v0 for k < k0, else min(v0 + slope·(k − k0), v_end), k =
    optimizer steps so far; old ← d·old + (1 − d)·θ after every epoch (d = 0 copies θ, d = 1 keeps)"""
    sampler_decay: tuple[int, float, float, float] = (75, 0.0, 0.0075, 0.999)
    """(k0, v0, slope, v_end) of the sampler snapshot, the same rule (the default: on-policy for 75 steps)"""


# What each preset is, why, and what it measured: docs/algorithms/crd.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): nft's toy setting with CRD's centred target.
    "toy": dict(TOY_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                num_steps=8, train_timesteps=4, learning_rate=1e-3, lora_rank=16, lora_alpha=16, kl_beta=0.1,
                eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting, untuned (nft.py and grpo.py carry tuned ones).
    "toy-edit": dict(TOY_EDIT_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                     num_steps=8, train_timesteps=4, learning_rate=1e-3, lora_rank=16, lora_alpha=16, kl_beta=0.1,
                     eval_every=10, save_every=10),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=4, num_steps=8, train_timesteps=4, learning_rate=1e-3, lora_rank=16,
                      lora_alpha=16, kl_beta=0.1, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): ~100× the papers' lr, a short epoch, 4 groups of 4.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=4,
                 group_size=4, batch_size=8, updates_per_epoch=1, num_steps=6, train_timesteps=3, kl_beta=0.0,
                 learning_rate=1e-1, lora_rank=8, lora_alpha=8, global_std=False, eval_every=25,
                 eval_num_prompts=8, save_every=25),
    # The paper's OCR setting (Flow-Factory's example, "paper Table 3") adapted to FLUX.1-dev.
    "flux1": dict(reward=["ocr"], resolution=512, num_steps=10, eval_num_steps=28, group_size=24,
                  prompts_per_epoch=48, batch_size=24, updates_per_epoch=2, learning_rate=3e-4, lora_rank=64,
                  lora_alpha=128, gradient_checkpointing=True, train_timesteps=20, timestep_range=(0.0, 0.99),
                  crd_beta=1.0, kl_beta=0.1, old_decay=(0, 0.25, 0.005, 0.999),
                  sampler_decay=(75, 0.0, 0.0075, 0.999), epochs=1000, eval_every=20, save_every=20),
}


def snapshot_decay(step: int, k0: int, v0: float, slope: float, v_end: float) -> float:
    """d after `step` optimizer steps in total (this epoch's included): snapshot ← d·snapshot + (1 − d)·θ."""
    return v0 if step < k0 else min(v0 + slope * (step - k0), v_end)


def group_mean(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean of `values` (B,); groups: (B,) ids 0 … G − 1 of whole groups."""
    count = torch.zeros(int(groups.max()) + 1, dtype=values.dtype, device=values.device)
    total = torch.zeros_like(count).index_add_(0, groups, values)
    return (total / count.index_add_(0, groups, torch.ones_like(values)))[groups]


def implicit_reward(v_theta, v_old, v_target, adaptive: bool) -> torch.Tensor:
    """r_θ (B,), float64: −mean[(v_θ − v*)²/w_θ − (v_old − v*)²/w_old] with w = stopgrad(max(mean|v − v*|, 1e-5))
    (adaptive), else ℓ_old − ℓ_θ. Zero wherever v_θ = v_old; v_old is detached."""
    err_theta, err_old = (v_theta.double() - v_target.double()).flatten(1), (v_old.detach().double()
                                                                            - v_target.double()).flatten(1)
    if not adaptive:
        return -(err_theta ** 2 - err_old ** 2).mean(1)
    w_theta = err_theta.detach().abs().mean(1, keepdim=True).clamp_min(1e-5)
    w_old = err_old.abs().mean(1, keepdim=True).clamp_min(1e-5)
    return -(err_theta ** 2 / w_theta - err_old ** 2 / w_old).mean(1)


def crd_loss(r_theta, r_hat, groups, beta: float, adv_clip_max: float, kind: str = "mse") -> torch.Tensor:
    """CRD's loss per sample (B,), float64; its mean over samples is L_CRD. r_theta: (B,) with grad; r_hat: (B,)
    targets in [0, 1]; groups: (B,) ids of the WHOLE groups in the batch. Both rewards are centred per group, r_θ
    around a stop-gradient mean, so the per-prompt log-partition term cancels."""
    target = r_hat.double() - group_mean(r_hat.double(), groups)  # R̃
    centred = r_theta - group_mean(r_theta.detach(), groups)  # R̃θ
    if kind == "mse":
        loss = (beta * centred - target) ** 2
    else:
        loss = F.binary_cross_entropy_with_logits(beta * centred, torch.sigmoid(target), reduction="none")
    return loss * adv_clip_max / beta  # the reference's A_max/β scale


def kl_coefficient(r_hat, kl_beta: float, reward_adaptive: bool):
    """Per-sample weight of the KL: β_KL·(m + r̂·(1 − m)) with m = 1e-4/β_KL (reward-adaptive: 1e-4 at r̂ = 0, β_KL
    at r̂ = 1, so the anchor is loose while a sample is bad and tight once it is good), else β_KL."""
    if kl_beta == 0 or not reward_adaptive:
        return kl_beta
    m = 1e-4 / kl_beta
    return kl_beta * (m + r_hat * (1 - m))


def group_sigmas(strategy: str, num_train: int, generators, sigmas, timestep_range, shift: float) -> torch.Tensor:
    """(B, T) training σ's, one row per generator (a group's samples pass equal generators, so they share σ's).
    `discrete` / `discrete_wo_init` with T above the n eligible steps pick step ⌊(i + U_i)·n/T⌋ in stratum i: each
    step T/n times on average (at least once when T ≥ 2n), each with a fresh ε; otherwise common.timesampling's."""
    steps = eligible_steps(sigmas, timestep_range, strategy)
    if strategy not in ("discrete", "discrete_wo_init") or num_train <= len(steps):
        return sample_train_sigmas(strategy, num_train, generators, sigmas, timestep_range, shift)
    schedule, steps, rows = sigmas.detach().float().cpu(), torch.tensor(steps), []
    for g in generators:
        strata = torch.arange(num_train, dtype=torch.float64) + torch.rand(num_train, generator=g, dtype=torch.float64)
        pick = (strata * len(steps) / num_train).long().clamp_max(len(steps) - 1)
        rows.append(schedule[steps[pick]][torch.randperm(num_train, generator=g)])
    return torch.stack(rows).to(sigmas.device)


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "CRD (arXiv:2603.14128): centred reward distillation on the forward process.")
    if args.crd_beta <= 0:
        raise UserError(f"--crd-beta must be positive, got {args.crd_beta}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    if args.kl_cfg is not None and args.kl_cfg < 1:
        raise UserError(f"--kl-cfg must be >= 1 (1: no guidance), got {args.kl_cfg}")
    for flag, (k0, v0, slope, v_end) in (("old-decay", args.old_decay), ("sampler-decay", args.sampler_decay)):
        if k0 < 0 or slope < 0 or not (0 <= v0 <= 1 and 0 <= v_end <= 1):
            raise UserError(f"--{flag} K0 V0 SLOPE V_END needs K0 >= 0, SLOPE >= 0 and V0, V_END in [0, 1], got "
                            f"{k0} {v0} {slope} {v_end}")
    if args.batch_size % args.group_size:
        raise UserError(f"--batch-size {args.batch_size} must be a multiple of --group-size {args.group_size}: "
                        f"CRD centres over each group inside one micro-batch")
    if args.train_timesteps < 1:
        raise UserError(f"--train-timesteps must be at least 1, got {args.train_timesteps}")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    # old and sampler: second and third LoRA adapters (or frozen copies when fully fine-tuning), equal to θ at first.
    run = setup(args, load_run_rewards(args), shadows=("old", "sampler"),
                reference_copy=args.kl_beta > 0, cfg_free=True)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    old, sampler = run.shadows["old"], run.shadows["sampler"]
    kl_cfg = args.kl_cfg if args.kl_cfg is not None else adapter.default_guidance_scale
    num_train, world = args.train_timesteps, run.data.num_processes
    if args.time_sampling not in ("discrete", "discrete_wo_init") or not eligible_steps(sigmas, args.timestep_range,
                                                                                       args.time_sampling):
        check_time_sampling(args.time_sampling, num_train, sigmas, args.timestep_range)
    per_process = args.updates_per_epoch * (args.batch_size // args.group_size)
    if args.prompts_per_epoch % (world * per_process):
        raise UserError(f"--prompts-per-epoch {args.prompts_per_epoch} must be a multiple of {world * per_process} "
                        f"(processes × --updates-per-epoch × groups per micro-batch), so that every process holds "
                        f"whole groups and every micro-batch whole groups")
    samples_per_epoch, local_count = args.prompts_per_epoch * args.group_size, run.local.stop - run.local.start
    rollout_batches = rollout_micro_batches(local_count, args.batch_size, args.updates_per_epoch)
    group_index = torch.arange(run.local.start, run.local.stop) // args.group_size  # group of each local sample

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="crd")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples, each group contiguous on one process: a function of (seed, epoch) ----
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local, whole_groups=True)
        group_ids = torch.tensor([r.key for r in records])
        noise_seeds = torch.tensor(training_seeds(args.seed, epoch, samples_per_epoch)[run.local])  # ε per sample
        sigma_seeds = torch.tensor(np.random.default_rng([args.seed, epoch, 0xC7D]).integers(
            0, 2**62, size=args.prompts_per_epoch))[group_index]  # σ per group

        # ---- 2. rollout with the sampler snapshot, keeping only x0 ---------------------------------------------
        cond = run.encode(records)
        run.transformer.eval()
        clean = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            x0 = sample(lambda x, sigma: sampler.velocity(x, sigma, c, guidance), adapter.noise(generators), sigmas,
                        args.dynamics, args.noise_level, generators)
            clean.append(x0)
            scoring.submit(adapter.decode(x0, c).cpu())
        clean = torch.cat(clean)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards, group-relative advantages over the whole epoch, and the target r̂ ∈ [0, 1] -------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        plan = plan_micro_batches(torch.ones_like(advantages, dtype=torch.bool), world, run.data.process_index,
                                  args.batch_size, args.updates_per_epoch)
        # NFT's optimality probability (A = 0 -> ½); centred per group in crd_loss.
        r_hat = ((advantages.clamp(-args.adv_clip_max, args.adv_clip_max) / args.adv_clip_max) / 2 + 0.5).clamp(0, 1)
        target_sq = float((r_hat - group_mean(r_hat, torch.arange(samples_per_epoch) // args.group_size)).pow(2).mean())
        advantages, r_hat = advantages[run.local].float().to(device), r_hat[run.local].to(device)
        reward_time = time.time() - reward_start

        # ---- 4. update: re-noise x0 at T σ's per group; regress the centred implicit reward on the centred r̂ ----
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "unscaled_loss", "kl", "kl_loss", "r_theta_mean",
                                 "old_v_mse", "old_kl", "grad_norm")}
        for micro_batches in plan:
            for mb in micro_batches:
                c, target, weight, x0 = ({k: v[mb.index] for k, v in cond.items()}, r_hat[mb.index],
                                         mb.weight.to(device), clean[mb.index])
                groups = torch.unique(group_index[mb.index], return_inverse=True)[1].to(device)
                train_sigmas = group_sigmas(args.time_sampling, num_train, training_generators(sigma_seeds[mb.index]),
                                            sigmas, args.timestep_range, args.time_shift)
                train_noise = sample_train_noise(num_train, training_generators(noise_seeds[mb.index]), x0)
                kl_coef = kl_coefficient(target, args.kl_beta, args.reward_adaptive_kl)
                for i in range(num_train):
                    sigma, eps = train_sigmas[:, i], train_noise[:, i]
                    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
                    x_sigma, v_target = (1 - sig) * x0 + sig * eps, eps - x0  # forward process, target v* = ε − x0
                    v_old = old.velocity(x_sigma, sigma, c, guidance)  # frozen policies first: no graph touched
                    v_ref = run.reference.velocity(x_sigma, sigma, c, kl_cfg) if args.kl_beta > 0 else None
                    with micro_step(run.accelerator, run.transformer, mb.last and i == num_train - 1):
                        v_theta = adapter.velocity(x_sigma, sigma, c, guidance)
                        r_theta = implicit_reward(v_theta, v_old, v_target, args.adaptive_logp)
                        policy_loss = crd_loss(r_theta, target, groups, args.crd_beta, args.adv_clip_max,
                                               args.crd_loss)
                        kl = torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # velocity-space KL to the (guided) reference
                            kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1)
                        loss = policy_loss + kl_coef * kl
                        # weight: 1 / (samples of this optimizer step), so the step averages samples and σ's
                        run.accelerator.backward((weight * loss).sum() / num_train)
                    with torch.no_grad():
                        for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                           ("unscaled_loss", policy_loss * args.crd_beta / args.adv_clip_max),
                                           ("kl_loss", kl_coef * kl), ("r_theta_mean", r_theta),
                                           ("old_v_mse", ((v_theta - v_old) ** 2).flatten(1).mean(1))):
                            stats[key].append(value.float().mean())
                        if args.kl_beta > 0:
                            stats["old_kl"].append(((v_old - v_ref) ** 2).mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            for key in ("kl", "kl_loss", "old_kl"):
                del stats[key]
        # Both snapshots trail θ: k counts optimizer steps including this epoch's (Flow-Factory's step counter).
        old_d = snapshot_decay(run.optimizer_steps, *args.old_decay)
        sampler_d = snapshot_decay(run.optimizer_steps, *args.sampler_decay)
        old.blend(old_d)
        sampler.blend(sampler_d)

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(old_decay=old_d, sampler_decay=sampler_d, target_sq_mean=target_sq,
                       zero_std_frac=adv_stats["zero_std_frac"],
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "r_theta_mean",
                                 "old_v_mse", "old_decay", "sampler_decay", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
