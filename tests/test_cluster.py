"""What a cluster does to runs (common/cluster.py, docs/running.md#clusters): a second run on a folder in use is
refused and changes nothing; a run stopped before its first checkpoint is started again from scratch; SIGTERM and
SIGINT stop every process after the same epoch with a checkpoint, and the resumed run equals an uninterrupted one."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ACCELERATE_2CPU, REPO, SLOW, free_port, read_metrics, run_script, slow_except

# tiny's --save-every is 50: of these 5 epochs only the last is a checkpoint epoch.
ARGS = ["--preset", "tiny", "--eval-every", "0", "--epochs", "5"]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu",
             "peak_memory_gb"}  # measured
LAST = "epoch_000004"
STOPPED = r"stopped by (SIG\w+) after epoch (\d+); checkpoint written; rerun with --resume"


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_equal_runs(out: Path, reference: Path) -> None:
    """The metrics lines (but the measured times) and the final weights are the same."""
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(out, base=True)) == strip(read_metrics(reference, base=True))
    weights, expected = (load_file(folder / "checkpoints" / LAST / "pytorch_lora_weights.safetensors")
                         for folder in (out, reference))
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)


def start(out: Path, logs: Path, launcher=None) -> subprocess.Popen:
    """algos/grpo.py with ARGS in the background, its output in logs.out / logs.err."""
    command = [*(launcher or [sys.executable]), str(REPO / "algos/grpo.py"), *ARGS, "--output-dir", str(out)]
    with open(logs.with_suffix(".out"), "w") as stdout, open(logs.with_suffix(".err"), "w") as stderr:
        return subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr)


def wait_for_first_epoch(process: subprocess.Popen, out: Path) -> None:
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None, f"the run ended ({process.returncode}) before its first epoch"
        assert time.time() < deadline, "no epoch within 300 s"
        time.sleep(0.02)


def stop_line(stdout: str, name: str) -> int:
    """The epoch of the one `stopped by NAME after epoch N` line."""
    (line,) = [line for line in stdout.splitlines() if line.startswith("stopped by")]
    match = re.fullmatch(STOPPED, line)
    assert match and match[1] == name, line
    return int(match[2])


def assert_stopped_after(out: Path, epoch: int) -> None:
    """The metrics end at `epoch`, whose checkpoint (not a --save-every epoch) is the only one."""
    assert epoch < 4, "the signal came too late to stop the run before its end"
    assert [m["epoch"] for m in read_metrics(out)] == list(range(epoch + 1))
    assert sorted(p.name for p in (out / "checkpoints").glob("epoch_*")) == [f"epoch_{epoch:06d}"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_flux_path):
    out = tmp_path_factory.mktemp("full") / "run"
    run_script("algos/grpo.py", *ARGS, "--output-dir", out)
    return out


# ---- 1. one run per output folder -------------------------------------------------------------------------------
def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_goes_on(full_run, tmp_path):
    out = tmp_path / "run"
    first = start(out, tmp_path / "first")
    wait_for_first_epoch(first, out)
    first.send_signal(signal.SIGSTOP)  # it holds the lock but cannot finish while the second run tries
    try:
        before = snapshot(out)
        for extra in ([], ["--resume"]):
            result = run_script("algos/grpo.py", *ARGS, "--output-dir", out, *extra, check=False)
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            expected = (f"error: {out} is in use by another run (process {first.pid} on {socket.gethostname()}): "
                        f"wait for it to end or choose another --output-dir")
            assert result.returncode == 2 and errors == [expected], result.stderr[-3000:]
            assert snapshot(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0
    assert_equal_runs(out, full_run)


@pytest.mark.parametrize("planted", slow_except(["symbolic link", "hard link", "folder"], "symbolic link"))
def test_a_planted_lock_file_is_never_written_through(tmp_path, planted):
    """In a shared runs folder anyone may leave OUTPUT_DIR/.lock pointing at someone's file: the run that empties and
    writes its lock would truncate that file. It is refused with one line and nothing changes."""
    victim, out = tmp_path / "victim.txt", tmp_path / "run"
    victim.write_text("keep me\n")
    out.mkdir()
    lock = out / ".lock"
    if planted == "symbolic link":
        lock.symlink_to(victim)
        expected = f"error: {lock} is a symbolic link, not a lock file"
    elif planted == "hard link":
        os.link(victim, lock)
        expected = f"error: {lock} is a hard link to another file, not a lock file"
    else:
        lock.mkdir()
        expected = f"error: cannot open the lock file {lock} (Is a directory)"
    before = snapshot(tmp_path)
    for extra in ([], ["--resume"]):
        result = run_script("algos/grpo.py", *ARGS, "--output-dir", out, *extra, check=False)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(errors) == 1 and errors[0].startswith(expected), result.stderr[-3000:]
        assert snapshot(tmp_path) == before and lock.is_symlink() == (planted == "symbolic link")


# ---- 2. a run stopped before its first checkpoint starts again -------------------------------------------------
@pytest.fixture(scope="module")
def killed_before_checkpoint(tmp_path_factory, tiny_flux_path):
    """A run killed (SIGKILL: no handler runs) after its first epoch, long before its first checkpoint."""
    out = tmp_path_factory.mktemp("killed") / "run"
    process = start(out, out.parent / "logs")
    wait_for_first_epoch(process, out)
    process.kill()
    process.wait()
    assert not (out / "checkpoints").exists()
    return out


@pytest.mark.parametrize("resume", slow_except([True, False], False))
def test_a_run_stopped_before_its_first_checkpoint_starts_again_from_scratch(killed_before_checkpoint, full_run,
                                                                              tmp_path, resume):
    out = tmp_path / "run"
    shutil.copytree(killed_before_checkpoint, out)
    assert (out / ".lock").read_text().split()[0].isdigit()  # the dead run's lock file blocks nothing
    (out / "eval").mkdir()
    (out / "eval" / "base.png").write_bytes(b"old grid")
    result = run_script("algos/grpo.py", *ARGS, "--output-dir", out, *(["--resume"] if resume else []))
    assert (f"{out} holds a run stopped before its first checkpoint: starting it again from scratch (its "
            f"metrics.jsonl and eval/ are cleared)") in result.stdout.splitlines()
    assert not (out / "eval").exists()
    assert_equal_runs(out, full_run)  # no line of the killed run is left


# ---- 3. SIGTERM and SIGINT: stop after the epoch in progress ----------------------------------------------------
def test_sigterm_stops_after_the_epoch_with_a_checkpoint_and_the_resume_is_exact(full_run, tmp_path):
    out = tmp_path / "run"
    process = start(out, tmp_path / "logs")
    wait_for_first_epoch(process, out)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143
    epoch = stop_line((tmp_path / "logs.out").read_text(), "SIGTERM")
    assert_stopped_after(out, epoch)
    assert (out / ".lock").read_text() == ""  # released
    run_script("algos/grpo.py", *ARGS, "--output-dir", out, "--resume")
    assert_equal_runs(out, full_run)


def test_sigint_stops_with_status_130_and_no_traceback(tiny_flux_path, tmp_path):
    out = tmp_path / "run"
    process = start(out, tmp_path / "logs")
    wait_for_first_epoch(process, out)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == 130
    stderr = (tmp_path / "logs.err").read_text()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert_stopped_after(out, stop_line((tmp_path / "logs.out").read_text(), "SIGINT"))


def _process_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of a launch's worker of `rank` (a child of the launcher with RANK=rank)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == launcher.pid and \
                    f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):  # a process that just ended
            continue
    raise AssertionError(f"no worker of rank {rank}")


@SLOW
def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_epoch(tmp_path):
    """Only rank 1 gets the signal; rank 0 learns of it through the all-reduce at the end of each epoch."""
    launcher = ACCELERATE_2CPU + ["--main_process_port", str(free_port())]
    run_script("algos/grpo.py", *ARGS, "--output-dir", tmp_path / "full", launcher=ACCELERATE_2CPU)
    out = tmp_path / "run"
    process = start(out, tmp_path / "logs", launcher)
    wait_for_first_epoch(process, out)
    os.kill(_process_of_rank(process, 1), signal.SIGTERM)
    assert process.wait(timeout=300) != 0  # the launcher reports its processes' 143 as a failure
    stderr = (tmp_path / "logs.err").read_text()
    if "terminate called without an active exception" not in stderr:  # gloo's exit-time abort (see run_script)
        statuses = re.findall(r"rank +: (\d+) .*\n +exitcode +: (-?\d+)", stderr)  # the launcher's report
        assert sorted(statuses) == [("0", "143"), ("1", "143")], stderr[-3000:]
    epoch = stop_line((tmp_path / "logs.out").read_text(), "SIGTERM")  # printed once, by the main process
    assert_stopped_after(out, epoch)
    assert {p.name for p in (out / "checkpoints" / f"epoch_{epoch:06d}").glob("rng_*.pt")} == {"rng_0.pt",
                                                                                                "rng_1.pt"}
    run_script("algos/grpo.py", *ARGS, "--output-dir", out, "--resume", launcher=ACCELERATE_2CPU)
    assert_equal_runs(out, tmp_path / "full")
