"""What every script does before its first epoch and after each one, written once: `setup` (accelerator, data,
model, LoRA or full fine-tuning, frozen policies, optimizer, `prepare`, resume) returns a `Run`; then
`optimizer_step`, `evaluate`, `log_epoch` and `save` are called from the script's own loop, which they never own."""

import atexit
import copy
import json
import os
import shutil
import time
from argparse import Namespace
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from common.cache import PromptEncoder, cache_texts, condition_inputs, find_cache
from common.checkpoint import (LORA_FILE, CheckpointError, clean_stale_writes, load_full_state_into,
                               load_lora_state_into, newest_complete_checkpoint, read_checkpoint, restore_rng,
                               save_checkpoint)
from common.cli import changed_on_resume, run_defining_flags
from common.cluster import LOCK_FILE, exit_stopped, lock_output_dir, requested_stop, stop_after_epoch_on_signals
from common.data import check_conditions, load_prompts, prompts_digest, shard
from common.distributed import (configure_backend, load_optimizer_state_dict, lora_state_dict, optimizer_state_dict,
                                place_like, save_pretrained, staging_device, trainable)
from common.evaluation import evaluate_prompts, load_hf_reference
from common.flops import FlopCounter, default_peak_tflops
from common.init_lora import init_lora_folder, load_init_lora, merge_init_lora
from common.guard import Guard, prompt_gap_notes
from common.models import ADAPTERS, load_adapter, resolve_model_path
from common.parallel import (DataParallel, check_world, device_mesh, enable_sequence_parallel, models_with_plans,
                             plan_owner)
from common.roles import TrainedRole, check_roles, load_roles_state, roles_state
from common.scoring import RolloutScoring, check_audio_rewards, check_video_rewards
from common.shadow import ReferencePolicy, ShadowPolicy
from common.tracking import MetricsLog, check_finite, format_metrics
from common.training import EMA, add_lora, apply_step, full_finetune_parameters, lr_scheduler, trainable_parameters
from common.utils import RunStopped, UserError, peak_memory_gb, resolve_dtype


@dataclass
class Run:
    """What `setup` built. The script reads these; only the helpers below write them."""

    args: object
    accelerator: Accelerator
    adapter: object               # common.models adapter; adapter.transformer is the prepared (wrapped) module
    transformer: torch.nn.Module  # the prepared module: call it through adapter.velocity
    unwrapped: torch.nn.Module    # the module itself (peft adapters, state dicts)
    params: list                  # the trained parameters (float32)
    optimizer: torch.optim.Optimizer
    scheduler: object             # learning-rate schedule, stepped by optimizer_step
    reference: ReferencePolicy    # the model before training (adapters disabled, or a frozen copy)
    shadows: dict                 # name -> ShadowPolicy (θ_old, EMA samplers) the script asked for
    ema: EMA | None               # --ema: an EMA of the weights for evaluation
    encode: PromptEncoder         # prompts -> conditioning (the embedding cache when it matches)
    rewards: list
    train_prompts: list
    test_prompts: list
    sigmas: torch.Tensor          # the rollout schedule σ_0 = 1 … σ_N = 0
    guidance: float
    output_dir: Path
    metrics_log: MetricsLog
    start_epoch: int = 0
    meta: dict = field(default_factory=dict)  # script state saved with the last checkpoint (e.g. a window)
    local: slice = field(default_factory=lambda: slice(0))  # this process's part of each epoch's M·K samples
    data: DataParallel | None = None  # the data-parallel ranks (world / --sequence-parallel) and their collectives
    optimizer_steps: int = 0      # taken so far, this run and the ones it resumes
    flops: FlopCounter = field(default_factory=FlopCounter)  # the transformers' work, for tflops and mfu
    reward_columns: dict = field(default_factory=dict)  # the last score_epoch's named reward columns, all processes
    roles: dict = field(default_factory=dict)  # name -> common.roles.TrainedRole: adapters trained beside "default"
    judges: list = field(default_factory=list)  # --judge: rewards scored at evaluation only (common.guard)
    guard: Guard | None = None   # --guard: acts on the judges at each evaluation
    guard_save: bool = False     # the guard asks `save` for this epoch's checkpoint (a judge's best, an event)
    guard_stop: str | None = None  # the guard's reason to stop once this epoch's checkpoint is written

    @property
    def device(self) -> torch.device:
        return self.accelerator.device


