"""Wan2.1 image-to-video (`--model wan-i2v`) on its tiny pipeline: parity with `WanImageToVideoPipeline` (true CFG
included), the ratio invariant, a LoRA the stock pipeline loads (the image stream's add_k/add_v projections
included), the embedding cache holding the CLIP embeddings and condition latents (cached = online, bitwise), and
one-line refusals of bad settings and Wan2.2 TI2V checkpoints."""

import json
import shutil

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from peft import get_peft_model_state_dict
from PIL import Image

from common.cache import (PromptEncoder, build_cache, cache_entries, condition_inputs, fingerprint_inputs,
                          open_cache)
from common.data import Prompt, load_images, load_prompts
from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ode_sample, sde_trajectory

RESOLUTION, FRAMES, GUIDANCE = 32, 5, 5.0  # 5 frames -> 2 latent frames


def scene(colour, size, box) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(colour, box)
    return image


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("wan-i2v")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Two prompts with their first frames (not square, not the output size: both get resized) and different
    negative prompts, so the image, the resize and the negative batch all matter."""
    folder = tmp_path_factory.mktemp("i2v")
    (folder / "images").mkdir()
    scene((200, 30, 30), (48, 40), (4, 8, 20, 24)).save(folder / "images" / "red.png")
    scene((30, 30, 200), (40, 56), (10, 2, 30, 14)).save(folder / "images" / "blue.png")
    (folder / "train.jsonl").write_text(
        '{"prompt": "the cat walks away", "negative_prompt": "blurry, static", "image": "images/red.png"}\n'
        '{"prompt": "a ball rolls", "image": "images/blue.png"}\n')
    return load_prompts(folder, "train")


def adapter_of(path, **kwargs):
    kwargs.setdefault("num_frames", FRAMES)
    return load_adapter("wan-i2v", str(path), "cpu", torch.float32, RESOLUTION, **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return adapter_of(path)


def stock(path, records, guidance, steps, seeds, output_type, lora=None):
    """The pipeline's own generation, one call per condition image (it takes one per call). UniPC at order 1 with
    the corrector off is exactly our Euler step over the same σ and timesteps (see tests/test_adapters.py)."""
    pipe = WanImageToVideoPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, solver_order=1,
                                                         disable_corrector=list(range(steps)))
    outputs = []
    for record, seed in zip(records, seeds):
        (image,) = load_images(record.images)
        outputs.append(pipe(image=image, prompt=record.prompt, negative_prompt=record.negative_prompt,
                            height=RESOLUTION, width=RESOLUTION, num_frames=FRAMES, num_inference_steps=steps,
                            guidance_scale=guidance, generator=sample_generators([seed], "cpu"),
                            output_type=output_type).frames)
    return torch.cat(outputs)


def test_ode_rollout_reproduces_the_pipeline_with_and_without_cfg(adapter, path, records):
    cond = PromptEncoder(adapter)(records)
    assert cond["prompt_embeds"].shape == (2, 512, 32)
    assert cond["image_embeds"].shape == (2, 17, 16)  # CLIP's penultimate states: 16 patches + the class token
    assert cond["image_condition"].shape == (2, 4 + 4, 2, 4, 4)  # first-frame mask (4) + VAE latents (z_dim 4)
    # The first latent frame is the image, the second is the zero frames: the mask says so.
    assert (cond["image_condition"][:, :4, 0] == 1).all() and (cond["image_condition"][:, :4, 1] == 0).all()
    assert adapter.noise(sample_generators([0], "cpu")).shape == (1, 4, 2, 4, 4)  # z_dim, not in_channels (12)
    finals = {}
    for guidance in (1.0, GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 6, [3, 4], guidance)
        theirs = stock(path, records, guidance, 6, [3, 4], "latent")
        torch.testing.assert_close(finals[guidance], theirs, rtol=0, atol=2e-5)
    # CFG moves the result far beyond the tolerance, so the parity above did test the guided path.
    assert (finals[1.0] - finals[GUIDANCE]).abs().max() > 0.05
    videos = adapter.decode(finals[GUIDANCE])
    theirs = stock(path, records, GUIDANCE, 6, [3, 4], "pt")
    assert videos.shape == theirs.shape == (2, FRAMES, 3, RESOLUTION, RESOLUTION) and videos.dtype == torch.float32
    torch.testing.assert_close(videos, theirs, rtol=0, atol=1e-5)
    # The condition image matters: the same prompts and noise with the images swapped give other videos.
    swapped = PromptEncoder(adapter)([Prompt(r.prompt, r.negative_prompt, o.images, o.image_digests)
                                      for r, o in zip(records, records[::-1])])
    assert (ode_sample(adapter, swapped, 6, [3, 4], GUIDANCE) - finals[GUIDANCE]).abs().max() > 1e-3


def test_ratio_is_exactly_one_with_cfg(adapter, records):
    """Training re-evaluates the stored flow-sde steps with the same CFG forward and batch: ratio == 1."""
    cond = PromptEncoder(adapter)(records * 2)
    sigmas = adapter.sigmas(5)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE,
                                                      steps=range(4))
    assert log_probs.shape == (4, 4) and torch.isfinite(log_probs).all()
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(path, records, tmp_path):
    """LoRA with α ≠ r on the default targets, the image stream's add_k/add_v projections among them, lora_B
    perturbed: the stock pipeline that loads the saved file generates what our rollout generates."""
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    wrapped = {name for name, module in adapter.transformer.named_modules() if hasattr(module, "lora_A")}
    assert {"blocks.0.attn2.add_k_proj", "blocks.0.attn2.add_v_proj", "blocks.0.attn1.to_q"} <= wrapped
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE)
    base = stock(path, records, GUIDANCE, 4, [1, 2], "latent")
    theirs = stock(path, records, GUIDANCE, 4, [1, 2], "latent", lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 0.01


def test_cache_holds_the_image_conditioning_bitwise(adapter, path, records, tmp_path):
    from accelerate import Accelerator

    entries = cache_entries(records, [], with_negatives=True)
    assert sorted(text for text, _ in entries.values()) == ["", "", "a ball rolls", "blurry, static",
                                                            "the cat walks away"]
    condition = condition_inputs("wan-i2v", RESOLUTION, None, FRAMES)
    inputs = fingerprint_inputs("wan-i2v", str(path), 512, torch.float32, list(entries), condition)
    # preprocess.py's load: UMT5, CLIP and the VAE; no transformer.
    encoder_only = adapter_of(path, text_only=True)
    assert not hasattr(encoder_only, "transformer") and encoder_only.pipe.image_encoder is not None
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    online = PromptEncoder(adapter)(records)
    assert online.keys() == {f"{prefix}{k}" for prefix in ("", "negative_")
                             for k in ("prompt_embeds", "image_embeds", "image_condition")}
    # The negative prompt carries the same image: its image tensors equal the positive ones.
    assert torch.equal(online["negative_image_embeds"], online["image_embeds"])
    assert torch.equal(online["negative_image_condition"], online["image_condition"])
    for record in records:  # the text-only adapter's rows equal the full adapter's, entry by entry
        row, full = encoder_only.encode_entry(record.prompt, record.images), adapter.encode_entry(record.prompt,
                                                                                                  record.images)
        assert row.keys() == full.keys() and all(torch.equal(row[k], full[k]) for k in row)
    trainer = adapter_of(path, load_text_encoders=False)
    assert trainer.text_encoders == [] and trainer.pipe.image_encoder is None and trainer.pipe.text_encoder is None
    cached = PromptEncoder(trainer, cache)(records)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))


def test_bad_input_is_refused_with_one_line(path, tmp_path):
    cases = [
        (dict(condition_size=64), "--condition-size 64 differs from --resolution 32: for Wan I2V the condition "
                                  "image is the video's first frame, at the output size"),
        (dict(max_sequence_length=513), "max_sequence_length 513 is not in 1..512, as Wan I2V requires"),
        (dict(num_frames=6), "num_frames 6 is not 4k \\+ 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message) as error:
            adapter_of(path, **kwargs)
        assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="resolution 24 is not a positive multiple of 16, as Wan I2V"):
        load_adapter("wan-i2v", str(path), "cpu", torch.float32, 24, text_only=True)
    adapter_of(path, condition_size=RESOLUTION, text_only=True)  # the output size itself is accepted
    # Wan2.2 image-to-video: TI2V's per-token timesteps, refused from the config (two experts: test_wan22_i2v.py).
    folder = tmp_path / "expand_timesteps"
    shutil.copytree(path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": True}))
    with pytest.raises(UserError, match="is a Wan2.2 TI2V \\(per-token-timestep\\) image-to-video checkpoint"):
        adapter_of(folder)


def test_bf16_weights_keep_float32_outputs_and_cfg_needs_negatives(path):
    adapter = load_adapter("wan-i2v", str(path), "cpu", torch.bfloat16, RESOLUTION, num_frames=FRAMES)
    image = scene((200, 30, 30), (48, 40), (4, 8, 20, 24))
    cond = adapter.encode_prompts(["a cat"], [[image]])
    assert all(v.dtype == torch.bfloat16 for v in cond.values())
    x = adapter.noise(sample_generators([0], "cpu"))
    v = adapter.velocity(x, 0.5, cond, 1.0)
    assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
    with pytest.raises(ValueError, match="needs negative prompt embeddings"):
        adapter.velocity(x, 0.5, cond, GUIDANCE)


def test_tiny_build_is_deterministic(path, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from common.models import tiny_model_path

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    rebuilt = tiny_model_path("wan-i2v")
    assert rebuilt != path
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file())
    for name in files:
        if name.suffix == ".safetensors":
            a, b = load_file(rebuilt / name), load_file(path / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        else:  # configs, the tokenizer and the image processor
            assert (rebuilt / name).read_bytes() == (path / name).read_bytes(), name
