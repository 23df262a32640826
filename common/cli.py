"""The flags every script shares (`TrainArgs`, which each script's `Args` extends with its algorithm's flags),
presets, and the checks that turn bad values into one-line errors before anything is loaded or written."""

import contextlib
import dataclasses
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import tyro

from common.data import default_dataset
from common.models.registry import CONDITIONED_MODELS, DEFAULT_MODEL, MODELS, TWO_EXPERT_MODELS, VIDEO_MODELS
from common.training import check_updates_per_epoch
from common.utils import UserError, avoid_cudnn_attention, install_user_error_hook, quiet_libraries

# Every --model name, from the registry (common/models/registry.py, which imports no model code), so that the scripts,
# preprocess.py and evaluate.py parse it without importing the adapters.
ModelName = Literal[tuple(MODELS)]
# diffusers' attention backends (`diffusers.models.attention_dispatch.AttentionBackendName`; tests check they agree),
# here so that a misspelt --attention-backend is refused, with the choices, before anything is loaded.
AttentionBackend = Literal["native", "flash", "flash_varlen", "flash_hub", "flash_varlen_hub", "flash_4_hub",
                           "_flash_3", "_flash_varlen_3", "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub",
                           "flex", "_native_cudnn", "_native_efficient", "_native_flash", "_native_math",
                           "_native_npu", "_native_xla", "sage", "sage_hub", "sage_blackwell_hub", "sage_varlen",
                           "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90",
                           "_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton", "xformers"]

NON_FINITE_NOTE = ("A non-finite reward, loss or gradient norm stops the run with one line naming the epoch and the "
                   "quantity, before the optimizer step and before anything of that epoch is written; a checkpoint is "
                   "never written with non-finite weights.")


