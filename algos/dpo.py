# Online Diffusion-DPO: the current θ samples K images per prompt, the best and the worst of each group (by
# advantage) form a preference pair, and θ is trained by the Diffusion-DPO loss on the forward process: at a shared
# (σ, ε) the winner's flow-matching error must fall, relative to the frozen reference, more than the loser's.
# Paper: Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization", arXiv:2311.12908; applied
# online as Flow-Factory's `dpo` trainer and Flow-GRPO's train_sd3_dpo.py do. Differs from awm.py (the script it
# was copied from): no ratio, clip or EMA; one (best, worst) pair per group instead of every sample, groups whole on
# one process; T logit-normal (σ, ε) draws shared by each pair; the reference (adapters disabled) in every term;
# optionally a reference that is refreshed from θ and samples (--ref-update-every). Math: docs/algorithms.md §7.
import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common.advantages import best_worst_pairs, compute_advantages
from common.cli import TrainArgs, launched_data_ranks, parse_args
from common.data import epoch_samples
from common.distributed import micro_step
from common.sampling import sample, sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.timesampling import sample_train_noise, shift_sigma, training_generators, training_seeds
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD, TOY_EDIT_WORLD, TOY_VIDEO_WORLD

BETA_NOTE = ("β multiplies a difference of per-element MEAN squared velocity errors, so its scale is tied to the "
             "prediction target and the latent: 100 on FLUX.1/SD3.5 velocities, 5000 in Diffusion-DPO's "
             "ε-prediction, 1–5 on the tiny models, where Flow-Factory's 2000 saturates the sigmoid and barely "
             "learns; keep |z| = (β/2)·|Δ_w − Δ_l| (logged as z_abs_mean) of order 1. Never port β across targets")


@dataclass
class Args(TrainArgs):
    group_size: int = 24
    """K: samples per prompt (one group; one preference pair is taken from it)"""
    num_steps: int = 40
    """sampling steps of a rollout"""
    learning_rate: float | None = 1e-5
    """AdamW learning rate. 1e-5 as Flow-Factory's DPO example, which reports that 1e-4–3e-4 (Flow-GRPO's 3e-4)
    blow up the gradient norm and collapse training"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: float = 64
    """LoRA alpha"""

    # Algorithm specific arguments
    dynamics: Literal["ode", "dpm", "flow-sde", "dance-sde", "cps"] = "ode"
    """rollout sampler of θ: ode (Euler, the references'), dpm (DPM-Solver++ 2M) or an SDE; only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout"""
    dpo_beta: float = 100.0
    """β of −log sigmoid(−β/2·(Δ_w − Δ_l)) (Flow-GRPO's and Flow-Factory's value on SD3.5 velocities). Note: β
    multiplies per-element MEAN squared velocity errors, so its scale is tied to the target and the latent: 1–5 on
    the tiny models (their preset: 1), where 2000 saturates the sigmoid; keep z_abs_mean of order 1"""
    train_timesteps: int | None = None
    """T ≥ 1: (σ, ε) draws per pair per epoch, all accumulated into the epoch's optimizer step (unset: ⌊0.99·N⌋, as
    Flow-GRPO's 39 at N = 40)"""
    time_shift: float = 3.0
    """σ = s·u/(1 + (s − 1)·u) of a logit-normal u (Flow-GRPO's SD3 training shift 3; 1: no shift, Flow-Factory)"""
    ref_update_every: int = 0
    """0: the reference is the model before training (adapters disabled) and θ samples. k > 0: a copy of θ, taken
    after every k-th optimizer step, is the reference AND the sampler (Flow-GRPO's online switch)"""


# What each preset is, why, and what it measured: docs/algorithms/dpo.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): 8 best/worst pairs per epoch in 4 optimizer steps, β 10 for the pretrained
    # model's error gaps, 20 epochs (it peaks there).
    "toy": dict(TOY_WORLD, epochs=20, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                num_steps=8, learning_rate=1e-3, lora_rank=16, lora_alpha=16, dpo_beta=10.0, eval_every=10,
                save_every=10),
    # The toy edit world (docs/toy-edit-world.md): the toy setting, untuned (nft.py and grpo.py carry tuned ones).
    "toy-edit": dict(TOY_EDIT_WORLD, epochs=20, prompts_per_epoch=8, group_size=8, batch_size=16, updates_per_epoch=4,
                     num_steps=8, learning_rate=1e-3, lora_rank=16, lora_alpha=16, dpo_beta=10.0, eval_every=10,
                     save_every=10),
    # The toy video world (docs/toy-video-world.md): the toy setting, untuned (nft.py and grpo.py: tuned ones).
    "toy-video": dict(TOY_VIDEO_WORLD, epochs=20, prompts_per_epoch=8, group_size=8, batch_size=16,
                      updates_per_epoch=4, num_steps=8, learning_rate=1e-3, lora_rank=16, lora_alpha=16, dpo_beta=10.0,
                      eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): ~100× the papers' lr, β rescaled for its velocity
    # errors (BETA_NOTE).
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=4,
                 group_size=4, batch_size=8, num_steps=4, learning_rate=5e-2, lora_rank=8, lora_alpha=8, dpo_beta=1.0,
                 global_std=False, eval_every=25, eval_num_prompts=8, save_every=25),
    # Flow-GRPO's pickscore_sd3 DPO setting (the online method's reference code) adapted to FLUX.1-dev.
    "flux1": dict(reward=["pickscore"], resolution=512, num_steps=28, eval_num_steps=28, group_size=24,
                  prompts_per_epoch=8, batch_size=8, learning_rate=1e-5, lora_rank=32, lora_alpha=64, dpo_beta=100.0,
                  time_shift=3.0, epochs=1000, eval_every=20, save_every=20),
}


