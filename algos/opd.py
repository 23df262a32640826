# DiffusionOPD: on-policy distillation of several single-reward teachers into one student. The student rolls out;
# at every state x_j it visits, the teacher of the prompt's task (a LoRA trained by any script here) gives its
# transition mean, and the student matches it under the per-step Gaussian KL. Rewards are only logged.
# Paper: DiffusionOPD, arXiv:2605.15055 (the math checked against Flow-Factory's port of the authors' `mopd`
# setting, pull request #170). Copied from grpo.py; what differs: no advantages, ratio or clip; the teachers'
# forward goes where grpo's reference forward was; only x_j is stored; `ode` is allowed (the default); prompts are
# drawn per task and routed to their teacher. Math: docs/algorithms.md §8.
import json
import math
import re
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro
from tqdm import tqdm

from common.checkpoint import LORA_FILE, LORA_FILE_2, newest_complete_checkpoint
from common.cli import TrainArgs, check_args, parse_args
from common.data import load_prompts, sample_seeds
from common.distributed import micro_step
from common.dynamics import sde_step
from common.sampling import sample_generators
from common.setup import (epoch_metrics, evaluate, evaluate_base, finish, log_epoch, optimizer_step, save, score_epoch,
                          setup, start_scoring)
from common.training import plan_micro_batches, rollout_micro_batches
from common.utils import UserError
from rewards import load_run_rewards
from worlds import TOY_WORLD


@dataclass
class Args(TrainArgs):
    group_size: int = 1
    """K: samples per prompt (1, the paper's: nothing compares a sample with its group)"""
    updates_per_epoch: int = 1
    """optimizer steps per epoch (the paper's: 1)"""

    # Algorithm specific arguments
    teacher: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a teacher as NAME=LORA_DIR[:WEIGHT][,guidance=G], repeated: LORA_DIR a checkpoint folder of any script (LoRA)
    or a run folder (its newest complete checkpoint); it teaches the prompts whose "task" is NAME (all prompts when
    it is the only teacher and the data has no tasks); WEIGHT (default 1) is its task's share of each epoch's
    prompts; G its guidance (default --guidance-scale)"""
    dynamics: Literal["ode", "flow-sde", "dance-sde", "cps"] = "ode"
    """rollout step and the Gaussian whose means are matched (ode: ½·mean((μ_S − μ_T)²), the paper's default)"""
    noise_level: float = 0.7
    """η of an SDE (student and teachers alike)"""
    timestep_range: tuple[float, float] = (0.0, 0.99)
    """(f_lo, f_hi): the rollout steps [⌊f_lo·N⌋, ⌊f_hi·N⌋) are trained (the paper's: all but the last)"""
    offload_trajectories: bool = False
    """keep the stored rollout states on the CPU between rollout and training"""


# What each preset is, why, and what it measured: docs/algorithms/opd.md#presets
PRESETS = {
    # The toy world (docs/toy-world.md): distil nft's toy count and shape teachers into one student on
    # data/toy_opd, at nft's toy LoRA and lr.
    "toy": dict(TOY_WORLD, dataset=str(Path(__file__).resolve().parent.parent / "data" / "toy_opd"), epochs=30,
                prompts_per_epoch=16, group_size=1, batch_size=4, updates_per_epoch=4, num_steps=8,
                learning_rate=1e-3, lora_rank=16, lora_alpha=16, eval_every=10, save_every=10),
    # The embedded tiny FLUX.1 on a CPU (docs/tiny-models.md): 4 prompts, 6 Euler steps, lr 3e-2.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=30, prompts_per_epoch=4,
                 group_size=1, batch_size=4, updates_per_epoch=1, num_steps=6, learning_rate=3e-2, lora_rank=8,
                 lora_alpha=8, eval_every=15, eval_num_prompts=4, save_every=15),
    # The paper's SD3.5-M setting (Flow-Factory's port of the authors' `mopd`); rewards are only logged: add
    # the ones matching your teachers.
    "sd3-mopd": dict(model="sd3", reward=["aesthetic"], resolution=512, num_steps=10, group_size=1,
                     prompts_per_epoch=72, batch_size=8, updates_per_epoch=1, learning_rate=3e-4, weight_decay=1e-4,
                     max_grad_norm=1.0, lora_rank=32, lora_alpha=64, guidance_scale=4.5, ema=True, epochs=1000,
                     eval_every=20, save_every=20),
}


