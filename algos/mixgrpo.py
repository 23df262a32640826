# MixGRPO: Flow-GRPO's clipped objective on a sliding window of SDE steps, Euler ODE elsewhere; MixGRPO-Flash
# integrates the steps after the window with a compressed DPM-Solver++ 2M schedule.
# Paper: Li et al., "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", arXiv:2507.21802.
# Math: ../shared/docs/algorithms.md §4 "MixGRPO" (this repo's spec). Usage: README.md.
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Annotated

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from accelerate.utils import gather, gather_object
from tqdm import tqdm

from common.advantages import AGGREGATIONS, compute_advantages
from common.cache import PromptEncoder, cache_texts, find_cache
from common.checkpoint import (LORA_FILE, latest_checkpoint, load_full_weights_into, load_lora_into,
                               load_training_state, save_checkpoint)
from common.data import DEFAULT_DATASET, epoch_draw, load_prompts, sample_seeds, shard
from common.distributed import (configure_backend, load_optimizer_state_dict, lora_state_dict, micro_step,
                                optimizer_state_dict, place_like, save_pretrained, staging_device, trainable)
from common.dynamics import DYNAMICS, sde_kl, sde_step
from common.models import ADAPTERS, load_adapter, resolve_model_path
from common.sampling import rollout, sample_generators
from common.tracking import MetricsLog, format_metrics, save_image_grid
from common.training import EMA, adapters_disabled, add_lora, trainable_parameters
from common.utils import (UserError, avoid_cudnn_attention, install_user_error_hook, peak_memory_gb,
                          quiet_libraries, resolve_dtype)
from rewards import load_rewards, score_samples

