"""Wall time per epoch of grpo (every step SDE and trained), mixgrpo (a window of W SDE/trained steps, Euler
ODE elsewhere) and mixgrpo --flash (plus a compressed DPM-Solver++ tail) at the same number of sampling steps,
side by side on the tiny FLUX.1. MixGRPO (arXiv:2507.21802) reports ~50% less training time than DanceGRPO and
~71% less for Flash. Each script runs in its own process; its metrics.jsonl gives the times.

Usage: OMP_NUM_THREADS=1 python benchmarks/rollout.py [--num-steps 25] [--window-size 4] [--warmup 2]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(script: str, flags: list[str], output_dir: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"}
    command = [sys.executable, str(REPO / script), *flags, "--output-dir", str(output_dir)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-steps", type=int, default=25, help="sampling steps S of every run (the paper: 25)")
    parser.add_argument("--window-size", type=int, default=4, help="MixGRPO window W (the paper: 4)")
    parser.add_argument("--warmup", type=int, default=2, help="first epochs left out of the means")
    args = parser.parse_args()

    # After the warm-up, one epoch per window position t = 0 … S − 3 (--iters-per-window 1), so MixGRPO's
    # numbers average over a whole sweep of the window as a long run does.
    epochs = args.warmup + args.num_steps - 2
    common = ["--preset", "tiny", "--num-steps", str(args.num_steps), "--epochs", str(epochs), "--eval-every", "0",
              "--save-every", "0"]
    mix = ["--window-size", str(args.window_size), "--iters-per-window", "1"]
    runs = {
        "grpo": ("algos/grpo.py", common),
        "mixgrpo": ("algos/mixgrpo.py", common + mix),
        "mixgrpo --flash": ("algos/mixgrpo.py", common + mix + ["--flash"]),
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, flags) in runs.items():
            print(f"running {name} ({epochs} epochs) ...", file=sys.stderr, flush=True)
            metrics = run(script, flags, Path(tmp) / name.replace(" --", "-"))[args.warmup:]
            mean = lambda key: sum(m[key] for m in metrics) / len(metrics)  # noqa: E731
            rows[name] = {
                "trained steps": mean("window_len") if "window_len" in metrics[0] else args.num_steps - 1,
                "NFE/sample": mean("nfe") if "nfe" in metrics[0] else args.num_steps,
                "rollout s": mean("rollout_time_s"),
                "train s": mean("train_time_s"),
                "epoch s": mean("epoch_time_s"),
            }
    base = rows["grpo"]
    header = ["method", "trained steps", "NFE/sample", "rollout s", "train s", "epoch s", "epoch vs grpo", "time saved"]
    print(f"tiny FLUX.1, {args.num_steps} sampling steps, window {args.window_size}, "
          f"mean over {epochs - args.warmup} epochs after {args.warmup} warm-up (one sweep of the window)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, row in rows.items():
        ratio = row["epoch s"] / base["epoch s"]
        print(f"| {name} | {row['trained steps']:.2f} | {row['NFE/sample']:.2f} | {row['rollout s']:.3f} | "
              f"{row['train s']:.3f} | {row['epoch s']:.3f} | {ratio:.2f} | {1 - ratio:.0%} |")
    for part in ("rollout s", "train s"):
        print(f"{part[:-2]} time vs grpo: " + ", ".join(f"{name} {row[part] / base[part]:.2f}"
                                                    for name, row in rows.items() if name != "grpo"))


if __name__ == "__main__":
    main()
