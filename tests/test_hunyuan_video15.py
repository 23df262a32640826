"""HunyuanVideo-1.5 text-to-video (`--model hunyuan-video-1.5`) and image-to-video (`hunyuan-video-1.5-i2v`) on their
tiny pipelines: parity with `HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` (CFG on and off, the ByT5
glyph stream of a quoted text included), the ratio invariant, a LoRA the stock transformer loads, cache = online
(bitwise, the SigLIP tokens and condition latents included), and one-line refusals."""

import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, condition_inputs, fingerprint_inputs, open_cache
from common.checkpoint import LORA_FILE
from common.data import Prompt, load_images, load_prompts
from common.distributed import lora_state_dict
from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import SLOW, ode_sample, sde_trajectory, slow_except

MODELS = ("hunyuan-video-1.5", "hunyuan-video-1.5-i2v")
RESOLUTION, FRAMES, TEXT, GUIDANCE = 32, 5, 32, 6.0  # 5 frames -> 2 latent frames


@pytest.fixture(scope="module")
def paths():
    from common.models import tiny_model_path

    return {model: tiny_model_path(model) for model in MODELS}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Two prompts (one quoting a text for the ByT5 stream, with a negative prompt) and square first frames, so that
    the I2V pipeline's aspect-ratio bucket at the tiny target_size 32 is the run's 32×32."""
    folder = tmp_path_factory.mktemp("hy15")
    (folder / "images").mkdir()
    for name, colour, box in (("red", (200, 30, 30), (4, 8, 20, 24)), ("blue", (30, 30, 200), (10, 2, 30, 14))):
        image = Image.new("RGB", (40, 40), "white")
        image.paste(colour, box)
        image.save(folder / "images" / f"{name}.png")
    (folder / "train.jsonl").write_text(
        '{"prompt": "a sign that says \\"hello\\"", "negative_prompt": "blurry", "image": "images/red.png"}\n'
        '{"prompt": "a ball rolls", "image": "images/blue.png"}\n')
    return load_prompts(folder, "train")


def adapter_of(model, path, **kwargs):
    kwargs.setdefault("num_frames", FRAMES)
    return load_adapter(model, str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=TEXT, **kwargs)


@pytest.fixture(scope="module")
def adapters(paths):
    return {model: adapter_of(model, paths[model]) for model in MODELS}


def text_records(records):
    return [Prompt(r.prompt, r.negative_prompt) for r in records]


def cond_of(adapter, model, records):
    return PromptEncoder(adapter)(records if model.endswith("i2v") else text_records(records))


def stock(model, path, records, guidance, steps, seeds, output_type, lora=None):
    """The pipeline's own generation, one call per prompt, its guider at `guidance`, the tiny text length."""
    i2v = model.endswith("i2v")
    pipe = (HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline).from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.tokenizer_max_length = TEXT
    pipe.guider = ClassifierFreeGuidance(guidance_scale=guidance)
    if lora is not None:
        pipe.transformer.load_lora_adapter(str(lora), prefix="transformer", weight_name=LORA_FILE)
    outputs = []
    for record, seed in zip(records, seeds):
        call = dict(prompt=record.prompt, negative_prompt=record.negative_prompt, num_frames=FRAMES,
                    num_inference_steps=steps, generator=sample_generators([seed], "cpu"), output_type=output_type)
        call.update(image=load_images(record.images)[0]) if i2v else call.update(height=RESOLUTION, width=RESOLUTION)
        outputs.append(pipe(**call).frames)
    return torch.cat(outputs)


@pytest.mark.parametrize("model", MODELS)
def test_ode_rollout_reproduces_the_pipeline_with_and_without_cfg(adapters, paths, records, model):
    adapter = adapters[model]
    cond = cond_of(adapter, model, records)
    assert cond["prompt_embeds"].shape == (2, TEXT, 32) and cond["prompt_embeds_2"].shape == (2, 256, 16)
    assert cond["prompt_embeds_mask_2"][0].sum() > 0 and cond["prompt_embeds_mask_2"][1].sum() == 0  # "hello" only
    if model.endswith("i2v"):
        assert cond["image_embeds"].shape == (2, 16, 16)  # SigLIP: 16 patches of 8 px
        assert cond["image_condition"].shape == (2, 4 + 1, 2, 2, 2)  # latents + mask, 2 latent frames
        assert (cond["image_condition"][:, 4, 0] == 1).all() and (cond["image_condition"][:, :, 1] == 0).all()
    finals = {}
    for guidance in (1.0, GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 4, [3, 4], guidance)
        theirs = stock(model, paths[model], records, guidance, 4, [3, 4], "latent")
        torch.testing.assert_close(finals[guidance], theirs, rtol=0, atol=2e-5)
    assert (finals[1.0] - finals[GUIDANCE]).abs().max() > 1e-3  # the guided path was tested
    if not model.endswith("i2v"):  # one decode path for both
        videos = adapter.decode(finals[GUIDANCE])
        theirs = stock(model, paths[model], records, GUIDANCE, 4, [3, 4], "pt")
        assert videos.shape == theirs.shape == (2, FRAMES, 3, RESOLUTION, RESOLUTION)
        torch.testing.assert_close(videos, theirs, rtol=0, atol=1e-5)
    else:  # the condition image matters: swapped images give other videos
        swapped = PromptEncoder(adapter)([Prompt(r.prompt, r.negative_prompt, o.images, o.image_digests)
                                          for r, o in zip(records, records[::-1])])
        assert (ode_sample(adapter, swapped, 4, [3, 4], GUIDANCE) - finals[GUIDANCE]).abs().max() > 1e-4


