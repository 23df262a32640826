# Advantage Weighted Matching (AWM): the pretraining flow-matching loss on clean rollout samples, weighted by the
# advantage inside a PPO-style clipped objective; Flow-GRPO's per-step Gaussian likelihood is replaced by the
# (negated, weighted) matching loss, so any sampler works and only x0 is kept.
# Paper: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models",
# arXiv:2509.25050. Differs from nft.py (the other forward-process script): a clipped ratio of matching-loss
# "log-probs", an EMA of θ as KL anchor and optional off-policy sampler; every sample trained, zero advantage too.
# The reference's SA-Solver rollout is not implemented: use ode, dpm or an SDE. Math: docs/algorithms.md §5.
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from common.advantages import compute_advantages, trained_samples
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import (check_time_sampling, sample_train_noise, sample_train_sigmas, training_generators,
                                 training_seeds)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


COLLAPSE_WARNING = ("turning off BOTH the EMA-KL term (--ema-kl-beta 0) and the PPO clip (--clip-range inf) tends to "
                    "collapse training (Flow-Factory's warning)")


@dataclass
class Args(TrainArgs):
    infinity_allowed = ("clip_range",)  # --clip-range inf: no clip
    adv_clip_max: float = 5.0
    """advantages are clamped to ±this, then divided by it (so the loss sees A ∈ [−1, 1])"""
    group_size: int = 24
    """K: samples per prompt (one group)"""
    num_steps: int = 14
    """sampling steps of a rollout"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: float = 64
    """LoRA alpha"""

    # Algorithm specific arguments
    dynamics: Literal["ode", "dpm", "flow-sde", "dance-sde", "cps"] = "ode"
    """rollout sampler: ode (Euler), dpm (DPM-Solver++ 2M) or an SDE; only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout"""
    time_sampling: Literal["discrete", "discrete_wo_init", "discrete_random", "uniform", "logit_normal"] = "discrete"
    """training σ's per sample: discrete (stratified over the rollout steps; PickScore), discrete_wo_init (never
    σ = 1; GenEval, OCR), discrete_random, uniform, logit_normal"""
    train_timesteps: int = 6
    """T: σ's trained per sample"""
    timestep_range: tuple[float, float] = (0.0, 0.9)
    """(f_lo, f_hi) fractions along the denoising axis (discrete kinds: rollout steps [⌊f_lo·N⌋, ⌊f_hi·N⌋))"""
    time_shift: float = 3.0
    """shift s of the continuous strategies: σ = s·u/(1 + (s − 1)·u)"""
    weighting: Literal["ghuber", "uniform", "t", "t2", "huber"] = "ghuber"
    """log-prob = −w(ℓ, σ) of the matching loss ℓ: ghuber (σ/p)(ℓ^p − ·) (every configuration the authors ship),
    uniform ℓ, t σℓ, t2 σ²ℓ, huber σ(√ℓ − ·)"""
    ghuber_power: float = 0.25
    """p of the ghuber weighting"""
    off_policy: bool = False
    """sample with the EMA of the trained weights and take logp_old from it (on-policy: ratio ≡ 1)"""
    clip_range: float = 1.0
    """PPO clip c on the ratio (inf: no clip). Warning: turning off both the clip and --ema-kl-beta tends to collapse"""
    kl_beta: float = 1e-4
    """weight of mean((v_θ − v_ref)²) to the reference model (1e-4 PickScore, 1e-3 GenEval, 3e-3 OCR; 0: off)"""
    ema_kl_beta: float = 1.0
    """weight of mean((v_θ − v_ema)²) to the EMA. Warning: turning off both it and the clip tends to collapse"""
    ema_decay_rate: float = 0.001
    """EMA decay after k optimizer steps: d = min(ema_max_decay, ema_decay_rate·k) …"""
    ema_max_decay: float = 0.3
    """… capped here; ema ← d·ema + (1 − d)·θ once after every epoch"""
    drop_zero_advantage: bool = False
    """variant: drop the samples of groups whose K rewards are equal (advantage 0) before training. AWM's reference
    trains them (its filter is commented out): they carry no policy gradient but do carry the KL and EMA-KL terms,
    and dropping a share f of samples scales the policy gradient by 1/(1 − f)"""


