"""A full disk: each write path of a run, met on a real, small tmpfs that is all but full, stops the run with one
`error:` line (exit status 3) and no traceback, leaves the last checkpoint loadable, the metrics' lines whole and
no temporary file behind; a rerun with --resume after freeing space finishes. The filler leaves an exact number of
free pages (tmpfs counts whole 4 KiB pages), chosen so that the write under test is the first that does not fit.
Mounting needs root (or CAP_SYS_ADMIN): elsewhere these tests skip."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import read_metrics, run_script, slow_except

TINY = ["--preset", "tiny", "--eval-every", "0"]
FULL = "No space left on device): free space and rerun with --resume (the previous checkpoints are intact)"


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("cannot mount a tmpfs here: no `mount` program")
    tried = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                           text=True)
    if tried.returncode != 0:  # not root, or a container without CAP_SYS_ADMIN (also under CI=true)
        pytest.skip(f"cannot mount a tmpfs here ({tried.stderr.strip() or tried.returncode}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(mount: Path, leave_pages: int) -> Path:
    """A filler file that leaves exactly `leave_pages` free blocks on the tmpfs."""
    stat = os.statvfs(mount)
    filler = mount / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * ((stat.f_bavail - leave_pages) * stat.f_frsize))
    assert os.statvfs(mount).f_bavail == leave_pages
    return filler


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_flux_path):
    """6 epochs (metrics.jsonl: over one page), checkpoints epoch_000002 and epoch_000005."""
    out = tmp_path_factory.mktemp("full-disk") / "run"
    run_script("algos/grpo.py", *TINY, "--epochs", "6", "--save-every", "3", "--output-dir", out)
    return out


def one_line(result) -> str:
    assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: "), result.stderr[-3000:]
    return lines[-1]


def resume(out, epochs, *flags, check=True):
    return run_script("algos/grpo.py", *TINY, "--epochs", str(epochs), "--output-dir", out, "--resume", *flags,
                      check=check)


# (free pages left, epochs, resume flags, the file named in the line). A resumed start writes .lock (1 page),
# metrics.jsonl.tmp (2 pages, then the old file's pages are freed), then the
# epochs' metrics lines, eval grids (~100 KiB) and checkpoints (~200 KiB).
CASES = {
    "lock file": (0, 8, [], ".lock"),
    "metrics rewrite at resume": (2, 8, [], "metrics.jsonl"),
    "metrics append": (3, 40, ["--save-every", "100"], "metrics.jsonl"),  # ~11 lines fit, no checkpoint before
    "eval grid": (16, 8, ["--eval-every", "1"], "epoch_000006.png"),
    "checkpoint": (16, 8, ["--save-every", "1"], ".epoch_000006.tmp"),
}


@pytest.mark.parametrize("case", slow_except(list(CASES), "checkpoint"))
def test_a_full_disk_stops_with_one_line_and_a_resume_after_freeing_space_finishes(base_run, tmpfs, case):
    from common.checkpoint import read_checkpoint

    leave, epochs, flags, written = CASES[case]
    out = tmpfs / "run"
    shutil.copytree(base_run, out)
    before = (out / "metrics.jsonl").read_text()
    filler = fill(tmpfs, leave)
    line = one_line(resume(out, epochs, *flags, check=False))
    assert f"(writing {written}: {FULL}" in line, line
    folder = {"checkpoint": out / "checkpoints", "eval grid": out / "eval"}.get(case, out)
    doing = "cannot write the checkpoint of epoch 6: " if case == "checkpoint" else ""
    assert line.startswith(f"error: {doing}the disk under {folder} is full"), line
    # The last checkpoint loads, `latest` names it, every metrics line is whole and no temporary file is left.
    assert read_checkpoint(out / "checkpoints" / "epoch_000005", False, 0).meta["epoch"] == 5
    assert (out / "checkpoints" / "latest").read_text() == "epoch_000005"
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["epoch"] for x in text.splitlines()][:6] == list(range(6))
    if leave < 3:  # failed before any epoch: nothing changed
        assert text == before
    leftovers = [p.name for p in out.rglob("*") if ".tmp" in p.name or ".old" in p.name]
    assert leftovers == [], leftovers

    filler.unlink()
    # Leftovers of a write killed outright (no chance to clean up) are removed by the next start.
    (out / "metrics.jsonl.tmp").write_text('{"epoch": 0')
    (out / "eval").mkdir(exist_ok=True)
    (out / "eval" / "epoch_000009.png.tmp.png").write_bytes(b"half")
    result = resume(out, 7)
    assert "removed unfinished checkpoint writes: epoch_000009.png.tmp.png, metrics.jsonl.tmp" in result.stdout
    assert [m["epoch"] for m in read_metrics(out) if m["epoch"] >= 0] == list(range(7))
    assert (out / "checkpoints" / "latest").read_text() == "epoch_000006"
    assert not list(out.rglob("*.tmp*"))


def test_a_full_disk_while_building_the_embedding_cache_stops_with_one_line(tiny_flux_path, tmpfs):
    fill(tmpfs, 0)
    result = run_script("preprocess.py", "--model-path", "tiny", "--max-sequence-length", "16", "--cache-dir",
                        tmpfs / "cache", check=False)
    line = one_line(result)
    assert line.startswith(f"error: cannot build the embedding cache: the disk under {tmpfs / 'cache'} is full")
    assert "No space left on device): free space and run it again" in line, line
    assert not [p for p in (tmpfs / "cache").iterdir() if p.name.endswith(".tmp")]


def _wrapped_by_torch() -> RuntimeError:
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError as err:  # carries the OSError as its __context__
            return err


@pytest.mark.parametrize("error,reason", [
    (lambda: OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), os.strerror(errno.EDQUOT)),
    (lambda: Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
     os.strerror(errno.ENOSPC)),  # safetensors
    (_wrapped_by_torch, os.strerror(errno.ENOSPC)),  # torch.save into a file object
])
def test_disk_writes_knows_a_full_disk_behind_the_libraries(tmp_path, error, reason):
    """Without a tmpfs: the errors as the libraries raise them, and the partial file is removed."""
    from common.utils import RunStopped, disk_writes

    partial = tmp_path / "x.tmp"
    with pytest.raises(RunStopped, match=f"the disk under {tmp_path} is full \\(writing x: {reason}\\)"):
        with disk_writes(tmp_path / "x", remove=[partial]):
            partial.write_text("half")
            raise error()
    assert not partial.exists()
    with pytest.raises(PermissionError), disk_writes(tmp_path / "x"):  # any other error passes through
        raise PermissionError(errno.EACCES, "denied")