@dataclass
class TrainArgs:
    # Flags for which +inf is a documented setting (`--clip-range inf`: no clip); every other float flag must be
    # finite (check_finite). A ClassVar, so not a flag.
    infinity_allowed: ClassVar[tuple[str, ...]] = ()

    # Run
    exp_name: str = ""
    """the name of this experiment (empty: the script's file name)"""
    preset: str = "none"
    """a named set of defaults (listed above); flags given on the command line override it"""
    seed: int = 1
    """seed of the experiment (prompt draws, rollout and training noise, LoRA init)"""
    track: Literal["wandb", "tensorboard"] | None = None
    """also log to Weights & Biases or TensorBoard (files under --output-dir); metrics.jsonl is always written"""
    wandb_project: str = "flow-rl"
    """the wandb project name"""
    output_dir: str | None = None
    """where metrics.jsonl, eval grids, tracker files and checkpoints go (unset: runs/{exp_name}-{seed})"""
    resume: bool = False
    """continue from the newest complete checkpoint in --output-dir"""

    # Model
    model: ModelName = DEFAULT_MODEL
    """model family (flux1-kontext, qwen-image-edit: image editing; wan-i2v, wan2.2-i2v, hunyuan-video-1.5-i2v,
    ltx2-i2v: image-to-video; their datasets give each prompt a condition image)"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` builds an offline tiny model, `toy` is the toy world's
    pretrained FLUX.1 (unset: the model's published checkpoint)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weights dtype: auto is bf16 on GPU and float32 on CPU; step and loss math is float32 whatever it is"""
    resolution: int = 512
    """image height and width"""
    max_sequence_length: int | None = None
    """prompt length in text-encoder tokens (longer prompts are truncated, with a warning; unset: the model's own,
    its pipeline's default: docs/models.md)"""
    num_frames: int | None = None
    """frames of a video model (the Wan models: 4k + 1; unset: 33); image models take none"""
    train_experts: Literal["high", "low", "both"] | None = None
    """wan2.2 and wan2.2-i2v only: the experts whose LoRA is trained (high noise: `transformer`, low noise:
    `transformer_2`); the other's stays as it is, and both still sample (unset: both)"""
    condition_size: int | None = None
    """side of the square that condition images are resized to (unset: as the pipeline does it: FLUX.1 Kontext's
    preferred resolution nearest the image's aspect ratio, Qwen-Image-Edit's area-preserving resize, Wan I2V's
    output size); conditioned models only"""
    guidance_scale: float | None = None
    """FLUX.1's guidance embedding or the true-CFG scale of the others (unset: the model's reference value)"""
    cache_dir: str | None = None
    """embedding cache root built by preprocess.py (unset: $FLOWRL_CACHE/embeddings)"""
    cache: bool = True
    """use a matching embedding cache when there is one (--no-cache: encode prompts with the text encoders)"""
    init_lora: str | None = None
    """start from a saved LoRA: a folder holding pytorch_lora_weights.safetensors (a checkpoint, data/toy/student) or
    a run's --output-dir (its newest complete checkpoint). Alone, it is loaded into the trained LoRA (same rank and
    α); see --merge-init-lora"""
    merge_init_lora: bool = False
    """merge --init-lora into the base weights first and train a new LoRA on top: the reference (adapters disabled)
    is then that model, e.g. a step-distilled student used as a base model"""
    attention_backend: AttentionBackend | None = None
    """the transformer's attention kernel, through diffusers' `set_attention_backend` (flash: flash-attn, sage:
    SageAttention, flex, xformers, ...); refused with one line where it cannot run here (unset: diffusers' default,
    torch's scaled_dot_product_attention)"""

    # Data and reward
    dataset: str | None = None
    """folder with train/test .jsonl (field `prompt`) or .txt files (unset: data/prompts; for conditioned models the
    toy edit world's data/toy_edit, prompts with condition images)"""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a reward as NAME[:WEIGHT][,KEY=VALUE...] or MODULE:ATTR[:WEIGHT]; repeat the flag for several
    (none given: jpeg_compressibility)"""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """how several rewards combine into one advantage"""
    global_std: bool = True
    """normalise advantages by the std over the whole epoch instead of the group's own (the references' default)"""
    adv_clip_max: float = 5.0
    """advantages are clamped to ±this"""
    judge: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a held-out judge: a reward (the --reward syntax) scored only at evaluation, on the test prompts, never trained
    on; logged as eval_judge_<name> and watched by --guard; repeat the flag for several (docs/guard.md)"""
    guard: Literal["off", "warn", "stop", "rollback"] | None = None
    """what the reward-hacking guard does when a judge stays below its best while the training reward's evaluation
    rises: warn (one line, a metrics key), stop (checkpoint, exit 3), rollback (restore the judge's best checkpoint,
    raise the KL weight, go on) (unset: warn with a --judge, else off)"""
    guard_patience: int = 2
    """evaluations in a row a judge must be hacked before the guard acts"""
    guard_margin: float = 2.0
    """how far below its best a judge must be, in standard errors of the difference of the two evaluations"""
    guard_kl_factor: float = 10.0
    """rollback: the KL weight (--kl-beta) is multiplied by this …"""
    guard_kl_floor: float = 0.01
    """… and raised to at least this (so a run with no KL gets one)"""
    guard_max_rollbacks: int = 2
    """rollback: the guard stops the run (as --guard stop) when hacking is found after this many rollbacks"""

    # Training
    epochs: int = 300
    """number of epochs (one epoch = rollout of M·K samples + updates_per_epoch optimizer steps)"""
    prompts_per_epoch: int = 48
    """M: prompts drawn per epoch"""
    group_size: int = 16
    """K: samples per prompt (one group)"""
    batch_size: int = 8
    """largest per-process micro-batch, for rollout and training"""
    updates_per_epoch: int = 1
    """optimizer steps per epoch; gradients accumulate over the micro-batches and trained steps in between"""
    num_steps: int = 10
    """sampling steps of a rollout"""
    learning_rate: float | None = None
    """AdamW learning rate (unset: 3e-4 for LoRA, 1e-5 for full fine-tuning)"""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """learning-rate schedule over the run's optimizer steps, after the warm-up"""
    lr_warmup_steps: int = 0
    """optimizer steps of linear warm-up from 0"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    lora_rank: int = 64
    """LoRA rank"""
    lora_alpha: float = 128
    """LoRA alpha"""
    full_finetune: bool = False
    """train all transformer weights instead of a LoRA (frozen policies become copies of the transformer)"""
    ema: bool = False
    """keep an EMA of the trained weights and evaluate with it"""
    ema_decay: float = 0.9
    """decay of that EMA per optimizer step"""

    # Memory
    gradient_checkpointing: bool = False
    """recompute transformer block activations in the backward pass (less memory, ~30% more time)"""
    reward_device: Literal["accelerator", "cpu"] = "accelerator"
    """where reward models run"""
    reward_workers: int = 4
    """threads that score each rollout micro-batch while the next is denoised (a reward server's requests overlap up
    to its client's connections=); 0: score the whole epoch after the rollout. The scores are the same either way"""

    sequence_parallel: int = 1
    """N > 1: Ulysses sequence parallelism; N processes run each transformer call together, each on 1/N of the tokens
    (diffusers' plan: flux1, flux2, qwen-image, wan and their variants), and share their samples; the launch's
    processes form world / N data-parallel groups (docs/distributed.md)"""

    peak_tflops: float | None = None
    """the accelerator's peak TFLOP/s per process, the denominator of `mfu` in metrics.jsonl (unset: the dense bf16
    peak of a known GPU, common.flops.PEAK_TFLOPS; on a CPU or an unknown GPU mfu is left out)"""

    # Evaluation and checkpoints
    eval_every: int = 10
    """evaluate with the Euler ODE on the test prompts every N epochs, and after the last (0: never)"""
    eval_num_prompts: int = 16
    """test prompts evaluated (the first N of the test split)"""
    eval_seeds: int = 1
    """samples per test prompt, at fixed seeds (one seed per prompt is noisy on small test sets)"""
    eval_num_steps: int | None = None
    """ODE steps of evaluation (unset: num_steps)"""
    eval_hf_reference: str | None = None
    """a teacher's per-sample blur measure (evaluate.py --save-hf): every evaluation then also logs eval_blur_ratio,
    its H over the teacher's on the same prompts × seeds (every evaluation logs H itself, eval_hf_ratio)"""
    save_every: int = 10
    """checkpoint every N epochs and after the last (0: only after the last)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""


def _preset_lines(presets: dict[str, dict]) -> str:
    lines = []
    for name, values in presets.items():
        if name != "none":
            settings = ", ".join(f"{k.replace('_', '-')}={v}" for k, v in values.items())
            lines.append(f"  {name}: {settings}")
    return "\n".join(lines)


def cli_one_line(args_class, **tyro_kwargs):
    """tyro.cli, with its boxed usage error turned into a one-line UserError (--help still prints and exits 0)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(args_class, **tyro_kwargs)
    except SystemExit as exit:
        if exit.code in (0, None):
            raise
        raise UserError(_one_line(captured.getvalue())) from None


def _one_line(message: str) -> str:
    """tyro's boxed error message as one line: the text between the box's first two rules, with `see --help`.
    With a UTF-8 stdout the first rule is the box's top border, titled "╭─ Invalid choice ──╮"; otherwise (a pipe
    under an ASCII locale) the title stands on a line of its own above a rule of "-"."""
    def is_rule(text):
        return text.startswith("─") or (len(text) >= 3 and set(text) == {"-"})

    texts = [line.strip().strip("│╭╮╰╯").strip() for line in message.splitlines()]
    rules = [i for i, text in enumerate(texts) if is_rule(text)]
    inside = texts[rules[0] + 1:rules[1] if len(rules) > 1 else None] if rules else texts
    lines = [text for text in inside if text and not is_rule(text)]
    return " ".join(" ".join(lines).split()) + " (see --help)"


def parse_args(args_class, presets: dict[str, dict] | None = None, description: str = "", check=None):
    """Parse the command line into `args_class`, whose defaults come from `--preset NAME` (flags given on the command
    line override it), then check the values (`check`, default `check_args` for TrainArgs). Installs the one-line
    error reporting first, so every bad input from here on exits with status 2 and one `error:` line."""
    install_user_error_hook()
    quiet_libraries()
    avoid_cudnn_attention()
    argv = sys.argv[1:]
    default = args_class()
    if presets is not None:
        name = "none"
        for i, token in enumerate(argv):
            if token == "--preset" and i + 1 < len(argv):
                name = argv[i + 1]
            elif token.startswith("--preset="):
                name = token.split("=", 1)[1]
        presets = {"none": {}, **presets}
        if name not in presets:
            raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(presets)}")
        # A list flag given on the command line (--reward) replaces the preset's list: tyro's append action would
        # add to it (`--preset toy --reward toy,mode=count` would train on both rewards).
        given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        preset = {k: v for k, v in presets[name].items()
                  if not (isinstance(v, list) and f"--{k.replace('_', '-')}" in given)}
        default = replace(default, preset=name, **preset)
        description = (f"{description}\n\n{NON_FINITE_NOTE}\n\nPresets (named defaults; flags override them):\n"
                       f"{_preset_lines(presets)}")
    args = cli_one_line(args_class, default=default, args=argv, description=description)
    if getattr(args, "exp_name", None) == "":
        args.exp_name = Path(sys.argv[0]).stem
    if hasattr(args, "dataset") and args.dataset is None:  # preprocess.py's Args has one too
        args.dataset = default_dataset(args.model)
    if getattr(args, "max_sequence_length", 0) is None and getattr(args, "model", None) is not None:
        args.max_sequence_length = MODELS[args.model].text_length  # the model's own; preprocess.py's Args has one too
    check_finite(args)
    (check or check_args)(args)
    return args


