"""Atomic checkpoints and a resume that never destroys a run.

OUTPUT_DIR/checkpoints/epoch_NNNNNN/ holds the weights in a format diffusers loads (LoRA:
`pytorch_lora_weights.safetensors`; full fine-tuning: `transformer/` from `save_pretrained`), the training state
(optimizer, learning-rate schedule, EMA, frozen policies; loaded with weights_only=True), each process's RNG state
and `meta.json` (the epoch, the flags that define the run, script state such as MixGRPO's window). A checkpoint is
written to a temporary folder and renamed into place, and `latest` names the newest one, so a run killed at any
moment leaves the previous checkpoint intact. meta.json, written last, records the sha256 of every other file.

Resume does not trust `latest`: it loads the newest checkpoint folder that loads completely (meta, weights,
training state, every file matching its sha256, finite weights), says which newer ones it skipped and why, and
refuses, rather than start from scratch, when a checkpoint was written in the folder but none loads completely
(common.setup._find_resume). Checkpoints from before the hashes (no "sha256" in meta.json) load unchecked.
"""

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.distributed import (full_state_loading, is_sharded, load_lora_state_dict, load_master_weights,
                                lora_parameter_names, model_state_dict)
from common.utils import RunStopped, disk_writes, write_text_atomic

LORA_FILE = "pytorch_lora_weights.safetensors"
# A second expert's LoRA (Wan2.2's low-noise `transformer_2`), in the same format: diffusers loads it with
# `load_lora_weights(folder, weight_name=LORA_FILE_2, load_into_transformer_2=True)`.
LORA_FILE_2 = "pytorch_lora_weights_transformer_2.safetensors"
# What a failed write can leave in OUTPUT_DIR (checkpoint folders aside), removed by the next start.
STALE_FILES = ("metrics.jsonl.tmp", "eval/*.tmp.png", "checkpoints/latest.tmp")


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as handle:  # a file object: a full disk then surfaces as ENOSPC (common.utils._disk_full)
        torch.save(obj, handle)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # streamed in chunks, never the whole file in memory


