"""Qwen-Image-Edit (`--model qwen-image-edit`, `QwenImageEditPlusPipeline`) on its tiny pipeline: the prompt
embeddings and rollouts equal the pipeline's (one and two condition images, with and without true CFG, the
pipeline's own resize and a fixed condition size), the ratio invariant with CFG, a LoRA that the stock pipeline
loads, the embedding cache (condition latents included, cached = online, bitwise) and bad condition images. The
tiny pipeline's processor is image-only (common/models/qwen_image_edit.py: it needs no torchvision); a checkpoint
whose processor needs torchvision stops with one line where it is missing."""

import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit
from peft import get_peft_model_state_dict
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, fingerprint_inputs, open_cache
from common.data import Prompt, load_prompts
from common.dynamics import sde_step
from common.models import load_adapter
from common.models.qwen_image_edit import processor_needs_torchvision
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ode_sample, sde_trajectory

RESOLUTION, GUIDANCE, SIZE = 64, 4.0, 32  # SIZE: --condition-size of most tests (4 condition tokens per image)


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("qwen-image-edit")


def scene(colour, size=(32, 32), box=(4, 8, 20, 24)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(colour, box)
    return image


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two prompts with one condition image each (one.jsonl) and two with two each (two.jsonl). The images are 48×32
    and 32×32, so a run over them takes a condition size (the default resize has its own test)."""
    folder = tmp_path_factory.mktemp("edits")
    (folder / "images").mkdir()
    scene((200, 30, 30), size=(48, 32)).save(folder / "images" / "wide.png")
    scene((30, 30, 200), box=(10, 2, 30, 14)).save(folder / "images" / "square.webp", lossless=True)
    scene((30, 160, 30), box=(2, 16, 14, 30)).save(folder / "images" / "green.png")
    (folder / "one.jsonl").write_text(
        '{"prompt": "make it green", "negative_prompt": "blurry, low quality", "image": "images/wide.png"}\n'
        '{"prompt": "move it left", "image": "images/square.webp"}\n')
    (folder / "two.jsonl").write_text(
        '{"prompt": "put 1 on 2", "negative_prompt": "blurry", '
        '"images": ["images/wide.png", "images/square.webp"]}\n'
        '{"prompt": "swap them", "images": ["images/green.png", "images/wide.png"]}\n')
    return folder


def adapter_of(path, **kwargs):
    kwargs.setdefault("condition_size", SIZE)
    return load_adapter("qwen-image-edit", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=32,
                        **kwargs)


def stock(path, records, guidance, steps, seeds, output_type, condition_size=SIZE, lora=None):
    """The stock pipeline, one call per record (it takes one prompt per call). With a condition size it is given
    the images resized to that square and its VAE area set to the square's: what the adapter's condition_size
    means (see QwenImageEditAdapter)."""
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    outputs = []
    with pytest.MonkeyPatch.context() as patch:
        for record, seed in zip(records, seeds):
            images = [Image.open(p).convert("RGB") for p in record.images]
            if condition_size is not None:
                patch.setattr(edit, "VAE_IMAGE_SIZE", condition_size ** 2)
                images = [pipe.image_processor.resize(image, condition_size, condition_size) for image in images]
            outputs.append(pipe(image=images, prompt=record.prompt, negative_prompt=record.negative_prompt,
                                true_cfg_scale=guidance, height=RESOLUTION, width=RESOLUTION,
                                num_inference_steps=steps, generator=sample_generators([seed], "cpu"),
                                output_type=output_type).images)
    return torch.cat(outputs)


def test_tokenizer_drops_exactly_the_template_prefix(path):
    """The Edit pipeline drops the first 64 tokens of its chat template: in the tiny tokenizer, as in the real one,
    they are the system prompt and the 'user' turn header."""
    pipe = QwenImageEditPlusPipeline.from_pretrained(str(path), transformer=None, vae=None, text_encoder=None)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("Picture 1: make it green")).input_ids
    assert pipe.prompt_template_encode_start_idx == 64 == len(pipe.tokenizer(prefix).input_ids)
    assert pipe.tokenizer.decode(ids[:64]) == prefix
    assert pipe.tokenizer.convert_ids_to_tokens(ids[64:66]) == ["Picture", "Ġ"]


def test_prompt_embeddings_are_the_pipelines_padded(path):
    """With a condition size the images become squares, shown to the text encoder at 384×384 as the pipeline shows
    a square image; the rows are the pipeline's embeddings padded to max_sequence_length + each image's framing
    ("Picture k: " and the vision markers: 7 tokens) and vision tokens; the latents are the squares' packed VAE
    latents. Without it, the pipeline's sizes: 1248×832 (VAE) and 480×320 (text encoder) for a 48×32 image."""
    adapter = adapter_of(path)
    pipe, images = adapter.pipe, [scene((200, 30, 30), size=(48, 32)), scene((30, 30, 200))]
    cond = adapter.encode_prompts(["make it green"], [images])
    squares = [pipe.image_processor.resize(image, SIZE, SIZE) for image in images]
    seen = [pipe.image_processor.resize(square, 384, 384) for square in squares]
    embeds, mask = pipe.encode_prompt(prompt="make it green", image=seen)
    assert mask is None  # one prompt: all its tokens count
    tokens = adapter._vision_tokens(48, 32)
    assert tokens == adapter._vision_tokens(32, 32) == 9
    length, text = embeds.shape[1], len(pipe.tokenizer(pipe.prompt_template_encode.format("make it green")).input_ids)
    assert length == 2 * (7 + tokens) + text - 64  # the images' part, then the text's (prompt and template end)
    assert cond["prompt_embeds"].shape == (1, 32 + 2 * (7 + tokens), 32)
    assert torch.equal(cond["prompt_embeds"][:, :length], embeds) and not cond["prompt_embeds"][:, length:].any()
    assert cond["prompt_embeds_mask"].sum() == length and cond["prompt_embeds_mask"][0, :length].all()
    latents = [pipe._encode_vae_image(pipe.image_processor.preprocess(square, SIZE, SIZE).unsqueeze(2), None)
               for square in squares]
    assert torch.equal(cond["image_latents"], torch.cat([pipe._pack_latents(x, 1, 4, 4, 4) for x in latents], dim=1))
    assert cond["image_shapes"].tolist() == [[[2, 2], [2, 2]]]
    assert adapter_of(path, condition_size=None, text_only=True)._sizes(48, 32) == ((832, 1248), (320, 480))
    # A text longer than max_sequence_length is cut at the end, as QwenImagePipeline cuts it (the Edit pipeline
    # never cuts): the images and the start of the text are kept.
    long = "make the red box green and move it to the top left corner"
    full, _ = pipe.encode_prompt(prompt=long, image=seen)
    cut = adapter.encode_prompts([long], [images])
    assert full.shape[1] > 64 and cut["prompt_embeds_mask"].all() and torch.equal(cut["prompt_embeds"], full[:, :64])


@pytest.mark.parametrize("split", ["one", "two"])
def test_ode_rollout_reproduces_the_pipeline_with_and_without_cfg(path, dataset, split):
    records = load_prompts(dataset, split)
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    count = len(records[0].images)
    assert cond["image_latents"].shape == (2, count * 4, 16) and "negative_image_latents" in cond
    finals = {}
    for guidance in (1.0, GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 6, [3, 4], guidance)
        theirs = stock(path, records, guidance, 6, [3, 4], "latent")
        torch.testing.assert_close(finals[guidance], theirs, rtol=0, atol=2e-5)
    # CFG moves the result far beyond the tolerance, so the parity above did test the guided path.
    assert (finals[1.0] - finals[GUIDANCE]).abs().max() > 0.01
    images = adapter.decode(finals[GUIDANCE])
    theirs = stock(path, records, GUIDANCE, 6, [3, 4], "pt")
    assert images.shape == theirs.shape == (2, 3, RESOLUTION, RESOLUTION)
    torch.testing.assert_close(images, theirs, rtol=0, atol=1e-5)
    # The conditions matter: the same prompts and noise with the other records' images give other edits.
    swapped = PromptEncoder(adapter)([Prompt(r.prompt, r.negative_prompt, o.images, o.image_digests)
                                      for r, o in zip(records, records[::-1])])
    assert (ode_sample(adapter, swapped, 6, [3, 4], GUIDANCE) - finals[GUIDANCE]).abs().max() > 0.01


def test_default_resize_is_the_pipelines(path, dataset):
    """No --condition-size: a 48×32 image becomes 1248×832 for the VAE (area 1024², 4056 condition tokens) and
    480×320 for the text encoder, as `QwenImageEditPlusPipeline` does by default. (Without CFG: each VAE encoding
    at this size takes seconds on a CPU; the guided path is the same as with a condition size.)"""
    records = load_prompts(dataset, "one")[:1]
    adapter = adapter_of(path, condition_size=None)
    assert adapter.condition_shape(48, 32) == (832, 1248) and adapter.condition_shape(32, 32) == (1024, 1024)
    cond = adapter.encode_entry(records[0].prompt, records[0].images)
    assert cond["image_latents"].shape == (1, 52 * 78, 16) and cond["image_shapes"].tolist() == [[[52, 78]]]
    torch.testing.assert_close(ode_sample(adapter, cond, 2, [5], 1.0),
                               stock(path, records, 1.0, 2, [5], "latent", condition_size=None), rtol=0, atol=2e-5)


def test_a_processor_that_needs_torchvision_is_one_line_and_the_cache_path_still_loads(path, tmp_path):
    """A checkpoint whose processor is Qwen2VLProcessor (the real ones'; transformers 5 builds it only with
    torchvision, for its video half): where torchvision is missing, loading the text side stops with one line;
    training from an embedding cache loads no processor and works."""
    import json
    import shutil

    real = tmp_path / "real"
    shutil.copytree(path, real)
    index = json.loads((real / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "PaddleOCRVLProcessor"]  # the tiny one: image-only
    (real / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]}))
    if not processor_needs_torchvision(str(real)):
        pytest.skip("torchvision is installed: transformers builds Qwen2VLProcessor here")
    assert not processor_needs_torchvision(str(path))
    with pytest.raises(UserError, match="prompt encoding needs torchvision") as error:
        adapter_of(real, text_only=True)
    assert "\n" not in str(error.value)
    assert adapter_of(real, load_text_encoders=False).pipe.processor is None


