# Direct Group Preference Optimization (DGPO): a DPO likelihood of a group's positive samples (A > 0) over its
# negative ones (A < 0), each weighted by |A| and written with flow-matching losses against a reference; Σ_g A = 0
# cancels the partition function, so no log-probs are needed and rollouts are deterministic ODE samples.
# Paper: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv:2510.08425.
# Copied from awm.py (AWM's EMA schedule and its ratio of matching losses are what DGPO's ema_ref and clip use).
# Differs: the group-weighted DPO surrogate instead of PPO's objective; M rollout steps per epoch shared by all
# samples and one ε per group; whole groups per micro-batch; the EMA ("ema_ref") samples only after
# --switch-ema-ref steps and is blended after each optimizer step; CFG'd rollouts on true-CFG models; the DPM-Solver
# rollout of the authors. Math: docs/algorithms.md §7.
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from common.advantages import compute_advantages
from common.cli import TrainArgs, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.models import ADAPTERS
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import group_noise, groups_per_micro_batch, training_seeds
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD


@dataclass
class Args(TrainArgs):
    infinity_allowed = ("clip_range",)  # --clip-range inf: no clip
    group_size: int = 24
    """K: samples per prompt (one group)"""
    prompts_per_epoch: int = 8
    """M: prompts (groups) per epoch, a multiple of the number of processes (each holds whole groups)"""
    batch_size: int = 24
    """largest per-process micro-batch. Training micro-batches hold whole groups: as many as fit, at least one
    (K samples, whatever this says)"""
    num_steps: int = 10
    """sampling steps of a rollout"""
    updates_per_epoch: int = 1
    """optimizer steps per epoch: 1 (the epoch's micro-batches × trained steps accumulate into one, as the authors')"""

    # Algorithm specific arguments
    dynamics: Literal["dpm", "ode"] = "dpm"
    """deterministic rollout sampler: dpm (DPM-Solver++ 2M, the authors') or ode (Euler, Flow-Factory's)"""
    train_timesteps: int = 4
    """rollout step indices trained per epoch, drawn without replacement from 0..--trunc-steps, shared by all samples"""
    trunc_steps: int = 6
    """the last rollout step index that may be trained (6; the authors' GenEval setting: 4)"""
    beta_dpo: float = 10.0
    """β of the group preference likelihood (PickScore 10, OCR/GenEval 100; 2000–5000 with --use-ema-ref)"""
    kl_beta: float = 1e-3
    """weight of mean((v_θ − v_ref)²) to the frozen reference (PickScore 1e-3, OCR/GenEval 0.02; 0: off)"""
    kl_cfg: float = 1.0
    """true-CFG scale of the frozen reference, in the preference term and the KL (1: none). Needs a model with true
    CFG: FLUX.1's guidance is an embedding, so there every policy sees the same one (--guidance-scale)"""
    clip_range: float = 5e-2
    """c: a sample whose ratio exp(ℓ_ema_ref − ℓ_θ) passes 1 + c (A > 0) or 1 − c (A ≤ 0) stops its gradient
    (inf: no clip)"""
    use_ema_ref: bool = False
    """the preference term's reference is ema_ref (TDM-R1's moving reference, arXiv:2603.07700) instead of the
    frozen model; raise --beta-dpo to 2000–5000 with it"""
    switch_ema_ref: int = 200
    """roll out with θ until the optimizer-step count exceeds this, then with ema_ref (the authors' GenEval: 500)"""
    ema_ref_decay_rate: float = 0.001
    """ema_ref decay of an optimizer step taken after k others: d = min(--ema-ref-max-decay, this·k) …"""
    ema_ref_max_decay: float = 0.3
    """… capped here; ema_ref ← d·ema_ref + (1 − d)·θ after every optimizer step"""


