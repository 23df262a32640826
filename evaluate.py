# Score models on a dataset's test split: an untrained model given by flags, the model a run started from (--base),
# and runs' newest checkpoints (LoRA or full fine-tune; the EMA weights for a run trained with --ema), each with the
# run's own saved settings. It is the evaluation the training scripts log (common.evaluation): the same prompts,
# seeds, batches and Euler ODE give the same numbers, so `--run RUN_DIR` reproduces the run's last logged
# evaluation and `--run RUN_DIR --base` its evaluation before the first update (on one process; a run evaluated on
# several processes batches differently and agrees to float rounding).
#   python evaluate.py --model flux1 --model-path toy --dataset data/toy --reward toy --eval-num-prompts 36 \
#       --eval-seeds 4 --eval-num-steps 8
#   python evaluate.py --run runs/nft-1 runs/grpo-1 --base --output compare.json
# With --benchmark NAME the model (or runs) is scored on a benchmark's own prompt set instead (common/benchmarks.py):
#   python evaluate.py --benchmark geneval2 --model flux1 --reward vlm_judge,url=http://127.0.0.1:8000
import json
import os
from argparse import Namespace
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro
from accelerate import Accelerator

from common.benchmarks import BENCHMARKS, benchmark_judge, run_benchmark
from common.cache import PromptEncoder, cache_texts, condition_inputs, find_cache
from common.checkpoint import load_full_state_into, load_lora_state_into, newest_complete_checkpoint
from common.cli import CONDITIONED_MODELS, AttentionBackend, ModelName, TrainArgs, check_finite, cli_one_line
from common.data import Prompt, check_conditions, default_dataset, load_prompts
from common.evaluation import evaluate_prompts, load_hf_reference, save_hf_reference
from common.init_lora import init_lora_folder, load_init_lora, lora_file_config, merge_init_lora
from common.models import ADAPTERS, default_max_sequence_length, load_adapter, resolve_model_path
from common.scoring import check_audio_rewards, check_video_rewards
from common.tracking import format_metrics
from common.training import EMA, add_lora, full_finetune_parameters, trainable_parameters
from common.utils import UserError, install_user_error_hook, quiet_libraries, resolve_dtype
from rewards import load_run_rewards


