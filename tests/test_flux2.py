"""The FLUX.2 [dev] and [klein] adapters on their tiny pipelines: parity with Flux2Pipeline / Flux2KleinPipeline
(guidance embedding; true CFG with the negative prompt), the empirical-μ schedule against numpy, LoRA into the
stock pipelines, the embedding cache, bad input."""

import math

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict

from common.cache import PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache
from common.data import Prompt
from common.models import ADAPTERS, load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ode_sample

MODELS = ("flux2", "flux2-klein")
GUIDANCE = {"flux2": 4.0, "flux2-klein": 4.0}
RESOLUTION = 32  # 2x2 image tokens
SEQ = 64  # FLUX.2's system prompt and chat template take 37 tiny tokens: the prompts must fit behind them
PROMPTS = [Prompt("a photo of a red cat"), Prompt("a dog")]


@pytest.fixture(scope="module")
def paths():
    from common.models import tiny_model_path

    return {model: tiny_model_path(model) for model in MODELS}


def make_adapter(model, path, dtype=torch.float32, **kwargs):
    return load_adapter(model, str(path), "cpu", dtype, RESOLUTION, max_sequence_length=SEQ, **kwargs)


@pytest.fixture(scope="module")
def adapters(paths):
    return {model: make_adapter(model, paths[model]) for model in MODELS}


def run_pipeline(path, prompts, guidance, steps, seeds, lora=None, **extra):
    """The stock pipeline from prompt strings: its final packed latents (taken by its step callback, since klein's
    "latent" output is already unpacked), its images and the timesteps it fed."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    final, timesteps = {}, []

    def keep(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        timesteps.append(t)
        return {}

    images = pipe(prompt=[p.prompt for p in prompts], guidance_scale=guidance, num_inference_steps=steps,
                  generator=sample_generators(seeds, "cpu"), height=RESOLUTION, width=RESOLUTION,
                  max_sequence_length=SEQ, output_type="pt", callback_on_step_end=keep, **extra).images
    return final["latents"], images, torch.stack(timesteps)


@pytest.mark.parametrize("model", MODELS)
def test_ode_rollout_and_decode_reproduce_the_stock_pipeline(adapters, paths, model):
    adapter = adapters[model]
    cond = PromptEncoder(adapter)(PROMPTS)
    assert ("negative_prompt_embeds" in cond) == (model == "flux2-klein")
    assert cond["prompt_embeds"].shape == (2, SEQ, adapter.config.joint_attention_dim)
    finals = {}
    for guidance in (1.0, GUIDANCE[model]):
        final = ode_sample(adapter, cond, 4, [3, 4], guidance)
        latents, images, timesteps = run_pipeline(paths[model], PROMPTS, guidance, 4, [3, 4])
        torch.testing.assert_close(timesteps, 1000 * adapter.sigmas(4)[:-1], rtol=0, atol=1e-4)  # same shift
        torch.testing.assert_close(final, latents, rtol=0, atol=2e-5)
        finals[guidance] = final
    # Guidance (the embedding of [dev], true CFG of klein) moves the result far beyond the tolerance.
    assert (finals[1.0] - finals[GUIDANCE[model]]).abs().max() > 0.05
    ours = adapter.decode(finals[GUIDANCE[model]])
    assert ours.shape == images.shape == (2, 3, RESOLUTION, RESOLUTION) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, images, rtol=0, atol=1e-5)


def test_klein_cfg_uses_the_records_negative_prompt_as_the_pipeline_uses_its_negative_embeddings(adapters, paths):
    """Klein's pipeline always takes "" as the negative prompt unless given negative embeddings; a dataset's
    negative prompt reaches it that way, and the adapter's batched v_neg + w·(v_pos − v_neg) matches its two calls."""
    adapter = adapters["flux2-klein"]
    prompts = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]
    cond = PromptEncoder(adapter)(prompts)
    ours = ode_sample(adapter, cond, 3, [5, 6], 4.0)
    latents, _, _ = run_pipeline(paths["flux2-klein"], prompts, 4.0, 3, [5, 6],
                                 negative_prompt_embeds=cond["negative_prompt_embeds"])
    torch.testing.assert_close(ours, latents, rtol=0, atol=2e-5)
    # The negative prompt matters: with "" for both the result differs.
    plain = PromptEncoder(adapter)([Prompt(p.prompt) for p in prompts])
    assert (ode_sample(adapter, plain, 3, [5, 6], 4.0) - ours).abs().max() > 1e-3
    # One velocity: the CFG combination, recomputed from two unguided calls.
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    negative = {"prompt_embeds": cond["negative_prompt_embeds"]}
    v_pos, v_neg = adapter.velocity(x, 0.6, cond, 1.0), adapter.velocity(x, 0.6, negative, 1.0)
    torch.testing.assert_close(adapter.velocity(x, 0.6, cond, 4.0), v_neg + 4.0 * (v_pos - v_neg), rtol=0, atol=1e-5)


