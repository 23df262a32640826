# Benchmark: rewards scored while the rollout goes on (--reward-workers, the default) against scoring after it
# (--reward-workers 0), on algos/grpo.py itself, in one run:
#   1. a fast CPU reward in process (JPEG compressibility): the overlap must cost nothing (epoch time ratio);
#   2. a reward server on 127.0.0.1 (python -m rewards.server) whose every request waits --latency seconds (unset: the
#      rollout time of case 1 divided by the micro-batches of an epoch, so that the reward's total latency equals the
#      rollout's time) before scoring JPEG compressibility: the rollout-and-scoring phase should fall towards the
#      rollout alone (the floor: case 1's serial rollout time) plus one micro-batch's scoring.
# Each case runs --epochs epochs, serial and overlapped runs alternating --repeats times (a shared machine's load
# drifts); the first epoch of each run (warm-up) is left out and the medians of the rest are reported.
#   OMP_NUM_THREADS=1 python benchmarks/rewards_overlap.py   (tiny and toy models on the CPU)
#   python benchmarks/rewards_overlap.py --models tiny --latency 0.2
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

REPO = Path(__file__).resolve().parent.parent
# Per model: the preset and the micro-batch size that splits an epoch into 8 micro-batches on one process.
MODELS = {"tiny": ["--preset", "tiny", "--batch-size", "2"], "toy": ["--preset", "toy", "--batch-size", "16"]}
MICRO_BATCHES = 8


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: ["tiny", "toy"])
    """models to run (tiny: the embedded tiny FLUX.1; toy: the toy world's)"""
    epochs: int = 4
    """epochs per run (the first is a warm-up, left out)"""
    repeats: int = 2
    """serial / overlapped run pairs per case, alternating"""
    latency: float | None = None
    """seconds each request to the reward server waits (unset: rollout time / micro-batches, measured)"""


class Delayed:
    """A reward server's reward: waits `seconds` per request (a VLM judge, a detector on another machine), then
    scores JPEG compressibility."""

    def __init__(self, seconds: str = "0.1"):
        self.seconds = float(seconds)

    def __call__(self, images, prompts):
        from rewards.jpeg import jpeg_compressibility

        time.sleep(self.seconds)
        return jpeg_compressibility(images, prompts)


def train(model: str, workers: int, reward: str, epochs: int) -> list[dict]:
    """The metrics of the epochs after the first."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, str(REPO / "algos/grpo.py"), *MODELS[model], "--epochs", str(epochs),
                   "--eval-every", "0", "--save-every", "0", "--reward", reward, "--reward-workers", str(workers),
                   "--output-dir", out]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["epoch"] >= 1]


def compare(model: str, reward: str, args) -> dict:
    """workers (0: serial, 4: overlapped) -> medians over the epochs of its runs: rollout, rollout + scoring, epoch."""
    lines = {0: [], 4: []}
    for _ in range(args.repeats):
        for workers in lines:
            lines[workers] += train(model, workers, reward, args.epochs)
    return {workers: {"rollout": statistics.median(m["rollout_time_s"] for m in ms),
                      "scored": statistics.median(m["rollout_time_s"] + m["reward_time_s"] for m in ms),
                      "epoch": statistics.median(m["epoch_time_s"] for m in ms)} for workers, ms in lines.items()}


class reward_server:
    def __init__(self, seconds: float):
        spec = f"benchmarks.rewards_overlap:Delayed,seconds={seconds}"
        command = [sys.executable, "-m", "rewards.server", "--reward", spec, "--port", "0"]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if " on http://" not in line:
            self.process.kill()
            raise SystemExit(f"the reward server did not start: {line!r}")
        self.url = line.split(" on ")[-1].strip()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait()


if __name__ == "__main__":
    args = tyro.cli(Args)
    rows = []
    for model in args.models:
        fast = compare(model, "jpeg_compressibility", args)
        floor = fast[0]["rollout"]
        latency = args.latency if args.latency is not None else floor / MICRO_BATCHES
        rows.append((model, "JPEG in process", floor, fast))
        with reward_server(latency) as server:
            remote = compare(model, f"remote,url={server.url}", args)
        rows.append((model, f"server, {latency * 1000:.0f} ms × {MICRO_BATCHES} requests", floor, remote))
    # scoring alone: what the serial run spends after its rollout (the reward's latency and the transfers)
    print("| model | reward | rollout alone (s) | scoring alone, serial (s) | rollout + scoring, serial → overlapped "
          "(s) | ratio | epoch, serial → overlapped (s) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for model, reward, floor, runs in rows:
        serial, overlapped = runs[0], runs[4]
        print(f"| {model} | {reward} | {floor:.3f} | {serial['scored'] - serial['rollout']:.3f} | "
              f"{serial['scored']:.3f} → {overlapped['scored']:.3f} | "
              f"{overlapped['scored'] / serial['scored']:.2f}× | {serial['epoch']:.3f} → {overlapped['epoch']:.3f} | "
              f"{overlapped['epoch'] / serial['epoch']:.2f}× |")