def test_ratio_is_exactly_one_with_cfg(path, dataset):
    """Training re-evaluates the stored flow-sde steps with the same CFG forward and batch: ratio == 1."""
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(load_prompts(dataset, "two") * 2)
    sigmas = adapter.sigmas(5)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE,
                                                      steps=range(4))
    assert log_probs.shape == (4, 4) and torch.isfinite(log_probs).all()
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(path, dataset, tmp_path):
    """LoRA with α ≠ r on the adapter's default targets, lora_B perturbed: the stock pipeline that loads the saved
    file generates, for the same condition images, what our rollout generates, and differs from the base."""
    records = load_prompts(dataset, "two")
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules, adapter.unused_modules(adapter.transformer))
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


def test_cache_holds_the_conditions_bitwise_and_training_needs_no_text_side(path, dataset, tmp_path):
    from accelerate import Accelerator

    records = load_prompts(dataset, "two")
    entries = cache_entries(records, [], with_negatives=True)
    inputs = fingerprint_inputs("qwen-image-edit", str(path), 32, torch.float32, list(entries),
                                condition={"resolution": RESOLUTION, "condition_size": SIZE})
    encoder_only = adapter_of(path, text_only=True)  # preprocess.py's load: text encoder, processor and VAE
    assert not hasattr(encoder_only, "transformer") and encoder_only.pipe.processor is not None
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    adapter = adapter_of(path)
    online = PromptEncoder(adapter)(records)
    trainer = adapter_of(path, load_text_encoders=False)
    cached = PromptEncoder(trainer, cache)(records)
    assert cached.keys() == online.keys() >= {"prompt_embeds", "image_latents", "image_shapes",
                                              "negative_prompt_embeds", "negative_image_latents"}
    assert all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == [] and trainer.pipe.processor is None and trainer.pipe.tokenizer is None
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))


