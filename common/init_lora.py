"""`--init-lora DIR` and `--merge-init-lora`, for every script through `common.setup`: start from a saved LoRA (a
step-distilled student, a finished run) instead of the base model.

- `--init-lora DIR` alone loads it into the trained adapter ("default"), which must have its rank and α: training
  continues it, and the reference (adapters disabled) stays the base model.
- with `--merge-init-lora` it is merged into the base weights first and a fresh LoRA is trained on top: the
  reference is then the merged model (a distilled model used as a base model, as in DiffusionNFT#45).
DIR is a folder holding the LoRA file (a checkpoint folder, data/toy/student/) or a run's --output-dir (its newest
complete checkpoint)."""

import json
import warnings
from pathlib import Path

from common.checkpoint import LORA_FILE, LORA_FILE_2, load_lora_state_into, newest_complete_checkpoint
from common.utils import UserError

MERGED_ADAPTER = "init_lora"  # the name the file is loaded under before it is fused into the base weights


def init_lora_folder(path: str | Path, model: str) -> Path:
    """The folder of --init-lora's LoRA file, or a one-line refusal (missing, a full fine-tune, two experts, trained
    on another model family)."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"--init-lora {folder} is not a folder (give a folder holding {LORA_FILE} or a run's "
                        f"--output-dir)")
    if not (folder / LORA_FILE).exists() and (folder / "checkpoints").is_dir():
        checkpoint, skipped = newest_complete_checkpoint(folder, False, 0)
        if checkpoint is None:
            raise UserError(f"--init-lora {folder} holds no complete LoRA checkpoint ({'; '.join(skipped) or 'none'})")
        folder = checkpoint.folder
    if not (folder / LORA_FILE).exists():
        raise UserError(f"--init-lora {folder} has no {LORA_FILE}")
    if (folder / LORA_FILE_2).exists():
        raise UserError(f"--init-lora {folder} also holds {LORA_FILE_2} (a two-expert model): not supported")
    meta = folder / "meta.json"
    trained_on = json.loads(meta.read_text()).get("model") if meta.exists() else None
    if trained_on is not None and trained_on != model:
        raise UserError(f"--init-lora {folder} was trained on {trained_on}, this run is {model}")
    return folder


def lora_file_config(folder: Path) -> dict:
    """The peft config saved with the LoRA file (common.models.base `save_lora`): {"r": ..., "lora_alpha": ...}."""
    from safetensors import safe_open

    with safe_open(folder / LORA_FILE, "pt") as lora:
        metadata = json.loads((lora.metadata() or {}).get("lora_adapter_metadata", "{}"))
    return {k.removeprefix("transformer."): v for k, v in metadata.items()}


def merge_init_lora(transformer, folder: Path) -> None:
    """Fuse the LoRA file into the transformer's base weights (its own rank and α) and remove every peft layer, so
    that the module is a plain transformer again, holding the merged model. Call before any adapter is added."""
    from safetensors import safe_open

    with warnings.catch_warnings():  # diffusers warns about adapter metadata it fills in: intended here
        warnings.simplefilter("ignore")
        transformer.load_lora_adapter(str(folder), weight_name=LORA_FILE, prefix="transformer",
                                      adapter_name=MERGED_ADAPTER)
    loaded = sum(f".{MERGED_ADAPTER}." in n for n, _ in transformer.named_parameters())
    with safe_open(folder / LORA_FILE, "pt") as lora:
        expected = sum(k.startswith("transformer.") for k in lora.keys())  # noqa: SIM118
    if loaded != expected:  # a LoRA of another architecture loads with a warning only
        raise UserError(f"--init-lora {folder / LORA_FILE} has {expected} LoRA tensors but {loaded} match this "
                        f"{type(transformer).__name__}: trained on another base model?")
    transformer.fuse_lora(adapter_names=[MERGED_ADAPTER])
    transformer.unload_lora()


def load_init_lora(transformer, folder: Path, rank: int, alpha: float) -> None:
    """Load the LoRA file into the trained adapter ("default", already added with --lora-rank / --lora-alpha)."""
    config = lora_file_config(folder)
    saved = (config.get("r"), config.get("lora_alpha"))
    if saved != (rank, alpha) and saved != (None, None):
        raise UserError(f"--init-lora {folder} has LoRA rank {saved[0]} and alpha {saved[1]}; pass --lora-rank "
                        f"{saved[0]} --lora-alpha {saved[1]} to continue it, or --merge-init-lora to train a new "
                        f"LoRA on the merged model")
    from safetensors.torch import load_file

    try:
        load_lora_state_into(transformer, load_file(folder / LORA_FILE), str(folder))
    except RuntimeError as err:  # keys this model lacks
        raise UserError(f"--init-lora {folder}: {str(err).splitlines()[0]}") from None
