"""Every algorithm in algos/ on one task, N seeds each: reward against wall-clock and against samples seen.

Each (algorithm, seed) runs as its own subprocess, one at a time (OMP_NUM_THREADS=1 in the child), with the
script's own preset (default `tiny`) and the shared task flags below overriding it: model, model path, reward,
prompts dataset, resolution, group size K, prompts per epoch M, sampling steps (only when --num-steps is
given: by default each preset keeps its own) and the number of epochs, budget / (M·K). The presets differ in
learning rate, clip range, steps and trained timesteps: each is the setting tuned for that algorithm.
The references' efficiency claims this measures side by side: DiffusionNFT (arXiv:2509.16117) and AWM
(arXiv:2509.25050) against Flow-GRPO (arXiv:2505.05470), MixGRPO (arXiv:2507.21802) against DanceGRPO.

Measures (written to OUTPUT_DIR/results.md, summary.json and compare.png):
- the reward curve is `--metric`: `eval` (default) is eval_reward_mean, ODE samples of the same test prompts
  at the same seeds with the same number of steps for every algorithm (`--eval-num-steps`), every
  `--eval-every` epochs; `train` is reward_mean of each epoch's own rollouts (SDE samples for the GRPO family,
  ODE/DPM-Solver samples for NFT and AWM, so not like for like);
- wall-clock is training time: the sum over epochs of rollout + reward + training time from metrics.jsonl
  (start-up, evaluation and checkpoints excluded, so evaluation frequency does not bias it);
- final reward: the mean of the curve's last 10% of points (at least one);
- threshold: `--threshold` when given, else start + `--threshold-gain`, where start is the mean of the
  first `--start-points` points of every run (all algorithms and seeds: the same initial model);
- epochs / time to threshold: the first point where the trailing mean over `--smooth` points reaches the
  threshold; mean ± std over the seeds that reach it (the count is shown);
- time per epoch: rollout / reward / training seconds, the mean over the epochs after `--warmup`.

Mean ± std is over seeds (population std). Time-to-threshold ratios are the baseline's time over each
algorithm's; epoch-time ratios are each algorithm's over the baseline's.

CPU default (tiny FLUX.1, JPEG compressibility, 5 algorithms × 3 seeds × 150 epochs; 13m49s on a 2-core CPU):
  OMP_NUM_THREADS=1 python benchmarks/compare.py

GPU (published FLUX.1-dev, each paper's preset at one shared 512px/M=48/K=24 task, 8 processes per run,
100 epochs; set the budget to what you can afford, and --threshold or --threshold-gain on the reward's own
scale: the 0.5 default is for the tiny JPEG task; pickscore here is logit_scale·cos/26):
  python benchmarks/compare.py --model-path None --resolution 512 --reward pickscore --group-size 24 \\
      --prompts-per-epoch 48 --budget 115200 --eval-every 10 --eval-num-steps 28 --eval-num-prompts 64 \\
      --preset none --algo-preset grpo flux1-flowgrpo grpo_guard flux1-grpo-guard mixgrpo flux1-mixgrpo \\
      nft flux1 awm flux1 --launcher "accelerate launch --num_processes 8" --seeds 1 2 3
"""
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro
from PIL import Image, ImageDraw, ImageFont

from common.utils import UserError, install_user_error_hook

REPO = Path(__file__).resolve().parent.parent
ALGOS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127)]


