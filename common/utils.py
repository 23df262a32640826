"""Small helpers every script needs: one-line errors, dtype choice, quiet libraries."""

import errno
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch


class UserError(Exception):
    """Bad input from the user (flags, data files, an unusable output folder): one line, exit status 2."""

    exit_code = 2


class RunStopped(UserError):
    """A run that cannot go on (a non-finite loss, a full disk): one line, exit status 3."""

    exit_code = 3


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
RERUN = "free space and rerun with --resume (the previous checkpoints are intact)"


def _disk_full(err: BaseException | None) -> str | None:
    """strerror when `err`, or an error it arose from, is a full disk or quota. Libraries wrap the OSError:
    torch.save into a file object raises a RuntimeError with it as __context__, safetensors says "(os error 28)"
    in its message; torch.save to a path gives only "unexpected pos", so the writes here hand it a file object."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            return os.strerror(err.errno)
        for code in DISK_FULL:
            if f"(os error {code})" in str(err) or os.strerror(code) in str(err):
                return os.strerror(code)
        err = err.__cause__ or err.__context__
    return None


@contextmanager
def disk_writes(path: str | Path, doing: str | None = None, then: str = RERUN, remove=()):
    """Writes of `path` (a file or folder) in the block: a full disk (ENOSPC, EDQUOT) stops the run with one line
    instead of a traceback. On any failure the partial files or folders in `remove` are deleted first (which also
    gives the space back). `doing` prefixes the line; `then` says what to do next."""
    try:
        yield
    except Exception as err:
        for leftover in map(Path, remove):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
        reason = _disk_full(err)
        if reason is None:
            raise
        path = Path(path)
        raise RunStopped(f"{doing + ': ' if doing else ''}the disk under {path.parent} is full (writing {path.name}: "
                         f"{reason}): {then}") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` through PATH.tmp and a rename, so a reader sees the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with disk_writes(path, remove=[tmp]):
        tmp.unlink(missing_ok=True)  # a leftover (or planted) PATH.tmp, even a symlink, is replaced, not written through
        with open(tmp, "x") as handle:
            handle.write(text)
        os.replace(tmp, path)


@contextmanager
def folder_replaced_atomically(out: Path):
    """A temporary folder beside `out` for the block to write; when the block ends without an error it replaces
    `out` by renames (the old folder moved aside first, then deleted), so `out` is never half-written. On an error
    the temporary folder is deleted and `out` is untouched."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
            os.rename(out, old / out.name)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_report(message: str) -> bool:
    """Whether this process is the first of its launch to report `message`: under torchrun / `accelerate launch`
    every process usually meets the same bad input, and the line should reach the terminal once. The processes of
    a launch on one machine share their parent (the launcher's agent) and TORCHELASTIC_RUN_ID ("none" for every
    standalone launch, so it alone would hide the line in the next launch); the first to create the marker file of
    (run id, parent, message) reports it."""
    import hashlib
    import tempfile

    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None or os.environ.get("WORLD_SIZE", "1") == "1":
        return True
    parent = str(os.getppid())
    try:  # with the parent's start time, a reused process id names another launch
        with open(f"/proc/{parent}/stat") as stat:
            parent += "@" + stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    key = hashlib.sha256(f"{run_id}\0{parent}\0{message}".encode()).hexdigest()[:20]
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), f"flowrl-error-{key}"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def install_user_error_hook() -> None:
    """Print a UserError as one `error: ...` line instead of a traceback, and exit with its status.

    The line goes to the process's real stderr, once per launch (whichever process meets the error first): under
    `accelerate launch` / torchrun, torch.distributed wraps sys.excepthook and captures what the hook writes to
    sys.stderr into a buffer that it prints only if the hook returns, which sys.exit never does; that is how these
    lines used to vanish."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if issubclass(kind, UserError):
            if _first_report(str(value)):
                sys.__stderr__.write(f"error: {value}\n")
                sys.__stderr__.flush()
            sys.exit(value.exit_code)
        previous(kind, value, traceback)

    sys.excepthook = hook


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on accelerators and float32 on the CPU (bf16 matmuls are slow and inexact there)."""
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in choices:
        raise UserError(f"unknown dtype {name!r}; choose one of: auto, {', '.join(choices)}")
    return choices[name]


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated by torch (GPU), or the process's peak resident set size (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def quiet_libraries() -> None:
    """Silence per-call progress bars and advisory warnings of diffusers/transformers."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def avoid_cudnn_attention() -> None:
    """Training on Hopper GPUs: since torch 2.11 the default scaled_dot_product_attention backend there, cuDNN,
    returns non-finite gradients for some shapes (pytorch/pytorch#196678; on an H200 with torch 2.11 every LoRA
    GRPO step of the tiny FLUX.1 had them), so attention runs on the flash / memory-efficient kernels instead.
    Forward results are the same to rounding; nothing changes on CPUs."""
    torch.backends.cuda.enable_cudnn_sdp(False)
