"""What dropping zero-advantage samples saves. With a binary reward many groups score the same for all K samples
(GenEval's success is such a reward); their advantages are 0 and carry no policy gradient. grpo.py drops them
before training by default, as Flow-GRPO does (--keep-zero-advantage trains them); awm.py trains them, as AWM's
reference does (--drop-zero-advantage drops them).
Both variants run side by side on the same epochs (same seed, so the same rollouts in epoch 0), and the train time
per epoch is compared with the fraction of samples dropped.

The reward: 1 when a sample's JPEG is smaller than --threshold kB, else 0 (on the tiny FLUX.1, about --quantile of
the first epoch's samples are below it), so a group of K = 8 scores all-0 or all-1 often.

Usage: OMP_NUM_THREADS=1 python benchmarks/zero_advantage.py [--epochs 20] [--scripts grpo awm]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_GRPO_FAMILY = {"keep": ["--keep-zero-advantage"], "drop": []}
VARIANTS = {"grpo": _GRPO_FAMILY, "grpo_guard": _GRPO_FAMILY, "mixgrpo": _GRPO_FAMILY,
            "awm": {"keep": [], "drop": ["--drop-zero-advantage"]}}  # the flags of each variant, per script


class BinaryJpeg:
    """1.0 when the image's JPEG (quality 95) is smaller than `threshold` kB, else 0.0."""

    def __init__(self, threshold: str = "3.6"):
        self.threshold = float(threshold)

    def __call__(self, images, prompts):
        from rewards.jpeg import jpeg_kilobytes

        return (jpeg_kilobytes(images) < self.threshold).astype(float)


def run(script: str, flags: list[str], output_dir: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(REPO / script), *flags, "--output-dir", str(output_dir)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--threshold", type=float, default=3.62, help="JPEG size (kB) below which the reward is 1")
    parser.add_argument("--scripts", nargs="+", default=["grpo", "awm"], choices=sorted(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2, help="first epochs left out of the means")
    args = parser.parse_args()
    common = ["--preset", "tiny", "--epochs", str(args.epochs), "--eval-every", "0", "--save-every", "0",
              "--reward", f"zero_advantage:BinaryJpeg,threshold={args.threshold}"]
    print(f"| script | variant | dropped | zero-std groups | train s/epoch | train time vs kept | reward |\n"
          f"|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for script in args.scripts:
            rows = {}
            for variant, extra in VARIANTS[script].items():
                print(f"running {script} ({variant}) ...", file=sys.stderr, flush=True)
                metrics = run(f"algos/{script}.py", common + extra, Path(tmp) / f"{script}-{variant}")[args.warmup:]
                mean = lambda key: sum(m[key] for m in metrics) / len(metrics)  # noqa: E731
                rows[variant] = {"dropped": mean("dropped_frac"), "zero": mean("zero_std_frac"),
                                 "train": mean("train_time_s"), "reward": mean("reward_mean")}
            for variant, row in rows.items():
                print(f"| {script} | {variant} | {row['dropped']:.2f} | {row['zero']:.2f} | {row['train']:.3f} | "
                      f"{row['train'] / rows['keep']['train']:.2f} | {row['reward']:.3f} |")


if __name__ == "__main__":
    main()