def flow_matching_error(velocity, target) -> torch.Tensor:
    """e = mean over elements of (v − (ε − x0))² per sample (B,), in float32 (a mean, not a sum, as every
    log-prob here: it is what ties β's scale to the target)."""
    return ((velocity.float() - target.float()) ** 2).flatten(1).mean(1)


def dpo_loss(e_theta_w, e_theta_l, e_ref_w, e_ref_l, beta: float):
    """Diffusion-DPO per pair: Δ_y = e_θ^y − e_ref^y, z = −(β/2)·(Δ_w − Δ_l), loss = −log sigmoid(z) (the paper's
    T·ω(λ) factor folded into β). At θ = ref, z = 0: loss = log 2 and ∇loss = (β/4)·(∇e_θ^w − ∇e_θ^l).
    Returns (loss (P,), z (P,))."""
    z = -0.5 * beta * ((e_theta_w - e_ref_w) - (e_theta_l - e_ref_l))
    return -F.logsigmoid(z), z


def check_whole_groups(prompts_per_epoch: int, world: int) -> None:
    if prompts_per_epoch % world:
        raise UserError(f"--prompts-per-epoch {prompts_per_epoch} must be a multiple of the {world} processes (each "
                        f"process holds whole groups, where its pairs are formed)")


def logit_normal_sigmas(generators, num_train: int, shift: float) -> torch.Tensor:
    """(pairs, T) float32 σ's: u = sigmoid(N(0, 1)) per draw, not stratified, then σ = shift(u) (Flow-GRPO's SD3
    training draw)."""
    return torch.stack([shift_sigma(torch.sigmoid(torch.randn(num_train, generator=g, dtype=torch.float64)), shift)
                        for g in generators]).float()


STAT_KEYS = ("loss", "implicit_acc", "z_abs_mean", "e_theta_w", "e_theta_l", "e_ref_w", "e_ref_l",
             "implicit_reward_w", "implicit_reward_l")