def check_opd_args(args) -> None:
    """The shared checks, except that K = 1 is allowed (no advantages: nothing compares a sample with its group)."""
    if args.group_size < 1:
        raise UserError(f"--group-size must be at least 1, got {args.group_size}")
    check_args(replace(args, group_size=max(args.group_size, 2)) if args.group_size == 1 else args)


@dataclass
class TeacherSpec:
    name: str
    path: Path
    weight: float
    guidance: float | None


def parse_teacher(spec: str) -> TeacherSpec:
    """NAME=LORA_DIR[:WEIGHT][,guidance=G] -> TeacherSpec (a one-line error otherwise)."""
    head, *options = spec.split(",")
    name, eq, rest = head.partition("=")
    if not eq or not re.fullmatch(r"[\w.-]+", name) or not rest:
        raise UserError(f"--teacher {spec!r}: expected NAME=LORA_DIR[:WEIGHT][,guidance=G] (NAME of letters, digits, "
                        f"'_', '.', '-')")
    path, weight = rest, 1.0
    head_path, colon, tail = rest.rpartition(":")
    if colon and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", tail):
        path, weight = head_path, float(tail)
    if not (math.isfinite(weight) and weight > 0):
        raise UserError(f"--teacher {spec!r}: WEIGHT must be a positive number, got {weight}")
    guidance = None
    for option in options:
        key, eq, value = option.partition("=")
        if key != "guidance" or not eq:
            raise UserError(f"--teacher {spec!r}: unknown option {option!r}; the only option is guidance=G")
        try:
            guidance = float(value)
        except ValueError:
            raise UserError(f"--teacher {spec!r}: guidance={value!r} is not a number") from None
        if not math.isfinite(guidance):
            raise UserError(f"--teacher {spec!r}: guidance must be finite")
    return TeacherSpec(name, Path(path), weight, guidance)


def teacher_checkpoint(spec: TeacherSpec, model: str) -> Path:
    """The folder of the teacher's LoRA file: LORA_DIR itself, or the newest complete checkpoint of a run folder.
    Refuses a full fine-tune and a checkpoint trained on another model family."""
    folder = spec.path
    if not folder.is_dir():
        raise UserError(f"--teacher {spec.name}: {folder} is not a folder")
    if not (folder / LORA_FILE).exists() and (folder / "checkpoints").is_dir():
        checkpoint, skipped = newest_complete_checkpoint(folder, False, 0)  # (rank: which RNG file it reads)
        if checkpoint is None:
            full = any((folder / "checkpoints").glob("epoch_*/transformer"))
            raise UserError(f"--teacher {spec.name}: {folder} holds no complete LoRA checkpoint"
                            + (" (it is a full fine-tune: teachers are LoRA adapters)" if full else
                               f" ({'; '.join(skipped) or 'none'})"))
        folder = checkpoint.folder
    if not (folder / LORA_FILE).exists():
        full = (folder / "transformer").is_dir()
        raise UserError(f"--teacher {spec.name}: {folder} has no {LORA_FILE}" + (
            " (a full fine-tune: teachers are LoRA adapters)" if full else
            " (give a checkpoint folder or a run's --output-dir)"))
    if (folder / LORA_FILE_2).exists():  # Wan2.2's low-noise expert: a teacher here is one adapter on one module
        raise UserError(f"--teacher {spec.name}: {folder} also holds {LORA_FILE_2} (a two-expert model); opd's "
                        f"teachers are single-transformer LoRAs")
    meta = folder / "meta.json"
    trained_on = json.loads(meta.read_text()).get("model") if meta.exists() else None
    if trained_on is not None and trained_on != model:
        raise UserError(f"--teacher {spec.name}: {folder} was trained on {trained_on}, the student is {model}")
    return folder


