# TDM-R1: RL for a few-step (step-distilled) generator with non-differentiable rewards. The generator keeps the
# trajectory-distribution-matching (TDM) loss of its distillation: at each of its N deterministic steps its x0
# prediction is pulled along a "revised x0" correction, teacher minus fake score, where the fake score tracks the
# generator's own samples. The reward enters through a surrogate diffusion model trained by DGPO's group preference
# on the generator's rollouts; its log-ratio to the teacher is a third correction. With --no-rl it is plain TDM: the
# same script distils the few-step student that TDM-R1 then starts from.
# Papers: TDM-R1, arXiv:2603.07700; TDM, arXiv:2503.06674. Followed: the authors' training code (Luo-Yihong/TDM-R1).
# Copied from dgpo.py: `dgpo_loss`, `dsm_clip` and the whole-group micro-batches (common.timesampling) train the
# surrogate unchanged. Differs: three trained LoRA adapters on one base (generator, fake score, surrogate;
# common.roles), the stored N-step Euler trajectory, re-noising to query times above each step (common.renoising),
# the revised-x0 generator loss, one optimizer step per role per epoch in the order fake, surrogate, generator.
# Math: docs/algorithms.md §9.
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.advantages import compute_advantages
from common.cli import TrainArgs, check_args, check_ranges, parse_args
from common.data import epoch_samples
from common.models import ADAPTERS
from common.roles import RoleOptimizer, all_reduce_gradients, role_backward
from common.sampling import sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.renoising import per_sample, query_sigma, renoise, schedule_shift, surrogate_target
from common.timesampling import group_noise, group_uniform, groups_per_micro_batch
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from recipes.tdmr1_authors import TDMR1
from worlds import TOY_WORLD


@dataclass
class Args(TrainArgs):
    infinity_allowed = ("clip_range",)  # --clip-range inf: no trust region
    group_size: int = 24
    """K: samples per prompt (one group; --no-rl: 1 is allowed)"""
    prompts_per_epoch: int = 48
    """M: prompts (groups) per epoch, a multiple of the number of processes (each holds whole groups)"""
    batch_size: int = 24
    """largest per-process micro-batch. Training micro-batches hold whole groups: as many as fit, at least one"""
    num_steps: int = 4
    """N: the generator's deterministic Euler steps, in rollout, training and (unset --eval-num-steps) evaluation"""
    learning_rate: float | None = 7.5e-5
    """the generator's AdamW lr (the authors: 3e-4 / 4)"""
    lora_rank: int = 32
    """LoRA rank of each of the three adapters"""
    lora_alpha: float = 64
    """LoRA alpha of each of the three adapters"""
    ema: bool = True
    """evaluate and checkpoint an EMA of the generator, decay min((1 + k)/(10 + k), --ema-decay) at its k-th step"""

    # Algorithm specific arguments
    no_rl: bool = False
    """plain TDM (distillation): no rewards in the loss, no surrogate; the generator loss is the TDM term at every
    step. Rollouts are still scored, for the log only"""
    train_steps: int = 2
    """n_b: distinct steps of the N trained per micro-batch, drawn uniformly (the authors 2; Flow-Factory all N)"""
    rl_steps: int | None = None
    """T_rl: the learned-reward term is on at steps j < T_rl; after it the generator loss is w·(TDM + CFG terms)
    (unset: N, every step)"""
    tdm_weight: float = 0.3
    """w: weight of the CFG term and 1 − w that of the learned-reward term (distribution matching keeps 1)"""
    teacher_cfg: float | None = None
    """w_R: true-CFG scale of the teacher whose distance normalises the TDM term (unset: 4.5 on models with true CFG,
    as hard-coded by the authors; 1 otherwise)"""
    cfg_reward_scale: float | None = None
    """λ: the CFG term's correction λ·(x̂0_c − x̂0_u) (unset: 3.5 with true CFG, the authors'; 0 otherwise)"""
    surrogate_cfg: float | None = None
    """w_S: true-CFG scale of the surrogate in the reward term (unset: 4.5 with true CFG, the authors' OCR; else 1)"""
    surrogate_ref_cfg: bool = False
    """the reward term's teacher also at w_S (Flow-Factory's form, zero for a fresh surrogate); default: CFG-free"""
    reward_tmin: float = 0.3
    """t_min: the reward term queries σ_S above max(σ_{j+1}, this)"""
    surrogate_tmin: float = 0.3
    """t′_min: the surrogate trains at σ′ above max(σ_{j′+1}, this)"""
    query_shift: float | None = None
    """s of the query times' shift φ(u) = s·u/(1 + (s − 1)·u) (unset: the rollout schedule's own)"""
    query_margin: float = 0.02
    """the query times start this far (unshifted time) above the boundary state's"""
    fake_learning_rate: float = 3e-4
    """the fake score's AdamW lr"""
    fake_beta1: float = 0.0
    """the fake score's AdamW β1 (β2 0.999)"""
    generator_beta1: float = 0.0
    """the generator's AdamW β1 (β2 0.999)"""
    fake_teacher_weight: float = 0.02
    """λ_f: weight of the fake loss's pull towards the teacher's velocity"""
    fake_updates: int = 1
    """fake optimizer steps per epoch: n − 1 fake-only passes, each stepped, before the joint pass"""
    surrogate_learning_rate: float = 3e-4
    """the surrogate's AdamW lr"""
    surrogate_beta1: float = 0.9
    """the surrogate's AdamW β1 (β2 0.999)"""
    beta_pref: float = 10.0
    """β of the group preference (OCR 10, GenEval 1)"""
    beta_ref: float = 1e-3
    """weight of the anchor D = mean (v_S − v_R)² that keeps the surrogate near the teacher"""
    runaway_threshold: float = 0.05
    """δ: above this D, samples that already beat the teacher in their advantage's direction stop their gradient"""
    clip_range: float = 1e-3
    """c: the trust region of DGPO on ρ = exp(ℓ_S̄ − ℓ_S), S̄ the slow EMA of the surrogate (inf: none)"""
    surrogate_ema_ref: bool = False
    """the preference logit's reference is S̄ instead of the frozen teacher (the authors' use_ema_ref, off)"""
    surrogate_old_decay_rate: float = 0.001
    """S̄ ← d·S̄ + (1 − d)·S after the k-th surrogate step, d = min(--surrogate-old-max-decay, rate·(1 + k))"""
    surrogate_old_max_decay: float = 0.3
    """the cap of that d"""


