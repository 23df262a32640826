"""Every model trains on two processes: no trained weight is left without a gradient (DDP stops at the first step
on one), checked on each tiny model by one backward, and, in the full tier, one epoch of algos/grpo.py on two
processes from an empty cache."""

import math
from pathlib import Path

import pytest
import torch

from common.cache import PromptEncoder
from common.data import Prompt
from common.models import ADAPTERS, load_adapter
from common.sampling import sample_generators
from common.training import add_lora, full_finetune_parameters
from conftest import ACCELERATE_2CPU, SLOW, read_metrics, run_script

# Prompts need room behind FLUX.2's 37-token system prompt and template.
SEQUENCE_LENGTH = {"flux2": 64}


def tiny_adapter(model: str):
    cls = ADAPTERS[model]
    extra = {}
    if cls.video:
        extra["num_frames"] = 9 if cls.audio else 5  # LTX-2: 8k + 1 frames; Wan, HunyuanVideo: 4k + 1
    if cls.condition_images[1] != 0:
        extra["condition_size"] = 32
    return load_adapter(model, "tiny", "cpu", torch.float32, 32, max_sequence_length=SEQUENCE_LENGTH.get(model, 32),
                        **extra)


def backward_once(adapter, image: Path) -> None:
    """One loss backward through the velocity the scripts train, with the model's CFG (its negative batch too)."""
    images = (str(image),) if adapter.condition_images[1] != 0 else ()
    cond = PromptEncoder(adapter)([Prompt("a red cat", "blurry", images=images)])
    x = adapter.noise(sample_generators([0], "cpu"))
    adapter.velocity(x, adapter.sigmas(4)[1], cond, adapter.default_guidance_scale).square().mean().backward()


@pytest.mark.parametrize("model", list(ADAPTERS))
def test_every_trained_weight_gets_a_gradient(model, edit_dataset):
    """A full fine-tune trains every weight but those of `adapter.unused_modules`, and exactly those get no gradient;
    the LoRA that training adds (common.setup) leaves none of its weights without one."""
    adapter = tiny_adapter(model)
    transformer = adapter.transformer
    unused = adapter.unused_modules(transformer)
    for name in unused:
        transformer.get_submodule(name)  # names a module the model has
    trained = {id(p) for p in full_finetune_parameters(transformer, unused)}
    transformer.requires_grad_(True)
    backward_once(adapter, edit_dataset / "images" / "0.png")
    without = sorted(name for name, p in transformer.named_parameters() if p.grad is None)
    assert without == sorted(name for name, p in transformer.named_parameters() if id(p) not in trained)
    assert bool(without) == bool(unused)

    transformer.requires_grad_(False).zero_grad(set_to_none=True)
    add_lora(transformer, 4, 4, adapter.lora_target_modules, unused)
    lora = [name for name, p in transformer.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in name for name in lora)
    backward_once(adapter, edit_dataset / "images" / "0.png")
    assert [name for name, p in transformer.named_parameters() if p.requires_grad and p.grad is None] == []


def tiny_flags(model: str) -> list[str]:
    """The smallest settings each tiny model takes (as tests/test_matrix.py's)."""
    cls = ADAPTERS[model]
    flags = ["--resolution", "32"]
    if cls.video:
        flags += ["--num-frames", "9" if cls.audio else "5"]
    if cls.condition_images[1] != 0:
        flags += ["--condition-size", "32"]
    if model in SEQUENCE_LENGTH:
        flags += ["--max-sequence-length", str(SEQUENCE_LENGTH[model])]
    return flags


@pytest.mark.parametrize("model", [pytest.param(model, marks=SLOW) for model in ADAPTERS])
def test_every_model_trains_an_epoch_on_two_processes(model, tmp_path, edit_dataset, monkeypatch):
    """`--preset tiny` for one epoch under DDP on two processes (its evaluations on 2 prompts), from an empty cache
    folder."""
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))  # both ranks find no tiny model: rank 0 builds it
    data = ["--dataset", edit_dataset] if ADAPTERS[model].condition_images[1] != 0 else []
    run_script("algos/grpo.py", "--preset", "tiny", "--model", model, "--model-path", "tiny", "--epochs", "1",
               "--eval-num-prompts", "2", *tiny_flags(model), *data, "--output-dir", tmp_path / "run",
               launcher=ACCELERATE_2CPU)
    (metrics,) = read_metrics(tmp_path / "run")
    assert metrics["num_processes"] == 2 and metrics["samples_seen"] == 16
    assert all(math.isfinite(metrics[k]) for k in ("reward_mean", "loss", "grad_norm")) and metrics["grad_norm"] > 0