def _check_output_dir(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir {output_dir} is a file, not a folder")
    if not output_dir.exists():  # a run that stops before writing anything leaves no empty folder behind
        atexit.register(_remove_if_empty, output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write_test.{os.getpid()}"  # the processes of a launch check at the same moment
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"--output-dir {output_dir} is not writable ({err.strerror})") from None


def _remove_if_empty(folder: Path) -> None:
    try:
        lock = folder / LOCK_FILE
        if [p.name for p in folder.iterdir()] == [LOCK_FILE] and lock.stat().st_size == 0:  # released (common.cluster)
            lock.unlink()
        folder.rmdir()  # only succeeds when empty (another process of the launch may have removed it already)
    except OSError:
        pass


def _claim_output_dir(accelerator: Accelerator, output_dir: Path) -> None:
    """Check the output folder and lock it (common.cluster) on the main process before any process reads it; the
    other processes check it once the main process holds it, or end with its refusal."""
    refusal = None
    if accelerator.is_main_process:
        try:
            _check_output_dir(output_dir)
            lock_output_dir(output_dir)
        except UserError as err:  # RunStopped too (a full disk under the lock file): its exit status is kept
            refusal = err
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise refusal
    if not accelerator.is_main_process:
        _check_output_dir(output_dir)  # another machine may see another folder


def _checkpoint_written(output_dir: Path) -> bool:
    """Whether a checkpoint was ever completed in the folder, even one that no longer loads: each is renamed into
    place (epoch_*; .epoch_*.old while a re-save swaps it) before `latest` names it, and `latest` is never removed."""
    root = output_dir / "checkpoints"
    return (root / "latest").exists() or any(root.glob("epoch_*")) or any(root.glob(".epoch_*.old"))


def _find_resume(args, output_dir: Path, rank: int, train_prompts: list):
    """(the checkpoint to resume from or None, the newer checkpoints skipped, whether a run stopped before its
    first checkpoint is to be started again from scratch, a note for each flag that changed and may), or a one-line
    refusal: of a folder where a checkpoint was ever written to be restarted from scratch, and of a change to a flag
    that defines the run (common.cli.RESUMABLE_FLAGS lists those that may change) or to its training prompts."""
    metrics = output_dir / "metrics.jsonl"
    written = _checkpoint_written(output_dir)
    restart = not written and metrics.exists() and metrics.stat().st_size > 0
    if not args.resume:
        if written:
            raise UserError(f"{output_dir} already holds a run: pass --resume to continue it or choose another "
                            f"--output-dir")
        return None, [], restart, []
    checkpoint, skipped = newest_complete_checkpoint(output_dir, args.full_finetune, rank)
    if checkpoint is None:
        if written:
            why = "; ".join(skipped) if skipped else "none is left"
            raise UserError(f"--resume: {output_dir} holds a run but no complete checkpoint ({why}); refusing to "
                            f"start it again from scratch: move it away or choose another --output-dir")
        return None, skipped, restart, []
    meta = checkpoint.meta
    algorithm = run_defining_flags(args)["algorithm"]
    if meta.get("run", {}).get("algorithm", algorithm) != algorithm:
        raise UserError(f"--resume: the script is {algorithm!r} but the run in {output_dir} was started with "
                        f"{meta['run']['algorithm']!r}; it defines the run, so it cannot change on resume")
    # `args`: every flag of the start that wrote the checkpoint; `run`: the few recorded before it (older ones).
    saved = {**meta.get("run", {}), **meta.get("args", {})}
    by_content = "prompts_sha256" in meta  # then the training prompts are compared, wherever their folder is now
    defining, others = changed_on_resume(args, saved, also_resumable=("dataset",) if by_content else ())
    refused = [f"{flag} is {now!r} but the run in {output_dir} was started with {then!r}"
               for flag, now, then in defining]
    if by_content and meta["prompts_sha256"] != prompts_digest(train_prompts):
        refused.append(f"the training prompts of {args.dataset} are not those of the run in {output_dir}")
    if refused:
        raise UserError(f"--resume: {'; '.join(refused)}; "
                        f"{'it defines' if len(refused) == 1 else 'these define'} the run, so "
                        f"{'it' if len(refused) == 1 else 'they'} cannot change on resume")
    notes = [f"note: {flag} is {now!r}, not {then!r} as when {checkpoint.folder.name} was saved"
             for flag, now, then in others]
    return checkpoint, skipped, False, notes


def setup(args, rewards: list, shadows: tuple = (), reference_copy: bool = False,
          cfg_free: bool = False, roles: dict | None = None) -> Run:
    """Build everything a script needs before its first epoch, resuming when asked.

    rewards: the loaded rewards (`rewards.load_run_rewards(args)`; `common.scoring.Reward`s), which the script
    hands in so that `common` never imports `rewards/` (rewards build on common, not the other way round); the
    judges among them (`Reward.judge`, --judge) are scored at evaluation only and watched by the guard.
    shadows: names of frozen policies that trail the trained one (ShadowPolicy: a second LoRA adapter, or a copy
    when fully fine-tuning), made before `prepare` so DDP registers only the trained weights; a (name, role) pair
    trails a trained role's adapter instead.
    roles: name -> common.roles.RoleOptimizer: LoRA adapters trained beside the run's own, each with its optimizer
    (`run.roles`, common.roles; one process or DDP).
    reference_copy: the script compares with the reference policy; when fully fine-tuning that needs a frozen copy
    (with LoRA the reference is the same module with its adapters disabled, at no cost).
    cfg_free: the algorithm runs without classifier-free guidance, so true-CFG models sample at scale 1.
    """
    output_dir = Path(args.output_dir or f"runs/{args.exp_name}-{args.seed}")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with=args.track, project_dir=str(output_dir))
    configure_backend(accelerator, args.batch_size, args.max_grad_norm)
    rank, world = accelerator.process_index, accelerator.num_processes
    # The processes of a sequence-parallel group share their samples: the data is split over data-parallel ranks.
    if args.sequence_parallel > 1 and plan_owner(ADAPTERS[args.model].pipeline_class_name) is None:
        raise UserError(f"--sequence-parallel: {args.model}'s transformer has no sequence-parallel plan in diffusers; "
                        f"models with one: {', '.join(models_with_plans(ADAPTERS))}")
    if args.sequence_parallel > 1 and ADAPTERS[args.model].sequence_parallel_refusal:
        raise UserError(f"--sequence-parallel: {args.model} {ADAPTERS[args.model].sequence_parallel_refusal}")
    check_world(args.sequence_parallel, world)
    judges, rewards = [r for r in rewards if r.judge], [r for r in rewards if not r.judge]
    guard_mode = getattr(args, "guard", None) or "off"
    reference_copy = reference_copy or guard_mode == "rollback"  # a rollback may switch the KL on
    data = DataParallel(accelerator, args.sequence_parallel, device_mesh(accelerator, args.sequence_parallel))
    local = shard(args.prompts_per_epoch * args.group_size, data.process_index, data.num_processes)
    train_prompts, test_prompts = load_prompts(args.dataset, "train"), load_prompts(args.dataset, "test")
    check_conditions(train_prompts + test_prompts, *ADAPTERS[args.model].condition_images, args.model)
    check_video_rewards(rewards + judges, args.model, ADAPTERS[args.model].video)
    check_audio_rewards(rewards + judges, args.model, ADAPTERS[args.model].audio)
    if args.prompts_per_epoch > len(train_prompts):
        raise UserError(f"--prompts-per-epoch {args.prompts_per_epoch} exceeds the {len(train_prompts)} training "
                        f"prompts of {args.dataset}")
    true_cfg = ADAPTERS[args.model].true_cfg
    if cfg_free and true_cfg and args.guidance_scale is not None and args.guidance_scale > 1:
        raise UserError(f"{args.exp_name} is CFG-free: --guidance-scale {args.guidance_scale} would turn on true CFG "
                        f"for {args.model}; leave it unset (1.0)")
    if roles:
        check_roles(args, accelerator)
    _claim_output_dir(accelerator, output_dir)
    checkpoint, skipped, restart, notes = _find_resume(args, output_dir, rank, train_prompts)

    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, accelerator.device)
    model_path = resolve_model_path(args.model, args.model_path)
    # With a matching embedding cache the text encoders are never loaded.
    cache = find_cache(args.model, model_path, args.max_sequence_length, dtype,
                       cache_texts(train_prompts, test_prompts, true_cfg), args.cache_dir, not args.cache,
                       condition_inputs(args.model, args.resolution, args.condition_size, args.num_frames))
    adapter = load_adapter(args.model, model_path, accelerator.device, dtype, args.resolution,
                           args.max_sequence_length, load_text_encoders=cache is None, num_frames=args.num_frames,
                           condition_size=args.condition_size, train_experts=args.train_experts)
    adapter.check_condition_shapes(train_prompts + test_prompts)
    if args.attention_backend is not None:
        adapter.set_attention_backend(args.attention_backend)
    guidance = args.guidance_scale if args.guidance_scale is not None else (
        1.0 if cfg_free and true_cfg else adapter.default_guidance_scale)
    encode = PromptEncoder(adapter, cache)
    accelerator.print(f"prompt embeddings: {cache.folder if cache else 'encoded online'}")
    texts = sorted({p.prompt for p in train_prompts + test_prompts})
    truncated = adapter.count_truncated(texts)
    if truncated:
        accelerator.print(f"warning: {truncated} of {len(texts)} prompts are longer than --max-sequence-length "
                          f"{args.max_sequence_length} tokens and are truncated")

    # Full fine-tuning under FSDP2/DeepSpeed waits on the CPU until `prepare` (common.distributed.staging_device).
    transformer = adapter.transformer.to(staging_device(accelerator, args.full_finetune))
    init_folder = init_lora_folder(args.init_lora, args.model) if args.init_lora else None
    if init_folder is not None and args.merge_init_lora:  # the merged model is the base: the reference, the copies
        merge_init_lora(transformer, init_folder)
    frozen_copy = None
    if args.full_finetune:
        if reference_copy:  # a frozen copy is the only reference a full fine-tune has
            frozen_copy = copy.deepcopy(transformer).requires_grad_(False)
        for param in full_finetune_parameters(transformer, adapter.unused_modules(transformer)):
            param.requires_grad_(True)
    else:
        add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_target_modules,
                 adapter.unused_modules(transformer))
        if init_folder is not None and not args.merge_init_lora:
            load_init_lora(transformer, init_folder, args.lora_rank, args.lora_alpha)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = trainable_parameters(transformer)
    total_steps = args.epochs * args.updates_per_epoch
    trained_roles = {name: TrainedRole(adapter, transformer, name, spec, args.weight_decay, args.lr_schedule,
                                       args.lr_warmup_steps, total_steps) for name, spec in (roles or {}).items()}
    shadow_policies = {name: ShadowPolicy(adapter, transformer, name, args.full_finetune, source)
                       for name, source in (s if isinstance(s, tuple) else (s, "default") for s in shadows)}
    if data.degree > 1:  # after LoRA and the copies: peft replaces the layers its hooks sit on, deepcopy drops them
        for module in (transformer, frozen_copy, *(getattr(s, "module", None) for s in shadow_policies.values())):
            if module is not None:
                enable_sequence_parallel(module, data.mesh, data.degree, accelerator.device)
    lr = args.learning_rate or (1e-5 if args.full_finetune else 3e-4)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    scheduler = lr_scheduler(optimizer, args.lr_schedule, args.lr_warmup_steps, total_steps)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    adapter.transformer = transformer  # rollout and training run the same (wrapped) module
    unwrapped = accelerator.unwrap_model(transformer)
    # FSDP2 replaces the parameters by DTensor shards: read them again; place the frozen copy like the model.
    params = trainable(unwrapped)
    reference = ReferencePolicy(adapter, unwrapped, place_like(frozen_copy, unwrapped))
    ema = EMA(params, args.ema_decay, module=unwrapped) if args.ema else None

    run = Run(args, accelerator, adapter, transformer, unwrapped, params, optimizer, scheduler, reference,
              shadow_policies, ema, encode, rewards, train_prompts, test_prompts,
              adapter.sigmas(args.num_steps), guidance, output_dir, MetricsLog(output_dir, accelerator), local=local,
              data=data, judges=judges, roles=trained_roles)
    if guard_mode != "off":
        run.guard = Guard([j.name for j in judges], guard_mode, args.guard_patience, args.guard_margin)
    # Every transformer a script runs: the trained one, a frozen reference copy, the shadows' copies.
    run.flops.attach(unwrapped, reference.copy, *(getattr(s, "module", None) for s in shadow_policies.values()),
                     adapter=adapter)
    if accelerator.is_main_process:
        stale = clean_stale_writes(output_dir)
        if stale:
            print(f"removed unfinished checkpoint writes: {', '.join(stale)}")
        if restart:  # the new run's lines must not follow the old ones
            (output_dir / "metrics.jsonl").unlink()
            shutil.rmtree(output_dir / "eval", ignore_errors=True)
    if skipped:
        accelerator.print(f"skipped checkpoints that do not load completely: {'; '.join(skipped)}")
    if checkpoint is not None:
        _restore(run, checkpoint)
        accelerator.print(f"resumed from {checkpoint.folder} at epoch {run.start_epoch}")
        for note in notes:
            accelerator.print(note)
        saved_by = len(list(checkpoint.folder.glob("rng_*.pt")))
        if saved_by != accelerator.num_processes:  # allowed: draws depend on (seed, epoch), not on the processes
            accelerator.print(f"note: {checkpoint.folder.name} was saved by {saved_by} process"
                              f"{'es' if saved_by != 1 else ''} and resumes on "
                              f"{accelerator.num_processes}: prompts and noise are drawn as before, but the run is no "
                              f"longer bit-identical to one that kept {saved_by}")
    elif restart:
        accelerator.print(f"{output_dir} holds a run stopped before its first checkpoint: starting it again from "
                          f"scratch (its metrics.jsonl and eval/ are cleared)")
    elif args.resume:
        accelerator.print(f"no run in {output_dir} yet: starting from scratch")
    if args.track:
        accelerator.init_trackers(args.wandb_project, config={k: str(v) for k, v in vars(args).items()},
                                  init_kwargs={"wandb": {"name": f"{args.exp_name}-{args.seed}", "dir": str(output_dir)}})
    stop_after_epoch_on_signals()  # before this, nothing is trained: a signal ends the run at once
    return run