STUDENT_DIR = Path(TOY_WORLD["dataset"]) / "student"  # the few-step toy student (`--preset toy-student`), a LoRA r16/α16
TOY_STUDENT_STEPS = 4
PRESETS = {
    # The toy world (docs/toy-world.md): distil the shipped 8-step model into a TOY_STUDENT_STEPS-step student
    # (algorithms.md §9's recipe: 32 prompts × 1 sample, every step trained, LoRA r16/α16, the authors' 1 : 4 lr ratio
    # at the toy scale, a 0.02 teacher pull on the fake score, the generator EMA). No true CFG: λ 0, w_R = w_S = 1.
    "toy-student": dict(TOY_WORLD, no_rl=True, group_size=1, prompts_per_epoch=32, batch_size=32,
                        num_steps=TOY_STUDENT_STEPS, eval_num_steps=TOY_STUDENT_STEPS, train_steps=TOY_STUDENT_STEPS,
                        lora_rank=16, lora_alpha=16, learning_rate=2.5e-4, fake_learning_rate=1e-3, teacher_cfg=1.0,
                        cfg_reward_scale=0.0, surrogate_cfg=1.0, epochs=350, eval_every=50, save_every=50),
    # TDM-R1 on that student (algorithms.md §9's experiment): 8 prompts × 8, every step trained, the reward term at
    # every step, LoRA r16/α16 for all three, dgpo's toy β_pref 2, the authors' β_ref, c, t_min and w. δ recalibrated
    # as §9 asks: the authors' 0.05 is below the toy's ordinary D, 0.2 binds only on a drifting surrogate.
    "toy": dict(TOY_WORLD, init_lora=str(STUDENT_DIR), epochs=60, prompts_per_epoch=8, group_size=8, batch_size=16,
                num_steps=TOY_STUDENT_STEPS, eval_num_steps=TOY_STUDENT_STEPS, train_steps=TOY_STUDENT_STEPS,
                rl_steps=TOY_STUDENT_STEPS, lora_rank=16, lora_alpha=16, learning_rate=2.5e-4,
                fake_learning_rate=1e-3, surrogate_learning_rate=1e-3, beta_pref=2.0, beta_ref=1e-3, clip_range=1e-3,
                runaway_threshold=0.2, reward_tmin=0.3, surrogate_tmin=0.3, tdm_weight=0.3, teacher_cfg=1.0,
                cfg_reward_scale=0.0, surrogate_cfg=1.0, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU: ~100× the papers' lr (docs/tiny-models.md), 3 steps, 2 trained.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=30, prompts_per_epoch=2,
                 group_size=4, batch_size=8, num_steps=3, train_steps=2, lora_rank=8, lora_alpha=8,
                 learning_rate=1e-2, fake_learning_rate=4e-2, surrogate_learning_rate=4e-2, beta_pref=2.0,
                 global_std=False, eval_every=15, eval_num_prompts=8, save_every=15),
    **TDMR1,  # the authors' SD3.5-M OCR and GenEval launchers, and Z-Image-Turbo (recipes/tdmr1_authors.py)
}