def _rng_state() -> dict:
    state = {"torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(accelerator, output_dir: str | Path, epoch: int, write_weights, states: dict,
                    meta: dict, keep: int = 2, model=None, pinned: set[str] = frozenset()) -> Path:
    """write_weights(folder) writes the model weights (called on the main process only). `states` maps
    names to state dicts saved in training_state.pt. All processes must call this. With `model`, its full
    state dict is gathered on every process first (FSDP2 shards: a collective) and passed on as
    write_weights(folder, state). A failed write (a full disk) stops the run with one line, removes the temporary
    folder and leaves the previous checkpoints as they were. The `keep` newest checkpoints stay, and those named in
    `pinned` (the guard's best evaluations, common.guard)."""
    root = Path(output_dir) / "checkpoints"
    final = root / f"epoch_{epoch:06d}"
    tmp = root / f".epoch_{epoch:06d}.tmp"
    state = model_state_dict(model) if model is not None else None
    try:
        with disk_writes(tmp, f"cannot write the checkpoint of epoch {epoch}", remove=[tmp]):
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                if model is None:
                    write_weights(tmp)
                else:
                    write_weights(tmp, state)
                _torch_save(states, tmp / "training_state.pt")
            accelerator.wait_for_everyone()
            _torch_save(_rng_state(), tmp / f"rng_{accelerator.process_index}.pt")
            accelerator.wait_for_everyone()  # every rank's rng file is complete before it is hashed
            if accelerator.is_main_process:
                hashes = {p.relative_to(tmp).as_posix(): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
                (tmp / "meta.json").write_text(json.dumps({"epoch": epoch, **meta, "sha256": hashes}, indent=1))
    except (OSError, RuntimeError) as err:  # not a full disk (permissions, ...): one line all the same
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise RunStopped(f"cannot write the checkpoint of epoch {epoch} under {root}: {reason}; the previous "
                         f"checkpoints are intact") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # re-saving an epoch after a resume: swap, never leave a half state
            stale = root / f".epoch_{epoch:06d}.old"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        write_text_atomic(root / "latest", final.name)
        for old in sorted(root.glob("epoch_*"))[:-keep] if keep > 0 else []:
            if old.name not in pinned:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def clean_stale_writes(output_dir: str | Path) -> list[str]:
    """Remove what a failed or killed write left behind (temporary checkpoint folders, *.tmp files of the
    metrics and eval grids); returns their names."""
    output_dir = Path(output_dir)
    stale = sorted([*output_dir.glob("checkpoints/.epoch_*.tmp"), *output_dir.glob("checkpoints/.epoch_*.old"),
                    *(path for pattern in STALE_FILES for path in output_dir.glob(pattern))])
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return [p.name for p in stale]


class CheckpointError(Exception):
    """A checkpoint folder that does not load completely."""


@dataclass
class Checkpoint:
    folder: Path
    meta: dict
    weights: dict[str, torch.Tensor]  # the LoRA file's or the full transformer's tensors
    states: dict                      # training_state.pt
    rng: dict | None                  # this process's RNG state (None when it ran with fewer processes)


def read_checkpoint(folder: Path, full_finetune: bool, process_index: int) -> Checkpoint:
    """Everything a resume needs from `folder`, read into memory; CheckpointError says what is missing or broken."""
    def read(what, load):
        try:
            return load()
        except FileNotFoundError:
            raise CheckpointError(f"{what} is missing") from None
        except Exception:  # truncated or corrupt files raise many kinds of errors
            raise CheckpointError(f"{what} does not load") from None

    def finite(what, tensors):
        if not all(torch.isfinite(t).all() for t in tensors.values()):
            raise CheckpointError(f"{what} holds non-finite weights")
        return tensors

    meta = read("meta.json", lambda: json.loads((folder / "meta.json").read_text()))
    if not isinstance(meta, dict) or "epoch" not in meta:
        raise CheckpointError("meta.json has no epoch")
    if not isinstance(meta["epoch"], int) or folder.name != f"epoch_{meta['epoch']:06d}":
        raise CheckpointError(f"meta.json says epoch {meta['epoch']!r} but the folder is {folder.name}")
    if bool(meta.get("full_finetune", False)) != full_finetune:
        raise CheckpointError(f"it holds {'full' if meta.get('full_finetune') else 'LoRA'} weights")
    hashes = meta.get("sha256", {})  # absent in checkpoints written before the hashes: nothing to check
    if not isinstance(hashes, dict):
        raise CheckpointError("meta.json's sha256 is not a mapping of files to hashes")
    # Every process checks every file (not only its own rng file), so all processes skip the same checkpoints.
    for name, digest in sorted(hashes.items()):
        if read(name, lambda: _sha256(folder / name)) != digest:
            raise CheckpointError(f"{name} does not match its sha256 in meta.json")
    if full_finetune:
        shards = sorted((folder / "transformer").glob("*.safetensors"))
        if not shards:
            raise CheckpointError("transformer/*.safetensors is missing")
        weights = {}
        for shard in shards:
            what = f"transformer/{shard.name}"
            weights.update(finite(what, read(what, lambda: load_file(shard))))
    else:
        weights = finite(LORA_FILE, read(LORA_FILE, lambda: load_file(folder / LORA_FILE)))
        if (folder / LORA_FILE_2).exists():
            weights.update(second_expert_keys(finite(LORA_FILE_2, read(LORA_FILE_2,
                                                                       lambda: load_file(folder / LORA_FILE_2)))))
    states = read("training_state.pt", lambda: torch.load(folder / "training_state.pt", map_location="cpu",
                                                           weights_only=True))
    rng_file = folder / f"rng_{process_index}.pt"
    rng = read(rng_file.name, lambda: torch.load(rng_file, weights_only=True)) if rng_file.exists() else None
    return Checkpoint(folder, meta, weights, states, rng)


def newest_complete_checkpoint(output_dir: str | Path, full_finetune: bool,
                               process_index: int) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint folder that loads completely, and a note for each newer one that does not."""
    skipped = []
    for folder in sorted((Path(output_dir) / "checkpoints").glob("epoch_*"), reverse=True):
        try:
            return read_checkpoint(folder, full_finetune, process_index), skipped
        except CheckpointError as err:
            skipped.append(f"{folder.name} ({err})")
    return None, skipped


def restore_rng(rng: dict | None) -> None:
    if rng is None:
        return
    torch.random.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def load_training_state(folder: Path, process_index: int) -> tuple[dict, dict]:
    """(states, meta) of a checkpoint; restores this process's RNG state."""
    checkpoint = read_checkpoint(folder, (folder / "transformer").is_dir(), process_index)
    restore_rng(checkpoint.rng)
    return checkpoint.states, checkpoint.meta


def second_expert_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LORA_FILE_2's keys (`transformer.…`, as diffusers writes every transformer LoRA) as `transformer_2.…`."""
    return {"transformer_2." + k.removeprefix("transformer."): v for k, v in state.items()}


def load_lora_state_into(transformer, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load LoRA weights in the diffusers file format into a peft-wrapped transformer (for resume). A module holding
    two experts (common.models.wan22.WanExperts) takes the keys as they are: `transformer.…`, `transformer_2.…`."""
    from peft import set_peft_model_state_dict

    if not hasattr(transformer, "transformer_2"):  # one transformer: the keys without the file's component name
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
    if is_sharded(transformer):  # FSDP2: whole tensors into the shards
        unexpected = load_lora_state_dict(transformer, state)
    else:
        unexpected = getattr(set_peft_model_state_dict(transformer, state), "unexpected_keys", None)
    if unexpected:
        raise RuntimeError(f"LoRA {source} has keys the model lacks: {unexpected[:3]}")
    names = lora_parameter_names(transformer, state)
    load_master_weights(transformer, {names[k]: v for k, v in state.items()})


def load_full_state_into(transformer, state: dict[str, torch.Tensor]) -> None:
    """Load a fully fine-tuned transformer's state dict (for resume)."""
    with full_state_loading(transformer):
        transformer.load_state_dict(state, strict=True)
    load_master_weights(transformer, state)


def load_lora_into(transformer, folder: Path) -> None:
    state = load_file(folder / LORA_FILE)
    if (folder / LORA_FILE_2).exists():
        state.update(second_expert_keys(load_file(folder / LORA_FILE_2)))
    load_lora_state_into(transformer, state, str(folder))


def load_full_weights_into(transformer, folder: Path) -> None:
    state = {}
    for shard in sorted((folder / "transformer").glob("*.safetensors")):
        state.update(load_file(shard))
    load_full_state_into(transformer, state)
