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


# The longest files first: `pytest -n 2 --dist loadfile` hands out whole files in collection order, and the
# toy learning tests (13 CPU-minutes) collected last would run alone at the end while the other worker idles.
# (pyproject.toml turns off xdist's own reordering by file size, which would undo this.)
LONGEST_FIRST = ["test_toy_learning.py", "test_distributed.py", "test_matrix.py", "test_two_processes.py",
                 "test_rewards_overlap.py"]


# Two tiers. Without --full the tests marked slow are deselected: the fast tier keeps every file's core checks for a
# first check in minutes; --full (what .ci/run passes) runs them all. In a parametrized test, `marks=SLOW` on a case.
# Beyond them, --exhaustive also runs what is marked exhaustive: the script × model matrix's pairs that the full tier
# covers by family (tests/test_matrix.py), about 20 minutes more.
SLOW = pytest.mark.slow
EXHAUSTIVE = pytest.mark.exhaustive


def slow_except(values, *fast):
    """A parametrize list whose cases are all in the full tier except `fast` (values, or tuples for several
    argnames)."""
    return [value if value in fast else pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=SLOW)
            for value in values]


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full tier: also the tests marked slow (learning, the whole matrix, distributed, "
                          "kill/resume); .ci/run passes it")
    parser.addoption("--exhaustive", action="store_true",
                     help="--full and every script × model pair of the matrix (tests marked exhaustive)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: in the full tier only (run with --full)")
    config.addinivalue_line("markers", "exhaustive: only with --exhaustive")


def pytest_collection_modifyitems(config, items):
    exhaustive = config.getoption("--exhaustive")
    for marker, wanted in (("slow", config.getoption("--full") or exhaustive), ("exhaustive", exhaustive)):
        if not wanted:
            dropped = [item for item in items if item.get_closest_marker(marker)]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_flux_path():
    from common.models import tiny_model_path

    return tiny_model_path("flux1")


def require_system(apt: str, program: str | None = None, library: str | None = None) -> None:
    """Skip the calling test when a system program (on PATH) or shared library (`library="GL"` for libGL) that
    pip cannot install is missing, naming the apt package that brings it. Under CI (`CI=true`) a missing one
    fails the test instead, so CI's coverage never shrinks silently (.ci/run installs .ci/apt-packages.txt)."""
    import ctypes.util
    import shutil

    if program is not None and shutil.which(program) is None:
        missing = f"the {program} program"
    elif library is not None and ctypes.util.find_library(library) is None:
        missing = f"the lib{library} shared library"
    else:
        return
    message = f"needs {missing}, which pip cannot install: `apt-get install {apt}` (as .ci/run does)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and this test {message}")
    pytest.skip(message)