# Stream tags: every random draw of an epoch has its own seed stream, indexed by group or by sample position.
FAKE_QUERY, FAKE_NOISE, GEN_QUERY, GEN_NOISE, REWARD_QUERY, REWARD_NOISE, SUR_QUERY, SUR_NOISE = range(8)


def stream_seeds(seed: int, epoch: int, count: int, *tags: int) -> list[int]:
    """`count` seeds (one per group, or per sample of the epoch's draw) of the draw named by `tags`: a function of
    (seed, epoch, tags) only, so 1 and 2 processes, and a resumed run, draw the same numbers."""
    return np.random.default_rng([seed, epoch, 0x7D41, *tags]).integers(0, 2**62, size=count).tolist()








def trained_steps(seed: int, epoch: int, group: int, num_steps: int, count: int, fake_pass: int = 0) -> list[int]:
    """J_b: `count` distinct generator steps of 0..N−1, drawn uniformly for the micro-batch whose first group is
    `group` (a function of the groups it holds, not of the process count)."""
    rng = np.random.default_rng([seed, epoch, 0x7D42, group, fake_pass])
    return rng.choice(num_steps, size=count, replace=False).tolist()


def surrogate_step(seed: int, epoch: int, group: int, position: int, num_steps: int) -> int:
    """j′ of the surrogate loss at the micro-batch's `position`-th trained step, P(j′) = (j′ + 1)/(N(N + 1)/2):
    later boundaries, nearer the clean image, more often (the authors')."""
    weights = np.arange(1, num_steps + 1, dtype=np.float64)
    return int(np.random.default_rng([seed, epoch, 0x7D43, group, position]).choice(num_steps,
                                                                                      p=weights / weights.sum()))


def mse(a, b):
    """mean over elements, per sample (B,)."""
    return ((a - b) ** 2).flatten(1).mean(1)


def fake_loss(v_fake, target, v_ref, teacher_weight: float):
    """L_f per sample: mean (v_f − u_f)² + λ_f·mean (v_f − sg v_R)², u_f = (x_τ − x̂0_G)/σ_τ."""
    loss = mse(v_fake, target.detach())
    return loss + teacher_weight * mse(v_fake, v_ref.detach()) if teacher_weight > 0 else loss


def normaliser(x0, x0_other):
    """max(mean |x̂0_G − x̂0_other|, 1e-6) per sample, float64, detached."""
    return (x0.detach().double() - x0_other.detach().double()).abs().flatten(1).mean(1).clamp_min(1e-6)


def revised_x0_loss(x0, correction, norm):
    """ℓ(c, n) per sample: mean (x̂0 − sg(x̂0 + c))²/n. Its value is mean c²/n whatever x̂0; its gradient with
    respect to x̂0 is −2c/(E·n): it moves x̂0 along c."""
    return mse(x0, (x0 + correction).detach()) / norm.to(x0.dtype)


def dsm_clip(loss_theta, loss_old, advantages, clip_range: float):
    """DGPO's clip on the flow-matching (DSM) losses: ρ = exp(ℓ_old − ℓ_θ) detached; a sample is clipped when
    A > 0 and ρ > 1 + c, or A ≤ 0 and ρ < 1 − c. Returns (ρ (B,), clipped (B,) bool)."""
    ratio = torch.exp(loss_old.detach() - loss_theta.detach())
    return ratio, torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


def runaway_clip(loss_s, loss_ref, advantages, anchor, threshold: float):
    """TDM-R1's gate: once the surrogate's distance to the teacher D passes δ, a sample that already beats the
    teacher in its advantage's direction (ρ_R = exp(ℓ_R − ℓ_S) > 1 for A > 0, < 1 for A ≤ 0) stops its gradient.
    Returns (ρ_R (B,), clipped (B,) bool)."""
    ratio = torch.exp(loss_ref.detach() - loss_s.detach())
    beats = torch.where(advantages > 0, ratio > 1, ratio < 1)
    return ratio, beats & bool(anchor > threshold)


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