@dataclass
class Args:
    algos: list[str] = field(default_factory=lambda: list(ALGOS))
    """scripts of algos/ to run (file names without .py)"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of each algorithm"""
    output_dir: str = "runs/compare"
    """where each run's folder, results.md, summary.json and compare.png go"""
    reuse: bool = False
    """keep a run whose metrics.jsonl already holds every epoch instead of running it again"""
    launcher: str = ""
    """command that starts each script (default: this python), e.g. "accelerate launch --num_processes 8" """
    preset: str = "tiny"
    """preset of every script (its own tuned lr, clip, steps, ...); the task flags below override it"""
    algo_preset: dict[str, str] = field(default_factory=dict)
    """per-algorithm preset as ALGO NAME pairs, e.g. grpo flux1-flowgrpo nft flux1 (preset names differ)"""
    extra_args: str = ""
    """more flags passed to every script, e.g. "--batch-size 4" """

    # The task (passed to every script)
    model: str = "flux1"
    """model family"""
    model_path: str | None = "tiny"
    """pipeline hub id or folder; `tiny` builds the offline tiny model; None: the published model"""
    reward: list[str] = field(default_factory=lambda: ["jpeg_compressibility"])
    """reward(s), as each script's --reward"""
    dataset: str | None = None
    """prompts folder (default: each script's default dataset)"""
    resolution: int = 64
    """image size"""
    group_size: int = 8
    """K: samples per prompt"""
    prompts_per_epoch: int = 2
    """M: prompts per epoch"""
    num_steps: int | None = None
    """sampling steps of the rollouts (default: each preset's own, e.g. NFT/AWM sample with fewer steps)"""
    budget: int = 2400
    """total rollout samples per run; epochs = budget // (M·K)"""
    eval_every: int = 5
    """evaluate every N epochs (the `eval` curve's spacing)"""
    eval_num_steps: int = 8
    """ODE steps of evaluation, the same for every algorithm"""
    eval_num_prompts: int = 8
    """test prompts evaluated (fixed seeds)"""

    # Analysis
    metric: str = "eval"
    """curve to compare: eval (eval_reward_mean) or train (reward_mean of the rollouts)"""
    threshold: float | None = None
    """reward threshold (default: start + --threshold-gain)"""
    threshold_gain: float = 0.5
    """threshold above the start (the mean of every run's first --start-points points) when --threshold is unset;
    0.5 is about half the JPEG gain the tiny runs make in 150 epochs"""
    start_points: int = 2
    """points per run averaged into the start"""
    smooth: int = 3
    """trailing-mean window (points) before comparing with the threshold"""
    warmup: int = 2
    """first epochs left out of the time-per-epoch means (first calls are slow)"""
    baseline: str = "grpo"
    """algorithm the ratios compare with (no ratios when it is not among --algos)"""