def write_edit_dataset(folder: Path) -> Path:
    """A small dataset of conditioned prompts: 4 training and 2 test lines, each with a 32×32 condition image
    (a coloured box on white; PNG, JPEG and WebP), as an editing or image-to-video model takes them."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    boxes = [((200, 30, 30), (4, 8, 20, 24)), ((30, 160, 30), (12, 2, 28, 14)), ((30, 30, 200), (2, 16, 14, 30)),
             ((220, 200, 40), (8, 8, 24, 24))]
    names = []
    for i, ((colour, box), kind) in enumerate(zip(boxes, ["png", "jpg", "webp", "png"])):
        image = Image.new("RGB", (32, 32), "white")
        image.paste(colour, box)
        names.append(f"images/{i}.{kind}")
        image.save(folder / names[-1], **({"lossless": True} if kind == "webp" else {}))
    lines = [("make it green", 0), ("turn it into a circle", 1), ("move it to the left", 2), ("make it blue", 3)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "image": names[i]}) + "\n" for p, i in lines))
    (folder / "test.jsonl").write_text("".join(json.dumps({"prompt": p, "image": names[i]}) + "\n"
                                               for p, i in [("make it red", 1), ("move it up", 3)]))
    return folder


@pytest.fixture(scope="session")
def edit_dataset(tmp_path_factory):
    return write_edit_dataset(tmp_path_factory.mktemp("edit-dataset"))


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_script(script: str, *args, check: bool = True, timeout: float = 600, launcher=None, env=None):
    """Run `algos/<script>` (or any repo-relative script) in a subprocess; returns CompletedProcess."""
    import shutil

    launched, launcher = launcher is not None, list(launcher or [sys.executable])
    if "accelerate.commands.launch" in launcher and "--main_process_port" not in launcher:
        # tests run two at a time (pytest -n 2): each launch gets its own port instead of the default 29500
        launcher += ["--main_process_port", str(free_port())]
    command = launcher + [str(REPO / script), *map(str, args)]
    args = list(map(str, args))
    output = Path(args[args.index("--output-dir") + 1]) if "--output-dir" in args else None
    backup = None
    if launched and output is not None and output.is_dir():  # to retry from the same folder (below)
        backup = Path(tempfile.mkdtemp(prefix="flowrl-retry-")) / "out"
        shutil.copytree(output, backup)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if launched and result.returncode != 0 and "terminate called without an active exception" in result.stderr:
        # gloo on CPU now and then aborts a process's exit in C++ static destructors, after the work is done.
        # A training script that got as far as its closing "outputs:" line finished its work: accept it.
        # Anything else runs once more from the output folder as it was before (a real failure fails again).
        if "outputs: " in result.stdout:
            return subprocess.CompletedProcess(result.args, 0, result.stdout, result.stderr)
        if output is not None:
            shutil.rmtree(output, ignore_errors=True)
            if backup is not None:
                shutil.copytree(backup, output)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, **(env or {})})
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def script_error(script: str, *args, env=None) -> str:
    """The `error: ...` line a repo script prints for bad input, got by running it in this process (runpy, as
    `python script args` from the repo root) until its UserError: no new interpreter, so a check that fires
    before the models load costs milliseconds instead of seconds. The printing of that line and the exit status
    2 of a real process are tested on real processes in test_reliability.py (grpo, grpo_guard) and test_dpo.py;
    every script installs the same hook (common.cli.parse_args)."""
    import contextlib
    import io
    import runpy

    from common.utils import UserError

    saved = sys.argv, sys.excepthook, dict(os.environ)
    sys.argv = [str(REPO / script), *map(str, args)]
    os.environ.update(env or {})
    try:
        with contextlib.chdir(REPO), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(str(REPO / script), run_name="__main__")
    except UserError as error:
        assert type(error) is UserError, f"{script}: {type(error).__name__}: {error}"
        assert "\n" not in str(error), f"{script}: the error is not one line: {error!r}"
        return f"error: {error}"
    finally:
        sys.argv, sys.excepthook = saved[:2]
        os.environ.clear()
        os.environ.update(saved[2])
    raise AssertionError(f"{script} {' '.join(map(str, args))} ran without an error")


def read_metrics(output_dir, base: bool = False) -> list[dict]:
    """The run's metrics lines; the evaluation before the first update (epoch −1) only with `base`."""
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in records if base or r["epoch"] >= 0]


ACCELERATE_2CPU = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def ode_sample(adapter, cond, num_steps, seeds, guidance):
    """Euler-ODE samples x0 of `cond` at the given noise seeds (common.sampling.sample, as evaluation runs it)."""
    from common.sampling import sample, sample_generators

    return sample(lambda x, sigma: adapter.velocity(x, sigma, cond, guidance),
                  adapter.noise(sample_generators(seeds, "cpu")), adapter.sigmas(num_steps), "ode")


def sde_trajectory(adapter, cond, sigmas, seeds, dynamics, noise_level, guidance, steps=None, keep_means=False):
    """The GRPO scripts' rollout loop over `steps` (default all): x_{j+1} = sde_step(x_j). Returns the stacked
    x_j, x_{j+1} and log p(x_{j+1} | x_j) of those steps, shaped (batch, steps, ...), and μ_j with keep_means."""
    import torch

    from common.dynamics import sde_step
    from common.sampling import sample_generators

    steps = range(len(sigmas) - 1) if steps is None else steps
    generators = sample_generators(seeds, "cpu")
    x, stored = adapter.noise(generators), ([], [], [], [])
    with torch.no_grad():
        for j in range(len(sigmas) - 1):
            v = adapter.velocity(x, sigmas[j], cond, guidance)
            x_next, log_prob, mean, _ = sde_step(dynamics if j in steps else "ode", v, x, sigmas[j], sigmas[j + 1],
                                                 noise_level, generator=generators)
            if j in steps:
                for values, value in zip(stored, (x, x_next, log_prob, mean)):
                    values.append(value)
            x = x_next
    out = tuple(torch.stack(values, dim=1) for values in stored)
    return out if keep_means else out[:3]


def assert_tiny_rebuild_equals(model: str, path: Path, cache_root: Path) -> None:
    """Building `model`'s tiny pipeline again under another cache root gives the same files: the same tensors in
    the weights, the same bytes elsewhere (the caller points FLOWRL_CACHE at `cache_root`)."""
    import torch
    from safetensors.torch import load_file

    from common.models import tiny_model_path

    rebuilt = tiny_model_path(model)
    assert rebuilt.is_relative_to(cache_root)
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert rebuilt != path and files == sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file())
    for name in files:
        if name.suffix == ".safetensors":
            a, b = load_file(rebuilt / name), load_file(path / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert (rebuilt / name).read_bytes() == (path / name).read_bytes(), name
