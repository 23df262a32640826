"""Shared fixtures: a per-session cache for the tiny pipelines and a runner for the algorithm scripts."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A fresh cache folder per session (unless FLOWRL_CACHE is set), so no tiny model or embedding cache left by an
# older version of the code is ever reused.
if "FLOWRL_CACHE" not in os.environ:
    os.environ["FLOWRL_CACHE"] = tempfile.mkdtemp(prefix="flowrl-test-cache-")
# Every script the tests start sees this environment: offline, no trackers, one thread per process
# (2-core CI; several torch processes each spinning 2 threads slow down tenfold).
os.environ.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="session")
def tiny_flux_path():
    from common.tiny import tiny_model_path

    return tiny_model_path("flux1")


def run_script(script: str, *args, check: bool = True, timeout: float = 600, launcher=None, env=None):
    """Run `algos/<script>` (or any repo-relative script) in a subprocess; returns CompletedProcess."""
    command = (launcher or [sys.executable]) + [str(REPO / script), *map(str, args)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if launcher and result.returncode != 0 and "terminate called without an active exception" in result.stderr:
        # gloo on CPU now and then aborts a process's exit in C++ static destructors, after the work is done.
        # A training script that got as far as its closing "outputs:" line finished its work: accept it.
        # Anything else runs once more (a real failure fails again).
        if "outputs: " in result.stdout:
            return subprocess.CompletedProcess(result.args, 0, result.stdout, result.stderr)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def read_metrics(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]


ACCELERATE_2CPU = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