WINDOW_SCHEDULES = ("progressive", "random", "decay", "exp_decay")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    preset: str = "none"
    """a named set of defaults (see PRESETS below); flags given on the command line override it"""
    seed: int = 1
    """seed of the experiment (prompt draws, rollout noise, LoRA init, random windows)"""
    track: bool = False
    """log to Weights & Biases through accelerate"""
    wandb_project: str = "flow-rl"
    """the wandb project name"""
    output_dir: str | None = None
    """where metrics.jsonl, eval grids and checkpoints go (default: runs/{exp_name}-{seed})"""
    resume: bool = False
    """continue from the latest checkpoint in --output-dir, window schedule included (fresh when there is none)"""

    # Model
    model: str = "flux1"
    """model family; one of common.models.ADAPTERS"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` builds an offline tiny one (default: the published model)"""
    dtype: str = "auto"
    """weights dtype: auto (bf16 on GPU, float32 on CPU), float32, bfloat16, float16; step math is float32"""
    resolution: int = 512
    """image height and width"""
    max_sequence_length: int = 512
    """T5 prompt length in tokens"""
    num_frames: int | None = None
    """frames of a video model (wan: 4k + 1, default 33); leave unset for image models"""
    guidance_scale: float | None = None
    """guidance: FLUX.1's embedding input, the true CFG scale of the others (default: the model's reference value)"""
    cache_dir: str | None = None
    """embedding cache root built by preprocess.py (default: $FLOWRL_CACHE/embeddings, used when it matches)"""
    no_cache: bool = False
    """encode prompts online with the text encoders even when a matching cache exists"""

    # Data and reward
    dataset: str = DEFAULT_DATASET
    """folder with train/test .jsonl (field `prompt`) or .txt files"""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a reward as NAME[:WEIGHT][,KEY=VALUE...] or MODULE:ATTR[:WEIGHT]; repeat the flag for several
    (default: jpeg_compressibility)"""
    advantage_aggregation: str = "sum"
    """how several rewards combine into one advantage: sum or gdpo"""
    global_std: bool = True
    """normalise advantages by the std over the whole epoch instead of the group's own"""
    adv_clip_max: float = 5.0
    """advantages are clamped to ±this"""

    # Algorithm specific arguments
    epochs: int = 300
    """number of epochs (one epoch = rollout of M·K samples + updates_per_epoch optimizer steps)"""
    prompts_per_epoch: int = 48
    """M: prompts drawn per epoch"""
    group_size: int = 16
    """K: samples per prompt (one group)"""
    batch_size: int = 8
    """per-process micro-batch, the same for rollout and training (so the first ratio is exactly 1)"""
    updates_per_epoch: int = 2
    """optimizer steps per epoch; gradients accumulate over samples × window steps in between"""
    num_steps: int = 25
    """S: sampling steps of a rollout (steps 0..S−3 can be in the window; the last two never are)"""
    dynamics: str = "flow-sde"
    """stochastic step inside the window: flow-sde, dance-sde or cps"""
    noise_level: float = 0.7
    """η of the SDE inside the window"""
    window_size: int = 4
    """W: consecutive SDE (and trained) steps; it shrinks where it would reach step S−2"""
    window_schedule: str = "progressive"
    """where the window starts each epoch: progressive, random, decay or exp_decay"""
    iters_per_window: int | None = None
    """τ: epochs the window stays at one start (progressive; exp_decay's base) (default 25, 20 with --flash)"""
    window_stride: int = 1
    """how many steps the window moves when it moves (progressive, decay, exp_decay)"""
    same_group_noise: bool = True
    """the K samples of a group start from one noise (the reference's --init_same_noise): before the window
    all steps are ODE, so rewards in a group then differ only through the window's SDE noise"""
    flash: bool = False
    """MixGRPO-Flash: after the window, a compressed schedule integrated with DPM-Solver++ 2M"""
    flash_compress_ratio: float = 0.4
    """Flash: the steps after the window shrink to max(⌊(S − L)·ratio⌋, 2) σ points (L: last window step)"""
    learning_rate: float | None = None
    """AdamW learning rate (default 3e-4 for LoRA, 1e-5 for full fine-tuning)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    lora_rank: int = 64
    """LoRA rank"""
    lora_alpha: float = 128
    """LoRA alpha"""
    full_finetune: bool = False
    """train all transformer weights instead of a LoRA (the paper's setting)"""
    clip_range: float = 1e-4
    """PPO clip ε on the ratio. Tiny because log-probs are means over elements"""
    kl_beta: float = 0.0
    """weight of the KL to the reference model (the paper uses 0)"""
    ema: bool = False
    """keep an EMA of the trained weights and evaluate with it"""
    ema_decay: float = 0.9
    """EMA decay per optimizer step"""

    # Memory
    gradient_checkpointing: bool = False
    """recompute transformer block activations in the backward pass (less memory, ~30% more time)"""
    offload_trajectories: bool = False
    """keep stored rollout steps on the CPU between rollout and training"""
    reward_device: str = "accelerator"
    """where reward models run: accelerator or cpu"""

    # Evaluation and checkpoints
    eval_every: int = 10
    """evaluate with the Euler ODE on the test prompts every N epochs (0: never)"""
    eval_num_prompts: int = 16
    """number of test prompts evaluated (at fixed seeds)"""
    eval_num_steps: int | None = None
    """ODE steps for evaluation (default: num_steps)"""
    save_every: int = 10
    """checkpoint every N epochs and at the end (0: only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""


PRESETS = {
    "none": {},
    # The embedded tiny FLUX.1 on a CPU. Like grpo.py's `tiny`, it needs a ~100x larger clip range and LoRA
    # lr than the paper to move a ~80k-parameter model. 12 steps: the window (4) sweeps steps 0..9 once in
    # 100 epochs, and Flash replaces the 8 steps after a window at 0 by 2 solver steps.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=150, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=2, num_steps=12, noise_level=0.8,
                 iters_per_window=10, learning_rate=3e-2, lora_rank=8, lora_alpha=8, clip_range=1e-2,
                 global_std=False, eval_every=50, eval_num_prompts=8, save_every=50),
    # The paper's FLUX.1-dev setting (scripts/finetune/finetune_flux_grpo_MixGRPO.sh): full fine-tuning at
    # lr 1e-5, 720px, 25 steps, flow-sde η 0.7, window 4 moving by 1 every 25 iterations, 12 samples per
    # prompt, one prompt per GPU on 32 GPUs, 4 optimizer steps per iteration, clip 1e-4, no KL, 300
    # iterations. The reward (HPS/ImageReward/...) is chosen with --reward.
    "flux1-mixgrpo": dict(resolution=720, num_steps=25, noise_level=0.7, window_size=4, iters_per_window=25,
                          full_finetune=True, learning_rate=1e-5, clip_range=1e-4, prompts_per_epoch=32,
                          group_size=12, batch_size=1, updates_per_epoch=4, global_std=False, epochs=300,
                          eval_every=25, save_every=25),
    # MixGRPO-Flash: the same with the compressed DPM-Solver++ tail and 20 iterations per window position.
    "flux1-mixgrpo-flash": dict(resolution=720, num_steps=25, noise_level=0.7, window_size=4, iters_per_window=20,
                                flash=True, full_finetune=True, learning_rate=1e-5, clip_range=1e-4,
                                prompts_per_epoch=32, group_size=12, batch_size=1, updates_per_epoch=4,
                                global_std=False, epochs=300, eval_every=25, save_every=25),
}


def parse_args() -> Args:
    """tyro CLI whose defaults come from --preset NAME (so explicit flags override the preset)."""
    import sys

    argv = sys.argv[1:]
    name = "none"
    for i, token in enumerate(argv):
        if token == "--preset" and i + 1 < len(argv):
            name = argv[i + 1]
        elif token.startswith("--preset="):
            name = token.split("=", 1)[1]
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return tyro.cli(Args, default=replace(Args(), preset=name, **PRESETS[name]), args=argv)


def window_dwell(schedule: str, start: int, num_steps: int, iters_per_window: int) -> int:
    """τ(t): how many epochs the window stays at start t."""
    if schedule == "decay":
        # ⌊10·(1 − t/(S − 2)) + 1·t/(S − 2)⌋ (from 10 epochs at t = 0 to 1 at the end), in exact integers
        return max(1, (10 * (num_steps - 2) - 9 * start) // (num_steps - 2))
    if schedule == "exp_decay":
        return math.ceil(iters_per_window * math.exp(-0.1 * max(start - 13, 0)))
    return iters_per_window


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


if __name__ == "__main__":
    install_user_error_hook()
    quiet_libraries()
    avoid_cudnn_attention()
    args = parse_args()

    # ---- validate the flags before anything is loaded or written -----------------------------------
    if args.model not in ADAPTERS:
        raise UserError(f"unknown model {args.model!r}; choose one of: {', '.join(ADAPTERS)}")
    if args.dynamics == "ode":
        raise UserError("--dynamics ode cannot be used with MixGRPO: the window steps need a log-prob, which the "
                        "deterministic ODE step lacks; choose one of flow-sde, dance-sde, cps")
    if args.dynamics not in DYNAMICS:
        raise UserError(f"unknown dynamics {args.dynamics!r}; choose one of: {', '.join(DYNAMICS[1:])}")
    if args.advantage_aggregation not in AGGREGATIONS:
        raise UserError(f"unknown --advantage-aggregation {args.advantage_aggregation!r}; "
                        f"choose one of: {', '.join(AGGREGATIONS)}")
    if args.window_schedule not in WINDOW_SCHEDULES:
        raise UserError(f"unknown --window-schedule {args.window_schedule!r}; "
                        f"choose one of: {', '.join(WINDOW_SCHEDULES)}")
    if args.num_steps < 3:
        raise UserError("--num-steps must be at least 3 (the last two steps are never in the window)")
    if not 1 <= args.window_size <= args.num_steps - 2:
        raise UserError(f"--window-size must be in [1, {args.num_steps - 2}] (num_steps − 2) for {args.num_steps} steps")
    iters_per_window = args.iters_per_window or (20 if args.flash else 25)
    if iters_per_window < 1 or args.window_stride < 1:
        raise UserError("--iters-per-window and --window-stride must be at least 1")
    if not 0.0 < args.flash_compress_ratio <= 1.0:
        raise UserError("--flash-compress-ratio must be in (0, 1]")
    lr = args.learning_rate or (1e-5 if args.full_finetune else 3e-4)
    clip_range = args.clip_range
    output_dir = args.output_dir or f"runs/{args.exp_name}-{args.seed}"

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with="wandb" if args.track else None)
    configure_backend(accelerator, args.batch_size, args.max_grad_norm)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    samples_per_epoch = args.prompts_per_epoch * args.group_size
    local = shard(samples_per_epoch, rank, world)
    local_count = local.stop - local.start
    if local_count % args.batch_size:
        raise UserError(f"{local_count} samples per process per epoch (M·K / processes) are not a multiple of "
                        f"--batch-size {args.batch_size}")
    num_batches = local_count // args.batch_size
    if num_batches % args.updates_per_epoch:
        raise UserError(f"{num_batches} micro-batches per process do not split into "
                        f"--updates-per-epoch {args.updates_per_epoch} equal updates")
    train_prompts, test_prompts = load_prompts(args.dataset, "train"), load_prompts(args.dataset, "test")
    if args.reward_device not in ("accelerator", "cpu"):
        raise UserError(f"unknown --reward-device {args.reward_device!r}; choose one of: accelerator, cpu")
    rewards = load_rewards(args.reward or ["jpeg_compressibility"], device if args.reward_device == "accelerator"
                           else torch.device("cpu"))
    if not args.resume and os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        raise UserError(f"{output_dir} already holds a run: pass --resume to continue it or choose another "
                        f"--output-dir")

    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, device)
    model_path = resolve_model_path(args.model, args.model_path)
    # With a matching embedding cache the text encoders are never loaded.
    cache = find_cache(args.model, model_path, args.max_sequence_length, dtype,
                       cache_texts(train_prompts, test_prompts, ADAPTERS[args.model].true_cfg),
                       args.cache_dir, args.no_cache)
    adapter = load_adapter(args.model, model_path, device, dtype, args.resolution, args.max_sequence_length,
                           load_text_encoders=cache is None, num_frames=args.num_frames)
    guidance = args.guidance_scale if args.guidance_scale is not None else adapter.default_guidance_scale
    encode = PromptEncoder(adapter, cache)
    accelerator.print(f"prompt embeddings: {cache.folder if cache else 'encoded online'}")
    # (full fine-tuning under FSDP2/DeepSpeed: on the CPU until `prepare`, see staging_device)
    transformer = adapter.transformer.to(staging_device(accelerator, args.full_finetune))
    reference = None
    if args.full_finetune:
        if args.kl_beta > 0:  # a frozen copy is the only reference a full fine-tune has
            import copy
            reference = copy.deepcopy(transformer).requires_grad_(False)
        transformer.requires_grad_(True)
    else:
        add_lora(transformer, args.lora_rank, args.lora_alpha, adapter.lora_target_modules)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = trainable_parameters(transformer)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    adapter.transformer = transformer  # rollout and training run the same (wrapped) module
    unwrapped = accelerator.unwrap_model(transformer)
    # FSDP2 (configs/fsdp2*.yaml) replaces the parameters by DTensor shards: read them again, and shard a
    # frozen full-fine-tune reference the same way (or bring it to the GPU after staging on the CPU).
    params = trainable(unwrapped)
    reference = place_like(reference, unwrapped)
    ema = EMA(params, args.ema_decay, module=unwrapped) if args.ema else None

    os.makedirs(output_dir, exist_ok=True)
    metrics_log = MetricsLog(output_dir, accelerator)
    start_epoch = 0
    window = {"start": 0, "epochs_at_start": 0}  # the schedule's state, saved with each checkpoint
    checkpoint = latest_checkpoint(output_dir) if args.resume else None
    if checkpoint is not None:
        states, meta = load_training_state(checkpoint, rank)
        (load_full_weights_into if args.full_finetune else load_lora_into)(unwrapped, checkpoint)
        load_optimizer_state_dict(unwrapped, optimizer, states["optimizer"])
        if ema is not None:
            ema.load_state_dict(states["ema"])
        window = meta["window"]
        start_epoch = meta["epoch"] + 1
        metrics_log.truncate_after(meta["epoch"])
        accelerator.print(f"resumed from {checkpoint} at epoch {start_epoch}, window start {window['start']}")
    elif args.resume:
        accelerator.print(f"no checkpoint in {output_dir}: starting from scratch")
    if args.track:
        accelerator.init_trackers(args.wandb_project, config={k: str(v) for k, v in vars(args).items()},
                                  init_kwargs={"wandb": {"name": f"{args.exp_name}-{args.seed}"}})

    sigmas = adapter.sigmas(args.num_steps)

    def write_weights(folder, state):  # state: the full state dict, gathered by save_checkpoint
        if args.full_finetune:
            save_pretrained(unwrapped, os.path.join(folder, "transformer"), state)
        else:
            adapter.save_lora(folder, lora_state_dict(unwrapped, state))

    def evaluate(epoch: int) -> dict:
        """ODE samples of the test prompts at fixed seeds (the same for every run): reward mean and a grid."""
        prompts = test_prompts[: args.eval_num_prompts]
        eval_sigmas = adapter.sigmas(args.eval_num_steps or args.num_steps)
        pointwise = [r for r in rewards if not r.groupwise]
        scores, images = [], []
        with accelerator.split_between_processes(list(range(len(prompts)))) as mine:
            for start in range(0, len(mine), args.batch_size):
                ids = mine[start:start + args.batch_size]
                cond = encode([prompts[i] for i in ids])
                traj = rollout(adapter, cond, eval_sigmas, sample_generators(ids, device), "ode", 0.0, [], [],
                               guidance)
                batch_images = adapter.decode(traj.final_latents)
                raw = score_samples(pointwise, batch_images, [prompts[i].prompt for i in ids],
                                    torch.tensor([prompts[i].key for i in ids]))
                scores += list(zip(ids, raw.tolist()))
                images += list(zip(ids, batch_images.cpu()))
        scores = sorted(gather_object(scores))
        images = sorted(gather_object(images), key=lambda item: item[0])
        raw = torch.tensor([s for _, s in scores], dtype=torch.float64)
        weights = torch.tensor([r.weight for r in pointwise], dtype=torch.float64)
        out = {"eval_reward_mean": float((raw @ weights).mean())}
        out.update({f"eval_reward_{r.name}": float(raw[:, k].mean()) for k, r in enumerate(pointwise)})
        if accelerator.is_main_process:
            save_image_grid(torch.stack([img for _, img in images]), os.path.join(output_dir, "eval", f"epoch_{epoch:06d}.png"))
        return out

    bar = tqdm(range(start_epoch, args.epochs), disable=not accelerator.is_main_process, desc="mixgrpo")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. the epoch's window and schedule ----------------------------------------------------
        if args.window_schedule == "random":
            window_start = random_window_start(args.seed, epoch, args.num_steps, args.window_size)
        else:
            window_start = window["start"]
        train_steps = window_steps(window_start, args.num_steps, args.window_size)
        # Flash: the steps after the window (L = its last step) run on a compressed schedule with DPM-Solver++.
        epoch_sigmas = (flash_sigmas(adapter, sigmas, train_steps[-1], args.flash_compress_ratio)
                        if args.flash else sigmas)
        solver_from = train_steps[-1] + 1 if args.flash else None

        # ---- 2. rollout: SDE inside the window, ODE elsewhere; M prompts × K samples over processes --
        draw = epoch_draw(len(train_prompts), args.prompts_per_epoch, args.group_size, args.seed, epoch)
        seeds = sample_seeds(args.seed, epoch, samples_per_epoch)[local]
        records = [train_prompts[i] for i in draw[local]]
        group_ids = torch.tensor([r.key for r in records])
        # one initial-noise seed per group, from (seed, epoch, group key): the same on any number of processes
        noise_seeds = [int(np.random.default_rng([args.seed, epoch, r.key, 0x6E0]).integers(2**62)) for r in records]
        cond_all = encode(records)
        transformer.eval()
        trajectories, images = [], []
        for b in range(num_batches):
            mb = slice(b * args.batch_size, (b + 1) * args.batch_size)
            cond = {k: v[mb] for k, v in cond_all.items()}
            noise = adapter.noise(sample_generators(noise_seeds[mb], device)) if args.same_group_noise else None
            traj = rollout(adapter, cond, epoch_sigmas, sample_generators(seeds[mb], device), args.dynamics,
                           args.noise_level, train_steps, train_steps, guidance, solver_from=solver_from,
                           initial_noise=noise, store_device="cpu" if args.offload_trajectories else None)
            trajectories.append(traj)
            images.append(adapter.decode(traj.final_latents).cpu())
        rollout_time = time.time() - epoch_start

        # ---- 3. rewards and advantages over the whole epoch (all processes) -------------------------
        reward_start = time.time()
        raw = score_samples(rewards, torch.cat(images), [r.prompt for r in records], group_ids, accelerator)
        all_raw = gather(raw.to(device)).cpu()
        all_ids = gather(group_ids.to(device)).cpu()
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        advantages = advantages[local].float().to(device)
        combined = all_raw @ torch.tensor([r.weight for r in rewards], dtype=torch.float64)
        reward_time = time.time() - reward_start

        # ---- 4. policy update: clipped surrogate on the window steps only ----------------------------
        train_start = time.time()
        transformer.train()
        batches_per_update = num_batches // args.updates_per_epoch
        num_train_steps = len(train_steps)
        stats = {"loss": [], "policy_loss": [], "kl": [], "approx_kl": [], "clipfrac": [], "ratio_mean": []}
        ratio_dev_first = torch.zeros((), device=device)
        for update in range(args.updates_per_epoch):
            for k in range(batches_per_update):
                b = update * batches_per_update + k
                mb = slice(b * args.batch_size, (b + 1) * args.batch_size)
                traj, cond, adv = trajectories[b], {key: v[mb] for key, v in cond_all.items()}, advantages[mb]
                for i, j in enumerate(train_steps):
                    last = k == batches_per_update - 1 and i == num_train_steps - 1
                    with micro_step(accelerator, transformer, last):
                        x, x_next = traj.latents[:, i].to(device), traj.next_latents[:, i].to(device)
                        log_prob_old = traj.log_probs[:, i].to(device)
                        v = adapter.velocity(x, sigmas[j], cond, guidance)
                        _, log_prob, mean, std = sde_step(args.dynamics, v, x, sigmas[j], sigmas[j + 1],
                                                          args.noise_level, prev_sample=x_next)
                        # Flow-GRPO's clipped ratio objective, averaged over the window steps only.
                        ratio = torch.exp(log_prob - log_prob_old)
                        unclipped = -adv * ratio
                        clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
                        policy_loss = torch.maximum(unclipped, clipped).mean()
                        loss = policy_loss
                        if args.kl_beta > 0:
                            # KL to the reference as Flow-GRPO's code computes it (sde_kl, algorithms.md §4).
                            with torch.no_grad():
                                if reference is not None:
                                    adapter.transformer = reference
                                    v_ref = adapter.velocity(x, sigmas[j], cond, guidance)
                                    adapter.transformer = transformer
                                else:
                                    with adapters_disabled(unwrapped):
                                        v_ref = adapter.velocity(x, sigmas[j], cond, guidance)
                                _, _, mean_ref, _ = sde_step(args.dynamics, v_ref, x, sigmas[j], sigmas[j + 1],
                                                             args.noise_level, prev_sample=x_next)
                            kl = sde_kl(args.dynamics, mean, mean_ref, std, sigmas[j], sigmas[j + 1]).mean()
                            loss = loss + args.kl_beta * kl
                            stats["kl"].append(kl.detach())
                        accelerator.backward(loss / (batches_per_update * num_train_steps))
                    with torch.no_grad():
                        if update == 0:  # invariant: θ = θ_old before the first optimizer step
                            ratio_dev_first = torch.maximum(ratio_dev_first, (ratio - 1).abs().max())
                        stats["loss"].append(loss.detach())
                        stats["policy_loss"].append(policy_loss.detach())
                        stats["approx_kl"].append(0.5 * ((log_prob - log_prob_old) ** 2).mean())
                        stats["clipfrac"].append(((ratio - 1).abs() > clip_range).float().mean())
                        stats["ratio_mean"].append(ratio.mean())
            accelerator.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update()
        train_time = time.time() - train_start
        window = advance_window(window, args.window_schedule, args.num_steps, iters_per_window, args.window_stride)

        # ---- 5. log, evaluate, checkpoint ----------------------------------------------------------
        metrics = {
            "epoch": epoch,
            "reward_mean": float(combined.mean()),
            "reward_std": float(combined.std(correction=0)),
            **{f"reward_{r.name}_mean": float(all_raw[:, k].mean()) for k, r in enumerate(rewards)},
            **{f"reward_{r.name}_std": float(all_raw[:, k].std(correction=0)) for k, r in enumerate(rewards)},
            **{name: float(accelerator.reduce(torch.stack(vals).mean(), "mean")) for name, vals in stats.items() if vals},
            "ratio_dev_first": float(accelerator.reduce(ratio_dev_first, "max")),
            "zero_std_frac": adv_stats["zero_std_frac"],
            "adv_abs_mean": float(advantages.abs().mean()),
            "window_start": window_start,
            "window_len": num_train_steps,
            "nfe": len(epoch_sigmas) - 1,  # transformer calls per rollout sample
            "lr": lr,
            "samples_seen": (epoch + 1) * samples_per_epoch,
            "num_processes": world,
            "rollout_time_s": rollout_time,
            "reward_time_s": reward_time,
            "train_time_s": train_time,
            "peak_memory_gb": float(accelerator.reduce(torch.tensor(peak_memory_gb(device), device=device), "max")),
        }
        last_epoch = epoch == args.epochs - 1
        if args.eval_every and (epoch % args.eval_every == 0 or last_epoch):
            transformer.eval()
            with ema.applied() if ema is not None else nullcontext():
                metrics.update(evaluate(epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        metrics_log.log(metrics)
        if accelerator.is_main_process:
            bar.write(format_metrics(metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "window_start",
                                               "loss", "clipfrac", "approx_kl", "epoch_time_s"]))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if last_epoch or (args.save_every and (epoch + 1) % args.save_every == 0):
            states = {"optimizer": optimizer_state_dict(unwrapped, optimizer)}
            if ema is not None:
                states["ema"] = ema.state_dict()
            save_checkpoint(accelerator, output_dir, epoch, write_weights, states,
                            {"model": args.model, "full_finetune": args.full_finetune,
                             "weights": "transformer" if args.full_finetune else LORA_FILE, "window": window},
                            keep=args.keep_checkpoints, model=unwrapped)
    accelerator.end_training()