def _floats(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, float)]
    return []


def check_finite(args) -> None:
    """Every float flag of any script's Args (alone or in a tuple or list) is finite: a NaN or inf would reach the
    loss as "gradient norm is nan" epochs later. Only the flags in the class's `infinity_allowed` may be +inf."""
    allowed = getattr(type(args), "infinity_allowed", ())
    for spec in dataclasses.fields(args):
        value = getattr(args, spec.name)
        if any(not math.isfinite(v) and not (v == math.inf and spec.name in allowed) for v in _floats(value)):
            shown = " ".join(map(str, value)) if isinstance(value, (tuple, list)) else value
            what = "a finite number or inf" if spec.name in allowed else "finite"
            raise UserError(f"--{spec.name.replace('_', '-')} must be {what}, got {shown}")


# (flag, smallest allowed value, why): every numeric flag of TrainArgs with a lower bound
_AT_LEAST = [("epochs", 1, ""), ("prompts_per_epoch", 1, ""), ("group_size", 2, " (advantages compare a sample with "
             "its group)"), ("batch_size", 1, ""), ("updates_per_epoch", 1, ""), ("num_steps", 2, ""),
             ("lr_warmup_steps", 0, ""), ("lora_rank", 1, ""), ("max_sequence_length", 1, ""), ("resolution", 1, ""),
             ("eval_every", 0, ""), ("eval_num_prompts", 1, ""), ("eval_seeds", 1, ""), ("save_every", 0, ""),
             ("keep_checkpoints", 1, ""), ("weight_decay", 0, ""), ("reward_workers", 0, ""),
             ("sequence_parallel", 1, ""), ("guard_patience", 1, ""), ("guard_margin", 0, ""),
             ("guard_kl_factor", 1, ""), ("guard_max_rollbacks", 1, "")]