def surrogate_loss(v_s, v_ref, v_old, target, advantages, groups, group_size: int, step: int, num_steps: int,
                   beta_pref: float, beta_ref: float, clip_range: float, threshold: float, ema_ref: bool = False,
                   reduce=lambda anchor: anchor):
    """L_S per sample at the surrogate's step j′ = `step`: ω·(L_pref + β_ref·D), ω = (j′ + 1)/N, where L_pref is
    DGPO's `dgpo_loss` on ℓ_S (detached where the trust region `dsm_clip` against S̄ or the runaway gate clips),
    referenced to the teacher's ℓ_R (S̄'s with `ema_ref`), and D = mean (v_S − v_R)² one number over the
    micro-batch (its gate value `reduce(D)`: the mean over every process). v_ref and v_old are frozen queries.
    Returns (L_S (B,), parts: ℓ_S, ℓ_R, ℓ_S̄, pref, D, σ(s_g), trust-clipped, runaway-clipped)."""
    loss_s, loss_ref, loss_old = mse(v_s, target), mse(v_ref, target), mse(v_old, target)
    _, clipped = dsm_clip(loss_s, loss_old, advantages, clip_range)
    anchor = mse(v_s, v_ref.detach()).mean()
    _, runaway = runaway_clip(loss_s, loss_ref, advantages, reduce(anchor.detach()), threshold)
    trained = torch.where(clipped | runaway, loss_s.detach(), loss_s)
    pref, group_weight, _ = dgpo_loss(trained, loss_old if ema_ref else loss_ref, advantages, groups, beta_pref,
                                      group_size)
    loss = (step + 1) / num_steps * (pref + beta_ref * anchor)
    return loss, dict(loss_s=loss_s, loss_ref=loss_ref, loss_old=loss_old, pref=pref, anchor=anchor,
                      group_weight=group_weight, clipped=clipped, runaway=runaway)


def generator_loss(x0, c_kl, c_cfg, c_reward, norm, norm_s, tdm_weight: float, mode: str):
    """L_G per sample from the generator's x̂0 (with grad) and the detached corrections: with ℓ = revised_x0_loss,
    mode "tdm" (--no-rl): ℓ(c_KL, n) + ℓ(c_CFG, n); "reward" (j < T_rl): ℓ(c_KL, n) + w·ℓ(c_CFG, n) +
    (1 − w)·ℓ(c_R, n_S); "late" (j ≥ T_rl): w·(ℓ(c_KL, n) + ℓ(c_CFG, n)) (the authors' factor w on the TDM term).
    c_CFG / c_R None: that term is 0. Returns (L_G, TDM term, CFG term, reward term), each (B,)."""
    tdm = revised_x0_loss(x0, c_kl, norm)
    cfg = revised_x0_loss(x0, c_cfg, norm) if c_cfg is not None else torch.zeros_like(tdm)
    reward = revised_x0_loss(x0, c_reward, norm_s) if mode == "reward" else torch.zeros_like(tdm)
    if mode == "tdm":
        loss = tdm + cfg
    elif mode == "reward":
        loss = tdm + tdm_weight * cfg + (1 - tdm_weight) * reward
    else:
        loss = tdm_weight * (tdm + cfg)
    return loss, tdm, cfg, reward


def old_decay(steps_before: int, rate: float, cap: float) -> float:
    """d of the S̄ blend after the surrogate step taken after `steps_before` others: min(cap, rate·(1 + k))."""
    return min(cap, rate * (1 + steps_before))


