# DiffusionNFT: online RL on the FORWARD process. Clean rollout samples are re-noised and the model is trained by
# flow matching toward an implicit positive policy and away from an implicit negative one, both built from θ and
# the sampling policy θ_old; no likelihoods, any sampler, CFG-free.
# Paper: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv:2509.16117.
# Differs from awm.py (the other forward-process script): no ratio or clip; θ_old samples and is the baseline of
# both implicit policies; zero-advantage samples are kept (r = ½ still pulls v⁺ and v⁻ together).
# Math: docs/algorithms.md §5.
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from common.advantages import compute_advantages
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import (check_time_sampling, default_num_train, sample_train_noise, sample_train_sigmas,
                                 training_generators, training_seeds)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    adv_clip_max: float = 5.0
    """A_max: advantages are clamped to ±this, mapped to the optimality r ∈ [0, 1], and the loss is scaled by it"""
    num_steps: int = 10
    """sampling steps of a rollout (the reference: 10 for SD3.5, 25 multi-reward)"""

    # Algorithm specific arguments
    dynamics: Literal["dpm", "ode", "flow-sde", "dance-sde", "cps"] = "dpm"
    """rollout sampler of θ_old: dpm (deterministic DPM-Solver++ 2M, the reference's), ode (Euler) or an SDE;
    only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout"""
    time_sampling: Literal["discrete_random", "discrete", "discrete_wo_init", "uniform", "logit_normal"] = \
        "discrete_random"
    """training σ's per sample: discrete_random (T distinct rollout steps uniformly at random, the reference's),
    discrete / discrete_wo_init (stratified over the rollout steps, AWM's), uniform, logit_normal"""
    train_timesteps: int | None = None
    """T ≥ 1: σ's trained per sample (unset: ⌊0.99·n⌋ of the n eligible rollout steps, as the reference)"""
    timestep_range: tuple[float, float] = (0.0, 1.0)
    """(f_lo, f_hi) fractions along the denoising axis (discrete kinds: rollout steps [⌊f_lo·N⌋, ⌊f_hi·N⌋))"""
    time_shift: float = 3.0
    """shift s of the continuous strategies: σ = s·u/(1 + (s − 1)·u)"""
    nft_beta: float = 1.0
    """β: how far the implicit positive/negative policies sit from θ_old (1.0; 0.1 for OCR/multi-reward)"""
    kl_beta: float = 1e-4
    """weight of mean((v_θ − v_ref)²) to the reference model (1e-4, always on in the reference; 0: off)"""
    decay_flat: int = 0
    """θ_old decay schedule: d = 0 (θ_old ← θ) until this many optimizer steps"""
    decay_uprate: float = 0.001
    """… then d grows by this much per optimizer step …"""
    decay_uphold: float = 0.5
    """… up to this cap: θ_old ← d·θ_old + (1 − d)·θ after every epoch"""