class Teacher:
    """A frozen LoRA adapter `teacher_NAME` on the student's transformer (rank and α from its file's peft config),
    switched in for each forward and back to the student's "default", as common.shadow.ShadowPolicy does."""

    def __init__(self, spec: TeacherSpec, folder: Path, adapter, transformer, guidance: float):
        from safetensors import safe_open

        self.name, self.adapter, self.transformer, self.guidance = spec.name, adapter, transformer, guidance
        self.adapter_name = f"teacher_{spec.name}"
        with warnings.catch_warnings():  # peft warns that another adapter is being added: intended here
            warnings.simplefilter("ignore")
            transformer.load_lora_adapter(str(folder), weight_name=LORA_FILE, prefix="transformer",
                                         adapter_name=self.adapter_name)
        transformer.set_adapter("default")  # peft also takes requires_grad from every other adapter
        loaded = [p for n, p in transformer.named_parameters() if f".{self.adapter_name}." in n]
        with safe_open(folder / LORA_FILE, "pt") as lora:
            expected = sum(k.startswith("transformer.") for k in lora.keys())  # noqa: SIM118
        if len(loaded) != expected:  # a LoRA of another architecture loads with a warning only
            raise UserError(f"--teacher {spec.name}: {folder / LORA_FILE} has {expected} LoRA tensors but only "
                            f"{len(loaded)} match this {type(transformer).__name__}: trained on another base model?")
        for p in loaded:
            p.requires_grad_(False)

    @torch.no_grad()
    def velocity(self, x, sigma, cond):
        self.transformer.set_adapter(self.adapter_name)
        try:
            return self.adapter.velocity(x, sigma, cond, self.guidance)
        finally:
            self.transformer.set_adapter("default")


def task_draw(tasks: np.ndarray, counts: list[int], group_size: int, seed: int, epoch: int) -> np.ndarray:
    """Dataset indices of the epoch's samples: counts[k] distinct prompts of task k (tasks: each prompt's task
    index), each K times, in a shuffled order; a function of (seed, epoch) only, as common.data.epoch_draw."""
    rng = np.random.default_rng([seed, epoch, 0x0BD])
    chosen = np.concatenate([rng.permutation(np.flatnonzero(tasks == k))[:n] for k, n in enumerate(counts)])
    return rng.permutation(np.repeat(chosen, group_size))


def teacher_means(teachers, who, x, sigma, sigma_next, cond, dynamics, noise_level):
    """μ_T of every row: each teacher runs once, on its own rows (who: each row's teacher index), at the student's
    η. A row's mean depends only on its own teacher."""
    mean = torch.zeros_like(x, dtype=torch.float32)
    for k, teacher in enumerate(teachers):
        rows = who == k
        if rows.any():
            v = teacher.velocity(x[rows], sigma, {key: value[rows] for key, value in cond.items()})
            # prev_sample given: sde_step draws no noise (only the mean is needed)
            mean[rows] = sde_step(dynamics, v, x[rows], sigma, sigma_next, noise_level, prev_sample=x[rows])[2]
    return mean


def opd_loss(dynamics: str, mean, mean_teacher, std) -> torch.Tensor:
    """ℓ per row (B,): ½·mean_elements((μ_S − μ_T)²)/D, D = 1 for ode, else S² clamped ≥ 1e-8 (the Gaussian KL of two
    steps with the same S, per element)."""
    gap = ((mean.float() - mean_teacher.float()) ** 2).flatten(1).mean(1) / 2
    if dynamics == "ode":
        return gap
    return gap / torch.as_tensor(std, dtype=torch.float32).flatten().pow(2).clamp_min(1e-8).expand_as(gap)


