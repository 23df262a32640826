"""Model adapters: one small class per model family over its diffusers pipeline components.

An adapter encodes prompts, makes the initial noise, gives the σ schedule, runs ONE velocity forward and
decodes latents to images (`decode(latents, cond)`: given the conditioning they were sampled with, which only
LTX-2's image-to-video reads, its clean first frame being no part of the latents). Rollout and training both call
`velocity`, so they cannot drift apart.
Weights live in the model dtype (bf16 on GPUs); everything that leaves `velocity` is float32.
"""

import importlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from common.models.registry import MODELS as _ROWS
from common.models.registry import REPO, TOY_REFUSAL, TWO_EXPERT_MODELS
from common.models.tiny_parts import TINY_VERSION, tiny_cache_root
from common.utils import UserError

DEFAULT_MODEL_PATHS = {model: row.checkpoint for model, row in _ROWS.items()}
MODELS = tuple(_ROWS)


def tiny_model_path(model: str) -> Path:
    """Path of the saved tiny pipeline for `model`, building it first if needed. Under torch.distributed only rank 0
    builds it and the others wait: transformers' `save_pretrained` writes nothing on the other ranks, so a folder
    they built would lack its text encoders. A folder is published (renamed into place) only once every component
    that model_index.json names holds its files; an incomplete one left by an older version is rebuilt."""
    path = tiny_cache_root() / f"tiny-{model}-v{TINY_VERSION}"
    if _complete_pipeline(path):
        return path
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        _build_tiny(model, path)
    if distributed:
        torch.distributed.barrier()
        if not _complete_pipeline(path):
            raise UserError(f"the tiny {model} pipeline that rank 0 built is not in {path} on this machine: put "
                            f"$FLOWRL_CACHE on a disk every machine shares, or build it there first "
                            f"(python -c \"from common.models import tiny_model_path; tiny_model_path('{model}')\")")
    return path


def _complete_pipeline(path: Path) -> bool:
    """Whether `path` holds a saved pipeline: model_index.json, and files in every component folder it names."""
    import json

    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    components = [name for name, value in index.items()
                  if not name.startswith("_") and isinstance(value, list) and value[0] is not None]
    return all(any(p.is_file() for p in (path / name).glob("*")) for name in components)


def _build_tiny(model: str, path: Path) -> None:
    """Build the tiny pipeline in a temporary folder beside `path`, check it, and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        # The builders seed torch's global RNG: fork it, or a run that builds the model would draw its LoRA init
        # and noise from another state than a run that finds it built.
        with torch.random.fork_rng(devices=[]):
            row = _ROWS[model]
            getattr(importlib.import_module(f"common.models.{row.family}"), row.tiny)(tmp)
        if not _complete_pipeline(tmp):
            raise RuntimeError(f"the tiny {model} pipeline built in {tmp} is incomplete")
        if path.exists():  # an incomplete folder from an earlier build: replace it
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rename(tmp, path)  # atomic; fails if another process won the race
        except OSError:
            if not _complete_pipeline(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(model: str, model_path: str | None) -> str:
    """`tiny` -> the locally built tiny pipeline; `toy` -> the shipped toy world's pipeline (the registry's `toy`
    column: FLUX.1, FLUX.1 Kontext, Wan); None -> the model's published checkpoint."""
    if model_path == "tiny":
        return str(tiny_model_path(model))
    if model_path == "toy":  # a toy world's pretrained pipeline (the registry's `toy`); a UserError for other models
        row = _ROWS.get(model)
        if row is None or row.toy is None:
            raise UserError(TOY_REFUSAL.format(model=model))
        return str(REPO / row.toy)
    return model_path or DEFAULT_MODEL_PATHS[model]


class _Adapters(Mapping):
    """--model name -> adapter class; a family's module is imported when one of its classes is first asked for."""

    def __getitem__(self, model: str) -> type:
        row = _ROWS[model]
        return getattr(importlib.import_module(f"common.models.{row.family}"), row.adapter)

    def __contains__(self, model) -> bool:
        return model in _ROWS

    def __iter__(self):
        return iter(_ROWS)

    def __len__(self) -> int:
        return len(_ROWS)


ADAPTERS = _Adapters()


def default_max_sequence_length(model: str) -> int:
    """The text length `model` encodes when none is given: the registry's, its stock pipeline's own (docs/models.md
    lists them; tests/test_models.py checks them against the adapters and pipelines), so that a LoRA trained here
    meets the text conditioning the stock pipeline gives."""
    return _ROWS[model].text_length


def load_adapter(model: str, model_path: str | None, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int | None = None, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int | None = None, condition_size: int | None = None, train_experts: str | None = None):
    """The adapter of `model`; `load_text_encoders=False` when training from the embedding cache,
    `text_only=True` to load nothing but the text encoders and condition encoders (preprocess.py). `num_frames`
    (video models only), `condition_size` (conditioned models only) and `max_sequence_length` default to the
    adapter's own; `train_experts` (high, low or both: whose LoRA is trained) applies to two-expert models only."""
    if model not in ADAPTERS:
        raise UserError(f"unknown model {model!r}; choose one of: {', '.join(ADAPTERS)}")
    if max_sequence_length is None:
        max_sequence_length = default_max_sequence_length(model)
    extra = {}
    if num_frames is not None:
        if not ADAPTERS[model].video:
            raise UserError(f"num_frames applies to video models, not to {model}")
        extra["num_frames"] = num_frames
    if condition_size is not None:
        if ADAPTERS[model].condition_images[1] == 0:
            raise UserError(f"condition_size applies to conditioned models, not to {model}")
        extra["condition_size"] = condition_size
    if train_experts is not None:
        if not getattr(ADAPTERS[model], "two_experts", False):
            raise UserError(f"train_experts applies to two-expert models ({', '.join(TWO_EXPERT_MODELS)}), not to "
                            f"{model}")
        extra["train_experts"] = train_experts
    path = resolve_model_path(model, model_path)
    return ADAPTERS[model](path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                           **extra)