_POSITIVE = ["lora_alpha", "max_grad_norm", "adv_clip_max", "guard_kl_floor"]


def launched_data_ranks(args) -> int:
    """The data-parallel ranks of this launch, read before setup from the launchers' process count (WORLD_SIZE):
    world / --sequence-parallel (setup refuses a degree that does not divide the world)."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")) // args.sequence_parallel)


def check_ranges(args, unit=(), unit_closed=(), positive=(), non_negative=()) -> None:
    """One line for the first flag outside its range: `unit` in [0, 1), `unit_closed` in [0, 1], `positive` > 0,
    `non_negative` >= 0 (names of args' fields)."""
    kinds = [(unit, lambda v: 0 <= v < 1, "in [0, 1)"), (unit_closed, lambda v: 0 <= v <= 1, "in [0, 1]"),
             (positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, ">= 0")]
    for names, holds, wanted in kinds:
        for name in names:
            if not holds(getattr(args, name)):
                raise UserError(f"--{name.replace('_', '-')} must be {wanted}, got {getattr(args, name)}")


def check_args(args) -> None:
    """One-line errors for values no run can use (the scripts check their own algorithm flags)."""
    for name, lowest, why in _AT_LEAST:
        value = getattr(args, name)
        if value < lowest:
            raise UserError(f"--{name.replace('_', '-')} must be at least {lowest}{why}, got {value}")
    check_ranges(args, positive=_POSITIVE)
    # Early, with the launchers' process count; rollout_micro_batches checks it again after setup.
    local = args.prompts_per_epoch * args.group_size // launched_data_ranks(args)
    check_updates_per_epoch(args.updates_per_epoch, local)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise UserError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.learning_rate is not None and not args.learning_rate > 0:
        raise UserError(f"--learning-rate must be positive, got {args.learning_rate}")
    if args.eval_num_steps is not None and args.eval_num_steps < 1:
        raise UserError(f"--eval-num-steps must be at least 1, got {args.eval_num_steps}")
    if not 0 <= args.ema_decay < 1:
        raise UserError(f"--ema-decay must be in [0, 1), got {args.ema_decay}")
    if args.train_experts is not None and args.model not in TWO_EXPERT_MODELS:
        raise UserError(f"--train-experts applies to two-expert models ({', '.join(TWO_EXPERT_MODELS)}), not to "
                        f"{args.model}")
    if args.model in TWO_EXPERT_MODELS and args.full_finetune:
        raise UserError(f"--full-finetune is not supported for {args.model} (two 14B experts): train LoRA, with "
                        "--train-experts to pick the experts")
    if args.num_frames is not None and args.model not in VIDEO_MODELS:
        raise UserError(f"--num-frames applies to video models ({', '.join(VIDEO_MODELS)}), not to {args.model}")
    if args.merge_init_lora and args.init_lora is None:
        raise UserError("--merge-init-lora merges the LoRA given by --init-lora: give --init-lora DIR")
    if args.init_lora is not None:
        if args.full_finetune and not args.merge_init_lora:
            raise UserError("--init-lora with --full-finetune: add --merge-init-lora (a LoRA is merged into the "
                            "weights that full fine-tuning trains)")
        from common.init_lora import init_lora_folder

        init_lora_folder(args.init_lora, args.model)
    if args.eval_hf_reference is not None and not Path(args.eval_hf_reference).is_file():
        raise UserError(f"--eval-hf-reference {args.eval_hf_reference} is not a file")
    check_guard(args)
    if args.condition_size is not None and args.model not in CONDITIONED_MODELS:
        raise UserError(f"--condition-size applies to conditioned models ({', '.join(CONDITIONED_MODELS)}), "
                        f"not to {args.model}")


def check_guard(args) -> None:
    """--guard's default (warn with a judge, else off) and the settings it cannot act on."""
    if args.guard is None:
        args.guard = "warn" if args.judge else "off"
    if args.guard == "off":
        return
    if not args.judge:
        raise UserError(f"--guard {args.guard} watches judges: give at least one --judge (e.g. --judge "
                        f"toy,mode=strict)")
    if not args.eval_every:
        raise UserError(f"--guard {args.guard} acts at evaluations: --eval-every must be at least 1")
    if args.guard == "rollback" and not hasattr(args, "kl_beta"):
        raise UserError("--guard rollback raises the KL weight, and this script has none (--kl-beta): use --guard "
                        "warn or stop")


# The flags a --resume may change, each named in one printed line (docs/running.md#outputs-checkpoints-resume): how
# long the run goes on, the optimizer's step size and clipping, evaluation, checkpoints, logging, and how the same
# computation is laid out on the hardware (micro-batches, memory switches, kernels, precision, sequence parallelism,
# the embedding cache), which moves the results by rounding at most. Every other flag, each script's own included,
# changes what is sampled or what is optimised, and a resume that changes one is refused; a flag added later is
# refused until it is listed here.
RESUMABLE_FLAGS = ("exp_name", "preset", "track", "wandb_project", "dtype", "cache_dir", "cache", "attention_backend",
                   "epochs", "batch_size", "learning_rate", "lr_schedule", "lr_warmup_steps", "weight_decay",
                   "max_grad_norm", "ema", "ema_decay", "gradient_checkpointing", "reward_device", "reward_workers",
                   "sequence_parallel", "peak_tflops", "eval_every", "eval_num_prompts", "eval_seeds",
                   "eval_num_steps", "eval_hf_reference", "save_every", "keep_checkpoints", "offload_trajectories",
                   # the held-out judges and the guard watch the run; they change neither samples nor objective
                   "judge", "guard", "guard_patience", "guard_margin", "guard_kl_factor", "guard_kl_floor",
                   "guard_max_rollbacks")
_WHERE = ("output_dir", "resume")  # where the run is, and that it goes on: never compared


def _flag_values(args) -> dict:
    """Every flag of `args` as the JSON value a checkpoint's meta.json records."""
    return json.loads(json.dumps(vars(args), default=str))


def run_defining_flags(args) -> dict:
    """The flags that define what a run is: the algorithm (the script's name) and every flag but RESUMABLE_FLAGS."""
    return {"algorithm": Path(sys.argv[0]).stem,
            **{k: v for k, v in _flag_values(args).items() if k not in RESUMABLE_FLAGS + _WHERE}}


def changed_on_resume(args, saved: dict, also_resumable: tuple[str, ...] = ()) -> tuple[list, list]:
    """The flags whose values differ from `saved` (those the resumed checkpoint was written with; a flag it does not
    record is not compared), as (flag, value now, saved value): (the run-defining ones, the others, RESUMABLE_FLAGS
    and `also_resumable`)."""
    defining, others = [], []
    for name, value in _flag_values(args).items():
        if name not in _WHERE and name in saved and saved[name] != value:
            change = (f"--{name.replace('_', '-')}", value, saved[name])
            (others if name in RESUMABLE_FLAGS + also_resumable else defining).append(change)
    return defining, others