# What each preset is, why, and what it measured: docs/algorithms/dgpo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): nft's toy scale at 4 prompts × 8 (one optimizer step per epoch: twice the
    # steps of 8 × 8 for the same samples), the tiny preset's β_dpo 2, a KL to the pretrained model.
    "toy": dict(TOY_WORLD, epochs=60, prompts_per_epoch=4, group_size=8, batch_size=16, num_steps=8,
                train_timesteps=4, trunc_steps=5, learning_rate=1e-3, lora_rank=16, lora_alpha=16, beta_dpo=2.0,
                kl_beta=0.1, eval_every=10, save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting, untuned (nft.py and grpo.py carry tuned ones).
    "toy-edit": dict(TOY_EDIT_WORLD, epochs=60, prompts_per_epoch=4, group_size=8, batch_size=16, num_steps=8,
                     train_timesteps=4, trunc_steps=5, learning_rate=1e-3, lora_rank=16, lora_alpha=16, beta_dpo=2.0,
                     kl_beta=0.1, eval_every=10, save_every=10),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=60, prompts_per_epoch=4, group_size=8, batch_size=16, num_steps=8,
                      train_timesteps=4, trunc_steps=5, learning_rate=1e-3, lora_rank=16, lora_alpha=16, beta_dpo=2.0,
                      kl_beta=0.1, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): ~100× the papers' lr, no KL, β_dpo 2 (10 saturated
    # the group weights).
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, num_steps=6, train_timesteps=4, trunc_steps=4, learning_rate=5e-2,
                 lora_rank=8, lora_alpha=8, beta_dpo=2.0, kl_beta=0.0, clip_range=5e-2, switch_ema_ref=30,
                 global_std=False, eval_every=25, eval_num_prompts=8, save_every=25),
    # The authors' PickScore setting adapted to FLUX.1-dev: its guidance embedding 3.5 instead of true CFG, one
    # whole group per micro-batch.
    "flux1": dict(reward=["pickscore"], resolution=512, num_steps=10, eval_num_steps=14, group_size=24,
                  prompts_per_epoch=8, batch_size=24, gradient_checkpointing=True, learning_rate=3e-4, lora_rank=64,
                  lora_alpha=128, beta_dpo=10.0, kl_beta=1e-3, clip_range=5e-2, trunc_steps=6, train_timesteps=4,
                  switch_ema_ref=200, global_std=True, epochs=1000, eval_every=20, save_every=20),
}


def train_step_indices(seed: int, epoch: int, trunc_steps: int, count: int) -> list[int]:
    """The epoch's trained rollout step indices: `count` distinct ones drawn uniformly from 0..trunc_steps, a
    function of (seed, epoch) only, so every sample, micro-batch and process trains the same ones."""
    return np.random.default_rng([seed, epoch, 0xD690]).choice(trunc_steps + 1, size=count, replace=False).tolist()


def dsm_clip(loss_theta, loss_old, advantages, clip_range: float):
    """DGPO's clip on the flow-matching (DSM) losses: ρ = exp(ℓ_old − ℓ_θ) detached; a sample is clipped when
    A > 0 and ρ > 1 + c, or A ≤ 0 and ρ < 1 − c. Returns (ρ (B,), clipped (B,) bool)."""
    ratio = torch.exp(loss_old.detach() - loss_theta.detach())
    return ratio, torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


def dgpo_loss(loss_theta, loss_ref, advantages, groups, beta_dpo: float, group_size: int):
    """DGPO's surrogate per sample: stopgrad(sigmoid(s_g))·A_i·ℓ_θ,i with the group logit
    s_g = (β/K)·Σ_{i∈g} A_i·(ℓ_θ,i − ℓ_ref,i) (detached, float64). `groups` (B,) numbers the micro-batch's groups
    0..G−1; every group must be whole. mean_b of it has K/(β·B) times the gradient of Σ_g −log sigmoid(R_θ(G⁺) −
    R_θ(G⁻)), R_θ(G) = (β/K)·Σ_{i∈G} |A_i|·(ℓ_ref,i − ℓ_θ,i), since R(G⁺) − R(G⁻) = −s_g.
    Returns (loss (B,), sigmoid(s_g) per sample (B,), s_g per sample (B,))."""
    terms = advantages.double() * (loss_theta.detach().double() - loss_ref.detach().double())
    sums = torch.zeros(int(groups.max()) + 1, dtype=torch.float64, device=terms.device).index_add_(0, groups, terms)
    logit = sums[groups] * (beta_dpo / group_size)
    weight = torch.sigmoid(logit)
    return weight.to(loss_theta.dtype) * advantages * loss_theta, weight, logit






