"""The evaluation before the first update (common.setup.evaluate_base): every script's first metrics line, logged
as epoch −1 with the same eval keys as the epochs' evaluations; it leaves training unchanged and a resumed run does
not repeat it."""

import json
import math

import pytest

from conftest import read_metrics, run_script, slow_except

TINY = ["--preset", "tiny", "--epochs", "2", "--save-every", "1"]


@pytest.mark.parametrize("script", slow_except(["nft", "grpo"], "nft"))
def test_the_first_line_is_the_untrained_models_evaluation(tmp_path, tiny_flux_path, script):
    out = tmp_path / "run"
    run_script(f"algos/{script}.py", *TINY, "--eval-every", "1", "--output-dir", out)
    lines = read_metrics(out, base=True)
    assert [line["epoch"] for line in lines] == [-1, 0, 1]
    base, first = lines[0], lines[1]
    eval_keys = sorted(k for k in first if k.startswith("eval_"))
    # the base line also holds each reward's prompt gap (docs/guard.md)
    assert eval_keys and sorted(k for k in base if k != "epoch" and not k.startswith("prompt_gap_")) == eval_keys
    assert {k for k in base if k.startswith("prompt_gap_")} == {"prompt_gap_jpeg_compressibility",
                                                                "prompt_gap_jpeg_compressibility_se"}
    assert (out / "eval" / "base.png").exists()
    # The same prompts and seeds: the untrained LoRA (B = 0) is the pretrained model, so the base differs from the
    # evaluation after one update only by what that update did.
    assert base["eval_reward_mean"] != first["eval_reward_mean"]

    # Training is the same with or without it (its RNG use is forked off).
    quiet = tmp_path / "quiet"
    run_script(f"algos/{script}.py", *TINY, "--eval-every", "0", "--output-dir", quiet)
    measured = ("_time_s", "tflops", "mfu", "peak_memory_gb")
    trained = [{k: v for k, v in line.items() if not k.startswith("eval_") and not k.endswith(measured)}
               for line in read_metrics(out)]
    assert [line["epoch"] for line in read_metrics(quiet, base=True)] == [0, 1]
    assert trained == [{k: v for k, v in line.items() if not k.endswith(measured)} for line in read_metrics(quiet)]

    # A resumed run continues after its checkpoint and does not evaluate the base again.
    run_script(f"algos/{script}.py", *TINY[:2], "--epochs", "3", "--save-every", "1", "--eval-every", "1",
               "--output-dir", out, "--resume")
    epochs = [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [-1, 0, 1, 2]


def test_eval_metrics_carry_their_standard_errors(tmp_path):
    """Every eval mean has `_se`, the sample standard deviation over prompts × seeds / √n; for the toy world's
    pass/fail checks that is √(p(1 − p)/(n − 1)), computed here from the logged rate alone."""
    out = tmp_path / "run"
    run_script("algos/nft.py", "--preset", "toy", "--epochs", "1", "--eval-num-prompts", "12", "--eval-seeds", "2",
               "--save-every", "0", "--output-dir", out)
    n = 12 * 2
    for line in read_metrics(out, base=True):
        means = [k for k in line if k.startswith("eval_") and not k.endswith("_se")]
        assert means and all(f"{k}_se" in line for k in means)
        for check in ("strict", "count", "shape"):
            p = line[f"eval_toy_{check}"]
            assert line[f"eval_toy_{check}_se"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), abs=1e-12)
        assert 0 < line["eval_reward_mean_se"] < 0.5
