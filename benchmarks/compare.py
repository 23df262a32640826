"""Every algorithm in algos/ on one task, N seeds each: a metric against wall-clock and against samples seen.

Default: the toy race. The toy world (worlds/toy/, data/toy/) is a CPU-sized GenEval; every
script of algos/ × seeds 1 2 3 runs its own `--preset toy` (the pretrained 2.7 MB FLUX.1 `--model-path toy`,
`--dataset data/toy`, `--reward toy`, 32 px, 16 text tokens, and that algorithm's own M, K, steps, lr, clip, ...)
for 768 rollout samples, compared on `eval_toy_strict`, the held-out GenEval-style success rate (all 36 test
prompts × 4 fixed seeds), in 12-20 minutes on 2 cores (23-38 CPU-minutes, as fast as the machine):
  python benchmarks/compare.py
768 samples are the first 1-2 CPU-minutes of each preset (12 of NFT's 30 epochs, 6 of GRPO's 100): the race
measures how fast each algorithm starts, not where it ends. The presets' own lengths (`--budget None`: 20-100
epochs, 2-14 CPU-minutes a run, ~1.5 hours for 24 runs on 2 cores) are where docs/toy-world.md's results come from.

Each (algorithm, seed) runs as its own subprocess with OMP_NUM_THREADS=1, `--jobs` of them at a time (default 2: a
2-core machine runs two one-thread runs side by side; after each algorithm's first run, the longest go first). The
task flags (--model, --model-path, --reward, --dataset, --resolution, --group-size K, --prompts-per-epoch M,
--num-steps) are optional: unset, each preset keeps its own value; given, they are passed to every script and
override its preset. The run length is `--budget` (total rollout samples per run) // (M·K) of each algorithm's M·K
(read from the script's PRESETS with the overrides applied), or with `--budget None` each preset's own `epochs`. The
evaluation (--eval-every, --eval-num-steps, --eval-num-prompts, --eval-seeds) is always passed, the same for every
algorithm. The references' efficiency claims this measures side by side: DiffusionNFT (arXiv:2509.16117) and AWM
(arXiv:2509.25050) against Flow-GRPO (arXiv:2505.05470), MixGRPO (arXiv:2507.21802) against DanceGRPO.

Measures (written to OUTPUT_DIR/results.md, summary.json and compare.png; each run's folder also holds
stdout.log, stderr.log, wall_time_s.txt and cpu_time_s.txt):
- the curve is `--metric KEY`, any numeric key of metrics.jsonl (default eval_toy_strict; `eval` is
  eval_reward_mean, `train` is reward_mean of each epoch's own rollouts: SDE samples for the GRPO family,
  ODE/solver samples for NFT and AWM, so not like for like). Evaluation keys are Euler-ODE samples of the same
  test prompts at the same seeds with the same steps for every algorithm, every --eval-every epochs and after
  the last; the first point is the evaluation of the untrained model, before the first update;
- wall-clock is training time: the sum over epochs of rollout + reward + training time from metrics.jsonl
  (start-up, evaluation and checkpoints excluded, so evaluation frequency does not bias it);
- CPU time: user + system time of each run's process (and of the processes it started and waited for, e.g.
  under a launcher), from os.wait4; "CPU min to threshold" estimates the training's share of it as the run's CPU
  time × (training seconds to threshold / the run's wall seconds), so that start-up and evaluation are left out here
  too (spread over the training seconds alone, as before 2026-12-05, they counted as training: a fifth to a quarter
  of a toy edit run's wall time, evaluated every 20 epochs);
- base: the first point; final: the mean of the curve's last 10% of points (at least one); best: its maximum;
- threshold: `--threshold` when given, else each run's own base + `--threshold-gain` (on the metric's own scale: the
  default 0.05 is five points of strict success), where a run's base is the mean of its first `--start-points` points
  (the first is the evaluation before the first update); start, drawn in the plot, is the mean of the bases;
- epochs / samples / time to threshold: the first point where the trailing mean over `--smooth` points reaches
  the threshold; mean ± std over the seeds that reach it (the count is shown);
- time per epoch: rollout / reward / training seconds, the mean over the epochs after `--warmup`.

Mean ± std is over seeds (population std). Time-to-threshold ratios are the baseline's time over each
algorithm's; epoch-time ratios are each algorithm's over the baseline's. A second table gives every (algorithm, seed):
its base, final, best, and the samples and CPU-seconds it took to reach its threshold; the ratios to the baseline
follow with their spread (min–max over every pair of a baseline seed and an algorithm seed that both reach it). The
table's caption holds the command that made it.

The papers' speed claims (NFT up to 25×, AWM up to 24× fewer samples or less time than Flow-GRPO) need runs long
enough that grpo reaches the threshold: every preset's own length, base + 0.10, evaluated every 2 epochs
(docs/benchmarks.md has its table and wall time):
  python benchmarks/compare.py --budget None --threshold-gain 0.10 --eval-every 2 --output-dir runs/compare-long

CPU, the tiny FLUX.1 with the JPEG reward instead (each script's `tiny` preset; 2400 samples = 150 epochs):
  python benchmarks/compare.py --preset tiny --model-path tiny --reward jpeg_compressibility --resolution 64 \\
      --group-size 8 --prompts-per-epoch 2 --budget 2400 --metric eval --threshold-gain 0.5 --start-points 2 \\
      --smooth 3 --eval-every 5 --eval-num-prompts 8 --eval-seeds 1

GPU (published FLUX.1-dev, each paper's preset at one shared 512px/M=48/K=24 task, 8 processes per run, one run
at a time, 100 epochs; set the budget to what you can afford, and add --threshold or --threshold-gain on the
reward's own scale: pickscore here is logit_scale·cos/26, and the 0.05 default is meant for eval_toy_strict):
  python benchmarks/compare.py --resolution 512 --reward pickscore --group-size 24 --prompts-per-epoch 48 \\
      --budget 115200 --metric eval --eval-every 10 --eval-num-steps 28 --eval-num-prompts 64 --eval-seeds 1 \\
      --preset none --algo-preset grpo flux1-flowgrpo grpo_guard flux1-grpo-guard mixgrpo flux1-mixgrpo \\
      nft flux1 awm flux1 dpo flux1 dgpo flux1 crd flux1 --launcher "accelerate launch --num_processes 8" \\
      --jobs 1 --seeds 1 2 3
"""
import json
import math
import os
import runpy
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro
from PIL import Image, ImageDraw, ImageFont

