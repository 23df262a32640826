"""benchmarks/flux_step.py on the tiny FLUX.1 transformer: both gradient-checkpointing variants run a full
LoRA Flow-GRPO step with finite loss and gradient norm, and the JSON holds their timings."""

import json
import math

from conftest import SLOW, run_script


def test_flux_step_benchmark_tiny(tiny_flux_path, tmp_path):  # the fixture builds the tiny pipeline once
    out = tmp_path / "flux_step.json"
    result = run_script("benchmarks/flux_step.py", "--size", "tiny", "--resolutions", "64", "--repeats", "1",
                        "--warmup", "0", "--json-out", out, timeout=120)
    report = json.loads(out.read_text())
    assert report["size"] == "tiny" and report["total_params"] > 0 and report["lora_params"] > 0
    rows = report["rows"]
    assert [(r["resolution"], r["image_tokens"], r["gradient_checkpointing"]) for r in rows] == \
        [(64, 16, False), (64, 16, True)]  # (64/16)^2 image tokens, as FLUX.1-dev packs them
    for row in rows:
        assert not row["oom"]
        for key in ("rollout_s", "train_s"):
            assert math.isfinite(row[key]) and row[key] > 0
        assert len(row["train_times"]) == 1
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row["peak_gib"] is None  # no GPU memory to report on a CPU
    table = [line for line in result.stdout.splitlines() if line.startswith("| 64 |")]
    assert len(table) == 2 and "| off |" in table[0] and "| on |" in table[1] and "n/a" in table[0]


@SLOW
def test_throughput_benchmark_tiny(tmp_path):
    """benchmarks/throughput.py on tiny widths for one script: the table and JSON carry its step time, its TFLOP/s
    and the mfu against the given peak, and the embedding cache's comparison run."""
    out = tmp_path / "throughput.json"
    result = run_script("benchmarks/throughput.py", "--size", "tiny", "--resolution", "64", "--scripts", "grpo",
                        "--epochs", "1", "--peak-tflops", "0.5", "--output-dir", tmp_path / "runs", "--json-out", out,
                        timeout=300)
    rows = json.loads(out.read_text())
    assert list(rows) == ["grpo", "grpo --no-cache"]
    for row in rows.values():
        assert row["tflops"] > 0 and row["mfu"] == row["tflops"] / 0.5 and row["optimizer_steps"] >= 1
        assert row["ratio_dev_first"] == 0  # float32 on a CPU: the ratio is exactly 1 before the first update
    table = [line for line in result.stdout.splitlines() if line.startswith("| grpo")]
    assert len(table) == 2 and "–" not in table[0], table
    assert "embedding cache: grpo epoch" in result.stdout
