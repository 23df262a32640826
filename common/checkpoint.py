"""Atomic checkpoints: OUTPUT_DIR/checkpoints/epoch_NNNNNN/ holding the weights in a format diffusers loads
(LoRA: `pytorch_lora_weights.safetensors`; full fine-tuning: `transformer/` from `save_pretrained`), the
training state (optimizer, EMA, ...; loaded with weights_only=True), each process's RNG state and
`meta.json`. A checkpoint is written to a temporary folder and renamed into place, and `latest` names the
newest complete one, so a run killed at any moment leaves the previous checkpoint intact."""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.distributed import (full_state_loading, is_sharded, load_lora_state_dict, load_master_weights,
                                lora_parameter_names, model_state_dict)

LORA_FILE = "pytorch_lora_weights.safetensors"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rng_state() -> dict:
    state = {"torch": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(accelerator, output_dir: str | Path, epoch: int, write_weights, states: dict,
                    meta: dict, keep: int = 2, model=None) -> Path:
    """write_weights(folder) writes the model weights (called on the main process only). `states` maps
    names to state dicts saved in training_state.pt. All processes must call this. With `model`, its full
    state dict is gathered on every process first (FSDP2 shards: a collective) and passed on as
    write_weights(folder, state)."""
    root = Path(output_dir) / "checkpoints"
    final = root / f"epoch_{epoch:06d}"
    tmp = root / f".epoch_{epoch:06d}.tmp"
    state = model_state_dict(model) if model is not None else None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if model is None:
            write_weights(tmp)
        else:
            write_weights(tmp, state)
        torch.save(states, tmp / "training_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"epoch": epoch, **meta}, indent=1))
    accelerator.wait_for_everyone()
    torch.save(_rng_state(), tmp / f"rng_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # re-saving an epoch after a resume: swap, never leave a half state
            stale = root / f".epoch_{epoch:06d}.old"
            os.replace(final, stale)
            os.replace(tmp, final)
            shutil.rmtree(stale)
        else:
            os.replace(tmp, final)
        _write_text_atomic(root / "latest", final.name)
        for old in sorted(root.glob("epoch_*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    pointer = Path(output_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    folder = pointer.parent / pointer.read_text().strip()
    return folder if (folder / "meta.json").exists() else None


def load_training_state(folder: Path, process_index: int) -> tuple[dict, dict]:
    """(states, meta) of a checkpoint; restores this process's RNG state."""
    states = torch.load(folder / "training_state.pt", map_location="cpu", weights_only=True)
    meta = json.loads((folder / "meta.json").read_text())
    rng_file = folder / f"rng_{process_index}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=True)
        torch.random.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return states, meta


def load_lora_into(transformer, folder: Path) -> None:
    """Load a saved diffusers-format LoRA file back into a peft-wrapped transformer (for resume)."""
    from peft import set_peft_model_state_dict

    state = load_file(folder / LORA_FILE)
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    if is_sharded(transformer):  # FSDP2: whole tensors into the shards
        unexpected = load_lora_state_dict(transformer, state)
    else:
        unexpected = getattr(set_peft_model_state_dict(transformer, state), "unexpected_keys", None)
    if unexpected:
        raise RuntimeError(f"LoRA checkpoint {folder} has keys the model lacks: {unexpected[:3]}")
    names = lora_parameter_names(transformer, state)
    load_master_weights(transformer, {names[k]: v for k, v in state.items()})


def load_full_weights_into(transformer, folder: Path) -> None:
    """Load `save_pretrained` safetensors shards of a fully fine-tuned transformer (for resume)."""
    state = {}
    for shard in sorted((folder / "transformer").glob("*.safetensors")):
        state.update(load_file(shard))
    with full_state_loading(transformer):
        transformer.load_state_dict(state, strict=True)
    load_master_weights(transformer, state)
