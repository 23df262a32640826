"""Qwen-Image 2.1 (`--model qwen-image-2.1`, `QwenImage21Pipeline`) on its tiny pipeline, in both of its modes (rows
without condition images: text-to-image; with them: editing): rollouts and decoded images equal the pipeline's
(with and without true CFG), a row's velocity does not depend on the rows batched with it, the ratio invariant, a
LoRA that the stock pipeline loads, the embedding cache (cached = online, bitwise), two processes through a script,
the tiny processor equal to Qwen3VLProcessor's image half, and bad input stopping with one line.

The stock pipeline runs as it does by default, with its prefix KV cache (text and condition keys and values computed
at the first step, reused after); the adapter runs every step's full forward, which training needs. In float32 the
two agree to the tolerance here."""

from pathlib import Path

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
from conftest import (ACCELERATE_2CPU, SLOW, assert_tiny_rebuild_equals, ode_sample, read_metrics, run_script,
                      sde_trajectory, slow_except)

RESOLUTION, GUIDANCE, SIZE = 64, 4.0, 32  # SIZE: --condition-size (one vision token, 2×2 latent tokens per image)
# Texts of different lengths and negative prompts of other lengths again, so the per-length batches matter.
TEXT = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

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
    Image.new("RGB", (32, 32), (30, 160, 30)).save(folder / "green.png")
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
                            generator=sample_generators([seed], "cpu"), output_type=output_type).images)
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


