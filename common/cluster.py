"""What a run needs on a shared cluster: one owner per output folder, and a clean stop on SIGTERM / SIGINT.

The lock: `lock_output_dir` holds an exclusive flock on OUTPUT_DIR/.lock for the life of the process (the kernel
drops it when the process ends, however it ends, so a lock file left by a dead run blocks nothing) and writes
"PID HOST" into it, which a refused run names. Under `accelerate launch` only the main process takes it
(common.setup) and the others start after it holds it: the launch is one owner.

The stop: from the first epoch on, SIGTERM (a scheduler's preemption or time limit) and SIGINT (Ctrl-C) only set
a flag. Every process finishes the epoch in progress; `save` (common.setup), the last call of every script's epoch,
takes the largest flag over the processes, so all of them stop after the same epoch, writes that epoch's
checkpoint and exits with 128 + the signal's number (143, 130). Finishing the epoch instead of stopping at once
keeps the resumed run equal to an uninterrupted one and loses no work; a scheduler must allow one epoch and a
checkpoint between its signal and its SIGKILL.
"""

import atexit
import errno
import fcntl
import os
import signal
import socket
import stat
import sys
from pathlib import Path

import torch

from common.utils import UserError, disk_writes

LOCK_FILE = ".lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received = 0  # the first stop signal this process received (0: none)


def lock_output_dir(output_dir: Path) -> None:
    """Take OUTPUT_DIR/.lock for the life of this process, or refuse with one line naming its holder without
    changing anything. A file system without flock (e.g. Lustre mounted without -o flock) runs unlocked, with a
    warning."""
    path = output_dir / LOCK_FILE
    fd = _open_lock_file(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 256).decode(errors="replace").split() or ["?", "?"]
        os.close(fd)
        raise UserError(f"{output_dir} is in use by another run (process {holder[0]} on {holder[-1]}): wait for it "
                        f"to end or choose another --output-dir") from None
    except OSError as err:
        os.close(fd)
        print(f"warning: cannot lock {path} ({err.strerror}): a second run on {output_dir} would not be refused")
        return
    os.ftruncate(fd, 0)
    with disk_writes(path):  # on a full disk, the first write of a run
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    # Emptied, not removed, at exit: a removed file would let two runs lock two different files of one name.
    # The descriptor stays open (and the lock held) until the process ends.
    atexit.register(os.ftruncate, fd, 0)


def _open_lock_file(path: Path, flags: int) -> int:
    """A descriptor of the lock file, which a run empties and writes: never through a symbolic link, a hard link or
    anything but a plain file (one planted in a shared runs folder would have the run truncate the file it names);
    such a path is refused with one line and left as it is."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)  # O_NONBLOCK: a FIFO does not hang the open
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link, not a lock file: a run never writes through it; remove it "
                            f"or choose another --output-dir") from None
        raise UserError(f"cannot open the lock file {path} ({err.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        what = "a hard link to another file" if stat.S_ISREG(info.st_mode) else "not a plain file"
        raise UserError(f"{path} is {what}, not a lock file: a run never writes through it; remove it or choose "
                        f"another --output-dir")
    return fd


def output_dir_holder(output_dir: Path) -> str | None:
    """"PID HOST" of the live run that holds OUTPUT_DIR/.lock, or None when no run does (the lock is tried and
    released at once): for a tool that is about to clear a run folder, as benchmarks/compare.py is."""
    path = Path(output_dir) / LOCK_FILE
    if not path.exists():
        return None
    try:  # a symbolic link or a FIFO is no run's lock (runs refuse them): not followed, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 256).decode(errors="replace").strip() or "? ?"
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a lock this took
    return None


def stop_after_epoch_on_signals() -> None:
    """From now on SIGTERM and SIGINT only ask the run to stop after the epoch in progress (`requested_stop`)."""
    def handler(signum, frame):
        global _received
        _received = _received or signum

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def requested_stop(accelerator) -> int:
    """The stop signal received by any process of the run (0: none), the same on all of them (an all-reduce, so
    every process must call this at the same point of the same epoch)."""
    if accelerator.num_processes == 1:
        return _received
    return int(accelerator.reduce(torch.tensor(_received, device=accelerator.device), "max"))


def exit_stopped(accelerator, signum: int, epoch: int) -> None:
    """End a run stopped by `signum` after `epoch`, whose checkpoint is written: one line, status 128 + signum."""
    accelerator.print(f"stopped by {signal.Signals(signum).name} after epoch {epoch}; checkpoint written; rerun with "
                      f"--resume", flush=True)
    # A launcher signals the processes still running when the first one exits: they are ending anyway, and a kill
    # would replace their status.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    accelerator.end_training()
    sys.exit(128 + signum)