if __name__ == "__main__":
    args = parse_args(Args, PRESETS, f"Online Diffusion-DPO (arXiv:2311.12908) on best/worst pairs of each group. "
                                     f"Note: {BETA_NOTE}.")
    if not args.dpo_beta > 0:
        raise UserError(f"--dpo-beta must be positive, got {args.dpo_beta}")
    if args.train_timesteps is not None and args.train_timesteps < 1:
        raise UserError(f"--train-timesteps must be at least 1, got {args.train_timesteps}")
    if not args.time_shift > 0:
        raise UserError(f"--time-shift must be positive (1: no shift), got {args.time_shift}")
    if args.ref_update_every < 0:
        raise UserError(f"--ref-update-every must be >= 0 (0: never), got {args.ref_update_every}")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    check_whole_groups(args.prompts_per_epoch, launched_data_ranks(args))  # the launchers' count, early
    # The reference: adapters disabled (a frozen copy when fully fine-tuning), or with --ref-update-every a shadow
    # of θ (a second LoRA adapter or a copy) that is refreshed from θ and also samples.
    online_ref = args.ref_update_every > 0
    run = setup(args, load_run_rewards(args), shadows=("ref",) if online_ref else (),
                reference_copy=not online_ref, cfg_free=True)
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    world, rank = run.data.num_processes, run.data.process_index
    check_whole_groups(args.prompts_per_epoch, world)  # the count that runs
    reference = run.shadows["ref"] if online_ref else run.reference
    sampler = reference.velocity if online_ref else torch.no_grad()(adapter.velocity)
    num_train = args.train_timesteps if args.train_timesteps is not None else max(1, math.floor(0.99 * args.num_steps))
    num_groups, size = args.prompts_per_epoch, args.group_size
    local_groups = slice(run.local.start // size, run.local.stop // size)  # whole groups (whole_groups=True)
    pairs_per_batch = max(1, args.batch_size // 2)  # a micro-batch of b pairs runs 2b samples through each model
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="dpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples, each group contiguous so that it lies on one process ----------------
        records, seeds = epoch_samples(run.train_prompts, num_groups, size, args.seed, epoch, run.local,
                                       whole_groups=True)
        group_ids = torch.tensor([r.key for r in records])
        pair_seeds = torch.tensor(training_seeds(args.seed, epoch, num_groups)[local_groups])  # one per group slot

        # ---- 2. rollout with θ (the refreshed reference with --ref-update-every), keeping only x0 ----------------
        cond = run.encode(records)
        run.transformer.eval()
        clean = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
            x0 = sample(lambda x, sigma: sampler(x, sigma, c, guidance), adapter.noise(generators), sigmas,
                        args.dynamics, args.noise_level, generators)
            clean.append(x0)
            scoring.submit(adapter.decode(x0, c).cpu())
        clean = torch.cat(clean)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards, advantages over the whole epoch, one (best, worst) pair per group ----------------------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # Pairs by slot (the draw's g-th run of K samples), so a pair never spans processes; a group whose
        # advantages are all equal holds no preference and gives no pair.
        has_pair = torch.zeros(num_groups, dtype=torch.bool)
        winner = torch.arange(num_groups) * size  # a slot without a pair keeps w = l (its padding is never counted)
        loser = winner.clone()
        for w, l in best_worst_pairs(advantages, torch.arange(num_groups * size) // size):
            has_pair[w // size], winner[w // size], loser[w // size] = True, w, l
        num_pairs = int(has_pair.sum())
        adv_w, adv_l = advantages[winner[has_pair]], advantages[loser[has_pair]]
        # Equal micro-step counts on every process: slots without a pair are left out, an empty micro-batch is
        # padding of weight 0; every real pair weighs world/(pairs of the optimizer step over all processes).
        plan = plan_micro_batches(has_pair, world, rank, pairs_per_batch, args.updates_per_epoch)
        winner, loser = winner[local_groups] - run.local.start, loser[local_groups] - run.local.start
        reward_time = time.time() - reward_start

        # ---- 4. update: Diffusion-DPO at T shared (σ, ε) draws per pair, against the reference ------------------
        train_start = time.time()
        run.transformer.train()
        sums = torch.zeros(len(STAT_KEYS) + 1, device=device, dtype=torch.float64)  # Σ over real pairs × draws, n
        grad_norms, steps_before = [], run.optimizer_steps
        for micro_batches in plan:
            for mb in micro_batches:
                w, l = winner[mb.index], loser[mb.index]
                both = torch.cat([w, l])  # winners then losers: same prompts, so cond rows are interchangeable
                c, x0, weight, real = ({k: v[both] for k, v in cond.items()}, clean[both], mb.weight.to(device),
                                       mb.real.to(device))
                # One σ and one ε per pair and draw, shared by its winner and loser (Diffusion-DPO), from the
                # pair's own generator: any process count or a resumed run draws the same.
                generators = training_generators(pair_seeds[mb.index])
                pair_sigma = logit_normal_sigmas(generators, num_train, args.time_shift).to(device)
                pair_noise = sample_train_noise(num_train, generators, clean[w])
                for i in range(num_train):
                    sigma = torch.cat([pair_sigma[:, i], pair_sigma[:, i]])
                    noise = torch.cat([pair_noise[:, i], pair_noise[:, i]])
                    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
                    x_sigma = (1 - sig) * x0 + sig * noise  # forward process, target v* = ε − x0
                    target = noise - x0
                    e_ref = flow_matching_error(reference.velocity(x_sigma, sigma, c, guidance), target)  # frozen
                    with micro_step(run.accelerator, run.transformer, mb.last and i == num_train - 1):
                        e_theta = flow_matching_error(adapter.velocity(x_sigma, sigma, c, guidance), target)
                        (e_theta_w, e_theta_l), (e_ref_w, e_ref_l) = e_theta.chunk(2), e_ref.chunk(2)
                        loss, z = dpo_loss(e_theta_w, e_theta_l, e_ref_w, e_ref_l, args.dpo_beta)
                        # weight: world / (pairs of this optimizer step), so the step averages pairs and draws
                        run.accelerator.backward((weight * loss).sum() / num_train)
                    with torch.no_grad():  # sums over real pairs (padding has weight 0), reduced after the epoch
                        values = (loss, (z > 0).float(), z.abs(), e_theta_w, e_theta_l, e_ref_w, e_ref_l,
                                  -0.5 * args.dpo_beta * (e_theta_w - e_ref_w),
                                  -0.5 * args.dpo_beta * (e_theta_l - e_ref_l), torch.ones_like(loss))
                        sums += torch.stack([v.detach().double()[real].sum() for v in values])
            grad_norms.append(torch.tensor(optimizer_step(run, epoch), device=device))
        # Online switch: after every k-th optimizer step θ is copied into the reference (which then samples).
        if online_ref and run.optimizer_steps // args.ref_update_every > steps_before // args.ref_update_every:
            reference.blend(0.0)

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, {"grad_norm": grad_norms},
                                {"rollout_time_s": rollout_time, "reward_time_s": reward_time,
                                 "train_time_s": time.time() - train_start})
        sums = run.data.reduce(sums, "sum")
        if sums[-1] > 0:  # no key when no group of the epoch gave a pair (a padding-only, zero-gradient step)
            metrics.update({key: float(sums[k] / sums[-1]) for k, key in enumerate(STAT_KEYS)})
        if num_pairs:
            metrics.update(adv_w_mean=float(adv_w.mean()), adv_l_mean=float(adv_l.mean()),
                           adv_margin=float((adv_w - adv_l).mean()))
        metrics.update(pairs=num_pairs, tie_frac=1 - num_pairs / num_groups, zero_std_frac=adv_stats["zero_std_frac"],
                       adv_abs_mean=float(advantages.abs().mean()),
                       **({"ref_updates": run.optimizer_steps // args.ref_update_every} if online_ref else {}))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss", "implicit_acc",
                                 "z_abs_mean", "pairs", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