def _restore(run: Run, checkpoint) -> None:
    """Resume: the training state of `checkpoint`, the epoch after it, its script state and guard state; the
    metrics after it are dropped."""
    _load_state(run, checkpoint)
    run.start_epoch = checkpoint.meta["epoch"] + 1
    run.meta = checkpoint.meta
    run.metrics_log.truncate_after(checkpoint.meta["epoch"])
    if run.guard is not None and "guard" in checkpoint.meta:
        run.guard.load_state_dict(checkpoint.meta["guard"])
        if run.guard.kl_beta is not None:  # raised by a rollback before the run stopped
            run.args.kl_beta = run.guard.kl_beta
            run.accelerator.print(f"guard: --kl-beta is {run.guard.kl_beta}, as a rollback of this run set it")


def _load_state(run: Run, checkpoint) -> None:
    """Weights, optimizer, schedule, EMA, frozen policies, RNG and the optimizer-step count of `checkpoint`: what a
    resume restores, and a guard rollback too (common.guard)."""
    states = checkpoint.states
    if run.args.full_finetune:
        load_full_state_into(run.unwrapped, checkpoint.weights)
    else:
        load_lora_state_into(run.unwrapped, checkpoint.weights, str(checkpoint.folder))
    load_optimizer_state_dict(run.unwrapped, run.optimizer, states["optimizer"])
    run.scheduler.load_state_dict(states["scheduler"])
    if run.ema is not None:
        if "ema" not in states:
            raise UserError(f"--ema: {checkpoint.folder} was saved without an EMA")
        run.ema.load_state_dict(states["ema"])
    for name, shadow in run.shadows.items():
        shadow.load_state_dict(states[name])
    load_roles_state(run.roles, states, checkpoint.folder)
    restore_rng(checkpoint.rng)
    run.optimizer_steps = checkpoint.meta.get("optimizer_steps",
                                              (checkpoint.meta["epoch"] + 1) * run.args.updates_per_epoch)


