# DiffusionNFT: online RL on the FORWARD process. Clean rollout samples are re-noised and the model is trained
# by flow matching toward an implicit positive policy and away from an implicit negative one; no likelihoods,
# any sampler, CFG-free.
# Paper: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv:2509.16117.
# Math: ../shared/docs/algorithms.md §5 (this repo's spec). Usage: README.md.
import os
import time
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
from common.timesampling import (TIME_SAMPLINGS, check_time_sampling, default_num_train, sample_train_noise,
                                 sample_train_sigmas, training_generators, training_seeds)
from common.tracking import MetricsLog, format_metrics, save_image_grid
from common.training import adapters_disabled, add_lora, trainable_parameters
from common.utils import (UserError, avoid_cudnn_attention, install_user_error_hook, peak_memory_gb,
                          quiet_libraries, resolve_dtype)
from rewards import load_rewards, score_samples

SAMPLERS = DYNAMICS + ("dpm",)  # the step dynamics, or the deterministic multistep solver


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
    training; true-CFG models (SD3.5, Qwen-Image, Wan) run CFG-free (1.0), as DiffusionNFT is CFG-free"""
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
    """A_max: advantages are clamped to ±this, mapped to the optimality r ∈ [0, 1], and the loss is scaled by it"""

    # Algorithm specific arguments
    epochs: int = 300
    """number of epochs (one epoch = rollout of M·K samples + updates_per_epoch optimizer steps)"""
    prompts_per_epoch: int = 48
    """M: prompts drawn per epoch"""
    group_size: int = 16
    """K: samples per prompt (one group)"""
    batch_size: int = 8
    """per-process micro-batch for rollout and training"""
    updates_per_epoch: int = 1
    """optimizer steps per epoch; gradients accumulate over samples × trained timesteps in between"""
    num_steps: int = 10
    """sampling steps of a rollout (the reference: 10 for SD3.5, 25 multi-reward)"""
    dynamics: str = "dpm"
    """rollout sampler of θ_old: dpm (deterministic DPM-Solver++ 2M, the reference's), ode (Euler), flow-sde,
    dance-sde or cps; only x0 is kept"""
    noise_level: float = 0.7
    """η of an SDE rollout (unused by ode)"""
    time_sampling: str = "discrete_random"
    """training σ's per sample: discrete_random (T distinct rollout steps uniformly at random, the reference's),
    discrete / discrete_wo_init (stratified over the rollout steps, AWM's), uniform, logit_normal"""
    train_timesteps: int | None = None
    """T: σ's trained per sample (default ⌊0.99·n⌋ of the n eligible rollout steps, as the reference)"""
    timestep_range: tuple[float, float] = (0.0, 1.0)
    """(f_lo, f_hi) fractions along the denoising axis: train on σ ∈ [1 − f_hi, 1 − f_lo]"""
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
    learning_rate: float | None = None
    """AdamW learning rate (default 3e-4 for LoRA, 1e-5 for full fine-tuning)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    lora_rank: int = 64
    """LoRA rank (64 FLUX, 32 SD3.5)"""
    lora_alpha: float = 128
    """LoRA alpha (128 FLUX, 64 SD3.5)"""
    full_finetune: bool = False
    """train all transformer weights instead of a LoRA (θ_old and the reference become frozen copies)"""

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
    # 6 rollout steps, 3 trained σ's and no KL keep an epoch at ~0.25 s; the JPEG reward rises by 0.8-1.0 kB
    # within 50 epochs for seeds 1-5.
    "tiny": dict(model_path="tiny", resolution=64, max_sequence_length=32, epochs=50, prompts_per_epoch=2,
                 group_size=8, batch_size=8, updates_per_epoch=1, num_steps=6, train_timesteps=3, kl_beta=0.0,
                 learning_rate=5e-2, lora_rank=8, lora_alpha=8, global_std=False, eval_every=25,
                 eval_num_prompts=8, save_every=25),
    # DiffusionNFT's default setting on FLUX.1-dev (the paper's runs are SD3.5-M: LoRA r32/α64, 10 steps at
    # 512 px, the same β, KL and decay): deterministic rollouts, group 16, 48 prompts, one step per epoch.
    "flux1": dict(resolution=512, num_steps=10, eval_num_steps=28, group_size=16, prompts_per_epoch=48,
                  batch_size=8, updates_per_epoch=1, learning_rate=3e-4, lora_rank=64, lora_alpha=128,
                  nft_beta=1.0, kl_beta=1e-4, decay_flat=0, decay_uprate=0.001, decay_uphold=0.5,
                  epochs=1000, eval_every=20, save_every=20),
    # The reference's OCR / multi-reward setting: small β, θ_old frozen for 75 steps then a slow EMA, 2 optimizer
    # steps per epoch. The OCR reward arrives with the rewards issue: pass --reward ocr.
    "flux1-ocr": dict(resolution=512, num_steps=10, eval_num_steps=28, group_size=16, prompts_per_epoch=48,
                      batch_size=8, updates_per_epoch=2, learning_rate=3e-4, lora_rank=64, lora_alpha=128,
                      nft_beta=0.1, kl_beta=1e-4, decay_flat=75, decay_uprate=0.0075, decay_uphold=0.999,
                      epochs=1000, eval_every=20, save_every=20),
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


def old_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """d after `step` optimizer steps in total (this epoch's included): θ_old ← d·θ_old + (1 − d)·θ."""
    return 0.0 if step < flat else min(uprate * (step - flat), uphold)


def nft_loss(v_theta, v_old, x_sigma, x0, sigma, advantages, beta: float, adv_clip_max: float):
    """DiffusionNFT's policy loss for one trained σ per sample. Returns (loss, ℓ⁺ (B,), ℓ⁻ (B,)).

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
    loss = ((r * loss_pos + (1 - r) * loss_neg) / beta).mean() * adv_clip_max
    return loss.float(), loss_pos.detach(), loss_neg.detach()


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
    if args.num_steps < 2:
        raise UserError("--num-steps must be at least 2")
    if args.nft_beta <= 0:
        raise UserError(f"--nft-beta must be positive, got {args.nft_beta}")
    if args.adv_clip_max <= 0:
        raise UserError(f"--adv-clip-max must be positive, got {args.adv_clip_max}")
    if args.decay_flat < 0 or args.decay_uprate < 0 or not 0 <= args.decay_uphold <= 1:
        raise UserError("the θ_old decay needs --decay-flat >= 0, --decay-uprate >= 0 and --decay-uphold in [0, 1]")
    if args.time_sampling not in TIME_SAMPLINGS:
        raise UserError(f"unknown --time-sampling {args.time_sampling!r}; choose one of: {', '.join(TIME_SAMPLINGS)}")
    true_cfg = ADAPTERS[args.model].true_cfg
    if true_cfg and args.guidance_scale is not None and args.guidance_scale > 1:
        raise UserError(f"DiffusionNFT is CFG-free: --guidance-scale {args.guidance_scale} would turn on true CFG "
                        f"for {args.model}; leave it unset (1.0)")
    guidance = args.guidance_scale if args.guidance_scale is not None else (1.0 if true_cfg else ADAPTERS[args.model].default_guidance_scale)
    lr = args.learning_rate or (1e-5 if args.full_finetune else 3e-4)
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
                       cache_texts(train_prompts, test_prompts, true_cfg), args.cache_dir, args.no_cache)
    adapter = load_adapter(args.model, model_path, device, dtype, args.resolution, args.max_sequence_length,
                           load_text_encoders=cache is None, num_frames=args.num_frames)
    encode = PromptEncoder(adapter, cache)
    accelerator.print(f"prompt embeddings: {cache.folder if cache else 'encoded online'}")
    sigmas = adapter.sigmas(args.num_steps)
    num_train = args.train_timesteps or default_num_train(args.time_sampling, sigmas, args.timestep_range)
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
    # θ_old: a second LoRA adapter "old" (or a frozen copy), equal to θ at the start. Made before `prepare`,
    # so DDP only registers the trained adapter's parameters.
    old = ShadowPolicy(transformer, "old", args.full_finetune)
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
        old.load_state_dict(states["old"])
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

    bar = tqdm(range(start_epoch, args.epochs), disable=not accelerator.is_main_process, desc="nft")
    for epoch in bar:
        epoch_start = time.time()
        # ---- 1. rollout with θ_old: M prompts × K samples, split over processes; keep x0 only ------------
        draw = epoch_draw(len(train_prompts), args.prompts_per_epoch, args.group_size, args.seed, epoch)
        seeds = sample_seeds(args.seed, epoch, samples_per_epoch)[local]
        time_seeds = training_seeds(args.seed, epoch, samples_per_epoch)[local]
        records = [train_prompts[i] for i in draw[local]]
        group_ids = torch.tensor([r.key for r in records])
        cond_all = encode(records)
        transformer.eval()
        clean, images = [], []
        with old.active(adapter):
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
        advantages = advantages[local].float().to(device)
        combined = all_raw @ torch.tensor([r.weight for r in rewards], dtype=torch.float64)
        reward_time = time.time() - reward_start

        # ---- 3. update: re-noise x0 at T σ's per sample and match the implicit positive/negative policies --
        train_start = time.time()
        transformer.train()
        batches_per_update = num_batches // args.updates_per_epoch
        stats = {"loss": [], "policy_loss": [], "kl": [], "positive_loss": [], "negative_loss": [], "old_v_mse": []}
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
                    x_sigma = (1 - sig) * x0 + sig * train_noise[:, i]  # forward process, target v* = ε − x0
                    with torch.no_grad():  # the frozen policies first, so adapter switches never touch a graph
                        with old.active(adapter):
                            v_old = adapter.velocity(x_sigma, sigma, cond, guidance)
                        v_ref = reference_velocity(x_sigma, sigma, cond) if args.kl_beta > 0 else None
                    with micro_step(accelerator, transformer, last):
                        v_theta = adapter.velocity(x_sigma, sigma, cond, guidance)
                        policy_loss, loss_pos, loss_neg = nft_loss(v_theta, v_old, x_sigma, x0, sigma, adv,
                                                                   args.nft_beta, args.adv_clip_max)
                        loss = policy_loss
                        if args.kl_beta > 0:  # velocity-space KL to the reference, as the reference code
                            kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1).mean()
                            loss = loss + args.kl_beta * kl
                            stats["kl"].append(kl.detach())
                        accelerator.backward(loss / (batches_per_update * num_train))
                    stats["loss"].append(loss.detach())
                    stats["policy_loss"].append(policy_loss.detach())
                    stats["positive_loss"].append(loss_pos.float().mean())
                    stats["negative_loss"].append(loss_neg.float().mean())
                    stats["old_v_mse"].append(((v_theta.detach() - v_old) ** 2).mean())
            accelerator.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # θ_old trails θ: d counts optimizer steps including this epoch's (Flow-Factory's epoch index is one behind).
        decay = old_decay((epoch + 1) * args.updates_per_epoch, args.decay_flat, args.decay_uprate, args.decay_uphold)
        old.blend(decay)
        train_time = time.time() - train_start

        # ---- 4. log, evaluate, checkpoint ----------------------------------------------------------
        metrics = {
            "epoch": epoch,
            "reward_mean": float(combined.mean()),
            "reward_std": float(combined.std(correction=0)),
            **{f"reward_{r.name}_mean": float(all_raw[:, k].mean()) for k, r in enumerate(rewards)},
            **{f"reward_{r.name}_std": float(all_raw[:, k].std(correction=0)) for k, r in enumerate(rewards)},
            **{name: float(accelerator.reduce(torch.stack(vals).mean(), "mean")) for name, vals in stats.items() if vals},
            "old_decay": decay,
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
                                               "kl", "old_v_mse", "old_decay", "epoch_time_s"]))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}")
        if last_epoch or (args.save_every and (epoch + 1) % args.save_every == 0):
            save_checkpoint(accelerator, output_dir, epoch, write_weights,
                            {"optimizer": optimizer_state_dict(unwrapped, optimizer), "old": old.state_dict()},
                            {"model": args.model, "full_finetune": args.full_finetune,
                             "weights": "transformer" if args.full_finetune else LORA_FILE},
                            keep=args.keep_checkpoints, model=unwrapped)
    accelerator.end_training()