from common.cli import cli_one_line
from common.cluster import output_dir_holder
from common.data import default_dataset
from common.utils import UserError, install_user_error_hook

REPO = Path(__file__).resolve().parent.parent
ALGOS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
# one colour per script of algos/ (there were 8 for 11 scripts: zip() left the 9th and later out of the plot)
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207), (0, 0, 128), (0, 0, 0), (128, 0, 0),
          (0, 128, 128), (255, 215, 0), (106, 61, 154)]
ALIASES = {"eval": "eval_reward_mean", "train": "reward_mean"}
# Flags this script passes to every script itself: --extra-args may not set them too.
MANAGED = ["--preset", "--seed", "--output-dir", "--epochs", "--model", "--model-path", "--reward", "--dataset",
           "--resolution", "--group-size", "--prompts-per-epoch", "--num-steps", "--eval-every", "--eval-num-steps",
           "--eval-num-prompts", "--eval-seeds", "--save-every"]


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
    jobs: int = 2
    """runs at a time, each a one-thread process (OMP_NUM_THREADS=1); use 1 when each run takes a whole machine"""
    launcher: str = ""
    """command that starts each script (default: this python), e.g. "accelerate launch --num_processes 8" """
    preset: str = "toy"
    """preset of every script (its own tuned M, K, lr, clip, steps, epochs, ...); the task flags below override it"""
    algo_preset: dict[str, str] = field(default_factory=dict)
    """per-algorithm preset as ALGO NAME pairs, e.g. grpo flux1-flowgrpo nft flux1 (preset names differ)"""
    extra_args: str = ""
    """more flags passed to every script, e.g. --extra-args="--batch-size 4" (with `=`: the value starts with --);
    not the flags this script passes itself"""

    # The task: unset, each preset's own value; given, passed to every script
    model: str | None = None
    """model family"""
    model_path: str | None = None
    """pipeline hub id or folder; `tiny` builds the offline tiny model, `toy` is the toy world's FLUX.1"""
    reward: Annotated[list[str], tyro.conf.UseAppendAction] = field(default_factory=list)
    """reward(s), as each script's --reward: repeat the flag for several (none given: each preset's own)"""
    dataset: str | None = None
    """prompts folder"""
    resolution: int | None = None
    """image size"""
    group_size: int | None = None
    """K: samples per prompt"""
    prompts_per_epoch: int | None = None
    """M: prompts per epoch"""
    num_steps: int | None = None
    """sampling steps of the rollouts (e.g. NFT/AWM presets sample with fewer steps)"""
    budget: int | None = 768
    """total rollout samples per run: epochs = budget // (M·K) of each algorithm; `--budget None`: each preset's
    own epochs. The default, 768 (12 epochs of the toy presets' 8×8, 6 of GRPO's 8×16), is what fits 8 algorithms ×
    3 seeds in 12-20 minutes on 2 cores: the toy race, the first 1-2 CPU-minutes of each preset"""

    # Evaluation: always passed, the same for every algorithm
    eval_every: int = 4
    """evaluate every N epochs and after the last (the spacing of an evaluation curve)"""
    eval_num_steps: int = 8
    """Euler-ODE steps of evaluation"""
    eval_num_prompts: int = 36
    """test prompts evaluated (the first N of the test split; the toy world holds out 36)"""
    eval_seeds: int = 4
    """fixed seeds per test prompt"""

    # Analysis
    metric: str = "eval_toy_strict"
    """curve to compare: any numeric metrics.jsonl key; `eval` is eval_reward_mean, `train` is reward_mean (the
    rollouts' own rewards)"""
    threshold: float | None = None
    """threshold on the metric (default: start + --threshold-gain)"""
    threshold_gain: float = 0.05
    """threshold above the start (the mean of every run's first --start-points points) when --threshold is unset,
    on the metric's own scale: 0.05 is five points of the toy world's strict success rate (the default race is
    short: the full toy presets gain 0.04-0.22 in 20-100 epochs, docs/toy-world.md)"""
    start_points: int = 1
    """points per run averaged into the start"""
    smooth: int = 2
    """trailing-mean window (points) before comparing with the threshold"""
    warmup: int = 2
    """first epochs left out of the time-per-epoch means (first calls are slow)"""
    baseline: str = "grpo"
    """algorithm the ratios compare with (no ratios when it is not among --algos)"""
    stop_at_threshold: bool = False
    """end each run (SIGKILL) once its curve reaches its threshold: the figures to threshold are unchanged, the
    rest of the run is not spent (its final and best are then those of the stopped run)"""