def records_of(folder, images: list[list[tuple[int, int]]]) -> list[Prompt]:
    """Records whose condition images have the given sizes."""
    rows = []
    for i, sizes in enumerate(images):
        paths = []
        for j, size in enumerate(sizes):
            paths.append(folder / f"{i}-{j}.png")
            scene((200, 30, 30), size=size).save(paths[-1])
        rows.append(Prompt("make it green", images=tuple(map(str, paths)), source=f"train.jsonl:{i + 1}"))
    return rows


@pytest.mark.parametrize("sizes,message", [
    ([[(32, 32)], [(48, 32)]], ("train.jsonl:2: its condition image becomes 1248×832 but train.jsonl:1's becomes "
                                "1024×1024: one run needs one size; give --condition-size N")),
    ([[(32, 32)], [(32, 32), (32, 32)]], "train.jsonl:2: 2 condition images but train.jsonl:1 has 1"),
    # One VAE size (1056×992), but the processor fits 34×32 and 35×32 into different vision-token counts.
    ([[(34, 32)], [(35, 32)]], ("train.jsonl:2: its condition images give [12] vision tokens but train.jsonl:1's "
                                "give [9]: one run needs one count; give --condition-size N")),
])
def test_conditions_of_other_shapes_stop_with_one_line(path, tmp_path, sizes, message):
    adapter = adapter_of(path, condition_size=None, text_only=True)
    records = records_of(tmp_path, sizes)
    with pytest.raises(UserError) as error:
        adapter.check_condition_shapes(records)
    assert message in str(error.value) and "\n" not in str(error.value)
    adapter_of(path, text_only=True).check_condition_shapes(records[:1] * 2)  # one shape: fine
    if len(sizes[1]) == 1:  # with a condition size every image becomes one square
        adapter_of(path, text_only=True).check_condition_shapes(records)


def test_encoding_images_of_two_sizes_stops_with_one_line(path):
    adapter = adapter_of(path, condition_size=None, text_only=True)
    with pytest.raises(UserError) as error:
        adapter.encode_prompts(["make it green"], [[scene((200, 30, 30)), scene((200, 30, 30), size=(48, 32))]])
    assert str(error.value) == ("a 48×32 condition image becomes 1248×832 with 12 vision tokens, but the first "
                                "(32×32) becomes 1024×1024 with 9: one run needs one size; give --condition-size N "
                                "(a square) or images of one aspect ratio")
    with pytest.raises(UserError, match="--condition-size 20 is not a positive multiple of 16"):
        adapter_of(path, condition_size=20, text_only=True)