def _empirical_mu(seq_len, steps):
    """BFL's fit of μ to (image tokens, steps), recomputed: linear in seq_len at 10 and 200 steps, interpolated in
    the steps, and the 200-step line alone beyond 4300 tokens."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq_len > 4300:
        return a2 * seq_len + b2
    m10, m200 = a1 * seq_len + b1, a2 * seq_len + b2
    return m200 + (steps - 200) * (m200 - m10) / 190


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("resolution", [32, 512, 1088])  # 4, 1024 and 4624 image tokens (past 4300: the 200-step line)
@pytest.mark.parametrize("steps", [4, 28])
def test_schedule_is_the_empirical_mu_exponential_shift(paths, model, resolution, steps):
    adapter = load_adapter(model, str(paths[model]), "cpu", torch.float32, resolution, load_text_encoders=False)
    sigmas = adapter.sigmas(steps).double().numpy()
    assert len(sigmas) == steps + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    t = np.linspace(1.0, 1 / steps, steps)
    mu = _empirical_mu((resolution // 16) ** 2, steps)
    np.testing.assert_allclose(sigmas[:-1], math.exp(mu) / (math.exp(mu) + (1 / t - 1)), rtol=0, atol=1e-6)
    if resolution < 1088:  # μ depends on the number of steps too, not on the token count alone
        assert abs(_empirical_mu((resolution // 16) ** 2, 50) - mu) > 0.01


@pytest.mark.parametrize("model", MODELS)
def test_saved_lora_loads_into_the_stock_pipeline_and_reproduces_our_model(paths, model, tmp_path):
    adapter = make_adapter(model, paths[model])
    cond = PromptEncoder(adapter)(PROMPTS)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    names = [n for n, _ in adapter.transformer.named_modules() if n.endswith("to_qkv_mlp_proj")]
    assert names and all(hasattr(adapter.transformer.get_submodule(n), "lora_A") for n in names)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    ours = ode_sample(adapter, cond, 3, [1, 2], GUIDANCE[model])
    base, _, _ = run_pipeline(paths[model], PROMPTS, GUIDANCE[model], 3, [1, 2])
    theirs, _, _ = run_pipeline(paths[model], PROMPTS, GUIDANCE[model], 3, [1, 2], lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 0.01


@pytest.mark.parametrize("model", MODELS)
def test_cached_embeddings_are_bitwise_equal_and_train_without_encoders(adapters, paths, model, tmp_path):
    from accelerate import Accelerator

    adapter = adapters[model]
    prompts = [Prompt("a photo of a red cat", "blurry"), Prompt("a dog", "")]
    texts = cache_texts(prompts, [], with_negatives=ADAPTERS[model].true_cfg)
    expected = {"a photo of a red cat", "a dog"} | ({"blurry", ""} if model == "flux2-klein" else set())
    assert texts == sorted(expected)
    inputs = fingerprint_inputs(model, str(paths[model]), SEQ, torch.float32, texts)
    build_cache(Accelerator(cpu=True), adapter, texts, tmp_path, inputs, shard_size=3, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    online = PromptEncoder(adapter)(prompts)
    trainer = make_adapter(model, paths[model], load_text_encoders=False)
    cached = PromptEncoder(trainer, cache)(prompts)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None and trainer.count_truncated(texts) == 0
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE[model]), adapter.velocity(x, 0.6, online, GUIDANCE[model]))
    encoder_only = make_adapter(model, paths[model], text_only=True)
    assert not hasattr(encoder_only, "transformer")
    assert torch.equal(encoder_only.encode_prompts(["a dog"])["prompt_embeds"],
                       adapter.encode_prompts(["a dog"])["prompt_embeds"])


@pytest.mark.parametrize("model", MODELS)
def test_truncation_counts_the_chat_template_and_bf16_keeps_float32(paths, adapters, model):
    adapter = adapters[model]
    prefix = len(adapter._template_ids(""))
    assert 0 < prefix < SEQ
    assert adapter.count_truncated(["a dog", "x" * (SEQ - prefix + 1)]) == 1
    low = make_adapter(model, paths[model], dtype=torch.bfloat16)
    cond = PromptEncoder(low)(PROMPTS)
    v = low.velocity(low.noise(sample_generators([0, 1], "cpu")), 0.5, cond, GUIDANCE[model])
    assert low.transformer.dtype == torch.bfloat16 and v.dtype == torch.float32 and torch.isfinite(v).all()


def test_bad_input_is_refused_with_one_line(paths):
    with pytest.raises(UserError, match="resolution 40 is not a positive multiple of 16, as FLUX.2"):
        load_adapter("flux2", str(paths["flux2"]), "cpu", torch.float32, 40)
    with pytest.raises(UserError, match="names Flux2Pipeline, not Flux2KleinPipeline"):
        load_adapter("flux2-klein", str(paths["flux2"]), "cpu", torch.float32, 32)
    adapter = make_adapter("flux2-klein", paths["flux2-klein"])
    cond = PromptEncoder(adapter)(PROMPTS)
    with pytest.raises(ValueError, match="needs negative prompt embeddings"):
        adapter.velocity(adapter.noise(sample_generators([0, 1], "cpu")), 0.5,
                         {"prompt_embeds": cond["prompt_embeds"]}, 4.0)


def test_tiny_builds_are_deterministic(tmp_path, monkeypatch, paths):
    from safetensors.torch import load_file

    from common.models import tiny_model_path

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    for model in MODELS:
        rebuilt = tiny_model_path(model)
        assert rebuilt != paths[model]
        files = sorted(p.relative_to(paths[model]) for p in paths[model].rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(rebuilt) for p in rebuilt.rglob("*") if p.is_file())
        for name in files:
            if name.suffix == ".safetensors":
                a, b = load_file(rebuilt / name), load_file(paths[model] / name)
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (model, name)
            else:  # configs, tokenizer files, chat templates
                assert (rebuilt / name).read_bytes() == (paths[model] / name).read_bytes(), (model, name)


def test_a_pixtral_processor_without_torchvision_is_one_line_and_the_cache_path_still_loads(paths, tmp_path):
    """The real FLUX.2 [dev] tokenizes with a PixtralProcessor, which transformers builds only with torchvision."""
    import json
    import shutil

    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        pytest.skip("torchvision is installed: the processor loads")
    folder = tmp_path / "pixtral"
    shutil.copytree(paths["flux2"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    with pytest.raises(UserError, match="FLUX.2's prompt encoding needs torchvision: .* PixtralProcessor"):
        load_adapter("flux2", str(folder), "cpu", torch.float32, RESOLUTION)
    assert load_adapter("flux2", str(folder), "cpu", torch.float32, RESOLUTION, load_text_encoders=False).text_encoders == []