def optimizer_step(run: Run, epoch: int) -> float:
    """Clip, check and apply the accumulated gradients; step the learning-rate schedule and the EMA. Returns the
    gradient norm before clipping. A non-finite norm stops the run before the weights change."""
    grad_norm = float(run.accelerator.clip_grad_norm_(run.params, run.args.max_grad_norm))
    apply_step(grad_norm, run.optimizer, run.scheduler, epoch)
    run.optimizer_steps += 1
    if run.ema is not None:
        run.ema.update()
    return grad_norm


def epoch_metrics(run: Run, epoch: int, all_raw: torch.Tensor, stats: dict, timings: dict) -> dict:
    """The metrics every script logs, in metrics.jsonl's key names: rewards (the epoch, all processes; with the named
    columns of rewards that return them, `reward_<name>_<column>_mean/_std`, from score_epoch), the mean of
    each list in `stats` over the micro-steps of all processes (a key no process filled is left out), the learning
    rate, counters and times."""
    accelerator, rewards = run.accelerator, run.rewards
    combined = all_raw @ torch.tensor([r.weight for r in rewards], dtype=torch.float64)
    device = run.device
    peak_memory = accelerator.reduce(torch.tensor(peak_memory_gb(device), device=device), "max")
    # One all-reduce of (sum, count) per key, on every process whatever it holds: a process whose micro-batches
    # were all padding has empty lists, and skipping its reduce would leave the others waiting in theirs.
    names = sorted(stats)
    totals = accelerator.reduce(torch.stack([
        torch.stack([torch.stack(stats[n]).double().sum(), torch.tensor(float(len(stats[n])), dtype=torch.float64)])
        if stats[n] else torch.zeros(2, dtype=torch.float64) for n in names]).to(device), "sum") if names else []
    means = {n: float(total[0] / total[1]) for n, total in zip(names, totals) if total[1] > 0}
    # Throughput of the epoch's transformer work (rollout and training, all processes) over its rollout and
    # training time; mfu against the peak of every process's accelerator.
    flops = float(accelerator.reduce(torch.tensor(float(run.flops.take()), dtype=torch.float64, device=device), "sum"))
    seconds = timings.get("rollout_time_s", 0.0) + timings.get("train_time_s", 0.0)
    tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
    peak = run.args.peak_tflops or default_peak_tflops(device)
    throughput = {"tflops": tflops, **({"mfu": tflops / (peak * accelerator.num_processes)} if peak else {})}
    return {
        "epoch": epoch,
        "reward_mean": float(combined.mean()),
        "reward_std": float(combined.std(correction=0)),
        **{f"reward_{r.name}_mean": float(all_raw[:, k].mean()) for k, r in enumerate(rewards)},
        **{f"reward_{r.name}_std": float(all_raw[:, k].std(correction=0)) for k, r in enumerate(rewards)},
        # Named columns of rewards that return them (score_epoch), e.g. reward_videoalign_motion_quality_mean.
        **{f"reward_{key}_{stat}": value for key, values in run.reward_columns.items()
           for stat, value in (("mean", float(values.nanmean())),
                               ("std", float(values[~values.isnan()].std(correction=0))))},
        **means,
        "lr": run.scheduler.get_last_lr()[0],
        "optimizer_steps": run.optimizer_steps,
        "samples_seen": (epoch + 1) * run.args.prompts_per_epoch * run.args.group_size,
        "num_processes": accelerator.num_processes,
        **timings,
        **throughput,
        "peak_memory_gb": float(peak_memory),
    }