@dataclass
class Args:
    run: list[str] = field(default_factory=list)
    """run folders (--output-dir of a training script): each is scored at its newest complete checkpoint, with the
    settings that checkpoint was trained with (its meta.json); flags below given explicitly override the evaluation
    settings of every run"""
    base: bool = False
    """with --run: also score the model the first run started from (its evaluation before the first update)"""
    output: str | None = None
    """write a JSON list with one object per scored model: `name`, `epoch` (-1: untrained) and the eval keys of
    metrics.jsonl"""
    best_of: bool = False
    """also report each metric's best-of-N: the mean over prompts of the best of the --eval-seeds samples (for a
    pass/fail check, the share of prompts some sample gets right: what sharpening alone could reach)"""
    save_hf: str | None = None
    """write the scored model's blur measure per sample (prompt, seed, h, strict) to this JSON file: a teacher's
    reference for --eval-hf-reference (one model only)"""
    eval_hf_reference: str | None = None
    """a teacher's reference file (--save-hf): also report eval_blur_ratio, H over the teacher's H on the same
    prompts × seeds (unset: the run's)"""
    init_lora: str | None = None
    """without --run: score this LoRA (a folder holding pytorch_lora_weights.safetensors, or a run folder) on the
    model given by the flags; with --merge-init-lora, merged into it (a run's own come from the run)"""
    merge_init_lora: bool = False
    """merge --init-lora into the base weights (without --run)"""
    grid_dir: str = "runs/evaluate"
    """folder for each scored model's captioned sample grid"""
    # The model, data and evaluation; unset ones come from the run (with --run) or take the training defaults.
    model: ModelName | None = None
    """model family (without --run: flux1)"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` / `toy` for the offline ones"""
    dataset: str | None = None
    """folder with the test split (without --run: the default prompt set)"""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a reward as NAME[:WEIGHT][,KEY=VALUE...]; repeat for several (without --run and none given:
    jpeg_compressibility)"""
    judge: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """a held-out judge (the --reward syntax), logged as eval_judge_<name>; repeat for several (with --run: the run's
    own --judge flags unless given)"""
    resolution: int | None = None
    max_sequence_length: int | None = None
    num_frames: int | None = None
    condition_size: int | None = None
    guidance_scale: float | None = None
    """FLUX.1's guidance embedding or the true-CFG scale (unset: the run's, else the model's reference value)"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    eval_num_prompts: int | None = None
    """the first N test prompts"""
    eval_seeds: int | None = None
    """samples per prompt, at the training scripts' fixed seeds"""
    eval_num_steps: int | None = None
    """Euler ODE steps"""
    batch_size: int | None = None
    """samples per forward pass (the run's own --batch-size reproduces its numbers exactly)"""
    cache_dir: str | None = None
    """embedding cache root (unset: the default root, when it holds a match)"""
    reward_device: Literal["accelerator", "cpu"] = "accelerator"
    attention_backend: AttentionBackend | None = None
    """diffusers' attention kernel for sampling (unset: the run's)"""
    benchmark: str | None = None
    """score on a benchmark's prompt set instead of the test split: geneval2 (its atoms asked through the first
    --reward vlm_judge,url=...; docs/running.md#benchmarks)"""
    benchmark_prompts: str | None = None
    """the benchmark's prompt file (unset: its example in data/, e.g. data/geneval2/example.jsonl); it pins the
    prompts and seeds, so --eval-num-prompts and --eval-seeds do not apply"""
    benchmark_dir: str = "runs/benchmark"
    """folder for a benchmark's results: per model NAME-BENCHMARK.json (every sample's scores and the tables),
    NAME-BENCHMARK.md (the tables) and NAME-BENCHMARK/ (the samples as PNG)"""


# With --run, the flags that may differ from the run's own: what is evaluated and where the model is found.
EVAL_FLAGS = ("eval_num_prompts", "eval_seeds", "eval_num_steps", "batch_size", "reward", "judge", "dataset",
              "guidance_scale", "model_path", "cache_dir", "reward_device", "attention_backend",
              "eval_hf_reference")