def check_tdmr1_args(args) -> None:
    """TrainArgs' checks, except that --no-rl may take K = 1 and N = 1; then this script's own."""
    check_args(replace(args, group_size=max(args.group_size, 2), num_steps=max(args.num_steps, 2)))
    if args.group_size < (1 if args.no_rl else 2):
        raise UserError(f"--group-size must be at least 2 (advantages compare a sample with its group; --no-rl "
                        f"takes 1), got {args.group_size}")
    if args.num_steps < 1:
        raise UserError(f"--num-steps must be at least 1, got {args.num_steps}")
    if args.full_finetune:
        raise UserError("tdmr1 trains three LoRA adapters on one base (generator, fake score, surrogate); "
                        "--full-finetune would need three transformer copies: train LoRA")
    if args.updates_per_epoch != 1:
        raise UserError(f"--updates-per-epoch must be 1 (each role takes one optimizer step per epoch), got "
                        f"{args.updates_per_epoch}")
    if not 1 <= args.train_steps <= args.num_steps:
        raise UserError(f"--train-steps must be in [1, {args.num_steps}] (distinct steps of the N), got "
                        f"{args.train_steps}")
    if args.rl_steps is not None and not 0 <= args.rl_steps <= args.num_steps:
        raise UserError(f"--rl-steps must be in [0, {args.num_steps}], got {args.rl_steps}")
    check_ranges(args, unit=("reward_tmin", "surrogate_tmin", "query_margin", "fake_beta1", "generator_beta1",
                             "surrogate_beta1"), unit_closed=("tdm_weight", "surrogate_old_max_decay"),
                 positive=("fake_learning_rate", "surrogate_learning_rate", "beta_pref", "clip_range"),
                 non_negative=("fake_teacher_weight", "beta_ref", "runaway_threshold", "surrogate_old_decay_rate"))
    if args.fake_updates < 1:
        raise UserError(f"--fake-updates must be at least 1, got {args.fake_updates}")
    if args.query_shift is not None and not args.query_shift > 0:
        raise UserError(f"--query-shift must be positive, got {args.query_shift}")
    true_cfg = ADAPTERS[args.model].true_cfg
    args.teacher_cfg = args.teacher_cfg if args.teacher_cfg is not None else (4.5 if true_cfg else 1.0)
    args.cfg_reward_scale = args.cfg_reward_scale if args.cfg_reward_scale is not None else (3.5 if true_cfg else 0.0)
    args.surrogate_cfg = args.surrogate_cfg if args.surrogate_cfg is not None else (4.5 if true_cfg else 1.0)
    for name in ("teacher_cfg", "surrogate_cfg"):
        value = getattr(args, name)
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (1: without CFG), got {value}")
        if value > 1 and not true_cfg:
            raise UserError(f"--{name.replace('_', '-')} {value}: {args.model} has no true CFG (its guidance is an "
                            f"embedding input, the same for every policy); leave it at 1")
    if args.cfg_reward_scale < 0:
        raise UserError(f"--cfg-reward-scale must be >= 0, got {args.cfg_reward_scale}")
    if args.cfg_reward_scale > 0 and args.teacher_cfg == 1:
        raise UserError(f"--cfg-reward-scale {args.cfg_reward_scale} needs the teacher's CFG: --teacher-cfg > 1 "
                        f"(x̂0_c − x̂0_u is read off the guided teacher)")
    if args.guidance_scale is not None and true_cfg and args.guidance_scale > 1:
        raise UserError(f"the generator samples CFG-free: --guidance-scale {args.guidance_scale} would turn on true CFG "
                        f"for {args.model}; leave it unset (the teacher's and surrogate's are --teacher-cfg and "
                        f"--surrogate-cfg)")


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "TDM-R1 (arXiv:2603.07700): RL of a few-step generator through a learned "
                      "surrogate reward; --no-rl: TDM distillation.", check=check_tdmr1_args)
    roles = {"fake": RoleOptimizer(args.fake_learning_rate, (args.fake_beta1, 0.999), args.max_grad_norm)}
    if not args.no_rl:
        roles["surrogate"] = RoleOptimizer(args.surrogate_learning_rate, (args.surrogate_beta1, 0.999),
                                           args.max_grad_norm)
    # The generator is the run's own adapter ("default": checkpoints, evaluation and the EMA apply to it); the fake
    # score and surrogate are trained roles (common.roles); S̄ trails the surrogate.
    run = setup(args, load_run_rewards(args), shadows=() if args.no_rl else (("surrogate_old", "surrogate"),),
                cfg_free=True, roles=roles)
    adapter, sigmas, device = run.adapter, run.sigmas, run.device
    fake, surrogate = run.roles["fake"], run.roles.get("surrogate")
    surrogate_old = run.shadows.get("surrogate_old")
    for group in run.optimizer.param_groups:  # the generator's AdamW: β1 0 (the authors')
        group["betas"] = (args.generator_beta1, 0.999)
    world, size, num_steps, num_train = run.data.num_processes, args.group_size, args.num_steps, args.train_steps
    if args.prompts_per_epoch % world:
        raise UserError(f"--prompts-per-epoch {args.prompts_per_epoch} must be a multiple of the {world} processes "
                        f"(each holds whole groups)")
    rl_steps = num_steps if args.rl_steps is None else args.rl_steps
    plain = 1.0 if adapter.true_cfg else run.guidance  # CFG-free queries (FLUX.1: its guidance embedding)
    teacher_cfg, surrogate_cfg = (args.teacher_cfg, args.surrogate_cfg) if adapter.true_cfg else (plain, plain)
    shift = args.query_shift or schedule_shift(adapter, num_steps)
    run.accelerator.print(f"query-time shift s = {shift:.4f}")
    local_count = run.local.stop - run.local.start
    rollout_batches = rollout_micro_batches(local_count, args.batch_size, 1)
    positions = torch.arange(run.local.start, run.local.stop)  # each local sample's place in the epoch's draw
    group_index = positions // size
    train_batch = size * groups_per_micro_batch(local_count // size, size, args.batch_size)
    num_groups, num_samples = args.prompts_per_epoch, args.prompts_per_epoch * size

    def renoised(epoch, state, sigma_lo, tmin, query_tag, noise_tag, groups, sample_positions, *step):
        """A query of `state` (at σ_lo): σ_q above max(σ_lo, tmin), one U per group, and the state re-noised to it
        with one ε per sample (`sample_positions` in the epoch's draw) or, given None, per group. Every draw from
        its own stream (seed, epoch, tag, *step). Returns (x_q, σ_q, ε, β)."""
        u = group_uniform(stream_seeds(args.seed, epoch, num_groups, query_tag, *step), groups)
        sigma_q = query_sigma(sigma_lo.double().cpu().clamp_min(tmin), u, shift, args.query_margin).float().to(device)
        per_group = sample_positions is None
        seeds = stream_seeds(args.seed, epoch, num_groups if per_group else num_samples, noise_tag, *step)
        noise = group_noise(seeds, groups if per_group else sample_positions, 1, state)[:, 0]
        x_q, _, beta = renoise(state, sigma_lo, sigma_q, noise)
        return x_q, sigma_q, noise, beta

    def note(**values):  # (B,) or scalar tensors: each one's mean, detached, into this epoch's `stats`
        for key, value in values.items():
            stats[key].append(value.detach().float().mean())

    evaluate_base(run)  # the untrained generator, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="tdmr1")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M prompts × K samples, each group contiguous on one process: a function of (seed, epoch) ----
        records, seeds = epoch_samples(run.train_prompts, args.prompts_per_epoch, size, args.seed, epoch, run.local,
                                       whole_groups=True)
        group_ids = torch.tensor([r.key for r in records])

        # ---- 2. rollout: the generator, CFG-free, N Euler steps, keeping every state x_0 … x_N -----------------
        cond = run.encode(records)
        run.transformer.eval()
        trajectory = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        for index in rollout_batches:
            c = {k: v[index] for k, v in cond.items()}
            x = adapter.noise(sample_generators(seeds[index], device))
            states = [x]
            with torch.no_grad():
                for j in range(num_steps):
                    x = x + (sigmas[j + 1] - sigmas[j]) * adapter.velocity(x, sigmas[j], c, plain)
                    states.append(x)
            trajectory.append(torch.stack(states, 1))
            scoring.submit(adapter.decode(x, c).cpu())
        trajectory = torch.cat(trajectory)  # (local samples, N + 1, ...)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and group-relative advantages (clamped to ±5) over the whole epoch (all processes) -------
        reward_start = time.time()
        all_raw, all_ids = score_epoch(run, scoring)
        adv_stats = {}
        if args.no_rl:
            advantages = torch.zeros(local_count, device=device)
        else:
            advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in run.rewards], all_ids,
                                                       args.advantage_aggregation, args.global_std,
                                                       args.adv_clip_max)
            advantages = advantages[run.local].float().to(device)
        # Every sample is kept (A = 0 weighs 0); micro-batches of whole groups, one optimizer step per role.
        plan = plan_micro_batches(torch.ones(num_samples, dtype=torch.bool), world, run.data.process_index,
                                  train_batch, 1)[0]
        reward_time = time.time() - reward_start

        # ---- 4. update: per micro-batch and trained step j, the fake loss, the surrogate loss (at its own j′) and
        # the generator loss, each into its own adapter; then per role: clip, step (fake, surrogate + S̄, generator)
        train_start = time.time()
        run.transformer.train()
        stats = {k: [] for k in ("fake_loss", "fake_dsm_loss", "replay_error", "sigma_tau", "loss", "tdm_term",
                                 "cfg_term", "reward_term", "norm", "norm_surrogate", "sigma_reward",
                                 "surrogate_loss", "surrogate_dsm_loss", "surrogate_value_delta", "pref_loss",
                                 "anchor", "group_weight_mean", "clipfrac", "runaway_frac", "surrogate_drift",
                                 "sigma_surrogate")}
        fake_norms = []
        for fake_pass in range(args.fake_updates):
            extra = args.fake_updates - 1 - fake_pass  # 0: the joint pass, which also trains surrogate and generator
            for mb in plan:
                index = mb.index
                c, adv, weight = {k: v[index] for k, v in cond.items()}, advantages[index], mb.weight.to(device)
                groups = group_index[index]  # in the epoch's draw
                local_groups = torch.unique(groups, return_inverse=True)[1].to(device)  # 0..G−1, whole groups
                path = trajectory[index]
                steps = trained_steps(args.seed, epoch, int(groups[0]), num_steps, num_train, extra)
                for position, j in enumerate(steps):
                    x_j, x_next = path[:, j], path[:, j + 1]
                    batch = len(x_j)
                    sigma_j, sigma_next = sigmas[j].expand(batch), sigmas[j + 1].expand(batch)
                    with torch.no_grad():  # the generator's step from the stored state: x̂0_G and the Euler point x̄
                        v_gen = adapter.velocity(x_j, sigma_j, c, plain)
                    x0_gen = x_j - sigmas[j] * v_gen
                    x_bar = x_j + (sigmas[j + 1] - sigmas[j]) * v_gen

                    # -- fake loss at j: the fake score fits the generator's samples x̄ re-noised to σ_τ > σ_{j+1}
                    x_tau, sigma_tau, _, _ = renoised(epoch, x_bar, sigma_next, 0.0, FAKE_QUERY, FAKE_NOISE, groups,
                                                      positions[index], extra, j)
                    target = (x_tau - x0_gen) / per_sample(sigma_tau, x_tau)  # u_f = ε_tot − x̂0_G
                    v_ref = run.reference.velocity(x_tau, sigma_tau, c, plain) if args.fake_teacher_weight > 0 \
                        else None
                    with role_backward(run.accelerator, run.transformer), fake.trained():
                        v_fake = adapter.velocity(x_tau, sigma_tau, c, plain)
                        loss_fake = fake_loss(v_fake, target, v_ref, args.fake_teacher_weight)
                        run.accelerator.backward((weight * loss_fake).sum() / num_train)
                    note(fake_loss=loss_fake, fake_dsm_loss=mse(v_fake.detach(), target))
                    stats["replay_error"].append((x_bar - x_next).abs().max())
                    if extra:
                        continue

                    # -- surrogate loss at j′ (∝ j′ + 1): DGPO's group preference on the stored x_{j′+1} re-noised
                    if surrogate is not None:
                        j_s = surrogate_step(args.seed, epoch, int(groups[0]), position, num_steps)
                        y, sigma_n = path[:, j_s + 1], sigmas[j_s + 1].expand(batch)
                        x_s, sigma_s, z, beta_s = renoised(epoch, y, sigma_n, args.surrogate_tmin, SUR_QUERY,
                                                           SUR_NOISE, groups, None, position)
                        target_s = surrogate_target(x_s, z, beta_s, sigma_s)
                        v_ref = run.reference.velocity(x_s, sigma_s, c, plain)  # frozen queries first
                        v_old = surrogate_old.velocity(x_s, sigma_s, c, plain)
                        with role_backward(run.accelerator, run.transformer), surrogate.trained():
                            v_s = adapter.velocity(x_s, sigma_s, c, plain)
                            loss_surrogate, part = surrogate_loss(
                                v_s, v_ref, v_old, target_s, adv, local_groups, size, j_s, num_steps, args.beta_pref,
                                args.beta_ref, args.clip_range, args.runaway_threshold, args.surrogate_ema_ref,
                                reduce=lambda anchor: run.data.reduce(anchor, "mean"))  # the gate's D: all processes
                            run.accelerator.backward((weight * loss_surrogate).sum() / num_train)
                        note(surrogate_loss=loss_surrogate, surrogate_dsm_loss=part["loss_s"],
                             surrogate_value_delta=part["loss_s"] - part["loss_ref"], pref_loss=part["pref"],
                             anchor=part["anchor"], group_weight_mean=part["group_weight"], clipfrac=part["clipped"],
                             runaway_frac=part["runaway"], surrogate_drift=mse(v_s, v_old), sigma_surrogate=sigma_s)

                    # -- generator loss at j: revised-x0 terms towards the teacher (TDM), its CFG, the learned reward
                    x_tau, sigma_tau, _, _ = renoised(epoch, x_bar, sigma_next, 0.0, GEN_QUERY, GEN_NOISE, groups,
                                                      positions[index], j)
                    with torch.no_grad():  # every query before the generator's forward (adapter switches)
                        x0_cond = x_tau - per_sample(sigma_tau, x_tau) * run.reference.velocity(x_tau, sigma_tau, c,
                                                                                                plain)
                        x0_guided = x0_cond if args.teacher_cfg == 1 else x_tau - per_sample(sigma_tau, x_tau) * \
                            run.reference.velocity(x_tau, sigma_tau, c, teacher_cfg)
                        x0_fake = x_tau - per_sample(sigma_tau, x_tau) * fake.velocity(x_tau, sigma_tau, c, plain)
                        c_kl = x0_cond - x0_fake  # the conditional teacher minus the fake score
                        # λ·(x̂0_c − x̂0_u), read off the guided teacher: x̂0^w − x̂0_c = (w − 1)·(x̂0_c − x̂0_u)
                        c_cfg = args.cfg_reward_scale * (x0_guided - x0_cond) / (args.teacher_cfg - 1) \
                            if args.cfg_reward_scale > 0 else None
                        norm = normaliser(x0_gen, x0_guided)
                        reward_step = surrogate is not None and j < rl_steps
                        if reward_step:
                            x_r, sigma_r, _, _ = renoised(epoch, x_bar, sigma_next, args.reward_tmin, REWARD_QUERY,
                                                          REWARD_NOISE, groups, None, j)
                            x0_sur = x_r - per_sample(sigma_r, x_r) * surrogate.velocity(x_r, sigma_r, c,
                                                                                         surrogate_cfg)
                            ref_cfg = surrogate_cfg if args.surrogate_ref_cfg else plain
                            x0_ref = x_r - per_sample(sigma_r, x_r) * run.reference.velocity(x_r, sigma_r, c, ref_cfg)
                            c_reward, norm_s = x0_sur - x0_ref, normaliser(x0_gen, x0_sur)
                    mode = "tdm" if surrogate is None else "reward" if reward_step else "late"
                    with role_backward(run.accelerator, run.transformer):
                        x0 = x_j - sigmas[j] * adapter.velocity(x_j, sigma_j, c, plain)  # with grad: the generator
                        loss, tdm_term, cfg_term, reward_term = generator_loss(
                            x0, c_kl, c_cfg, c_reward if reward_step else None, norm, norm_s if reward_step else None,
                            args.tdm_weight, mode)
                        run.accelerator.backward((weight * loss).sum() / num_train)
                    note(loss=loss, tdm_term=tdm_term, cfg_term=cfg_term, norm=norm, sigma_tau=sigma_tau)
                    if reward_step:
                        note(reward_term=reward_term, norm_surrogate=norm_s, sigma_reward=sigma_r)
            fake_norms.append(fake.step(run.accelerator, epoch))  # n − 1 fake-only steps, then the joint pass's
        surrogate_norm = decay = None
        if surrogate is not None:
            surrogate_norm = surrogate.step(run.accelerator, epoch)
            decay = old_decay(surrogate.steps - 1, args.surrogate_old_decay_rate, args.surrogate_old_max_decay)
            surrogate_old.blend(decay)  # S̄ ← d·S̄ + (1 − d)·S: the trust region tightens as d grows
        all_reduce_gradients(run.accelerator, run.params)  # no_sync above: the generator's gradients, averaged here
        if run.ema is not None:  # the authors' generator EMA: min((1 + k)/(10 + k), decay)
            run.ema.decay = min((1 + run.optimizer_steps) / (10 + run.optimizer_steps), args.ema_decay)
        grad_norm = optimizer_step(run, epoch)

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats,
                                {"rollout_time_s": rollout_time, "reward_time_s": reward_time,
                                 "train_time_s": time.time() - train_start})
        metrics.update(grad_norm=grad_norm, fake_grad_norm=float(np.mean(fake_norms)), **(
            {"surrogate_grad_norm": surrogate_norm, "surrogate_old_decay": decay,
             "zero_std_frac": adv_stats["zero_std_frac"],
             "adv_abs_mean": float(run.accelerator.reduce(advantages.abs().mean(), "mean"))}
            if surrogate is not None else {}))
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "eval_reward_mean", "eval_blur_ratio", "loss", "fake_loss",
                                 "surrogate_loss", "anchor", "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