@pytest.mark.parametrize("model", slow_except(MODELS, "hunyuan-video-1.5-i2v"))
def test_ratio_is_exactly_one_with_cfg(adapters, records, model):
    adapter = adapters[model]
    cond = cond_of(adapter, model, records)
    sigmas = adapter.sigmas(3)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(2), "flow-sde", 0.7, GUIDANCE,
                                                      steps=range(2))
    for j in range(2):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_saved_lora_loads_into_the_stock_transformer_and_reproduces_our_model(paths, records, tmp_path):
    model = "hunyuan-video-1.5-i2v"
    adapter = adapter_of(model, paths[model])
    cond = cond_of(adapter, model, records)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules, adapter.unused_modules(adapter.transformer))
    wrapped = {name for name, module in adapter.transformer.named_modules() if hasattr(module, "lora_A")}
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj"} <= wrapped
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, lora_state_dict(adapter.transformer, adapter.transformer.state_dict()))
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE)
    base = stock(model, paths[model], records, GUIDANCE, 4, [1, 2], "latent")
    theirs = stock(model, paths[model], records, GUIDANCE, 4, [1, 2], "latent", lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 1e-3


@pytest.mark.parametrize("model", slow_except(MODELS, "hunyuan-video-1.5-i2v"))
def test_cache_equals_online_bitwise(adapters, paths, records, model, tmp_path):
    from accelerate import Accelerator

    use = records if model.endswith("i2v") else text_records(records)
    entries = cache_entries(use, [], with_negatives=True)
    condition = condition_inputs(model, RESOLUTION, None, FRAMES)
    inputs = fingerprint_inputs(model, str(paths[model]), TEXT, torch.float32, list(entries), condition)
    encoder_only = adapter_of(model, paths[model], text_only=True)  # the text (and image) encoders, the VAE for I2V
    assert not hasattr(encoder_only, "transformer")
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    trainer = adapter_of(model, paths[model], load_text_encoders=False)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None and trainer.pipe.text_encoder_2 is None
    cached = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(use)
    online = PromptEncoder(adapters[model])(use)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    x = trainer.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapters[model].velocity(x, 0.6, online, GUIDANCE))


def test_bad_input_is_refused_with_one_line(paths, tmp_path):
    import json
    import shutil

    from common.data import check_conditions
    from common.models import ADAPTERS

    i2v = "hunyuan-video-1.5-i2v"
    cases = [(lambda: adapter_of(i2v, paths[i2v], num_frames=6), "num_frames 6 is not 4k \\+ 1"),
             (lambda: adapter_of(i2v, paths[i2v], condition_size=64), "--condition-size 64 differs from --resolution"),
             (lambda: load_adapter(i2v, str(paths[i2v]), "cpu", torch.float32, 24, num_frames=FRAMES),
              "resolution 24 is not a positive multiple of 16"),
             (lambda: adapter_of(i2v, paths["hunyuan-video-1.5"]), "its model_index.json names HunyuanVideo15Pipeline"),
             (lambda: check_conditions([Prompt("a cat", source="train.txt:1")], *ADAPTERS[i2v].condition_images, i2v),
              "train.txt:1: hunyuan-video-1.5-i2v needs a condition image")]
    # A guider that is not plain CFG over every step would be followed silently otherwise.
    folder = tmp_path / "rescaled"
    shutil.copytree(paths["hunyuan-video-1.5"], folder)
    config = json.loads((folder / "guider" / "guider_config.json").read_text())
    (folder / "guider" / "guider_config.json").write_text(json.dumps({**config, "guidance_rescale": 0.7}))
    cases.append((lambda: adapter_of("hunyuan-video-1.5", folder), "is not plain CFG over every step"))
    for make, message in cases:
        with pytest.raises(UserError, match=message) as error:
            make()
        assert "\n" not in str(error.value)


@SLOW
def test_two_processes_train_the_image_to_video_model(tmp_path):
    """`--preset tiny` on two processes with the default dataset (data/toy_edit, prompts with condition images)."""
    from conftest import ACCELERATE_2CPU, read_metrics, run_script

    args = ["--preset", "tiny", "--model", "hunyuan-video-1.5-i2v", "--model-path", "tiny", "--resolution", "32",
            "--num-frames", "5", "--max-sequence-length", "16", "--epochs", "1", "--prompts-per-epoch", "1",
            "--group-size", "4", "--batch-size", "2", "--num-steps", "4", "--updates-per-epoch", "1", "--eval-every",
            "0"]
    run_script("algos/grpo.py", *args, "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    (metrics,) = read_metrics(tmp_path)
    assert metrics["num_processes"] == 2 and metrics["grad_norm"] > 0


def test_count_truncated_counts_the_prompt_after_the_dropped_prefix(adapters):
    """The pipeline cuts the templated prompt at 108 + max_sequence_length tokens and drops the 108-token prefix: a
    prompt is cut when its tokens plus the generation prompt's exceed max_sequence_length (the tiny tokenizer has
    one token per character of an unknown word)."""
    adapter = adapters["hunyuan-video-1.5"]
    template = adapter.pipe.tokenizer.apply_chat_template(
        [[{"role": "system", "content": adapter.pipe.system_message}, {"role": "user", "content": "x"}]],
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    assert adapter.pipe.prompt_template_encode_start_idx == 108
    room = TEXT - (len(template) - 108 - 1)  # characters of a one-word prompt that still fit
    assert adapter.count_truncated(["x" * room, "x" * (room + 1), "a cat"]) == 1
