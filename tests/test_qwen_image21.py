"""Qwen-Image 2.1 (`--model qwen-image-2.1`, `QwenImage21Pipeline`) on its tiny pipeline, in both of its modes (rows
without condition images: text-to-image; with them: editing): rollouts and decoded images equal the pipeline's
(with and without true CFG), a row's velocity does not depend on the rows batched with it, the ratio invariant, a
LoRA that the stock pipeline loads, the embedding cache (cached = online, bitwise), two processes through a script,
the tiny processor equal to Qwen3VLProcessor's image half, and bad input stopping with one line.

The stock pipeline runs with use_kv_cache=False: its prefix KV cache computes the same attention in another layout
(its docstring: equally valid, not bitwise equal); training needs every step's full forward anyway."""

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from peft import get_peft_model_state_dict
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, fingerprint_inputs, open_cache
from common.data import Prompt, load_prompts
from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ACCELERATE_2CPU, ode_sample, read_metrics, run_script, sde_trajectory

RESOLUTION, GUIDANCE, SIZE = 64, 4.0, 32  # SIZE: --condition-size (one vision token, 2×2 latent tokens per image)
# Texts of different lengths and negative prompts of other lengths again, so the per-length batches matter.
TEXT = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]


@pytest.fixture(scope="module")
def path():
    from common.tiny import tiny_model_path

    return tiny_model_path("qwen-image-2.1")


def scene(colour, size=(32, 32), box=(4, 8, 20, 24)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(colour, box)
    return image


@pytest.fixture(scope="module")
def edits(tmp_path_factory):
    """Two prompts with two condition images each (48×32 and 32×32: a run over them takes a condition size)."""
    folder = tmp_path_factory.mktemp("edits21")
    scene((200, 30, 30), size=(48, 32)).save(folder / "wide.png")
    scene((30, 30, 200), box=(10, 2, 30, 14)).save(folder / "square.png")
    (folder / "two.jsonl").write_text(
        '{"prompt": "put 1 on 2", "negative_prompt": "blurry", "images": ["wide.png", "square.png"]}\n'
        '{"prompt": "swap the two boxes", "images": ["square.png", "wide.png"]}\n')
    return load_prompts(folder, "two")


def adapter_of(path, **kwargs):
    return load_adapter("qwen-image-2.1", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=32,
                        **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return adapter_of(path, condition_size=SIZE)


def stock(path, records, guidance, steps, seeds, output_type="latent", lora=None):
    """The stock pipeline, one call per record (its images are one set for every prompt of a call), given the
    condition images as the adapter's condition size makes them: squares of SIZE, at an output_resolution of SIZE
    (the pipeline's condition area) and an output of RESOLUTION²."""
    pipe = QwenImage21Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    outputs = []
    for record, seed in zip(records, seeds):
        images = [pipe.image_processor.resize(Image.open(p).convert("RGB"), SIZE, SIZE) for p in record.images]
        outputs.append(pipe(prompt=record.prompt, image=images or None, negative_prompt=record.negative_prompt,
                            true_cfg_scale=guidance, height=RESOLUTION, width=RESOLUTION, output_resolution=SIZE,
                            num_inference_steps=steps, sigmas=list(np.linspace(1.0, 1 / steps, steps)),
                            generator=sample_generators([seed], "cpu"), output_type=output_type,
                            use_kv_cache=False).images)
    return torch.cat(outputs)


@pytest.mark.parametrize("mode", ["text", "edit"])
def test_ode_rollout_and_images_reproduce_the_pipeline_with_and_without_cfg(adapter, path, edits, mode):
    records = TEXT if mode == "text" else edits
    cond = PromptEncoder(adapter)(records)
    assert ("image_latents" in cond) == (mode == "edit")
    finals = {}
    for guidance in (1.0, GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 4, [3, 4], guidance)
        torch.testing.assert_close(finals[guidance], stock(path, records, guidance, 4, [3, 4]), rtol=0, atol=2e-5)
    assert (finals[1.0] - finals[GUIDANCE]).abs().max() > 0.01  # the guided path was tested
    theirs = stock(path, records, 1.0, 4, [3, 4], "pt")
    assert theirs.shape == (2, 4, RESOLUTION, RESOLUTION)  # RGBA
    alpha = theirs[:, 3:]
    torch.testing.assert_close(adapter.decode(finals[1.0]), theirs[:, :3] * alpha + 1 - alpha, rtol=0, atol=1e-5)


def test_a_rows_velocity_does_not_depend_on_its_batch(adapter):
    """Rows of other text lengths run as separate batches: each row's velocity is the one it has alone."""
    cond = PromptEncoder(adapter)(TEXT)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    both = adapter.velocity(x, 0.7, cond, GUIDANCE)
    for i in range(2):
        alone = adapter.velocity(x[i:i + 1], 0.7, {k: v[i:i + 1] for k, v in cond.items()}, GUIDANCE)
        torch.testing.assert_close(both[i:i + 1], alone, rtol=0, atol=1e-6)


def test_ratio_is_exactly_one_with_cfg(adapter, edits):
    cond = PromptEncoder(adapter)(edits + [Prompt(r.prompt, "", r.images, r.image_digests) for r in edits])
    sigmas = adapter.sigmas(4)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE)
    assert log_probs.shape == (4, 4) and torch.isfinite(log_probs).all()
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6