@torch.no_grad()
def evaluate(run: Run, epoch: int) -> dict:
    """At every --eval-every epochs, after the last, and before the first update (epoch −1, `evaluate_base`): the
    first --eval-num-prompts test prompts × --eval-seeds fixed seeds (the same in every run) with the trained
    weights (their EMA with --ema), scored by `common.evaluation.evaluate_prompts` (the rewards' and judges' means,
    each check of a reward that reports checks, each with its standard error `_se`; at epoch −1 also each one's
    prompt gap); its captioned grid goes to OUTPUT_DIR/eval/ and the trackers. Then the guard (--guard) looks at
    the judges and acts (`_guard_acts`). evaluate.py runs the same code on a run's checkpoint."""
    args = run.args
    if not args.eval_every or (epoch >= 0 and not (epoch % args.eval_every == 0 or epoch == args.epochs - 1)):
        return {}
    run.transformer.eval()
    grid = run.output_dir / "eval" / (f"epoch_{epoch:06d}.png" if epoch >= 0 else "base.png")
    with run.ema.applied() if run.ema is not None else nullcontext(), run.flops.paused():
        metrics = evaluate_prompts(run.adapter, run.data, run.encode, run.rewards + run.judges,
                                   run.test_prompts[: args.eval_num_prompts], args.eval_seeds,
                                   args.eval_num_steps or args.num_steps, args.batch_size, run.guidance, grid,
                                   max(epoch, 0), prompt_gap=epoch < 0,
                                   hf_reference=load_hf_reference(args.eval_hf_reference))
    _guard_acts(run, epoch, metrics)
    return metrics