if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "DGPO (arXiv:2510.08425): direct group preference optimisation.")
    if not args.beta_dpo > 0:
        raise UserError(f"--beta-dpo must be positive, got {args.beta_dpo}")
    if args.kl_beta < 0:
        raise UserError(f"--kl-beta must be >= 0, got {args.kl_beta}")
    if not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive (inf: no clip), got {args.clip_range}")
    if not 0 <= args.trunc_steps < args.num_steps:
        raise UserError(f"--trunc-steps must be in [0, {args.num_steps - 1}] (a rollout step index), got "
                        f"{args.trunc_steps}")
    if not 1 <= args.train_timesteps <= args.trunc_steps + 1:
        raise UserError(f"--train-timesteps must be in [1, {args.trunc_steps + 1}] (distinct steps of "
                        f"0..--trunc-steps), got {args.train_timesteps}")
    if args.switch_ema_ref < 0 or args.ema_ref_decay_rate < 0 or not 0 <= args.ema_ref_max_decay <= 1:
        raise UserError("ema_ref needs --switch-ema-ref >= 0, --ema-ref-decay-rate >= 0 and --ema-ref-max-decay in "
                        "[0, 1]")
    if args.updates_per_epoch != 1:
        raise UserError(f"--updates-per-epoch must be 1 (DGPO accumulates the epoch into one optimizer step), got "
                        f"{args.updates_per_epoch}")
    if args.kl_cfg < 1:
        raise UserError(f"--kl-cfg must be >= 1 (1: the reference without CFG), got {args.kl_cfg}")
    if args.kl_cfg > 1 and not ADAPTERS[args.model].true_cfg:
        raise UserError(f"--kl-cfg {args.kl_cfg}: {args.model} has no true CFG (its guidance is an embedding input, "
                        f"the same for every policy); leave --kl-cfg at 1")
    need_ref = not args.use_ema_ref or args.kl_beta > 0  # the frozen reference: preference term and/or KL
    need_old = args.use_ema_ref or args.clip_range != float("inf")  # ema_ref in training: clip and/or reference
    # ema_ref: a second LoRA adapter (or a frozen copy when fully fine-tuning), equal to θ at the start.
    run = setup(args, load_run_rewards(args), shadows=("ema_ref",), reference_copy=need_ref)
    adapter, sigmas, device, ema_ref = run.adapter, run.sigmas, run.device, run.shadows["ema_ref"]
    world, size, num_train = run.data.num_processes, args.group_size, args.train_timesteps
    if args.prompts_per_epoch % world:
        raise UserError(f"--prompts-per-epoch {args.prompts_per_epoch} must be a multiple of the {world} processes "
                        f"(each holds whole groups)")
    # Mode 1 of the authors on true-CFG models: rollouts at --guidance-scale, θ and ema_ref trained without CFG, the
    # frozen reference at --kl-cfg. FLUX.1: one guidance embedding everywhere (--guidance-scale 1 gives Mode 2).
    train_guidance = 1.0 if adapter.true_cfg else run.guidance
    ref_guidance = args.kl_cfg if args.kl_cfg > 1 else train_guidance
    local_count = run.local.stop - run.local.start
    rollout_batches = rollout_micro_batches(local_count, args.batch_size, 1)
    group_index = torch.arange(run.local.start, run.local.stop) // size  # each local sample's group in the draw
    train_batch = size * groups_per_micro_batch(local_count // size, size, args.batch_size)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="dgpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples, each group contiguous on one process: a function of (seed, epoch) ----
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, size, args.seed, epoch, run.local,
                                       whole_groups=True)
        group_ids = torch.tensor([r.key for r in records])
        steps = train_step_indices(args.seed, epoch, args.trunc_steps, num_train)  # the same everywhere
        noise_seeds = training_seeds(args.seed, epoch, args.prompts_per_epoch)  # one ε stream per group

        # ---- 2. rollout with θ (with ema_ref once the step count exceeds --switch-ema-ref), keeping only x0 -------
        cond = run.encode(records)
        run.transformer.eval()
        use_ema_sampler = run.optimizer_steps > args.switch_ema_ref
        policy = ema_ref.velocity if use_ema_sampler else adapter.velocity
        clean = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            x0 = sample(lambda x, sigma: policy(x, sigma, c, run.guidance), adapter.noise(generators), sigmas,
                        args.dynamics)
            clean.append(x0)
            scoring.submit(adapter.decode(x0, c).cpu())
        clean = torch.cat(clean)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and group-relative advantages (clamped to ±5) over the whole epoch (all processes) -------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # Every sample is kept (A = 0 weighs 0); micro-batches of whole groups, one optimizer step per epoch.
        plan = plan_micro_batches(torch.ones_like(advantages, dtype=torch.bool), world, run.data.process_index,
                                  train_batch, 1)
        advantages = advantages[run.local].float().to(device)
        reward_time = time.time() - reward_start

        # ---- 4. update: the group preference surrogate at the epoch's M steps, one ε per group and step ----------
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("loss", "policy_loss", "kl", "dsm_loss", "ref_dsm_loss", "group_weight_mean",
                                 "group_margin_mean", "clipfrac", "ratio_mean", "grad_norm")}
        ratio_dev, weight_dev = (torch.zeros((), device=device, dtype=torch.float64) for _ in range(2))
        for mb in plan[0]:
            c, adv, weight, x0 = ({k: v[mb.index] for k, v in cond.items()}, advantages[mb.index],
                                  mb.weight.to(device), clean[mb.index])
            groups = torch.unique(group_index[mb.index], return_inverse=True)[1].to(device)  # 0..G−1, whole groups
            noise = group_noise(noise_seeds, group_index[mb.index], num_train, x0)  # shared by a group, new per step
            for i, j in enumerate(steps):
                sigma = sigmas[j].expand(len(x0))
                eps = noise[:, i]
                x_sigma, target = (1 - sigmas[j]) * x0 + sigmas[j] * eps, eps - x0  # forward process, v* = ε − x0
                # frozen policies first (no graph touched): the reference at --kl-cfg, ema_ref without CFG
                v_ref = run.reference.velocity(x_sigma, sigma, c, ref_guidance) if need_ref else None
                v_old = ema_ref.velocity(x_sigma, sigma, c, train_guidance) if need_old else None
                with micro_step(run.accelerator, run.transformer, mb.last and i == num_train - 1):
                    v_theta = adapter.velocity(x_sigma, sigma, c, train_guidance)
                    loss_theta = ((v_theta - target) ** 2).flatten(1).mean(1)  # ℓ_θ, float32
                    loss_old = ((v_old - target) ** 2).flatten(1).mean(1) if need_old else loss_theta.detach()
                    loss_ref = loss_old if args.use_ema_ref else ((v_ref - target) ** 2).flatten(1).mean(1)
                    ratio, clipped = dsm_clip(loss_theta, loss_old, adv, args.clip_range)
                    trained = torch.where(clipped, loss_theta.detach(), loss_theta)  # clipped: no gradient
                    policy_loss, group_weight, logit = dgpo_loss(trained, loss_ref, adv, groups, args.beta_dpo, size)
                    kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1) if args.kl_beta > 0 else torch.zeros_like(adv)
                    loss = policy_loss + args.kl_beta * kl
                    # weight: 1 / (samples of the epoch), so the step averages samples and the M steps
                    run.accelerator.backward((weight * loss).sum() / num_train)
                with torch.no_grad():
                    ratio_dev = torch.maximum(ratio_dev, (ratio.double() - 1).abs().max())
                    weight_dev = torch.maximum(weight_dev, (group_weight - 0.5).abs().max())
                    for key, value in (("loss", loss), ("policy_loss", policy_loss), ("kl", kl),
                                       ("dsm_loss", loss_theta), ("ref_dsm_loss", loss_ref),
                                       ("group_weight_mean", group_weight), ("group_margin_mean", -logit),
                                       ("clipfrac", clipped.float()), ("ratio_mean", ratio)):
                        stats[key].append(value.float().mean())
        stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))
        # ema_ref trails θ: blended after the step with d counting the steps taken before it.
        decay = min(args.ema_ref_max_decay, args.ema_ref_decay_rate * (run.optimizer_steps - 1))
        ema_ref.blend(decay)
        if args.kl_beta == 0:
            del stats["kl"]

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        metrics.update(ratio_dev_max=float(run.accelerator.reduce(ratio_dev.float(), "max")),
                       group_weight_dev_max=float(run.accelerator.reduce(weight_dev.float(), "max")),
                       zero_std_frac=adv_stats["zero_std_frac"], ema_ref_decay=decay,
                       ema_ref_sampler=float(use_ema_sampler),
                       adv_abs_mean=float(run.accelerator.reduce(advantages.abs().mean(), "mean")))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "dsm_loss",
                                 "group_weight_mean", "clipfrac", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