# What each preset is, why, and what it measured: docs/algorithms/nft.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): LoRA r16 at lr 1e-3 (faster settings collapsed), a KL to the pretrained
    # model, 4 of 8 steps trained, 4 optimizer steps per epoch.
    "toy": dict(TOY_WORLD, epochs=30, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                num_steps=8, train_timesteps=4, learning_rate=1e-3, lora_rank=16, lora_alpha=16, kl_beta=0.1,
                eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting on the strict reward, a full fine-tune at
    # lr 1e-4 (it gained more than the LoRA).
    "toy-edit": dict(TOY_EDIT_WORLD, reward=["toy_edit,mode=strict"], epochs=100, prompts_per_epoch=8, group_size=8,
                     batch_size=16, updates_per_epoch=4, num_steps=8, train_timesteps=4, full_finetune=True,
                     learning_rate=1e-4, kl_beta=0.1, eval_every=20, save_every=20),
    # The toy video world (docs/toy-video-world.md): the toy setting as it is, 60 epochs.
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=60, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=4, num_steps=8, train_timesteps=4, learning_rate=1e-3, lora_rank=16,
                      lora_alpha=16, kl_beta=0.1, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): ~100× the papers' lr, a short epoch.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=1, num_steps=6, train_timesteps=3, kl_beta=0.0,
                 learning_rate=5e-2, lora_rank=8, lora_alpha=8, global_std=False, eval_every=25,
                 eval_num_prompts=8, save_every=25),
    # DiffusionNFT's PickScore setting on FLUX.1-dev: deterministic rollouts, one optimizer step per epoch.
    "flux1": dict(reward=["pickscore"], resolution=512, num_steps=10, eval_num_steps=28, group_size=16,
                  prompts_per_epoch=48, batch_size=8, updates_per_epoch=1, learning_rate=3e-4, lora_rank=64,
                  lora_alpha=128, nft_beta=1.0, kl_beta=1e-4, decay_flat=0, decay_uprate=0.001, decay_uphold=0.5,
                  epochs=1000, eval_every=20, save_every=20),
    # The reference's OCR setting: small β, θ_old frozen for 75 steps then a slow EMA, 2 optimizer steps per
    # epoch.
    "flux1-ocr": dict(reward=["ocr"], resolution=512, num_steps=10, eval_num_steps=28, group_size=16,
                      prompts_per_epoch=48, batch_size=8, updates_per_epoch=2, learning_rate=3e-4, lora_rank=64,
                      lora_alpha=128, nft_beta=0.1, kl_beta=1e-4, decay_flat=75, decay_uprate=0.0075,
                      decay_uphold=0.999, epochs=1000, eval_every=20, save_every=20),
}
# The guard's demonstration (docs/guard.md): the toy setting trained on a hackable reward, the share of the canvas in
# the prompt's colour, with the toy world's strict checks as the held-out judge.
PRESETS["toy-hack"] = dict(PRESETS["toy"], reward=["toy_colour_share"], judge=["toy,mode=strict"],
                           epochs=60, eval_every=5, save_every=10)


def old_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """d after `step` optimizer steps in total (this epoch's included): θ_old ← d·θ_old + (1 − d)·θ."""
    return 0.0 if step < flat else min(uprate * (step - flat), uphold)