def _guard_acts(run: Run, epoch: int, metrics: dict) -> None:
    """The guard's rule on this evaluation (common.guard.Guard.observe), then its mode's action: warn prints; stop
    has `save` write this epoch's checkpoint and stop the run; rollback restores the checkpoint of the judge's best
    evaluation (the resume's `_load_state`), raises --kl-beta and goes on (after --guard-max-rollbacks: stop)."""
    guard, args = run.guard, run.args
    if guard is None:
        return
    events, new_best = guard.observe(epoch, metrics)
    acts = guard.mode in ("stop", "rollback")
    run.guard_save = acts and (new_best or bool(events))  # a judge's best checkpoint; the state after an event
    if not events:
        return
    for event in events:
        metrics[f"guard_hacking_{event.judge}"] = 1.0
    event = min(events, key=lambda e: e.best_epoch)  # several judges: back to the earliest best
    folder = run.output_dir / "checkpoints" / f"epoch_{event.best_epoch:06d}"
    if guard.mode == "warn":
        for e in events:
            guard.record(e, "warn")
            run.accelerator.print(f"guard: {e.line()} (--guard warn: going on)")
        return
    if guard.mode == "rollback" and guard.rollbacks < args.guard_max_rollbacks:
        try:
            checkpoint = read_checkpoint(folder, args.full_finetune, run.accelerator.process_index)
        except CheckpointError as err:
            raise RunStopped(f"guard: {event.line()}; cannot roll back to {folder} ({err})") from None
        _load_state(run, checkpoint)
        guard.rollbacks += 1
        guard.flag_kl_beta = args.kl_beta if guard.kl_beta is None else guard.flag_kl_beta
        guard.kl_beta = args.kl_beta = max(args.kl_beta * args.guard_kl_factor, args.guard_kl_floor)
        guard.record(event, "rollback")
        metrics.update(guard_rollbacks=float(guard.rollbacks), guard_kl_beta=args.kl_beta)
        run.accelerator.print(f"guard: {event.line()}; rolled back to {folder} (rollback {guard.rollbacks} of "
                              f"{args.guard_max_rollbacks}), --kl-beta now {args.kl_beta:g}")
        return
    guard.record(event, "stop")
    after = f" after {guard.rollbacks} rollbacks" if guard.mode == "rollback" else ""
    run.guard_stop = f"guard: {event.line()}; stopping{after}. The checkpoint of its best evaluation: {folder}"