if __name__ == "__main__":
    args = parse_args(Args, PRESETS, "DiffusionOPD (arXiv:2605.15055): on-policy distillation of task teachers.",
                      check=check_opd_args)
    lo, hi = math.floor(args.timestep_range[0] * args.num_steps), math.floor(args.timestep_range[1] * args.num_steps)
    if not (0 <= args.timestep_range[0] <= args.timestep_range[1] <= 1 and lo < hi):
        raise UserError(f"--timestep-range {args.timestep_range[0]} {args.timestep_range[1]} trains no step of "
                        f"{args.num_steps}: give 0 <= lo < hi <= 1 with ⌊lo·N⌋ < ⌊hi·N⌋")
    if args.dynamics == "cps" and hi == args.num_steps:
        raise UserError("--dynamics cps: the last step (σ' = 0) has S = 0, so ℓ divides by 0: end --timestep-range "
                        "below 1")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if args.full_finetune:
        raise UserError("--full-finetune: the teachers are LoRA adapters on the student's base weights, which full "
                        "fine-tuning changes; train a LoRA student")
    specs = [parse_teacher(spec) for spec in args.teacher]
    if not specs:
        raise UserError("give at least one --teacher NAME=LORA_DIR (a checkpoint or run folder of any script)")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise UserError(f"--teacher {max(names, key=names.count)!r} is given twice: one teacher per task")
    specs.sort(key=lambda s: s.name)  # the draw follows the names, not the order of the flags
    folders = [teacher_checkpoint(s, args.model) for s in specs]

    # Routing, checked before anything loads: each training prompt's task index (untagged data with one teacher:
    # all its).
    train_prompts = load_prompts(args.dataset, "train")
    tasks = {r.task for r in train_prompts}
    if tasks == {""} and len(specs) == 1:
        task_index = np.zeros(len(train_prompts), dtype=np.int64)
    else:
        untaught = sorted(tasks - set(names))
        if untaught:
            first = next(r for r in train_prompts if r.task == untaught[0])
            raise UserError(f"{first.source}: task {untaught[0]!r} has no teacher (teachers: {', '.join(names)})"
                            if untaught[0] else f"{first.source}: no \"task\", but {len(specs)} teachers are given: "
                            f"tag every line with one of {', '.join(names)}")
        idle = [s.name for s in specs if s.name not in tasks]
        if idle:
            raise UserError(f"--teacher {idle[0]}: no training prompt has task {idle[0]!r} (tasks: "
                            f"{', '.join(sorted(tasks))})")
        task_index = np.array([[s.name for s in specs].index(r.task) for r in train_prompts])
    shares = [args.prompts_per_epoch * s.weight / sum(s.weight for s in specs) for s in specs]
    counts = [round(share) for share in shares]
    for k, (spec, share, count) in enumerate(zip(specs, shares, counts)):
        if abs(share - count) > 1e-9 or count < 1:
            raise UserError(f"--prompts-per-epoch {args.prompts_per_epoch} gives task {spec.name!r} {share:g} prompts "
                            f"(its weight's share): choose weights and M that give every task a whole number ≥ 1")
        if count > (task_index == k).sum():
            raise UserError(f"task {spec.name!r} has {(task_index == k).sum()} training prompts, fewer than the "
                            f"{count} drawn per epoch")
    run = setup(args, load_run_rewards(args))
    adapter, sigmas, guidance, device = run.adapter, run.sigmas, run.guidance, run.device
    store = "cpu" if args.offload_trajectories else device
    train_steps = list(range(lo, hi))
    teachers = [Teacher(s, folder, adapter, run.unwrapped, s.guidance if s.guidance is not None else guidance)
                for s, folder in zip(specs, folders)]
    rollout_batches = rollout_micro_batches(run.local.stop - run.local.start, args.batch_size, args.updates_per_epoch)
    samples_per_epoch = args.prompts_per_epoch * args.group_size

    evaluate_base(run)  # the untrained model, logged as epoch −1 (a resumed run has it)
    bar = tqdm(range(run.start_epoch, args.epochs), disable=not run.accelerator.is_main_process, desc="opd")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. draw M·w_k/Σw prompts of each task × K samples: a function of (seed, epoch) ----------------------
        draw = task_draw(task_index, counts, args.group_size, args.seed, epoch)
        records = [run.train_prompts[i] for i in draw[run.local]]
        seeds = torch.tensor(sample_seeds(args.seed, epoch, samples_per_epoch)[run.local], dtype=torch.int64)
        who = torch.tensor(task_index[draw[run.local]], device=device)  # each sample's teacher
        group_ids = torch.tensor([r.key for r in records])

        # ---- 2. rollout with the student: x_{j+1} = sde_step(x_j) (Euler for ode); keep x_j of trained steps ----
        cond = run.encode(records)
        run.transformer.eval()
        stored = []
        scoring = start_scoring(run, records, group_ids)  # rewards score each micro-batch as it is decoded
        with torch.no_grad():
            for index in rollout_batches:
                c, generators = {k: v[index] for k, v in cond.items()}, sample_generators(seeds[index], device)
                x, steps = adapter.noise(generators), []
                for j in range(args.num_steps):
                    v = adapter.velocity(x, sigmas[j], c, guidance)
                    if j in train_steps:
                        steps.append(x.to(store))
                    x = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1], args.noise_level,
                                 generator=generators)[0]
                stored.append(torch.stack(steps, dim=1))  # (batch, trained steps, ...)
                scoring.submit(adapter.decode(x, c).cpu())
        stored = torch.cat(stored)
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards, only logged (per task too); every sample is trained -----------------------------------
        reward_start = time.time()
        all_raw, _ = score_epoch(run, scoring)
        plan = plan_micro_batches(torch.ones(samples_per_epoch, dtype=torch.bool), run.data.num_processes,
                                  run.data.process_index, args.batch_size, args.updates_per_epoch)
        reward_time = time.time() - reward_start

        # ---- 4. update: match each row's teacher mean at the stored states --------------------------------------
        train_start = time.time()
        run.transformer.train()
        stats = {"grad_norm": []}
        kl_sum, kl_count = torch.zeros(len(teachers), device=device), torch.zeros(len(teachers), device=device)
        for micro_batches in plan:
            for mb in micro_batches:
                c, weight, real, rows = ({k: v[mb.index] for k, v in cond.items()}, mb.weight.to(device),
                                         mb.real.to(device), who[mb.index])
                for i, j in enumerate(train_steps):
                    x = stored[mb.index, i].to(device)
                    mean_teacher = teacher_means(teachers, rows, x, sigmas[j], sigmas[j + 1], c, args.dynamics,
                                                 args.noise_level)
                    with micro_step(run.accelerator, run.transformer, mb.last and i == len(train_steps) - 1):
                        v = adapter.velocity(x, sigmas[j], c, guidance)
                        _, _, mean, std = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1], args.noise_level,
                                                   prev_sample=x)
                        # ℓ = KL(student step ‖ teacher step) per element: ½·mean((μ_S − μ_T)²)/S² (ode: S² → 1)
                        loss = opd_loss(args.dynamics, mean, mean_teacher, std)
                        # weight: 1 / (samples of this optimizer step), so the step averages samples and steps
                        run.accelerator.backward((weight * loss).sum() / len(train_steps))
                    with torch.no_grad():  # kl_NAME: the mean of ℓ over that teacher's rows and trained steps
                        for k in range(len(teachers)):
                            mine = real & (rows == k)
                            kl_sum[k] += loss.detach()[mine].sum()
                            kl_count[k] += mine.sum()
            stats["grad_norm"].append(torch.tensor(optimizer_step(run, epoch), device=device))

        # ---- 5. log, evaluate, checkpoint ---------------------------------------------------------------------
        metrics = epoch_metrics(run, epoch, all_raw, stats, {"rollout_time_s": rollout_time,
                                                             "reward_time_s": reward_time,
                                                             "train_time_s": time.time() - train_start})
        kl_sum, kl_count = (run.data.reduce(t, "sum").cpu().double() for t in (kl_sum, kl_count))
        metrics["loss"] = float(kl_sum.sum() / kl_count.sum())
        metrics.update({f"kl_{t.name}": float(kl_sum[k] / kl_count[k]) for k, t in enumerate(teachers)})
        all_tasks = torch.as_tensor(task_index[draw])  # every sample's teacher, in draw order (all processes)
        metrics.update({f"reward_{r.name}_{t.name}_mean": float(all_raw[all_tasks == k, n].mean())
                        for n, r in enumerate(run.rewards) for k, t in enumerate(teachers)})
        metrics.update(evaluate(run, epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        log_epoch(run, metrics, ["epoch", "reward_mean", "eval_reward_mean", "loss",
                                 *[f"kl_{t.name}" for t in teachers], "epoch_time_s"], bar)
        save(run, epoch)
    finish(run)