def nft_loss(v_theta, v_old, x_sigma, x0, sigma, advantages, beta: float, adv_clip_max: float):
    """DiffusionNFT's policy loss for one trained σ per sample. Returns (loss (B,), ℓ⁺ (B,), ℓ⁻ (B,)).

    v_theta: velocity of the trained policy (with grad); v_old: of θ_old (detached here); x_sigma, x0: the
    re-noised and the clean sample; sigma: (B,); advantages: (B,) group-normalised.
    """
    # Optimality probability r ∈ [0, 1] from the clipped advantage (A = 0 -> r = ½).
    r = ((advantages.double().clamp(-adv_clip_max, adv_clip_max) / adv_clip_max) / 2 + 0.5).clamp(0, 1)
    v_old = v_old.detach()
    # Implicit policies (paper eq. 6): v⁺ = β·v_θ + (1 − β)·v_old, v⁻ = (1 + β)·v_old − β·v_θ. They are
    # symmetric around v_old and both equal v_θ in value while θ = θ_old, yet gradients flow through both.
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    x0_pos, x0_neg = x_sigma - sig * v_pos, x_sigma - sig * v_neg  # x̂0 = x_σ − σ·v
    # Adaptive x0-space weighting (the reference's): each sample's squared error over its own mean abs error,
    # the normaliser a float64 constant (no gradient).
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().flatten(1).mean(1).clamp_min(1e-5)
        w_neg = (x0_neg.double() - x0.double()).abs().flatten(1).mean(1).clamp_min(1e-5)
    loss_pos = ((x0_pos - x0) ** 2).flatten(1).mean(1) / w_pos
    loss_neg = ((x0_neg - x0) ** 2).flatten(1).mean(1) / w_neg
    # Paper eq. 8: L = E[r·ℓ⁺ + (1 − r)·ℓ⁻] / β, scaled by A_max as the reference does.
    loss = (r * loss_pos + (1 - r) * loss_neg) / beta * adv_clip_max
    return loss.float(), loss_pos.detach(), loss_neg.detach()


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "DiffusionNFT (arXiv:2509.16117): forward-process RL with implicit policies.")
    if args.nft_beta <= 0:
        raise UserError(f"--nft-beta must be positive, got {args.nft_beta}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    if args.train_timesteps is not None and args.train_timesteps < 1:
        raise UserError(f"--train-timesteps must be at least 1 (unset: the default), got {args.train_timesteps}")
    if args.decay_flat < 0 or args.decay_uprate < 0 or not 0 <= args.decay_uphold <= 1:
        raise UserError("the θ_old decay needs --decay-flat >= 0, --decay-uprate >= 0 and --decay-uphold in [0, 1]")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    # θ_old: a second LoRA adapter "old" (or a frozen copy when fully fine-tuning), equal to θ at the start.
    run = setup(args, load_run_rewards(args), shadows=("old",), reference_copy=args.kl_beta > 0, cfg_free=True)
    adapter, sigmas, guidance, device, old = run.adapter, run.sigmas, run.guidance, run.device, run.shadows["old"]
    num_train = (args.train_timesteps if args.train_timesteps is not None else
                 default_num_train(args.time_sampling, sigmas, args.timestep_range))
    check_time_sampling(args.time_sampling, num_train, sigmas, args.timestep_range)
    samples_per_epoch, local_count = args.prompts_per_epoch * args.group_size, run.local.stop - run.local.start
    rollout_batches = rollout_micro_batches(local_count, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="nft")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples: a function of (seed, epoch), so any process count or resume agrees --
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, args.group_size, args.seed, epoch,
                                       run.local)
        group_ids = torch.tensor([r.key for r in records])
        time_seeds = torch.tensor(training_seeds(args.seed, epoch, samples_per_epoch)[run.local])

        # ---- 2. rollout with θ_old, keeping only x0 --------------------------------------------------------------
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

        # ---- 3. rewards and group-relative advantages over the whole epoch (all processes) ----------------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        plan = plan_micro_batches(torch.ones_like(advantages, dtype=torch.bool), run.data.num_processes,
                                  run.data.process_index, args.batch_size, args.updates_per_epoch)
        advantages = advantages[run.local].float().to(device)
        reward_time = time.time() - reward_start

        # ---- 4. update: re-noise x0 at T σ's per sample; match the implicit positive and negative policies -------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "old_v_mse",
                                 "grad_norm")}
        for micro_batches in plan:
            for mb in micro_batches:
                c, adv, weight, x0 = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                      mb.weight.to(device), clean[mb.index])
                # An independent σ and ε per sample, from the sample's own generator (algorithms.md §5).
                generators = training_generators(time_seeds[mb.index])
                train_sigmas = sample_train_sigmas(args.time_sampling, num_train, generators, sigmas,
                                                   args.timestep_range, args.time_shift)
                train_noise = sample_train_noise(num_train, generators, x0)
                for i in range(num_train):
                    sigma = train_sigmas[:, i]
                    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
                    x_sigma = (1 - sig) * x0 + sig * train_noise[:, i]  # forward process, target v* = ε − x0
                    v_old = old.velocity(x_sigma, sigma, c, guidance)  # frozen policies first: no graph touched
                    v_ref = run.reference.velocity(x_sigma, sigma, c, guidance) if args.kl_beta > 0 else None
                    with micro_step(run.accelerator, run.transformer, mb.last and i == num_train - 1):
                        v_theta = adapter.velocity(x_sigma, sigma, c, guidance)
                        policy_loss, loss_pos, loss_neg = nft_loss(v_theta, v_old, x_sigma, x0, sigma, adv,
                                                                   args.nft_beta, args.adv_clip_max)
                        kl = torch.zeros_like(policy_loss)
                        if args.kl_beta > 0:  # velocity-space KL to the reference, as the reference code
                            kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1)
                        loss = policy_loss + args.kl_beta * kl
                        # weight: 1 / (samples of this optimizer step), so the step averages samples and σ's
                        run.accelerator.backward((weight * loss).sum() / num_train)
                    with torch.no_grad():
                        for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                           ("positive_loss", loss_pos), ("negative_loss", loss_neg),
                                           ("old_v_mse", ((v_theta - v_old) ** 2).flatten(1).mean(1))):
                            stats[key].append(value.float().mean())
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        if args.kl_beta == 0:
            del stats["kl"]
        # θ_old trails θ: d counts optimizer steps including this epoch's (Flow-Factory's epoch index is one behind).
        decay = old_decay(run.optimizer_steps, args.decay_flat, args.decay_uprate, args.decay_uphold)
        old.blend(decay)

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(old_decay=decay, zero_std_frac=adv_stats["zero_std_frac"],
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "kl", "old_v_mse",
                                 "old_decay", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