@dataclass
class Plan:
    """What one algorithm's runs are: its preset, and the script's settings after the overrides."""
    preset: str
    settings: dict
    epochs: int

    @property
    def samples_per_epoch(self) -> int:
        return self.settings["prompts_per_epoch"] * self.settings["group_size"]


def metric_key(args: Args) -> str:
    return ALIASES.get(args.metric, args.metric)


def task_overrides(args: Args) -> dict:
    """The task flags given on the command line (None or no --reward: leave each preset's own value)."""
    names = ["model", "model_path", "reward", "dataset", "resolution", "group_size", "prompts_per_epoch", "num_steps"]
    return {name: getattr(args, name) for name in names if getattr(args, name) not in (None, [])}


def plan_runs(args: Args) -> dict[str, Plan]:
    """Each algorithm's preset and settings, read from its script (runpy: the script's main block does not run)
    with the task overrides applied, and its epochs: the preset's, or --budget // (M·K)."""
    plans = {}
    for algo in args.algos:
        name = args.algo_preset.get(algo, args.preset)
        module = runpy.run_path(str(REPO / "algos" / f"{algo}.py"))
        presets = {"none": {}, **module["PRESETS"]}
        if name not in presets:
            how = "--algo-preset" if algo in args.algo_preset else "--preset"
            raise UserError(f"unknown preset {name!r} of algos/{algo}.py ({how}); choose one of: {', '.join(presets)}")
        settings = vars(replace(module["Args"](), **{**presets[name], **task_overrides(args)}))
        if settings["dataset"] is None:  # the scripts' default: the model's (common.data.default_dataset)
            settings["dataset"] = default_dataset(settings["model"])
        plan = Plan(name, settings, settings["epochs"])
        if args.budget is not None:
            plan.epochs = args.budget // plan.samples_per_epoch
            if plan.epochs < 1:
                raise UserError(f"--budget {args.budget} is less than one epoch of {algo}'s M·K = "
                                f"{plan.samples_per_epoch} samples")
        plans[algo] = plan
    return plans


def command_of(args: Args, algo: str, seed: int, epochs: int, run_dir: Path, preset: str) -> list[str]:
    flags = ["--preset", preset, "--seed", seed, "--output-dir", run_dir, "--epochs", epochs,
             "--eval-every", args.eval_every, "--eval-num-steps", args.eval_num_steps,
             "--eval-num-prompts", args.eval_num_prompts, "--eval-seeds", args.eval_seeds, "--save-every", 0]
    for name, value in task_overrides(args).items():
        for v in value if isinstance(value, list) else [value]:
            flags += ["--" + name.replace("_", "-"), v]
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    return launcher + [str(REPO / "algos" / f"{algo}.py"), *map(str, flags), *shlex.split(args.extra_args)]