# What each preset is, why, and what it measured: docs/algorithms/awm.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): nft's toy setting with AWM's own ghuber weighting.
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
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): ~100× the papers' lr, a short epoch, uniform
    # weighting (it learned faster than ghuber there).
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, num_steps=6, train_timesteps=5, learning_rate=5e-2, lora_rank=8,
                 lora_alpha=8, weighting="uniform", kl_beta=0.0, global_std=False, eval_every=25, eval_num_prompts=8,
                 save_every=25),
    # AWM's PickScore setting on FLUX.1-dev (the paper's): deterministic rollouts.
    "flux1": dict(reward=["pickscore"], resolution=512, num_steps=14, eval_num_steps=28, train_timesteps=6,
                  time_sampling="discrete", timestep_range=(0.0, 0.9), group_size=24, prompts_per_epoch=48,
                  batch_size=8, learning_rate=3e-4, lora_rank=32, lora_alpha=64, kl_beta=1e-4, ema_kl_beta=1.0,
                  clip_range=1.0, epochs=1000, eval_every=20, save_every=20),
    # AWM's OCR setting: never σ = 1, KL 3e-3; its SA-Solver rollout is not implemented (the ODE rolls out).
    "flux1-ocr": dict(reward=["ocr"], resolution=512, num_steps=14, eval_num_steps=28, train_timesteps=6,
                      time_sampling="discrete_wo_init", timestep_range=(0.0, 0.9), group_size=24, prompts_per_epoch=48,
                      batch_size=8, learning_rate=3e-4, lora_rank=32, lora_alpha=64, kl_beta=3e-3, ema_kl_beta=1.0,
                      clip_range=1.0, epochs=1000, eval_every=20, save_every=20),
}