def evaluate_base(run: Run) -> None:
    """The evaluation of the untrained model, logged as epoch −1 before any training line so that every table's
    base is the model before the first update (after it, a harmful first step would pass for the start). Scripts
    call it after their own checks, just before the epoch loop, so that bad flags stop a run before it spends an
    evaluation. A resumed run has it already. The global RNG is left as it was: the training is unchanged.
    It also measures each reward's and judge's prompt gap (one line for each whose gap is within noise), and with
    --guard stop or rollback writes the untrained state as the checkpoint of epoch −1, where a rollback may go."""
    if not run.args.eval_every or run.start_epoch > 0 or run.meta:  # run.meta: resumed (from epoch −1 too)
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        metrics = evaluate(run, -1)
    log_epoch(run, {"epoch": -1, **metrics}, ["epoch", "eval_reward_mean"])
    for line in prompt_gap_notes(metrics):
        run.accelerator.print(line)
    if run.guard_save:
        save(run, -1)


def log_epoch(run: Run, metrics: dict, show: list[str], bar=None) -> None:
    """Check that the losses, rewards and gradient norm are finite (else stop, before writing), then append the
    epoch to metrics.jsonl, send it to the trackers and print the `show` keys (and, beside eval_reward_mean, the
    held-out success rate `eval_<reward>_strict` of rewards that have one, e.g. the toy world's)."""
    check_finite(metrics)
    run.metrics_log.log(metrics)
    if run.accelerator.is_main_process:
        if "eval_reward_mean" in show:
            at = show.index("eval_reward_mean") + 1
            strict = [k for k in metrics if k.startswith("eval_") and k.endswith("_strict") and k not in show]
            show = show[:at] + [key for k in strict for key in (k, k + "_se")] + show[at:]
        line = format_metrics(metrics, show)
        bar.write(line) if bar is not None else print(line, flush=True)


