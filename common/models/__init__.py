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
    """Path of the saved tiny pipeline for `model`, building it first if needed (safe under several processes)."""
    path = tiny_cache_root() / f"tiny-{model}-v{TINY_VERSION}"
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        # The builders seed torch's global RNG: fork it, or a run that builds the model would draw its LoRA init
        # and noise from another state than a run that finds it built.
        with torch.random.fork_rng(devices=[]):
            row = _ROWS[model]
            getattr(importlib.import_module(f"common.models.{row.family}"), row.tiny)(tmp)
        try:
            os.rename(tmp, path)  # atomic; fails if another process won the race
        except OSError:
            if not (path / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


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


def load_adapter(model: str, model_path: str | None, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int | None = None, condition_size: int | None = None, train_experts: str | None = None):
    """The adapter of `model`; `load_text_encoders=False` when training from the embedding cache,
    `text_only=True` to load nothing but the text encoders and condition encoders (preprocess.py). `num_frames`
    (video models only) and `condition_size` (conditioned models only) default to the adapter's own;
    `train_experts` (high, low or both: whose LoRA is trained) applies to two-expert models only."""
    if model not in ADAPTERS:
        raise UserError(f"unknown model {model!r}; choose one of: {', '.join(ADAPTERS)}")
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