def run_one(args: Args, algo: str, seed: int, epochs: int, run_dir: Path) -> float:
    """Run one script to completion in a subprocess; returns its wall time (s), start-up included."""
    flags = ["--preset", args.algo_preset.get(algo, args.preset), "--seed", seed, "--output-dir", run_dir,
             "--model", args.model, "--resolution", args.resolution, "--group-size", args.group_size,
             "--prompts-per-epoch", args.prompts_per_epoch, "--epochs", epochs, "--eval-every", args.eval_every,
             "--eval-num-steps", args.eval_num_steps, "--eval-num-prompts", args.eval_num_prompts,
             "--save-every", 0]
    if args.model_path is not None:
        flags += ["--model-path", args.model_path]
    if args.dataset is not None:
        flags += ["--dataset", args.dataset]
    if args.num_steps is not None:
        flags += ["--num-steps", args.num_steps]
    for reward in args.reward:
        flags += ["--reward", reward]
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    command = launcher + [str(REPO / "algos" / f"{algo}.py"), *map(str, flags), *shlex.split(args.extra_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    start = time.time()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    (run_dir / "stderr.log").write_text(result.stderr)
    if result.returncode:
        raise SystemExit(f"{shlex.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return time.time() - start


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def curve(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(training seconds so far, samples seen, reward) at each epoch that logged `key`."""
    seconds = np.cumsum([m["rollout_time_s"] + m["reward_time_s"] + m["train_time_s"] for m in metrics])
    rows = [(seconds[i], m["samples_seen"], m[key]) for i, m in enumerate(metrics) if key in m]
    return tuple(np.array(column, dtype=float) for column in zip(*rows))


def first_reach(values: np.ndarray, threshold: float, smooth: int) -> int | None:
    """Index of the first point whose trailing mean over `smooth` points (fewer at the start) is ≥ threshold."""
    for i in range(len(values)):
        if values[max(0, i - smooth + 1): i + 1].mean() >= threshold:
            return i
    return None


def mean_std(values) -> str:
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.3f} ± {values.std():.3f}" if len(values) else "–"


def summarise(args: Args, runs: dict[str, list[dict]]) -> tuple[dict, float, float]:
    """Per-algorithm numbers (lists over seeds) from the runs' metrics; also the start and the threshold."""
    key = {"eval": "eval_reward_mean", "train": "reward_mean"}[args.metric]
    curves = {algo: [curve(m, key) for m in seeds] for algo, seeds in runs.items()}
    start = float(np.mean([c[2][: args.start_points].mean() for cs in curves.values() for c in cs]))
    threshold = args.threshold if args.threshold is not None else start + args.threshold_gain
    summary = {}
    for algo, cs in curves.items():
        row = {"final": [], "epochs_to": [], "time_to": [], "samples_to": [], "rollout": [], "reward": [],
               "train": [], "epoch": [], "reached": 0, "seeds": len(cs)}
        for (seconds, samples, reward), metrics in zip(cs, runs[algo]):
            row["final"].append(reward[-max(1, math.ceil(0.1 * len(reward))):].mean())
            hit = first_reach(reward, threshold, args.smooth)
            if hit is not None:
                row["reached"] += 1
                epoch = int(samples[hit] // (args.group_size * args.prompts_per_epoch))
                row["epochs_to"].append(epoch)
                row["time_to"].append(seconds[hit])
                row["samples_to"].append(samples[hit])
            timed = metrics[args.warmup:] or metrics
            for part in ("rollout", "reward", "train"):
                row[part].append(np.mean([m[f"{part}_time_s"] for m in timed]))
            row["epoch"].append(np.mean([m["rollout_time_s"] + m["reward_time_s"] + m["train_time_s"] for m in timed]))
        summary[algo] = {k: [float(x) for x in v] if isinstance(v, list) else v for k, v in row.items()}
    return summary, start, threshold


def write_table(args: Args, summary: dict, start: float, threshold: float, epochs: int, wall: dict) -> str:
    how = (f"--threshold {threshold:.3f}" if args.threshold is not None else
           f"start {start:.3f} (mean of every run's first {args.start_points} points) + {args.threshold_gain}")
    lines = [f"{args.model} `{args.model_path}`, {args.resolution}px, reward {', '.join(args.reward)}, "
             f"M={args.prompts_per_epoch} prompts × K={args.group_size}, budget {args.budget} samples = {epochs} "
             f"epochs, seeds {' '.join(map(str, args.seeds))}; each algorithm with its own `--preset "
             f"{args.preset}` (the presets differ in lr, clip range, steps, trained timesteps)"
             + (f", per-algorithm presets {args.algo_preset}" if args.algo_preset else "") + ".",
             f"Reward: {'eval_reward_mean (ODE, ' + str(args.eval_num_steps) + ' steps, ' + str(args.eval_num_prompts) + ' test prompts, fixed seeds, every ' + str(args.eval_every) + ' epochs)' if args.metric == 'eval' else 'reward_mean of the rollouts'}; "
             f"final = mean of the last 10% of points; threshold {threshold:.3f} = {how}, reached when the "
             f"trailing mean over {args.smooth} points is ≥ it. Times are training seconds (rollout + reward + "
             f"training; start-up and evaluation excluded), per epoch after {args.warmup} warm-up epochs. "
             f"Mean ± std over seeds.", "",
             "| algorithm | final reward | reached | epochs to threshold | time to threshold (s) | "
             "rollout s/epoch | reward s/epoch | train s/epoch | epoch s | run wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for algo, row in summary.items():
        lines.append(f"| {algo} | {mean_std(row['final'])} | {row['reached']}/{row['seeds']} | "
                     f"{mean_std(row['epochs_to'])} | {mean_std(row['time_to'])} | {mean_std(row['rollout'])} | "
                     f"{mean_std(row['reward'])} | {mean_std(row['train'])} | {mean_std(row['epoch'])} | "
                     f"{mean_std(wall[algo])} |")
    base = summary.get(args.baseline)
    if base is not None:
        lines.append("")
        for algo, row in summary.items():
            if algo == args.baseline:
                continue
            b = args.baseline
            parts = [f"epoch time {algo}/{b} = {np.mean(row['epoch']) / np.mean(base['epoch']):.2f}"]
            if row["time_to"] and base["time_to"]:
                parts.append(f"time to threshold {b}/{algo} = {np.mean(base['time_to']) / np.mean(row['time_to']):.2f} "
                             f"(epochs {np.mean(base['epochs_to']) / np.mean(row['epochs_to']):.2f}; over the seeds "
                             f"that reach it: {row['reached']}/{row['seeds']} and {base['reached']}/{base['seeds']})")
            else:
                parts.append(f"time to threshold: {algo if not row['time_to'] else b} never reaches it")
            lines.append(f"- {algo} vs {b}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


# ---- the plot, drawn with PIL (matplotlib is not a dependency) -----------------------------------------
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 × 10^k steps) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def draw_panel(img: Image.Image, box: tuple[int, int, int, int], series: dict, xlabel: str, ylabel: str,
               font, ylim: tuple[float, float]):
    """One panel: per algorithm a (x, mean, lo, hi) band and line inside box = (left, top, right, bottom)."""
    left, top, right, bottom = box
    xmax = max(float(s[0].max()) for s in series.values())
    xticks, yticks = nice_ticks(0.0, xmax), nice_ticks(*ylim)
    x0, x1, y0, y1 = 0.0, max(xticks[-1], xmax), min(yticks[0], ylim[0]), max(yticks[-1], ylim[1])
    px = lambda x: left + (x - x0) / (x1 - x0) * (right - left)  # noqa: E731
    py = lambda y: bottom - (y - y0) / (y1 - y0) * (bottom - top)  # noqa: E731
    draw = ImageDraw.Draw(img)
    for t in xticks:
        draw.line([(px(t), top), (px(t), bottom)], fill=(232, 232, 232))
        draw.line([(px(t), bottom), (px(t), bottom + 5)], fill="black")
        draw.text((px(t), bottom + 8), f"{t:g}", fill="black", font=font, anchor="mt")
    for t in yticks:
        draw.line([(left, py(t)), (right, py(t))], fill=(232, 232, 232))
        draw.line([(left - 5, py(t)), (left, py(t))], fill="black")
        draw.text((left - 8, py(t)), f"{t:.3g}", fill="black", font=font, anchor="rm")
    draw.rectangle(box, outline="black")
    draw.text(((left + right) / 2, bottom + 30), xlabel, fill="black", font=font, anchor="mt")
    label = Image.new("RGBA", (int(draw.textlength(ylabel, font=font)) + 4, 20), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((2, 2), ylabel, fill="black", font=font)
    label = label.rotate(90, expand=True)
    img.paste(label, (left - 75, (top + bottom) // 2 - label.height // 2), label)
    for (x, mean, lo, hi), color in zip(series.values(), COLORS):
        band = Image.new("RGBA", img.size, (0, 0, 0, 0))
        polygon = [(px(a), py(b)) for a, b in zip(x, hi)] + [(px(a), py(b)) for a, b in zip(x[::-1], lo[::-1])]
        if len(polygon) >= 3:
            ImageDraw.Draw(band).polygon(polygon, fill=color + (60,))
            img.alpha_composite(band)
        points = [(px(a), py(b)) for a, b in zip(x, mean)]
        ImageDraw.Draw(img).line(points, fill=color, width=2) if len(points) > 1 else None
        for p in points if len(points) == 1 else []:
            ImageDraw.Draw(img).ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=color)


def plot(args: Args, runs: dict[str, list[dict]], threshold: float, path: Path, size=(1400, 560)):
    """Reward against training wall-clock (x: the seeds' mean time at each point) and against samples seen;
    line = mean over seeds, band = min–max over seeds."""
    key = {"eval": "eval_reward_mean", "train": "reward_mean"}[args.metric]
    by_time, by_samples = {}, {}
    for algo, seeds in runs.items():
        curves = [curve(m, key) for m in seeds]
        n = min(len(c[2]) for c in curves)
        seconds, samples, reward = (np.stack([c[i][:n] for c in curves]) for i in range(3))
        stats = (reward.mean(0), reward.min(0), reward.max(0))
        by_time[algo], by_samples[algo] = (seconds.mean(0), *stats), (samples[0], *stats)
    all_rewards = np.concatenate([np.concatenate(s[2:]) for s in by_time.values()] + [[threshold]])
    pad = 0.05 * (all_rewards.max() - all_rewards.min() or 1.0)
    ylim = (float(all_rewards.min() - pad), float(all_rewards.max() + pad))
    font = ImageFont.load_default(size=15)
    img = Image.new("RGBA", size, "white")
    width, height = size
    ylabel = f"{'eval' if args.metric == 'eval' else 'train'} reward ({', '.join(args.reward)})"
    panels = [(by_time, "training wall-clock (s)"), (by_samples, "samples seen")]
    for i, (series, xlabel) in enumerate(panels):
        left = 95 + i * width // 2
        box = (left, 40, left + width // 2 - 130, height - 110)
        draw_panel(img, box, series, xlabel, ylabel, font, ylim)
        draw = ImageDraw.Draw(img)
        y = box[1] + (ylim[1] - threshold) / (ylim[1] - ylim[0]) * (box[3] - box[1])
        for xs in range(box[0], box[2], 12):  # dashed threshold line
            draw.line([(xs, y), (min(xs + 6, box[2]), y)], fill=(90, 90, 90))
    draw = ImageDraw.Draw(img)
    draw.text((width / 2, 12), f"{args.model} {args.model_path}: {args.metric} reward, mean over "
              f"{len(args.seeds)} seed(s), band min-max, dashed: threshold {threshold:.3f}", fill="black", font=font,
              anchor="mt")
    x = 95
    for algo, color in zip(runs, COLORS):  # legend along the bottom
        draw.line([(x, height - 25), (x + 30, height - 25)], fill=color, width=4)
        draw.text((x + 38, height - 25), algo, fill="black", font=font, anchor="lm")
        x += 60 + int(draw.textlength(algo, font=font))
    img.convert("RGB").save(path)


if __name__ == "__main__":
    install_user_error_hook()
    args = tyro.cli(Args, description=__doc__)
    unknown = [a for a in args.algos if a not in ALGOS]
    if unknown or not args.algos:
        raise UserError(f"unknown --algos {' '.join(unknown)}; choose from: {', '.join(ALGOS)}")
    if args.metric not in ("eval", "train"):
        raise UserError(f"unknown --metric {args.metric!r}; choose eval or train")
    epochs = args.budget // (args.prompts_per_epoch * args.group_size)
    if epochs < 1:
        raise UserError(f"--budget {args.budget} is less than one epoch of M·K = "
                         f"{args.prompts_per_epoch * args.group_size} samples")
    if args.metric == "eval" and args.eval_every < 1:
        raise UserError("--metric eval needs --eval-every ≥ 1; use --metric train to run without evaluation")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, wall = {a: [] for a in args.algos}, {a: [] for a in args.algos}
    begin = time.time()
    for algo in args.algos:
        for seed in args.seeds:
            run_dir = out / f"{algo}-{seed}"
            metrics = read_metrics(run_dir)
            wall_file = run_dir / "wall_time_s.txt"
            if not (args.reuse and len(metrics) == epochs and wall_file.exists()):
                print(f"[{time.time() - begin:6.0f}s] {algo} seed {seed}: {epochs} epochs", file=sys.stderr, flush=True)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
                wall_file.write_text(f"{run_one(args, algo, seed, epochs, run_dir):.3f}\n")
                metrics = read_metrics(run_dir)
            runs[algo].append(metrics)
            wall[algo].append(float(wall_file.read_text()))
    summary, start, threshold = summarise(args, runs)
    table = write_table(args, summary, start, threshold, epochs, wall)
    (out / "results.md").write_text(table)
    (out / "summary.json").write_text(json.dumps({"start": start, "threshold": threshold, "epochs": epochs,
                                                  "algorithms": summary, "run_wall_s": wall}, indent=1))
    plot(args, runs, threshold, out / "compare.png")
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'summary.json'}, {out / 'compare.png'} "
          f"({time.time() - begin:.0f}s)")