class Runner:
    """Starts runs as subprocesses, `--jobs` at a time, and measures each one's wall and CPU time (os.wait4 on
    its pid: user + system time of the process and of the children it waited for)."""

    def __init__(self):
        self.live: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self, command: list[str], run_dir: Path, done=None) -> tuple[int, float, float] | None:
        """(exit status, wall seconds, CPU seconds) of one run, None when stopping; stdout and stderr go straight
        to run_dir/stdout.log and stderr.log. `done()`, asked every few seconds while the run goes, ends it early
        (SIGKILL; exit status 0 then) when it returns True."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
        with self.lock:
            if self.stopping.is_set():
                return None
            with open(run_dir / "stdout.log", "w") as stdout, open(run_dir / "stderr.log", "w") as stderr:
                start = time.time()
                process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
            self.live[process.pid] = process
        ended_early = False
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG if done else 0)
            if pid:
                break
            if not ended_early and done():
                process.kill()
                ended_early = True
            else:
                time.sleep(2.0)
        wall = time.time() - start
        # reaped here: Popen must not wait for it again
        process.returncode = 0 if ended_early else os.waitstatus_to_exitcode(status)
        with self.lock:
            del self.live[process.pid]
        return process.returncode, wall, usage.ru_utime + usage.ru_stime

    def stop(self):
        """Start nothing more and terminate the runs still going (our own children, by pid)."""
        with self.lock:
            self.stopping.set()
            for process in self.live.values():
                if process.returncode is None:
                    process.terminate()


def check_metric(key: str, metrics: list[dict], algo: str, seed: int):
    if not any(key in m for m in metrics):
        keys = sorted({k for m in metrics for k, v in m.items() if isinstance(v, (int, float))})
        raise UserError(f"--metric {key}: run {algo} seed {seed} logged no {key!r} (its numeric keys: "
                        f"{', '.join(keys)})")


def next_run(algos: list[str], measured: dict[str, float]) -> int:
    """Index of the run to start next among runs of `algos` waiting in seed-major order: an algorithm not yet
    timed first (the earliest), then the one whose first run took longest (`measured`: wall seconds)."""
    return max(range(len(algos)), key=lambda i: (algos[i] not in measured, measured.get(algos[i], 0.0), -i))


def run_all(args: Args, plans: dict[str, Plan], out: Path) -> tuple[dict, dict, dict]:
    """Every (algorithm, seed), reusing finished runs with --reuse. Each algorithm's first run starts early
    (seed-major); later runs go longest first by their algorithm's first measured wall time, so the short ones
    fill the end instead of one long run finishing alone. Returns the metrics, wall seconds and CPU seconds of
    each run, by algorithm, in --seeds order."""
    key, begin = metric_key(args), time.time()
    runs, wall, cpu, todo = {}, {}, {}, []
    for seed in args.seeds:
        for algo in args.algos:
            run_dir = out / f"{algo}-{seed}"
            files = run_dir / "wall_time_s.txt", run_dir / "cpu_time_s.txt"
            finished = (len(epoch_lines(read_metrics(run_dir))) == plans[algo].epochs
                        or (run_dir / "stopped_at_threshold.txt").exists())
            if args.reuse and finished and all(f.exists() for f in files):
                continue
            todo.append((algo, seed, run_dir, files))
    runner = Runner()

    def one(algo, seed, run_dir, files):
        run_dir.mkdir(parents=True, exist_ok=True)
        holder = output_dir_holder(run_dir)
        if holder is not None:  # another compare.py (or a hand-started run) is running it: clear nothing
            raise UserError(f"{run_dir} is in use by another run (process {holder}): wait for it to end, or use "
                            f"another --output-dir")
        stopped = run_dir / "stopped_at_threshold.txt"
        for path in (run_dir / "metrics.jsonl", stopped, *files):
            path.unlink(missing_ok=True)
        command = command_of(args, algo, seed, plans[algo].epochs, run_dir, plans[algo].preset)
        print(f"[{time.time() - begin:6.0f}s] {algo} seed {seed}: {plans[algo].epochs} epochs of "
              f"{plans[algo].samples_per_epoch} samples", file=sys.stderr, flush=True)

        def reached() -> bool:
            metrics = read_metrics(run_dir, complete_lines_only=True)
            if not any(key in m for m in metrics):
                return False
            values = curve(metrics, key)[3]
            if len(values) <= args.start_points - 1:
                return False
            if first_reach(values, run_threshold(args, values), args.smooth) is None:
                return False
            stopped.write_text(f"{epoch_lines(metrics)[-1]['epoch'] if epoch_lines(metrics) else -1}\n")
            return True

        result = runner.run(command, run_dir, reached if args.stop_at_threshold else None)
        if result is None:
            return
        status, seconds, cpu_seconds = result
        if status:
            tail = (run_dir / "stderr.log").read_text()[-3000:]
            raise SystemExit(f"{shlex.join(command)} failed ({status}):\n{tail}")
        files[0].write_text(f"{seconds:.3f}\n")
        files[1].write_text(f"{cpu_seconds:.3f}\n")
        check_metric(key, read_metrics(run_dir), algo, seed)
        print(f"[{time.time() - begin:6.0f}s] {algo} seed {seed} done: {seconds:.0f} s wall, {cpu_seconds:.0f} s CPU",
              file=sys.stderr, flush=True)
        return seconds

    measured, queue_lock = {}, threading.Lock()

    def worker():
        while True:
            with queue_lock:
                if not todo or runner.stopping.is_set():
                    return
                item = todo.pop(next_run([algo for algo, *_ in todo], measured))
            seconds = one(*item)
            if seconds is not None:
                with queue_lock:
                    measured.setdefault(item[0], seconds)

    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        pending = {pool.submit(worker) for _ in range(args.jobs)}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()  # a failed run stops the others
    except BaseException:
        runner.stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    for algo in args.algos:
        runs[algo], wall[algo], cpu[algo] = [], [], []
        for seed in args.seeds:
            run_dir = out / f"{algo}-{seed}"
            metrics = read_metrics(run_dir)
            check_metric(key, metrics, algo, seed)
            runs[algo].append(metrics)
            wall[algo].append(float((run_dir / "wall_time_s.txt").read_text()))
            cpu[algo].append(float((run_dir / "cpu_time_s.txt").read_text()))
    return runs, wall, cpu


def read_metrics(run_dir: Path, complete_lines_only: bool = False) -> list[dict]:
    """The run's metrics.jsonl; `complete_lines_only` leaves out a last line still being written (a live run)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    if complete_lines_only and not text.endswith("\n"):
        lines = lines[:-1]
    return [json.loads(line) for line in lines if line]