def matching_log_prob(velocity, target, sigma, weighting: str, ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's "log-prob" (B,) float64: −w(ℓ, σ), ℓ = mean over elements of (v − (ε − x0))², the flow-matching
    loss of the pretraining objective (a mean, not a sum, as all log-probs here)."""
    loss = ((velocity.double() - target.double()) ** 2).flatten(1).mean(1)
    s = sigma.double()
    if weighting == "uniform":
        weighted = loss
    elif weighting == "t":
        weighted = s * loss
    elif weighting == "t2":
        weighted = s**2 * loss
    elif weighting == "huber":  # a pseudo-Huber in √ℓ: gradients stop growing with the error
        weighted = s * (torch.sqrt(loss + 1e-10) - 1e-5)
    elif weighting == "ghuber":  # generalised: ℓ^p, 0 at ℓ = 0
        weighted = s / ghuber_power * ((loss + 1e-10) ** ghuber_power - 1e-10**ghuber_power)
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    return -weighted


def clipped_policy_loss(log_prob, log_prob_old, advantages, clip_range: float):
    """PPO's clipped surrogate per sample on ratio = exp(logp − logp_old): max(−A·ratio, −A·clamp(ratio, 1 ± c)).
    Returns (loss (B,), ratio (B,))."""
    ratio = torch.exp(log_prob - log_prob_old)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)), ratio


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, f"AWM (arXiv:2509.25050): advantage-weighted flow matching. Note: {COLLAPSE_WARNING}.")
    if args.ghuber_power <= 0:
        raise UserError(f"--ghuber-power must be positive, got {args.ghuber_power}")
    if not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive (inf: no clip), got {args.clip_range}")
    if args.kl_beta < 0 or args.ema_kl_beta < 0:
        raise UserError("--kl-beta and --ema-kl-beta must be >= 0")
    if args.ema_decay_rate < 0 or not 0 <= args.ema_max_decay <= 1:
        raise UserError("the EMA decay needs --ema-decay-rate >= 0 and --ema-max-decay in [0, 1]")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if args.ema_kl_beta == 0 and args.clip_range == float("inf"):
        print(f"warning: {COLLAPSE_WARNING}", flush=True)
    # The EMA of θ (a second LoRA adapter "ema", or a frozen copy): the off-policy sampler and the EMA-KL anchor.
    use_ema = args.off_policy or args.ema_kl_beta > 0
    run = setup(args, load_run_rewards(args), shadows=("ema",) if use_ema else (),
                reference_copy=args.kl_beta > 0, cfg_free=True)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    ema = run.shadows.get("ema")
    num_train = args.train_timesteps
    check_time_sampling(args.time_sampling, num_train, sigmas, args.timestep_range)
    samples_per_epoch, local_count = args.prompts_per_epoch * args.group_size, run.local.stop - run.local.start
    rollout_batches = rollout_micro_batches(local_count, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="awm")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        time_seeds = torch.tensor(training_seeds(args.seed, epoch, samples_per_epoch)[run.local])

        # ---- 2. rollout with θ (with the EMA when off-policy), keeping only x0 ---------------------------------
        cond = run.encode(records)
        run.transformer.eval()
        clean = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            policy = ema.velocity if args.off_policy else torch.no_grad()(adapter.velocity)
            x0 = sample(lambda x, sigma: policy(x, sigma, c, guidance), adapter.noise(generators), sigmas,
                        args.dynamics, args.noise_level, generators)
            clean.append(x0)
            scoring.submit(adapter.decode(x0, c).cpu())
        clean = torch.cat(clean)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and group-relative advantages over the whole epoch (all processes) ----------------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # Every sample is trained, as AWM's reference does: A = 0 samples still carry the KL and EMA-KL terms.
        keep = trained_samples(adv_stats, keep_zero_advantage=not args.drop_zero_advantage)
        plan = plan_micro_batches(keep, run.data.num_processes, run.data.process_index,
                                  args.batch_size, args.updates_per_epoch)
        advantages = (advantages[run.local] / args.adv_clip_max).to(device)  # AWM scales A into [−1, 1]
        reward_time = time.time() - reward_start

        # ---- 4. update: advantage-weighted flow matching at T re-noised σ's per sample, clipped as PPO ----------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "matching_loss", "kl", "ema_kl", "approx_kl", "clipfrac",
                                 "ratio_mean", "grad_norm")}
        ratio_dev = torch.zeros((), device=device, dtype=torch.float64)
        for micro_batches in plan:
            for mb in micro_batches:
                c, adv, weight, x0 = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                      mb.weight.to(device), clean[mb.index])
                real = mb.real.to(device)
                # An independent σ and ε per sample, from the sample's own generator (algorithms.md §5).
                generators = training_generators(time_seeds[mb.index])
                train_sigmas = sample_train_sigmas(args.time_sampling, num_train, generators, sigmas,
                                                   args.timestep_range, args.time_shift)
                train_noise = sample_train_noise(num_train, generators, x0)
                for i in range(num_train):
                    sigma = train_sigmas[:, i]
                    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
                    x_sigma = (1 - sig) * x0 + sig * train_noise[:, i]  # forward process
                    target = train_noise[:, i] - x0  # v* = ε − x0, the pretraining target
                    v_ema = ema.velocity(x_sigma, sigma, c, guidance) if ema is not None else None  # frozen first
                    v_ref = run.reference.velocity(x_sigma, sigma, c, guidance) if args.kl_beta > 0 else None
                    with micro_step(run.accelerator, run.transformer, mb.last and i == num_train - 1):
                        v_theta = adapter.velocity(x_sigma, sigma, c, guidance)
                        log_prob = matching_log_prob(v_theta, target, sigma, args.weighting, args.ghuber_power)
                        if args.off_policy:  # the sampling policy is the EMA: its log-prob at the same (σ, ε)
                            log_prob_old = matching_log_prob(v_ema, target, sigma, args.weighting, args.ghuber_power)
                        else:  # on-policy: ratio ≡ 1, the gradient is that of mean(A·logp) (AWM eq. 9)
                            log_prob_old = log_prob.detach()
                        policy_loss, ratio = clipped_policy_loss(log_prob, log_prob_old, adv, args.clip_range)
                        policy_loss = policy_loss.float()
                        kl, ema_kl = torch.zeros_like(policy_loss), torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # velocity-space KL to the reference (adapters disabled)
                            kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1)
                        if args.ema_kl_beta > 0:  # keeps θ near its recent past: the EMA-KL term
                            ema_kl = ((v_theta - v_ema) ** 2).flatten(1).mean(1)
                        loss = policy_loss + args.kl_beta * kl + args.ema_kl_beta * ema_kl
                        # weight: 1 / (kept samples of this optimizer step), so the step averages samples and σ's
                        run.accelerator.backward((weight * loss).sum() / num_train)
                    if not real.any():  # a padding-only micro-batch (see plan_micro_batches)
                        continue
                    with torch.no_grad():  # statistics over this micro-batch's kept samples
                        ratio_dev = torch.maximum(ratio_dev, (ratio[real] - 1).abs().max())
                        for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                           ("ema_kl", ema_kl), ("ratio_mean", ratio),
                                           ("matching_loss", ((v_theta - target) ** 2).flatten(1).mean(1)),
                                           ("approx_kl", 0.5 * (log_prob - log_prob_old) ** 2),
                                           ("clipfrac", ((ratio - 1).abs() > args.clip_range).float())):
                            stats[key].append(value[real].float().mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        for key, beta in (("kl", args.kl_beta), ("ema_kl", args.ema_kl_beta)):
            if beta == 0:
                del stats[key]
        # The EMA trails θ, updated once per epoch; d counts optimizer steps including this epoch's.
        decay = min(args.ema_max_decay, args.ema_decay_rate * run.optimizer_steps)
        if ema is not None:
            ema.blend(decay)

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(ratio_dev_max=float(run.accelerator.reduce(ratio_dev.float(), "max")),
                       zero_std_frac=adv_stats["zero_std_frac"], dropped_frac=float(1 - keep.float().mean()),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")), **({"ema_decay": decay} if ema is not None else {}))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "ema_kl",
                                 "clipfrac", "approx_kl", "dropped_frac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