def check(args: Args) -> None:
    check_finite(args)
    for name in ("eval_num_prompts", "eval_seeds", "eval_num_steps", "batch_size", "resolution"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.benchmark is not None and args.benchmark not in BENCHMARKS:
        raise UserError(f"unknown --benchmark {args.benchmark!r}; choose from: {', '.join(BENCHMARKS)}")
    if args.benchmark_prompts is not None and args.benchmark is None:
        raise UserError("--benchmark-prompts is the prompt file of a --benchmark: give --benchmark too")
    if args.save_hf is not None and (len(args.run) > 1 or (args.run and args.base)):
        raise UserError("--save-hf writes one model's reference: score one (no --run, or one --run without --base)")
    if (args.init_lora is not None or args.merge_init_lora) and args.run:
        raise UserError("--init-lora scores a LoRA without --run (a run's own --init-lora comes from the run)")
    if args.merge_init_lora and args.init_lora is None:
        raise UserError("--merge-init-lora merges the LoRA given by --init-lora: give --init-lora DIR")
    if args.eval_hf_reference is not None and not Path(args.eval_hf_reference).is_file():
        raise UserError(f"--eval-hf-reference {args.eval_hf_reference} is not a file")
    if args.base and not args.run:
        raise UserError("--base scores the model a --run started from: give --run (without it the model given by "
                        "the flags is scored untrained anyway)")
    # Where the results go is checked now, not after the scoring.
    if args.benchmark is None:
        check_folder("--grid-dir", Path(args.grid_dir))
    else:
        check_folder("--benchmark-dir", Path(args.benchmark_dir))
    if args.output is not None:
        output = Path(args.output)
        if output.is_dir():
            raise UserError(f"--output {output} is a folder: give the name of the JSON file to write")
        if not output.parent.is_dir():
            raise UserError(f"--output {output}: the folder {output.parent} does not exist")
        if not os.access(output.parent, os.W_OK | os.X_OK):
            raise UserError(f"--output {output}: the folder {output.parent} is not writable")


def check_folder(flag: str, folder: Path) -> None:
    """One line when `folder` (made when first written) cannot be: it, or the nearest of its parents that exists,
    is a file, or that parent is not writable."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {folder}: {'it' if existing == folder else existing} is a file, not a folder")
    if existing != folder and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: {existing} is not writable")


def newest_checkpoint(folder: Path, accelerator):
    """The run's newest complete checkpoint (a damaged newer one is skipped, as on --resume, and named in one line);
    it carries the flags of the start that wrote it (meta.json `args`)."""
    metas = sorted((folder / "checkpoints").glob("epoch_*/meta.json"), reverse=True)
    if not metas:
        raise UserError(f"--run {folder}: no checkpoint (not a run folder, or a run stopped before its first one)")
    try:
        full_finetune = bool(json.loads(metas[0].read_text()).get("full_finetune"))
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        full_finetune = (metas[0].parent / "transformer").is_dir()
    checkpoint, skipped = newest_complete_checkpoint(folder, full_finetune, accelerator.process_index)
    if checkpoint is None:
        raise UserError(f"--run {folder}: no complete checkpoint ({'; '.join(skipped) or 'none is left'})")
    if skipped:
        accelerator.print(f"note: --run {folder}: skipped checkpoints that do not load completely: "
                          f"{'; '.join(skipped)}; scoring {checkpoint.folder.name} instead")
    if "args" not in checkpoint.meta:
        raise UserError(f"--run {folder}: {checkpoint.folder.name} was saved before checkpoints carried their "
                        f"settings; evaluate it with explicit flags")
    return checkpoint


def settings(args: Args, saved: dict | None) -> Namespace:
    """The run's settings (or the training defaults), with the flags given here on top."""
    values = dict(saved) if saved is not None else {k: v for k, v in asdict(TrainArgs()).items()}
    if saved is None:
        values["guidance"] = None
    for name, value in asdict(args).items():
        given = value not in (None, [])
        if (name in values or name in EVAL_FLAGS) and given and (saved is None or name in EVAL_FLAGS):
            values[name] = value
    values["eval_num_steps"] = values["eval_num_steps"] or values["num_steps"]  # unset: the rollout's steps
    values["dataset"] = values["dataset"] or default_dataset(values["model"])
    if values["max_sequence_length"] is None:  # unset here and in the training defaults: the model's own
        values["max_sequence_length"] = default_max_sequence_length(values["model"])
    return Namespace(**values)


def load_model(s: Namespace, accelerator, test: list | None = None):
    """The adapter and prompt encoder for settings `s` (the untrained transformer), and the prompts to score: `test`,
    or the dataset's test split."""
    test = test if test is not None else load_prompts(s.dataset, "test")[: s.eval_num_prompts]
    check_conditions(test, *ADAPTERS[s.model].condition_images, s.model)
    dtype = resolve_dtype(s.dtype, accelerator.device)
    model_path = resolve_model_path(s.model, s.model_path)
    cache = find_cache(s.model, model_path, s.max_sequence_length, dtype,
                       cache_texts([], test, ADAPTERS[s.model].true_cfg), s.cache_dir, not s.cache,
                       condition_inputs(s.model, s.resolution, s.condition_size, s.num_frames))
    adapter = load_adapter(s.model, model_path, accelerator.device, dtype, s.resolution, s.max_sequence_length,
                           load_text_encoders=cache is None, num_frames=s.num_frames,
                           condition_size=s.condition_size)
    adapter.check_condition_shapes(test)
    if getattr(s, "attention_backend", None) is not None:  # runs saved before the flag have none
        adapter.set_attention_backend(s.attention_backend, backward=False)
    adapter.transformer.to(accelerator.device)
    if getattr(s, "init_lora", None):  # runs saved before the flag have none
        folder = init_lora_folder(s.init_lora, s.model)
        if s.merge_init_lora:
            merge_init_lora(adapter.transformer, folder)
        else:  # the run's own LoRA (`trained`) has the same rank and α
            config = lora_file_config(folder)
            add_lora(adapter.transformer, config["r"], config["lora_alpha"], adapter.lora_target_modules,
                     adapter.unused_modules(adapter.transformer))
            trainable_parameters(adapter.transformer)
            load_init_lora(adapter.transformer, folder, config["r"], config["lora_alpha"])
    return adapter, PromptEncoder(adapter, cache), test


def score(name: str, epoch: int, s: Namespace, adapter, encode, rewards, test, accelerator, grid_dir: Path, ema=None,
          best_of: bool = False, items_out: list | None = None) -> dict:
    guidance = s.guidance_scale if s.guidance_scale is not None else (
        s.guidance if s.guidance is not None else adapter.default_guidance_scale)
    adapter.transformer.eval()
    with ema.applied() if ema is not None else nullcontext(), torch.no_grad():
        metrics = evaluate_prompts(adapter, accelerator, encode, rewards, test, s.eval_seeds,
                                   s.eval_num_steps, s.batch_size, guidance, grid_dir / f"{name}.png",
                                   best_of=best_of, items_out=items_out,
                                   hf_reference=load_hf_reference(getattr(s, "eval_hf_reference", None)))
    return {"name": name, "epoch": epoch, **metrics}


def trained(checkpoint, s: Namespace, adapter):
    """Put a checkpoint's weights into the adapter's transformer; its epoch and the EMA (or None)."""
    transformer = adapter.transformer
    if s.full_finetune:
        load_full_state_into(transformer, checkpoint.weights)
        params = full_finetune_parameters(transformer, adapter.unused_modules(transformer))  # the EMA's, as trained
    else:
        if not getattr(transformer, "peft_config", None):  # (a run from --init-lora has it: load_model)
            add_lora(transformer, s.lora_rank, s.lora_alpha, adapter.lora_target_modules,
                     adapter.unused_modules(transformer))
        params = trainable_parameters(transformer)  # float32, as trained
        load_lora_state_into(transformer, checkpoint.weights, str(checkpoint.folder))
    ema = None
    if s.ema:
        ema = EMA(params, s.ema_decay, module=transformer)
        ema.load_state_dict(checkpoint.states["ema"])
    return checkpoint.meta["epoch"], ema


def table(results: list[dict]) -> str:
    """One row per eval mean: its value ± standard error for each scored model."""
    keys = [k for k in results[0] if k.startswith("eval_") and not k.endswith("_se") and "_best_of_" not in k]
    lines = ["| metric | " + " | ".join(r["name"] for r in results) + " |",
             "|---|" + "---|" * len(results)]
    for key in keys:
        best = [next((v for k, v in r.items() if k.startswith(key + "_best_of_")), None) for r in results]
        cells = [(f"{r[key]:.4f} ± {r[key + '_se']:.4f}" + (f" (best of N {b:.4f})" if b is not None else ""))
                 if key in r else "–" for r, b in zip(results, best)]
        lines.append(f"| {key[5:]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def score_or_benchmark(args: Args, name: str, epoch: int, model: tuple, rewards, test, judge, records, accelerator,
                       ema=None, items_out: list | None = None) -> dict:
    """`score` on the test split, or with --benchmark `run_benchmark` on its prompts; `model`: (settings, adapter,
    prompt encoder)."""
    if records is not None:
        return run_benchmark(args.benchmark, name, epoch, *model, judge, records, accelerator,
                             Path(args.benchmark_dir), ema)
    return score(name, epoch, *model, rewards, test, accelerator, Path(args.grid_dir), ema, best_of=args.best_of,
                 items_out=items_out)


def main() -> None:
    install_user_error_hook()
    quiet_libraries()
    args = cli_one_line(Args, description="Score models and runs on a dataset's test split (the training scripts' "
                                      "evaluation; see the header of evaluate.py).")
    check(args)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    grid_dir = Path(args.grid_dir)
    checkpoints = [newest_checkpoint(Path(folder), accelerator) for folder in args.run]
    jobs = [(Path(folder), c) for folder, c in zip(args.run, checkpoints)] or [(None, None)]
    records = None
    if args.benchmark is not None:
        load_records, example = BENCHMARKS[args.benchmark][:2]
        records = load_records(Path(args.benchmark_prompts) if args.benchmark_prompts else example)
    results, items = [], [] if args.save_hf else None
    for k, (folder, checkpoint) in enumerate(jobs):
        saved = checkpoint.meta["args"] if checkpoint is not None else None
        s = settings(args, saved)
        if s.model in CONDITIONED_MODELS and s.condition_size is None and saved is None:
            accelerator.print(f"note: {s.model} resizes condition images as its pipeline does (--condition-size unset)")
        if records is not None and (s.model in CONDITIONED_MODELS or ADAPTERS[s.model].video):
            raise UserError(f"--benchmark {args.benchmark} scores text-to-image models; {s.model} "
                            f"{'makes videos' if ADAPTERS[s.model].video else 'edits images'}")
        if records is not None and not any(spec.split(",")[0] == "vlm_judge" for spec in s.reward or []):
            raise UserError(f"--benchmark {args.benchmark} asks its atoms through a VLM judge: give --reward "
                            f"vlm_judge,url=http://HOST:PORT[,model=NAME] (docs/rewards.md#vlm-judge)")
        test = [Prompt(r.prompt) for r in records] if records is not None else None
        adapter, encode, test = load_model(s, accelerator, test)
        rewards = load_run_rewards(s)
        check_video_rewards(rewards, s.model, ADAPTERS[s.model].video)
        check_audio_rewards(rewards, s.model, ADAPTERS[s.model].audio)
        judge = benchmark_judge(rewards, args.benchmark) if records is not None else None
        model, scoring = (s, adapter, encode), (rewards, test, judge, records, accelerator)
        if folder is None or (args.base and k == 0):  # before the checkpoint goes into the same transformer
            name = "base" if folder is None else f"{folder.name}-base"
            results.append(score_or_benchmark(args, name, -1, model, *scoring, items_out=items))
        if folder is not None:
            epoch, ema = trained(checkpoint, s, adapter)
            results.append(score_or_benchmark(args, folder.name, epoch, model, *scoring, ema=ema, items_out=items))
        if records is None:
            accelerator.print(format_metrics(results[-1], ["name", "epoch", "eval_reward_mean"]))
    if accelerator.is_main_process:
        if records is None:
            print(table(results))
            print(f"grids: {grid_dir}")
        else:
            print(f"{args.benchmark} results and samples: {args.benchmark_dir}")
        if args.save_hf:
            if not items:
                raise UserError("--save-hf: the scored model gave no images to measure")
            save_hf_reference(args.save_hf, items, {"model": s.model, "model_path": s.model_path,
                                                    "resolution": s.resolution, "eval_num_steps": s.eval_num_steps,
                                                    "eval_seeds": s.eval_seeds, "name": results[-1]["name"]})
            print(f"blur reference: {args.save_hf} ({len(items)} samples)")
        if args.output:
            summary = [{k: v for k, v in r.items() if k not in ("tables", "prompts")} for r in results]
            tmp = Path(args.output + ".tmp")
            tmp.write_text(json.dumps(summary, indent=1) + "\n")
            os.replace(tmp, args.output)


if __name__ == "__main__":
    main()