def test_padding_would_change_a_rows_velocity(adapter):
    """Why `velocity` batches rows by text length: the transformer given the short row cut at its own length
    reproduces its velocity, but cut at the long row's length, its padding masked, gives another one (the RoPE
    counts the padded positions before the target's tokens)."""
    cond = PromptEncoder(adapter)(TEXT)
    x = adapter.noise(sample_generators([1], "cpu"))
    short = {k: v[1:2] for k, v in cond.items() if not k.startswith("negative_")}

    def forward(length):
        slots = torch.cat([short["image_pad_mask"][:, :length].bool(),
                           torch.ones(1, adapter.image_tokens // 4, dtype=torch.bool)], dim=1)
        with torch.no_grad():
            out = adapter.transformer(hidden_states=x, timestep=torch.full((1,), 0.75), img_mask=slots,
                                      encoder_hidden_states=short["prompt_embeds"][:, :length],
                                      encoder_hidden_states_mask=short["prompt_embeds_mask"][:, :length].bool(),
                                      img_shapes=[[(1, adapter.latent_h, adapter.latent_w)]], return_dict=False)[0]
        return out[:, -x.shape[1]:]

    own, long = int(short["prompt_embeds_mask"].sum()), int(cond["prompt_embeds_mask"][0].sum())
    alone = adapter.velocity(x, 0.75, short)
    assert own < long
    torch.testing.assert_close(forward(own), alone, rtol=0, atol=1e-6)
    assert (forward(long) - alone).abs().max() > 1e-3


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
    # The conditions matter: the same prompts and noise with other images give other edits (far beyond the
    # parity tolerance; the tiny VAE maps colours to nearby latents, hence not by much).
    green = str(Path(edits[0].images[0]).parent / "green.png")
    other = PromptEncoder(adapter)([Prompt(r.prompt, images=(green, green), image_digests=("g", "g")) for r in edits])
    same = PromptEncoder(adapter)(edits)
    assert (ode_sample(adapter, other, 4, [0, 1], 1.0) - ode_sample(adapter, same, 4, [0, 1], 1.0)).abs().max() > 1e-3


def test_embeddings_are_the_pipelines_padded_and_long_texts_are_cut(adapter, edits):
    """The rows are the pipeline's embeddings zero-padded to max_sequence_length + the images' framing
    ("<imageK>" and the vision markers) and vision tokens, the vision tokens marked; a longer text is cut at the
    end, its images kept."""
    pipe = adapter.pipe
    images = [pipe.image_processor.resize(Image.open(p).convert("RGB"), SIZE, SIZE).convert("RGBA")
              for p in edits[0].images]
    embeds, mask, pad_mask = pipe.encode_prompt(prompt=edits[0].prompt, image=images)
    cond = adapter.encode_entry(edits[0].prompt, edits[0].images)
    length = embeds.shape[1]
    assert mask is None and pad_mask.sum() == 2  # one prompt: all its tokens count; one vision token per image
    assert cond["prompt_embeds"].shape == (1, 32 + adapter._framing(2) + 2, 32) and adapter._framing(2) > 4
    assert torch.equal(cond["prompt_embeds"][:, :length], embeds) and not cond["prompt_embeds"][:, length:].any()
    assert cond["prompt_embeds_mask"].sum() == length and torch.equal(cond["image_pad_mask"][:, :length].bool(),
                                                                      pad_mask)
    assert cond["image_shapes"].tolist() == [[[2, 2], [2, 2]]] and cond["image_latents"].shape == (1, 8, 8)
    long = "put the red box on the blue one and move both of them to the top left corner of the image"
    full, _, _ = pipe.encode_prompt(prompt=long, image=images)
    cut = adapter.encode_prompts([long], [[Image.open(p).convert("RGB") for p in edits[0].images]])
    assert full.shape[1] > cut["prompt_embeds"].shape[1] and cut["prompt_embeds_mask"].all()
    assert torch.equal(cut["prompt_embeds"], full[:, :cut["prompt_embeds"].shape[1]])
    text = adapter.encode_prompts(["a dog"])
    assert text.keys() == {"prompt_embeds", "prompt_embeds_mask", "image_pad_mask"} and not text["image_pad_mask"].any()
    assert adapter.count_truncated([long, "a dog"]) == 1


def test_tiny_processor_is_qwen3vl_processors_image_half(path, monkeypatch):
    """The tiny pipeline's image-only processor (transformers' PaddleOCRVLProcessor) gives the same inputs as
    Qwen3VLProcessor (built from the same image processor and tokenizer, without its video half) for the
    pipeline's template with two images, and the same system-turn length it drops."""
    from transformers import Qwen3VLProcessor

    pipe = QwenImage21Pipeline.from_pretrained(str(path), transformer=None, vae=None, text_encoder=None)
    processor = pipe.processor
    monkeypatch.setattr(Qwen3VLProcessor, "get_attributes", classmethod(lambda cls: ["image_processor", "tokenizer"]))
    qwen3 = Qwen3VLProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                             chat_template=processor.chat_template)
    slot = "<image1><|vision_start|><|image_pad|><|vision_end|>"
    text = pipe.prompt_template_ti2i.replace(slot, slot + slot.replace("1", "2")).format("put 1 on 2")
    images = [scene((200, 30, 30), size=(64, 32)), scene((30, 30, 200))]
    ours, theirs = (p(text=[text, "a"], images=images, padding=True, padding_side="left", return_tensors="pt")
                    for p in (processor, qwen3))
    assert ours.keys() == theirs.keys() >= {"input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (ours["input_ids"] == pipe._img_token_id).sum() == 3  # 2 + 1 vision tokens
    system = [{"role": "system", "content": [{"type": "text", "text": pipe.sys_prompt}]}]
    assert qwen3.apply_chat_template(system, tokenize=True, return_dict=False)[0] == \
        processor.apply_chat_template(system, tokenize=True, return_dict=False)[0]
    assert processor.tokenizer.decode(processor.tokenizer(text).input_ids[:pipe._drop_idx]) == \
        f"<|im_start|>system\n{pipe.sys_prompt}<|im_end|>\n"


@SLOW
def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(path, edits, tmp_path):
    """LoRA with α ≠ r on the adapter's default targets, lora_B perturbed: the stock pipeline that loads the saved
    file generates what our rollout generates, in both modes, and differs from the base."""
    adapter = adapter_of(path, condition_size=SIZE)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    records = [TEXT[0], edits[0]]
    ours = torch.cat([ode_sample(adapter, PromptEncoder(adapter)([r]), 3, [1], 1.0) for r in records])
    base = stock(path, records, 1.0, 3, [1, 1])
    theirs = stock(path, records, 1.0, 3, [1, 1], lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).flatten(1).abs().max(dim=1).values.min() > 0.01


@pytest.mark.parametrize("mode", slow_except(["text", "edit"], "edit"))
def test_cache_is_online_bitwise_and_training_needs_no_text_side(path, adapter, edits, tmp_path, mode):
    from accelerate import Accelerator

    records = TEXT if mode == "text" else edits
    entries = cache_entries(records, [], with_negatives=True)
    inputs = fingerprint_inputs("qwen-image-2.1", str(path), 32, torch.float32, list(entries),
                                condition={"resolution": RESOLUTION, "condition_size": SIZE})
    encoder_only = adapter_of(path, text_only=True, condition_size=SIZE)  # preprocess.py's load
    assert not hasattr(encoder_only, "transformer") and encoder_only.pipe.processor is not None
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    online = PromptEncoder(adapter)(records)
    trainer = adapter_of(path, load_text_encoders=False, condition_size=SIZE)
    cached = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(records)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))


def test_bad_input_is_refused_with_one_line(path, adapter, edits, tmp_path):
    mixed = [edits[0], Prompt("a dog", source="train.jsonl:3")]
    with pytest.raises(UserError) as error:
        adapter.check_condition_shapes(mixed)
    assert "train.jsonl:3: 0 condition images but" in str(error.value) and "\n" not in str(error.value)
    # 640×640 is beyond the tiny processor's 64 vision tokens: it would not give one per 2×2 latent tokens
    big = tmp_path / "big.png"
    scene((200, 30, 30), size=(640, 640)).save(big)
    with pytest.raises(UserError, match="gives 64 vision tokens, not one per 32×32 pixels") as error:
        adapter_of(path, condition_size=640, text_only=True).check_condition_shapes(
            [Prompt("x", images=(str(big),), source="a:1")])
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="--condition-size 20 is not a positive multiple of 32"):
        adapter_of(path, condition_size=20, text_only=True)
    with pytest.raises(UserError, match="resolution 48 is not a positive multiple of 32"):
        load_adapter("qwen-image-2.1", str(path), "cpu", torch.float32, 48)
    with pytest.raises(ValueError, match="negative prompt embeddings"):
        adapter.velocity(adapter.noise(sample_generators([0], "cpu")), 0.5, adapter.encode_prompts(["a"]), 2.0)


@SLOW
def test_two_processes_train_text_to_image(tmp_path):
    """A GRPO epoch of text-to-image prompts on 2 gloo processes (DDP), its evaluation batching prompts of
    different text lengths."""
    run_script("algos/grpo.py", "--preset", "tiny", "--model", "qwen-image-2.1", "--resolution", "32",
               "--epochs", "1", "--prompts-per-epoch", "2", "--group-size", "2", "--batch-size", "2",
               "--num-steps", "3", "--updates-per-epoch", "1", "--eval-every", "1", "--eval-num-prompts", "2",
               "--max-sequence-length", "16", "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    (metrics,) = read_metrics(tmp_path)
    assert metrics["num_processes"] == 2 and metrics["samples_seen"] == 4 and metrics["ratio_dev_first"] < 1e-6


def test_tiny_build_is_deterministic(tmp_path, monkeypatch, path):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    assert_tiny_rebuild_equals("qwen-image-2.1", path, tmp_path)