def run_threshold(args: Args, values: np.ndarray) -> float:
    """A run's threshold: --threshold, or its own base (the mean of its first --start-points points) + the gain."""
    return args.threshold if args.threshold is not None else values[: args.start_points].mean() + args.threshold_gain


def epoch_lines(metrics: list[dict]) -> list[dict]:
    """The training epochs' lines (not the evaluation before the first update, epoch −1)."""
    return [m for m in metrics if m["epoch"] >= 0]


def training_seconds(metrics: list[dict]) -> np.ndarray:
    """Training seconds so far (rollout + reward + training) after each epoch."""
    return np.cumsum([m["rollout_time_s"] + m["reward_time_s"] + m["train_time_s"] for m in epoch_lines(metrics)])


def curve(metrics: list[dict], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(training seconds so far, samples seen, epochs done, value) before the first update (0, 0, 0, value) and at
    each epoch that logged `key`."""
    seconds = training_seconds(metrics)
    rows = [(0.0, 0, 0, m[key]) for m in metrics if m["epoch"] < 0 and key in m]
    rows += [(seconds[i], m["samples_seen"], m["epoch"] + 1, m[key]) for i, m in enumerate(epoch_lines(metrics))
             if key in m]
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


def summarise(args: Args, runs: dict[str, list[dict]], cpu: dict[str, list[float]],
              wall: dict[str, list[float]]) -> tuple[dict, float, float]:
    """Per-algorithm numbers (lists over seeds) from the runs' metrics, CPU and wall times; also the start and the
    threshold."""
    key = metric_key(args)
    curves = {algo: [curve(m, key) for m in seeds] for algo, seeds in runs.items()}
    start = float(np.mean([c[3][: args.start_points].mean() for cs in curves.values() for c in cs]))
    threshold = args.threshold if args.threshold is not None else start + args.threshold_gain
    summary = {}
    for algo, cs in curves.items():
        row = {"base": [], "final": [], "best": [], "epochs_to": [], "time_to": [], "samples_to": [],
               "cpu_min_to": [], "rollout": [], "reward": [], "train": [], "epoch": [], "cpu_min": [],
               "reached": 0, "seeds": len(cs), "threshold": [], "per_seed_samples_to": [], "per_seed_cpu_s_to": []}
        for (seconds, samples, epochs, values), metrics, cpu_s, wall_s in zip(cs, runs[algo], cpu[algo], wall[algo]):
            row["base"].append(values[0])
            # each run from its own base (the evaluation before its first update), unless --threshold is given
            own = run_threshold(args, values)
            row["threshold"].append(own)
            row["final"].append(values[-max(1, math.ceil(0.1 * len(values))):].mean())
            row["best"].append(values.max())
            row["cpu_min"].append(cpu_s / 60)
            hit = first_reach(values, own, args.smooth)
            # an estimate: the process's CPU time spread evenly over its wall time, of which the training seconds
            # to threshold are a part (start-up and evaluations are the rest); 0 when the evaluation before the
            # first update already reaches the threshold (a stopped run may have no epoch)
            cpu_s_to = None if hit is None else 0.0 if seconds[hit] == 0 else (
                cpu_s * seconds[hit] / max(wall_s, training_seconds(metrics)[-1]))
            row["per_seed_samples_to"].append(None if hit is None else samples[hit])
            row["per_seed_cpu_s_to"].append(cpu_s_to)
            if hit is not None:
                row["reached"] += 1
                row["epochs_to"].append(epochs[hit])
                row["time_to"].append(seconds[hit])
                row["samples_to"].append(samples[hit])
                row["cpu_min_to"].append(cpu_s_to / 60)
            timed = epoch_lines(metrics)[args.warmup:] or epoch_lines(metrics)
            for part in ("rollout", "reward", "train"):
                row[part].append(np.mean([m[f"{part}_time_s"] for m in timed]) if timed else math.nan)
            row["epoch"].append(row["rollout"][-1] + row["reward"][-1] + row["train"][-1])
        summary[algo] = {k: [None if x is None else float(x) for x in v] if isinstance(v, list) else v
                         for k, v in row.items()}
    return summary, start, threshold


def command_line() -> str:
    """This run's command as typed from the repository root (the script path made relative when it is inside)."""
    script = Path(sys.argv[0]).resolve()
    script = script.relative_to(REPO) if script.is_relative_to(REPO) else Path(sys.argv[0])
    return shlex.join(["python", str(script), *sys.argv[1:]])


def describe_metric(args: Args) -> str:
    key = metric_key(args)
    if key.startswith("eval_"):
        return (f"`{key}`, held out: Euler ODE, {args.eval_num_steps} steps, the first {args.eval_num_prompts} test "
                f"prompts × {args.eval_seeds} fixed seeds, the same for every algorithm, every {args.eval_every} "
                f"epochs and after the last (the first point is the untrained model's)")
    if key == "reward_mean":
        return ("`reward_mean`, the rewards of each epoch's own rollouts (SDE samples for the GRPO family, "
                "ODE/solver samples for NFT and AWM: not like for like)")
    return f"`{key}` from metrics.jsonl"


def describe_task(plans: dict[str, Plan]) -> str:
    """The task settings: one value when every algorithm has the same, else each algorithm's."""
    def show(name, value):
        if name == "dataset":
            path = Path(value)
            return str(path.relative_to(REPO)) if path.is_absolute() and path.is_relative_to(REPO) else str(value)
        if name == "reward":
            return ", ".join(value) or "jpeg_compressibility"  # the scripts' default when none is given
        return str(value)

    parts = []
    for name, label in [("model", "model"), ("model_path", "model path"), ("dataset", "dataset"),
                        ("reward", "reward"), ("resolution", "resolution"), ("max_sequence_length", "text tokens"),
                        ("num_steps", "rollout steps")]:
        values = {algo: show(name, plan.settings[name]) for algo, plan in plans.items()}
        if len(set(values.values())) == 1:
            parts.append(f"{label} {next(iter(values.values()))}")
        else:
            parts.append(f"{label} " + "/".join(f"{v} ({a})" for a, v in values.items()))
    return "; ".join(parts)


def write_table(args: Args, plans: dict[str, Plan], summary: dict, start: float, threshold: float, wall: dict,
                command: str) -> str:
    how = (f"--threshold {threshold:.3f}" if args.threshold is not None else
           f"each run's own base (its first {args.start_points} point(s); mean {start:.3f}) + {args.threshold_gain:g}")
    presets = sorted({p.preset for p in plans.values()})
    preset_text = (f"each algorithm with its own `--preset {presets[0]}`" if len(presets) == 1 else
                   "presets " + ", ".join(f"{a} `{p.preset}`" for a, p in plans.items()))
    budget = (f"budget {args.budget} samples per run (epochs = budget // M·K)" if args.budget is not None else
              "each preset's own epochs")
    lines = [f"`{command}`", "",
             f"Seeds {' '.join(map(str, args.seeds))}; {preset_text} (the presets differ in M, K, lr, clip range, "
             f"steps, trained timesteps, epochs); {budget}; {args.jobs} run(s) at a time, one thread each. Task: "
             f"{describe_task(plans)}. Metric: {describe_metric(args)}. Threshold (mean) {threshold:.3f} = {how}, reached "
             f"when the trailing mean over {args.smooth} points is ≥ it. Final = mean of the last 10% of points. "
             f"Times are training seconds (rollout + reward + training; start-up and evaluation excluded), per "
             f"epoch after {args.warmup} warm-up epochs; run wall s is the whole process. CPU min is the run's "
             f"process CPU time (user + system, os.wait4); CPU min to threshold is an estimate of the training's "
             f"share: CPU min × training seconds to threshold / run wall s. Mean ± std over seeds (to threshold: over "
             f"the seeds that reach it).", "",
             "| algorithm | M×K | epochs | final | reached | epochs to threshold | samples to threshold | "
             "time to threshold (s) | CPU min to threshold | rollout s/epoch | reward s/epoch | train s/epoch | "
             "epoch s | run wall s | CPU min |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for algo, row in summary.items():
        s = plans[algo].settings
        lines.append(f"| {algo} | {s['prompts_per_epoch']}×{s['group_size']} | {plans[algo].epochs} | "
                     f"{mean_std(row['final'])} | {row['reached']}/{row['seeds']} | {mean_std(row['epochs_to'])} | "
                     f"{mean_std(row['samples_to'])} | {mean_std(row['time_to'])} | {mean_std(row['cpu_min_to'])} | "
                     f"{mean_std(row['rollout'])} | {mean_std(row['reward'])} | {mean_std(row['train'])} | "
                     f"{mean_std(row['epoch'])} | {mean_std(wall[algo])} | {mean_std(row['cpu_min'])} |")
    lines += ["", f"`{metric_key(args)}` per algorithm, mean ± std over seeds: base (the first point), final (mean of "
              f"the last 10% of points), best (the maximum over points)."]
    for algo, row in summary.items():
        lines.append(f"- {algo}: base {mean_std(row['base'])}, final {mean_std(row['final'])}, best "
                     f"{mean_std(row['best'])}")
    base = summary.get(args.baseline)
    if base is not None and len(summary) > 1:
        lines.append("")
        b = args.baseline
        for algo, row in summary.items():
            if algo == b:
                continue
            parts = [f"epoch time {algo}/{b} = {np.mean(row['epoch']) / np.mean(base['epoch']):.2f}"]
            if row["time_to"] and base["time_to"] and min(np.mean(row["time_to"]), np.mean(base["time_to"])) == 0:
                parts.append("time to threshold: reached before training (a threshold at or below the base)")
            elif row["time_to"] and base["time_to"]:
                parts.append(f"time to threshold {b}/{algo} = {np.mean(base['time_to']) / np.mean(row['time_to']):.2f} "
                             f"(samples {np.mean(base['samples_to']) / np.mean(row['samples_to']):.2f}, epochs "
                             f"{np.mean(base['epochs_to']) / np.mean(row['epochs_to']):.2f}; over the seeds that "
                             f"reach it: {row['reached']}/{row['seeds']} and {base['reached']}/{base['seeds']})")
            else:
                parts.append(f"time to threshold: {algo if not row['time_to'] else b} never reaches it")
            lines.append(f"- {algo} vs {b}: " + "; ".join(parts))
    lines += per_seed_table(args, summary)
    return "\n".join(lines) + "\n"


def ratio_with_spread(baseline: list, values: list) -> str:
    """mean(baseline) / mean(values) over the seeds that reached the threshold, and its min–max over every pair of a
    baseline seed and a seed of `values` that both reached it; – when either never does, or reached it before
    training (0: a threshold at or below the base)."""
    base, mine = [b for b in baseline if b is not None], [v for v in values if v is not None]
    if not base or not mine or min(base) <= 0 or min(mine) <= 0:
        return "–"
    pairs = [b / v for b in base for v in mine]
    return f"{np.mean(base) / np.mean(mine):.2f} ({min(pairs):.2f}–{max(pairs):.2f})"


def per_seed_table(args: Args, summary: dict) -> list[str]:
    """Every (algorithm, seed): base, final, best, samples and CPU-seconds to its own threshold; then the ratios of
    the baseline's samples and CPU-seconds to each algorithm's, with their spread."""
    lines = ["", "| algorithm | seed | base | threshold | final | best | samples to threshold | CPU s to threshold |",
             "|---|---|---|---|---|---|---|---|"]
    for algo, row in summary.items():
        for i, seed in enumerate(args.seeds):
            samples, cpu_s = row["per_seed_samples_to"][i], row["per_seed_cpu_s_to"][i]
            lines.append(f"| {algo} | {seed} | {row['base'][i]:.3f} | {row['threshold'][i]:.3f} | {row['final'][i]:.3f} | "
                         f"{row['best'][i]:.3f} | {'–' if samples is None else f'{samples:.0f}'} | "
                         f"{'–' if cpu_s is None else f'{cpu_s:.0f}'} |")
    base = summary.get(args.baseline)
    if base is not None and len(summary) > 1:
        b = args.baseline
        lines += ["", f"Ratios to {b} ({b}'s samples or CPU-seconds to threshold over the algorithm's: > 1 is faster "
                  f"than {b}), mean over the seeds that reach it (min–max over seed pairs):", "",
                  f"| algorithm | reached | samples ratio | CPU-seconds ratio |", "|---|---|---|---|"]
        for algo, row in summary.items():
            if algo != b:
                lines.append(f"| {algo} | {row['reached']}/{row['seeds']} ({b} {base['reached']}/{base['seeds']}) | "
                             f"{ratio_with_spread(base['per_seed_samples_to'], row['per_seed_samples_to'])} | "
                             f"{ratio_with_spread(base['per_seed_cpu_s_to'], row['per_seed_cpu_s_to'])} |")
    return lines


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
    """The metric against training wall-clock (x: the seeds' mean time at each point) and against samples seen;
    line = mean over seeds, band = min–max over seeds."""
    key = metric_key(args)
    by_time, by_samples = {}, {}
    for algo, seeds in runs.items():
        curves = [curve(m, key) for m in seeds]
        n = min(len(c[3]) for c in curves)
        seconds, samples, _, values = (np.stack([c[i][:n] for c in curves]) for i in range(4))
        stats = (values.mean(0), values.min(0), values.max(0))
        by_time[algo], by_samples[algo] = (seconds.mean(0), *stats), (samples[0], *stats)
    all_values = np.concatenate([np.concatenate(s[2:]) for s in by_time.values()] + [[threshold]])
    pad = 0.05 * (all_values.max() - all_values.min() or 1.0)
    ylim = (float(all_values.min() - pad), float(all_values.max() + pad))
    font = ImageFont.load_default(size=15)
    img = Image.new("RGBA", size, "white")
    width, height = size
    panels = [(by_time, "training wall-clock (s)"), (by_samples, "samples seen")]
    for i, (series, xlabel) in enumerate(panels):
        left = 95 + i * width // 2
        box = (left, 40, left + width // 2 - 130, height - 110)
        draw_panel(img, box, series, xlabel, key, font, ylim)
        draw = ImageDraw.Draw(img)
        y = box[1] + (ylim[1] - threshold) / (ylim[1] - ylim[0]) * (box[3] - box[1])
        for xs in range(box[0], box[2], 12):  # dashed threshold line
            draw.line([(xs, y), (min(xs + 6, box[2]), y)], fill=(90, 90, 90))
    draw = ImageDraw.Draw(img)
    draw.text((width / 2, 12), f"{key}: mean over {len(args.seeds)} seed(s), band min-max, dashed: threshold "
              f"{threshold:.3f}", fill="black", font=font, anchor="mt")
    x = 95
    for algo, color in zip(runs, COLORS):  # legend along the bottom
        draw.line([(x, height - 25), (x + 30, height - 25)], fill=color, width=4)
        draw.text((x + 38, height - 25), algo, fill="black", font=font, anchor="lm")
        x += 60 + int(draw.textlength(algo, font=font))
    img.convert("RGB").save(path)


def check_flags(args: Args):
    """One-line errors for flags no run can use, before anything runs or loads."""
    unknown = [a for a in args.algos if a not in ALGOS]
    if unknown or not args.algos:
        raise UserError(f"unknown --algos {' '.join(unknown)}; choose from: {', '.join(ALGOS)}")
    unknown = [a for a in args.algo_preset if a not in ALGOS]
    if unknown:
        raise UserError(f"unknown algorithm {' '.join(unknown)} in --algo-preset; choose from: {', '.join(ALGOS)}")
    if not args.seeds:
        raise UserError("--seeds needs at least one seed")
    if len(set(args.seeds)) != len(args.seeds):
        raise UserError(f"--seeds has repeats: {' '.join(map(str, args.seeds))}")
    for name, lowest in [("jobs", 1), ("budget", 1), ("start_points", 1), ("smooth", 1), ("warmup", 0),
                         ("eval_every", 0), ("eval_num_steps", 1), ("eval_num_prompts", 1), ("eval_seeds", 1),
                         ("resolution", 1), ("group_size", 2), ("prompts_per_epoch", 1), ("num_steps", 2)]:
        value = getattr(args, name)
        if value is not None and value < lowest:
            raise UserError(f"--{name.replace('_', '-')} must be at least {lowest}, got {value}")
    if args.metric in ("", "epoch"):
        raise UserError(f"--metric {args.metric!r} is not a curve; give a metrics.jsonl key such as eval_toy_strict")
    if metric_key(args).startswith("eval_") and args.eval_every < 1:
        raise UserError(f"--metric {args.metric} needs --eval-every ≥ 1; use --metric train to run without "
                        f"evaluation")
    try:
        extra = shlex.split(args.extra_args)
    except ValueError as error:
        raise UserError(f"--extra-args {args.extra_args!r}: {error}") from None
    for token in extra:
        if token.split("=", 1)[0] in MANAGED:
            flag = token.split("=", 1)[0]
            raise UserError(f"--extra-args sets {flag}, which compare.py passes to every script itself"
                            + (f": use compare.py's own {flag}" if flag not in ("--seed", "--output-dir") else ""))


def parse_flags() -> Args:
    """The command line as Args (tyro's boxed errors as one-line UserErrors, as in the scripts), checked."""
    args = cli_one_line(Args, description=__doc__)
    check_flags(args)
    return args


if __name__ == "__main__":
    install_user_error_hook()
    args = parse_flags()
    plans = plan_runs(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    begin = time.time()
    runs, wall, cpu = run_all(args, plans, out)
    summary, start, threshold = summarise(args, runs, cpu, wall)
    command = command_line()
    table = write_table(args, plans, summary, start, threshold, wall, command)
    (out / "results.md").write_text(table)
    (out / "summary.json").write_text(json.dumps({
        "command": command, "metric": metric_key(args), "start": start, "threshold": threshold,
        "seeds": args.seeds, "epochs": {a: p.epochs for a, p in plans.items()},
        "presets": {a: p.preset for a, p in plans.items()},
        "samples_per_epoch": {a: p.samples_per_epoch for a, p in plans.items()},
        "algorithms": summary, "run_wall_s": wall, "run_cpu_s": cpu}, indent=1))
    plot(args, runs, threshold, out / "compare.png")
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'summary.json'}, {out / 'compare.png'} "
          f"({time.time() - begin:.0f}s)")
