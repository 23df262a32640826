"""Reward checkpoints: where a file or a snapshot is (a local path or a hub repo) and how its weights load
(safetensors, or torch.load with weights_only=True: no pickled code runs)."""

import re
from pathlib import Path

import torch

from common.utils import UserError

LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a clone without git-lfs holds instead of a file


def local_path(path: str, what: str) -> Path | None:
    """`path` as a file or folder here, or None when it is a hub repo id. A path that can only mean a place here (it
    starts with /, . or ~, has more than one /, or its parent folder exists) and does not exist is refused with one
    line naming `what`: tried as a hub id it would fail later, in the hub's words."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or (local.parent != Path() and local.parent.is_dir()):
        raise UserError(f"cannot load {what} {path!r}: no such file or folder")
    return None


def checkpoint_file(path: str, filenames: tuple[str, ...]) -> Path:
    """A checkpoint file: `path` itself, the first of `filenames` in the folder `path`, else the first of `filenames`
    that the hub repo `path` holds."""
    local = local_path(path, "the reward checkpoint")
    if local is not None and local.is_file():
        return local
    if local is not None:
        return next((local / name for name in filenames if (local / name).exists()), local / filenames[0])
    from huggingface_hub import hf_hub_download

    errors = []
    for name in filenames:
        try:
            return Path(hf_hub_download(path, name))
        except Exception as error:  # offline, unknown repo or file
            errors.append(str(error).splitlines()[0])
    raise UserError(f"cannot load the reward checkpoint {path!r}/{' or '.join(filenames)}: {errors[-1]}")


def snapshot_folder(path: str) -> Path:
    """A folder of the hub repo or local folder `path` (the whole snapshot)."""
    local = local_path(path, "the reward checkpoint")
    if local is not None:
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as error:
        raise UserError(f"cannot load the reward checkpoint {path!r}: {str(error).splitlines()[0]}") from None


def load_state(file: Path) -> dict:
    """A state dict from safetensors or a weights-only torch pickle (`{"model": ...}` unwrapped, as the references).
    A file that is not one (cut short, another kind of file, a pickle of other objects) is one line naming it."""
    if not file.exists():
        raise UserError(f"reward checkpoint {file} does not exist")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(file)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors', zipfile's and the unpickler's errors all mean: not weights
        raise UserError(f"reward checkpoint {file} does not load: {_not_weights(error, file)}") from None
    if not isinstance(state, dict):
        raise UserError(f"reward checkpoint {file} holds a {type(state).__name__}, not a state dict of tensors")
    return state.get("model", state) if isinstance(state.get("model", None), dict) else state


def _not_weights(error: Exception, file: Path) -> str:
    """Why a checkpoint did not load, in one line (torch's own message for a refused pickle is many lines that
    advise weights_only=False, which would run whatever code the pickle holds)."""
    with open(file, "rb") as handle:
        if handle.read(len(LFS_POINTER)) == LFS_POINTER:
            return "it is a Git LFS pointer, not the weights (fetch them: git lfs pull)"
    message = str(error).strip()
    if message.startswith("Weights only load failed"):
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", message)
        if refused:
            return f"it pickles {refused[1]}, not only tensors, and such a file is not loaded (no pickled code runs)"
        message = next(iter(re.findall(r"Unsupported operand \d+", message)), "not a pickle of tensors")
    kind = "safetensors" if file.suffix == ".safetensors" else "torch.save"
    return f"not a complete {kind} file ({type(error).__name__}: {message.splitlines()[0] if message else 'empty'})"
