# Advantage Weighted Matching (AWM): the pretraining flow-matching loss on clean rollout samples, weighted by
# the advantage, inside a PPO-style clipped objective; the per-step Gaussian likelihood of Flow-GRPO is replaced
# by the (negated, weighted) matching loss, so any sampler works and only x0 is kept.
# Paper: Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models",
# arXiv:2509.25050. Math: ../shared/docs/algorithms.md §5 (this repo's spec). Usage: README.md.
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Annotated

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
from common.dynamics import DYNAMICS
from common.models import ADAPTERS, load_adapter, resolve_model_path
from common.sampling import rollout, sample_generators
from common.shadow import ShadowPolicy
from common.timesampling import (TIME_SAMPLINGS, check_time_sampling, sample_train_noise, sample_train_sigmas,
                                 training_generators, training_seeds)
from common.tracking import MetricsLog, format_metrics, save_image_grid
from common.training import adapters_disabled, add_lora, trainable_parameters
from common.utils import (UserError, avoid_cudnn_attention, install_user_error_hook, peak_memory_gb,
                          quiet_libraries, resolve_dtype)
from rewards import load_rewards, score_samples

SAMPLERS = DYNAMICS + ("dpm",)  # the step dynamics, or the deterministic multistep solver
WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
COLLAPSE_WARNING = ("turning off BOTH the EMA-KL term (--ema-kl-beta 0) and the PPO clip (--clip-range inf) "
                    "tends to collapse training (Flow-Factory's warning)")


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    preset: str = "none"
    """a named set of defaults (see PRESETS below); flags given on the command line override it"""
    seed: int = 1
    """seed of the experiment (prompt draws, rollout and training noise, LoRA init)"""
    track: bool = False
    """log to Weights & Biases through accelerate"""
    wandb_project: str = "flow-rl"
    """the wandb project name"""
    output_dir: str | None = None
    """where metrics.jsonl, eval grids and checkpoints go (default: runs/{exp_name}-{seed})"""
    resume: bool = False
    """continue from the latest checkpoint in --output-dir (starts fresh when there is none)"""

    # Model
    model: str = "flux1"
    """model family; one of common.models.ADAPTERS"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` builds an offline tiny one (default: the published model)"""
    dtype: str = "auto"
    """weights dtype: auto (bf16 on GPU, float32 on CPU), float32, bfloat16, float16; loss math is float32/64"""
    resolution: int = 512
    """image height and width"""
    max_sequence_length: int = 512
    """T5 prompt length in tokens"""
    num_frames: int | None = None
    """frames of a video model (wan: 4k + 1, default 33); leave unset for image models"""
    guidance_scale: float | None = None
    """guidance-distilled models (FLUX.1-dev): the guidance embedding, 3.5 by default, the same in rollout and
    training; true-CFG models (SD3.5, Qwen-Image, Wan) run CFG-free (1.0), as AWM is CFG-free"""
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
    """normalise advantages by the std over the whole epoch instead of the group's own (the references' default)"""
    adv_clip_max: float = 5.0
    """advantages are clamped to ±this, then divided by it (so the loss sees A ∈ [−1, 1])"""

    # Algorithm specific arguments
    epochs: int = 300
    """number of epochs (one epoch = rollout of M·K samples + updates_per_epoch optimizer steps)"""
    prompts_per_epoch: int = 48
    """M: prompts drawn per epoch"""
    group_size: int = 24
    """K: samples per prompt (one group)"""
    batch_size: int = 8
    """per-process micro-batch for rollout and training"""
    updates_per_epoch: int = 1
    """optimizer steps per epoch; gradients accumulate over samples × trained timesteps in between"""
    num_steps: int = 14
    """sampling steps of a rollout"""
    dynamics: str = "ode"
    """rollout sampler: ode (deterministic Euler), dpm (deterministic DPM-Solver++ 2M), flow-sde, dance-sde or cps;
    only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout (unused by ode)"""
    time_sampling: str = "discrete"
    """training σ's per sample: discrete (PickScore), discrete_wo_init (GenEval, OCR), uniform, logit_normal"""
    train_timesteps: int = 6
    """T: σ's trained per sample"""
    timestep_range: tuple[float, float] = (0.0, 0.9)
    """(f_lo, f_hi) fractions along the denoising axis: train on σ ∈ [1 − f_hi, 1 − f_lo] (the noisiest 90%)"""
    time_shift: float = 3.0
    """shift s of the continuous strategies: σ = s·u/(1 + (s − 1)·u)"""
    weighting: str = "ghuber"
    """log-prob = −w(ℓ, σ) of the matching loss ℓ: uniform ℓ, t σℓ, t2 σ²ℓ, huber σ(√ℓ − ·), ghuber (σ/p)(ℓ^p − ·)"""
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
    learning_rate: float | None = None
    """AdamW learning rate (default 3e-4 for LoRA, 1e-5 for full fine-tuning)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    lora_rank: int = 32
    """LoRA rank"""
    lora_alpha: float = 64
    """LoRA alpha"""
    full_finetune: bool = False
    """train all transformer weights instead of a LoRA (the EMA and the reference become frozen copies)"""

    # Memory
    gradient_checkpointing: bool = False
    """recompute transformer block activations in the backward pass (less memory, ~30% more time)"""
    reward_device: str = "accelerator"
    """where reward models run: accelerator or cpu"""

    # Evaluation and checkpoints
    eval_every: int = 10
    """evaluate the trained policy θ with the ODE on the test prompts every N epochs (0: never)"""
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
    # The embedded tiny FLUX.1 on a CPU: a ~80k-parameter model needs ~100x the papers' lr (environment.md).
    # 6 rollout steps, 5 trained σ's and no KL to the reference keep an epoch at ~0.3 s; the JPEG reward rises
    # by 0.4-1.0 kB within 50 epochs for seeds 1-5.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, num_steps=6, train_timesteps=5, learning_rate=5e-2, lora_rank=8,
                 lora_alpha=8, kl_beta=0.0, global_std=False, eval_every=25, eval_num_prompts=8, save_every=25),
    # AWM's PickScore setting (deterministic rollouts, `discrete` σ's over the noisiest 90%, KL 1e-4) on
    # FLUX.1-dev; the paper's LoRA r32/α64, 14 rollout steps, 6 trained σ. Pass --reward pickscore.
    "flux1": dict(resolution=512, num_steps=14, eval_num_steps=28, train_timesteps=6, time_sampling="discrete",
                  timestep_range=(0.0, 0.9), group_size=24, prompts_per_epoch=48, batch_size=8, learning_rate=3e-4,
                  lora_rank=32, lora_alpha=64, kl_beta=1e-4, ema_kl_beta=1.0, clip_range=1.0, epochs=1000,
                  eval_every=20, save_every=20),
    # GenEval/OCR: never train at σ = 1, stronger KL (1e-3 GenEval; pass --kl-beta 3e-3 for OCR). The reference
    # rolls out with a stochastic SA-Solver (stochasticity 0.4 on σ ∈ [0.3, 0.9]), which is not implemented
    # here: the rollout stays the Euler ODE (pass --dynamics flow-sde for a stochastic one).
    "flux1-geneval": dict(resolution=512, num_steps=14, eval_num_steps=28, train_timesteps=6,
                          time_sampling="discrete_wo_init", timestep_range=(0.0, 0.9),
                          group_size=24, prompts_per_epoch=48, batch_size=8, learning_rate=3e-4,
                          lora_rank=32, lora_alpha=64, kl_beta=1e-3, ema_kl_beta=1.0, clip_range=1.0, epochs=1000,
                          eval_every=20, save_every=20),
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
    description = f"Advantage Weighted Matching (arXiv:2509.25050). Note: {COLLAPSE_WARNING}."
    return tyro.cli(Args, default=replace(Args(), preset=name, **PRESETS[name]), args=argv, description=description)


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
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    return -weighted


def clipped_policy_loss(log_prob, log_prob_old, advantages, clip_range: float):
    """PPO's clipped surrogate on ratio = exp(logp − logp_old): mean_b max(−A·ratio, −A·clamp(ratio, 1 ± c)).
    Returns (loss, ratio)."""
    ratio = torch.exp(log_prob - log_prob_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


if __name__ == "__main__":
    install_user_error_hook()
    quiet_libraries()
    avoid_cudnn_attention()
    args = parse_args()

    # ---- validate the flags before anything is loaded or written -----------------------------------
    if args.model not in ADAPTERS:
        raise UserError(f"unknown model {args.model!r}; choose one of: {', '.join(ADAPTERS)}")
    if args.dynamics not in SAMPLERS:
        raise UserError(f"unknown dynamics {args.dynamics!r}; choose one of: {', '.join(SAMPLERS)}")
    if args.dynamics == "cps" and not 0 <= args.noise_level <= 1:
        raise UserError(f"--dynamics cps needs --noise-level in [0, 1], got {args.noise_level}")
    if args.advantage_aggregation not in AGGREGATIONS:
        raise UserError(f"unknown --advantage-aggregation {args.advantage_aggregation!r}; "
                        f"choose one of: {', '.join(AGGREGATIONS)}")
    if args.weighting not in WEIGHTINGS:
        raise UserError(f"unknown --weighting {args.weighting!r}; choose one of: {', '.join(WEIGHTINGS)}")
    if args.ghuber_power <= 0:
        raise UserError(f"--ghuber-power must be positive, got {args.ghuber_power}")
    if args.num_steps < 2:
        raise UserError("--num-steps must be at least 2")
    if not args.clip_range > 0:
        raise UserError(f"--clip-range must be positive (inf: no clip), got {args.clip_range}")
    if args.adv_clip_max <= 0:
        raise UserError(f"--adv-clip-max must be positive, got {args.adv_clip_max}")
    if args.kl_beta < 0 or args.ema_kl_beta < 0:
        raise UserError("--kl-beta and --ema-kl-beta must be >= 0")
    if args.ema_decay_rate < 0 or not 0 <= args.ema_max_decay <= 1:
        raise UserError("the EMA decay needs --ema-decay-rate >= 0 and --ema-max-decay in [0, 1]")
    if args.time_sampling not in TIME_SAMPLINGS:
        raise UserError(f"unknown --time-sampling {args.time_sampling!r}; choose one of: {', '.join(TIME_SAMPLINGS)}")
    true_cfg = ADAPTERS[args.model].true_cfg
    if true_cfg and args.guidance_scale is not None and args.guidance_scale > 1:
        raise UserError(f"AWM is CFG-free: --guidance-scale {args.guidance_scale} would turn on true CFG "
                        f"for {args.model}; leave it unset (1.0)")
    guidance = args.guidance_scale if args.guidance_scale is not None else (1.0 if true_cfg else ADAPTERS[args.model].default_guidance_scale)
    lr = args.learning_rate or (1e-5 if args.full_finetune else 3e-4)
    output_dir = args.output_dir or f"runs/{args.exp_name}-{args.seed}"

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), log_with="wandb" if args.track else None)
    configure_backend(accelerator, args.batch_size, args.max_grad_norm)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    if args.ema_kl_beta == 0 and args.clip_range == float("inf"):
        accelerator.print(f"warning: {COLLAPSE_WARNING}")
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
                       cache_texts(train_prompts, test_prompts, true_cfg), args.cache_dir, args.no_cache)
    adapter = load_adapter(args.model, model_path, device, dtype, args.resolution, args.max_sequence_length,
                           load_text_encoders=cache is None, num_frames=args.num_frames)
    encode = PromptEncoder(adapter, cache)
    accelerator.print(f"prompt embeddings: {cache.folder if cache else 'encoded online'}")
    sigmas = adapter.sigmas(args.num_steps)
    num_train = args.train_timesteps
    check_time_sampling(args.time_sampling, num_train, sigmas, args.timestep_range)
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
    # The EMA (a second LoRA adapter "ema", or a frozen copy): the off-policy sampler and the EMA-KL anchor.
    # Made before `prepare`, so DDP only registers the trained adapter's parameters.
    use_ema = args.off_policy or args.ema_kl_beta > 0
    ema = ShadowPolicy(transformer, "ema", args.full_finetune) if use_ema else None
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay, eps=1e-8)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    adapter.transformer = transformer  # rollout and training run the same (wrapped) module
    unwrapped = accelerator.unwrap_model(transformer)
    # FSDP2 (configs/fsdp2*.yaml) replaces the parameters by DTensor shards: read them again, and shard a
    # frozen full-fine-tune reference the same way (or bring it to the GPU after staging on the CPU).
    params = trainable(unwrapped)
    reference = place_like(reference, unwrapped)

    os.makedirs(output_dir, exist_ok=True)
    metrics_log = MetricsLog(output_dir, accelerator)
    start_epoch = 0
    checkpoint = latest_checkpoint(output_dir) if args.resume else None
    if checkpoint is not None:
        states, meta = load_training_state(checkpoint, rank)
        (load_full_weights_into if args.full_finetune else load_lora_into)(unwrapped, checkpoint)
        load_optimizer_state_dict(unwrapped, optimizer, states["optimizer"])
        if ema is not None:
            ema.load_state_dict(states["ema"])
        start_epoch = meta["epoch"] + 1
        metrics_log.truncate_after(meta["epoch"])
        accelerator.print(f"resumed from {checkpoint} at epoch {start_epoch}")
    elif args.resume:
        accelerator.print(f"no checkpoint in {output_dir}: starting from scratch")
    if args.track:
        accelerator.init_trackers(args.wandb_project, config={k: str(v) for k, v in vars(args).items()},
                                  init_kwargs={"wandb": {"name": f"{args.exp_name}-{args.seed}"}})

    def write_weights(folder, state):  # state: the full state dict, gathered by save_checkpoint
        if args.full_finetune:
            save_pretrained(unwrapped, os.path.join(folder, "transformer"), state)
        else:
            adapter.save_lora(folder, lora_state_dict(unwrapped, state, adapter_name="default"))

    def reference_velocity(x, sigma, cond):
        if reference is not None:
            adapter.transformer = reference
            try:
                return adapter.velocity(x, sigma, cond, guidance)
            finally:
                adapter.transformer = transformer
        with adapters_disabled(unwrapped):
            return adapter.velocity(x, sigma, cond, guidance)

    def generate(cond, generators, dynamics, step_sigmas):
        """Clean latents x0 of one micro-batch (only the final sample is kept: no trajectory is stored)."""
        if dynamics == "dpm":  # multistep DPM-Solver++ 2M from σ = 1 on (common/solvers.py)
            return rollout(adapter, cond, step_sigmas, generators, "ode", 0.0, [], [], guidance,
                           solver_from=0).final_latents
        sde_steps = [] if dynamics == "ode" else list(range(len(step_sigmas) - 1))
        return rollout(adapter, cond, step_sigmas, generators, dynamics, args.noise_level, sde_steps, [],
                       guidance).final_latents

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
                batch_images = adapter.decode(generate(cond, sample_generators(ids, device), "ode", eval_sigmas))
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

    bar = tqdm(range(start_epoch, args.epochs), disable=not accelerator.is_main_process, desc="awm")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. rollout (with the EMA when off-policy): M prompts × K samples, split over processes --------
        draw = epoch_draw(len(train_prompts), args.prompts_per_epoch, args.group_size, args.seed, epoch)
        seeds = sample_seeds(args.seed, epoch, samples_per_epoch)[local]
        time_seeds = training_seeds(args.seed, epoch, samples_per_epoch)[local]
        records = [train_prompts[i] for i in draw[local]]
        group_ids = torch.tensor([r.key for r in records])
        cond_all = encode(records)
        transformer.eval()
        clean, images = [], []
        with ema.active(adapter) if args.off_policy else nullcontext():
            for b in range(num_batches):
                mb = slice(b * args.batch_size, (b + 1) * args.batch_size)
                x0 = generate({k: v[mb] for k, v in cond_all.items()}, sample_generators(seeds[mb], device),
                              args.dynamics, sigmas)
                clean.append(x0)
                images.append(adapter.decode(x0).cpu())
        rollout_time = time.time() - epoch_start

        # ---- 2. rewards and advantages over the whole epoch (all processes) -------------------------
        reward_start = time.time()
        raw = score_samples(rewards, torch.cat(images), [r.prompt for r in records], group_ids, accelerator)
        all_raw = gather(raw.to(device)).cpu()
        all_ids = gather(group_ids.to(device)).cpu()
        advantages, adv_stats = compute_advantages(all_raw, [r.weight for r in rewards], all_ids,
                                                   args.advantage_aggregation, args.global_std, args.adv_clip_max)
        # AWM scales the clipped advantage into [−1, 1].
        advantages = (advantages[local] / args.adv_clip_max).to(device)
        combined = all_raw @ torch.tensor([r.weight for r in rewards], dtype=torch.float64)
        reward_time = time.time() - reward_start

        # ---- 3. update: advantage-weighted flow matching at T re-noised σ's per sample ------------------
        train_start = time.time()
        transformer.train()
        batches_per_update = num_batches // args.updates_per_epoch
        stats = {k: [] for k in ("loss", "policy_loss", "matching_loss", "kl", "ema_kl", "approx_kl", "clipfrac",
                                 "ratio_mean")}
        ratio_dev = torch.zeros((), device=device, dtype=torch.float64)
        for update in range(args.updates_per_epoch):
            for k in range(batches_per_update):
                b = update * batches_per_update + k
                mb = slice(b * args.batch_size, (b + 1) * args.batch_size)
                cond, adv, x0 = {key: v[mb] for key, v in cond_all.items()}, advantages[mb], clean[b]
                # An independent σ and ε per sample, from the sample's own generator (algorithms.md §5).
                generators = training_generators(time_seeds[mb])
                train_sigmas = sample_train_sigmas(args.time_sampling, num_train, generators, sigmas,
                                                   args.timestep_range, args.time_shift)
                train_noise = sample_train_noise(num_train, generators, x0)
                for i in range(num_train):
                    last = k == batches_per_update - 1 and i == num_train - 1
                    sigma = train_sigmas[:, i]
                    sig = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
                    x_sigma = (1 - sig) * x0 + sig * train_noise[:, i]  # forward process
                    target = train_noise[:, i] - x0  # v* = ε − x0, the pretraining target
                    with torch.no_grad():  # the frozen policies first, so adapter switches never touch a graph
                        v_ema = None
                        if ema is not None:
                            with ema.active(adapter):
                                v_ema = adapter.velocity(x_sigma, sigma, cond, guidance)
                        v_ref = reference_velocity(x_sigma, sigma, cond) if args.kl_beta > 0 else None
                    with micro_step(accelerator, transformer, last):
                        v_theta = adapter.velocity(x_sigma, sigma, cond, guidance)
                        log_prob = matching_log_prob(v_theta, target, sigma, args.weighting, args.ghuber_power)
                        if args.off_policy:  # the sampling policy is the EMA: its log-prob at the same (σ, ε)
                            log_prob_old = matching_log_prob(v_ema, target, sigma, args.weighting, args.ghuber_power)
                        else:  # on-policy: ratio ≡ 1, the gradient is that of mean(A·logp) (AWM eq. 9)
                            log_prob_old = log_prob.detach()
                        policy_loss, ratio = clipped_policy_loss(log_prob, log_prob_old, adv, args.clip_range)
                        loss = policy_loss.float()
                        if args.kl_beta > 0:  # velocity-space KL to the reference (adapters disabled)
                            kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1).mean()
                            loss = loss + args.kl_beta * kl
                            stats["kl"].append(kl.detach())
                        if args.ema_kl_beta > 0:  # keeps θ near its recent past: the EMA-KL term
                            ema_kl = ((v_theta - v_ema) ** 2).flatten(1).mean(1).mean()
                            loss = loss + args.ema_kl_beta * ema_kl
                            stats["ema_kl"].append(ema_kl.detach())
                        accelerator.backward(loss / (batches_per_update * num_train))
                    with torch.no_grad():
                        ratio_dev = torch.maximum(ratio_dev, (ratio - 1).abs().max())
                        stats["loss"].append(loss.detach())
                        stats["policy_loss"].append(policy_loss.detach().float())
                        stats["matching_loss"].append(((v_theta - target) ** 2).mean())
                        stats["approx_kl"].append(0.5 * ((log_prob - log_prob_old) ** 2).mean().float())
                        stats["clipfrac"].append(((ratio - 1).abs() > args.clip_range).float().mean())
                        stats["ratio_mean"].append(ratio.mean().float())
            accelerator.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # EMA update once per epoch; d counts optimizer steps including this epoch's.
        decay = min(args.ema_max_decay, args.ema_decay_rate * (epoch + 1) * args.updates_per_epoch)
        if ema is not None:
            ema.blend(decay)
        train_time = time.time() - train_start

        # ---- 4. log, evaluate, checkpoint ----------------------------------------------------------
        metrics = {
            "epoch": epoch,
            "reward_mean": float(combined.mean()),
            "reward_std": float(combined.std(correction=0)),
            **{f"reward_{r.name}_mean": float(all_raw[:, k].mean()) for k, r in enumerate(rewards)},
            **{f"reward_{r.name}_std": float(all_raw[:, k].std(correction=0)) for k, r in enumerate(rewards)},
            **{name: float(accelerator.reduce(torch.stack(vals).mean(), "mean")) for name, vals in stats.items() if vals},
            "ratio_dev_max": float(accelerator.reduce(ratio_dev.float(), "max")),
            **({"ema_decay": decay} if ema is not None else {}),
            "zero_std_frac": adv_stats["zero_std_frac"],
            "adv_abs_mean": float(advantages.abs().mean()),
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
            metrics.update(evaluate(epoch))
        metrics["epoch_time_s"] = time.time() - epoch_start
        metrics_log.log(metrics)
        if accelerator.is_main_process:
            bar.write(format_metrics(metrics, ["epoch", "reward_mean", "reward_std", "eval_reward_mean", "loss",
                                               "ema_kl", "clipfrac", "approx_kl", "epoch_time_s"]))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if last_epoch or (args.save_every and (epoch + 1) % args.save_every == 0):
            states = {"optimizer": optimizer_state_dict(unwrapped, optimizer)}
            if ema is not None:
                states["ema"] = ema.state_dict()
            save_checkpoint(accelerator, output_dir, epoch, write_weights, states,
                            {"model": args.model, "full_finetune": args.full_finetune,
                             "weights": "transformer" if args.full_finetune else LORA_FILE},
                            keep=args.keep_checkpoints, model=unwrapped)
    accelerator.end_training()
