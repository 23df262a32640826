"""Reward checkpoints: where a file or a snapshot is (a local path or a hub repo) and how its weights load
(safetensors, or torch.load with weights_only=True: no pickled code runs)."""

from pathlib import Path

import torch

from common.utils import UserError


def checkpoint_file(path: str, filenames: tuple[str, ...]) -> Path:
    """A checkpoint file: `path` itself, the first of `filenames` in the folder `path`, else the first of `filenames`
    that the hub repo `path` holds."""
    local = Path(path)
    if local.is_file():
        return local
    if local.is_dir():
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
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as error:
        raise UserError(f"cannot load the reward checkpoint {path!r}: {str(error).splitlines()[0]}") from None


def load_state(file: Path) -> dict:
    """A state dict from safetensors or a weights-only torch pickle (`{"model": ...}` unwrapped, as the references)."""
    if not file.exists():
        raise UserError(f"reward checkpoint {file} does not exist")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(file)
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state.get("model", None), dict) else state