def save(run: Run, epoch: int, meta: dict | None = None) -> None:
    """Checkpoint at every --save-every epochs and after the last: weights (LoRA file or `transformer/`), optimizer,
    learning-rate schedule, EMA, the frozen policies, RNG, and `meta` (script state restored as run.meta).
    After a SIGTERM or SIGINT to any process (common.cluster), every process stops here, after the epoch it was in:
    it checkpoints this epoch and exits with 128 + the signal's number (a signal during the last epoch changes
    nothing: the run ends as usual)."""
    args = run.args
    last = epoch == args.epochs - 1
    stop = 0 if last else requested_stop(run.accelerator)
    due = args.save_every and epoch >= 0 and (epoch + 1) % args.save_every == 0
    if not (stop or last or due or run.guard_save):
        return
    for p in run.params:
        if not torch.isfinite(p.detach()).all():
            raise RunStopped(f"epoch {epoch}: the trained weights are not finite; no checkpoint was written")
    states = {"optimizer": optimizer_state_dict(run.unwrapped, run.optimizer), "scheduler": run.scheduler.state_dict()}
    if run.ema is not None:
        states["ema"] = run.ema.state_dict()
    states.update({name: shadow.state_dict() for name, shadow in run.shadows.items()})
    states.update(roles_state(run.roles))

    def write_weights(folder, state):  # state: the full state dict, gathered by save_checkpoint
        if args.full_finetune:
            save_pretrained(run.unwrapped, os.path.join(folder, "transformer"), state)
        else:
            run.adapter.save_lora(folder, lora_state_dict(run.unwrapped, state))
            os.chmod(Path(folder) / LORA_FILE, 0o666 & ~_umask())  # safetensors writes 0600

    # `args`: every flag of the start that wrote it and the guidance it resolved to, so that evaluate.py scores
    # the checkpoint as this run evaluated it.
    flags = dict(vars(args))
    if run.guard is not None and run.guard.kl_beta is not None:  # the flag as given: a rollback's raise is guard state
        flags["kl_beta"] = run.guard.flag_kl_beta
    settings = json.loads(json.dumps(flags, default=str))
    info = {"run": run_defining_flags(Namespace(**flags)), "prompts_sha256": prompts_digest(run.train_prompts),
            "model": args.model, "full_finetune": args.full_finetune,
            "weights": "transformer" if args.full_finetune else LORA_FILE, "optimizer_steps": run.optimizer_steps,
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {**settings, "guidance": run.guidance},
            **({"guard": run.guard.state_dict()} if run.guard is not None else {}), **(meta or {})}
    # The checkpoints of the judges' best evaluations stay out of rotation: a rollback or a stop names them.
    pinned = {f"epoch_{e:06d}" for e in run.guard.best_epochs()} if run.guard is not None else set()
    save_checkpoint(run.accelerator, run.output_dir, epoch, write_weights, states, info, keep=args.keep_checkpoints,
                    model=run.unwrapped, pinned=pinned)
    run.guard_save = False
    if run.guard_stop:
        raise RunStopped(run.guard_stop)
    if stop:
        exit_stopped(run.accelerator, stop, epoch)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def finish(run: Run) -> None:
    """End the trackers and say where the outputs are."""
    run.accelerator.end_training()
    run.accelerator.print(f"outputs: {run.output_dir} (metrics.jsonl, eval/, checkpoints/)")


def start_scoring(run: Run, records: list, group_ids: torch.Tensor) -> RolloutScoring:
    """The epoch's scoring, before its rollout: the script hands it each micro-batch's decoded images in draw order
    (`.submit`), and --reward-workers threads score them while the next micro-batch is denoised (0: all of it in
    `score_epoch`, after the rollout). Either way the scores are the same, bit for bit (common.scoring)."""
    return RolloutScoring(run.rewards, [r.prompt for r in records], group_ids, [r.images for r in records],
                          run.data, run.args.reward_workers)


def score_epoch(run: Run, scoring: RolloutScoring | torch.Tensor, records: list | None = None,
                group_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of this process's samples (`start_scoring`'s, once the rollout is over; or a tensor of all its images
    with their records and group ids), gathered over all processes in draw order: (all raw scores (N, R), all group
    ids (N,)). Group statistics then see every sample of a group, whichever process drew it (each once: the
    gather is over the data-parallel ranks, common.parallel). Returns only once every
    score is in and no reward thread is left; a reward's failure is raised instead, before anything is trained."""
    if not isinstance(scoring, RolloutScoring):  # the images (or an AudioVideo) themselves
        images, scoring = scoring, start_scoring(run, records, group_ids)
        scoring.submit(images)
    raw = scoring.collect()
    # The rewards' named columns (e.g. VideoAlign's per dimension), gathered the same way for epoch_metrics to log.
    names = sorted(set().union(*run.data.gather_object([sorted(scoring.columns)]))) if run.data.num_processes > 1 \
        else sorted(scoring.columns)
    missing = torch.full((len(raw),), float("nan"), dtype=torch.float64)
    run.reward_columns = {name: run.data.gather(scoring.columns.get(name, missing).to(run.device)).cpu()
                          for name in names}
    return run.data.gather(raw.to(run.device)).cpu(), run.data.gather(scoring.group_ids.to(run.device)).cpu()
