"""Z-Image (`--model z-image`) on its tiny pipeline: its reversed time and negated output turned into the scripts'
convention (σ: 1 = noise, 0 = data; v ≈ ε − x0) and pinned step by step against the stock `ZImagePipeline`; parity
with the pipeline with and without CFG, its CFG truncation and normalisation included; the schedule against numpy;
the ratio invariant with CFG; a LoRA the stock pipeline loads; the embedding cache (cached = online, bitwise); bad
input."""

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from peft import get_peft_model_state_dict

from common.cache import PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache
from common.data import Prompt
from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import assert_tiny_rebuild_equals, ode_sample, sde_trajectory

RESOLUTION, GUIDANCE = 32, 5.0  # w = 5 is the pipeline's guidance_scale 4 (Z-Image's, and Flow-Factory's)
# Different lengths and different negative prompts, so masks, the caption lists and the negative rows all matter.
PROMPTS = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("z-image")


def adapter_of(path, **kwargs):
    kwargs.setdefault("max_sequence_length", 32)
    return load_adapter("z-image", str(path), "cpu", kwargs.pop("dtype", torch.float32), RESOLUTION, **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return adapter_of(path)


@pytest.fixture(scope="module")
def cond(adapter):
    return PromptEncoder(adapter)(PROMPTS)


def stock(path, guidance, steps, seeds, output_type="latent", lora=None, step_latents=None, **options):
    """The pipeline's own generation from the prompt strings; its guidance_scale is our w − 1. `step_latents`: a
    list that receives the latents after each step."""
    pipe = ZImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    if step_latents is not None:
        def keep(pipe, step, timestep, tensors):
            step_latents.append(tensors["latents"].clone())
            return {}

        options["callback_on_step_end"] = keep
    return pipe(prompt=[p.prompt for p in PROMPTS], negative_prompt=[p.negative_prompt for p in PROMPTS],
                height=RESOLUTION, width=RESOLUTION, num_inference_steps=steps, guidance_scale=guidance - 1,
                generator=sample_generators(seeds, "cpu"), output_type=output_type, max_sequence_length=32,
                **options).images


def raw_output(adapter, cond, x, time):
    """The transformer itself on each sample's unpadded caption at `time`, no adapter in between."""
    captions = [e[m.bool()] for e, m in zip(cond["prompt_embeds"], cond["prompt_embeds_mask"])]
    times = torch.full((x.shape[0],), float(time))
    with torch.no_grad():
        out = adapter.transformer(list(x.unsqueeze(2).unbind(0)), times, captions, return_dict=False)[0]
    return torch.stack(out).squeeze(2)


def test_velocity_is_minus_the_transformer_at_the_reversed_time_and_steps_like_the_pipeline(adapter, cond, path):
    """The convention, pinned: at every σ of a 5-step schedule (none at 0.5, where 1 − σ = σ) the adapter's v is
    minus the raw transformer output at time 1 − σ, and the Euler step x + (σ' − σ)·v lands on the stock pipeline's
    next latent. A flipped time (the transformer at σ) or a flipped sign (+output) lands far from it."""
    pipeline_steps = []
    stock(path, 1.0, 5, [3, 4], step_latents=pipeline_steps)
    sigmas = adapter.sigmas(5)
    assert not torch.isclose(sigmas, torch.tensor(0.5)).any()
    x = adapter.noise(sample_generators([3, 4], "cpu"))
    for j in range(5):
        sigma, sigma_next, expected = float(sigmas[j]), float(sigmas[j + 1]), pipeline_steps[j]
        v = adapter.velocity(x, sigmas[j], cond, 1.0)
        reversed_time, same_time = raw_output(adapter, cond, x, 1 - sigma), raw_output(adapter, cond, x, sigma)
        torch.testing.assert_close(v, -reversed_time, rtol=0, atol=1e-5)
        dt = sigma_next - sigma
        torch.testing.assert_close(x + dt * v, expected, rtol=0, atol=1e-6)
        assert (x + dt * reversed_time - expected).abs().max() > 1e-3  # flipped sign
        assert (x - dt * same_time - expected).abs().max() > 1e-3  # flipped time
        x = x + dt * v
    # The schedule runs from pure noise (σ = 1: the transformer's time 0) to data (σ = 0: time 1).
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    assert torch.equal(adapter.model_time(sigmas[[0, -1]]), torch.tensor([0.0, 1.0]))


def test_ode_rollout_reproduces_the_pipeline_with_and_without_cfg(adapter, cond, path):
    assert cond.keys() == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds",
                           "negative_prompt_embeds_mask"}
    finals = {}
    for guidance in (1.0, GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 4, [3, 4], guidance)
        torch.testing.assert_close(finals[guidance], stock(path, guidance, 4, [3, 4]), rtol=0, atol=2e-5)
    assert (finals[1.0] - finals[GUIDANCE]).abs().max() > 0.05  # the guided path was tested
    images = adapter.decode(finals[GUIDANCE])
    theirs = stock(path, GUIDANCE, 4, [3, 4], "pt")
    assert images.shape == theirs.shape == (2, 3, RESOLUTION, RESOLUTION) and images.dtype == torch.float32
    torch.testing.assert_close(images, theirs, rtol=0, atol=1e-5)


def test_cfg_truncation_and_normalisation_match_the_pipeline(path, cond):
    """The pipeline's two CFG options: truncation 0.3 drops CFG on the last of 4 steps (time 1 − σ = 0.5 > 0.3),
    normalisation 1.0 caps the guided prediction's norm at the positive one's. Each changes the result, and each
    matches the pipeline."""
    adapter = adapter_of(path)
    plain = ode_sample(adapter, cond, 4, [3, 4], GUIDANCE)
    for options in ({"cfg_truncation": 0.3}, {"cfg_normalization": 1.0},
                    {"cfg_truncation": 0.3, "cfg_normalization": 1.0}):
        adapter.cfg_truncation = options.get("cfg_truncation", 1.0)
        adapter.cfg_normalization = options.get("cfg_normalization", 0.0)
        ours = ode_sample(adapter, cond, 4, [3, 4], GUIDANCE)
        torch.testing.assert_close(ours, stock(path, GUIDANCE, 4, [3, 4], **options), rtol=0, atol=2e-5)
        assert (ours - plain).abs().max() > 1e-3, options


def test_truncation_is_decided_per_sample(path, cond):
    """Training batches may mix σ: each sample gets CFG or not from its own σ, as it would alone."""
    adapter = adapter_of(path)
    adapter.cfg_truncation = 0.3
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    sigma = torch.tensor([0.9, 0.4])  # time 0.1: guided; time 0.6: truncated
    v = adapter.velocity(x, sigma, cond, GUIDANCE)
    for i in range(2):
        alone = {k: t[i:i + 1] for k, t in cond.items()}
        torch.testing.assert_close(v[i:i + 1], adapter.velocity(x[i:i + 1], sigma[i], alone, GUIDANCE), rtol=0,
                                   atol=1e-5)
    unguided = adapter.velocity(x, sigma, cond, 1.0)
    assert (v[0] - unguided[0]).abs().max() > 1e-3 and torch.allclose(v[1], unguided[1], rtol=0, atol=1e-5)


def test_schedule_matches_numpy(adapter):
    """Z-Image-Turbo's scheduler: a static shift 3 of linspace(1, 1/N, N), then 0."""
    n = 10
    expected = 3 * np.linspace(1.0, 1 / n, n) / (1 + 2 * np.linspace(1.0, 1 / n, n))
    sigmas = adapter.sigmas(n).double().numpy()
    assert len(sigmas) == n + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    np.testing.assert_allclose(sigmas[:-1], expected, rtol=0, atol=1e-6)


def test_ratio_is_exactly_one_with_cfg(adapter):
    cond = PromptEncoder(adapter)(PROMPTS * 2)
    sigmas = adapter.sigmas(4)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE,
                                                      steps=range(3))
    assert torch.isfinite(log_probs).all()
    for j in range(3):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(path, tmp_path):
    """LoRA r 4 / α 8 on the adapter's targets, lora_B perturbed: the stock pipeline that loads the saved file
    generates what our rollout generates (with CFG), and differs from the base."""
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(PROMPTS)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    names = [n for n, _ in adapter.transformer.named_parameters() if "lora_B" in n]
    assert any("noise_refiner" in n for n in names) and any("feed_forward.w2" in n for n in names)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE)
    theirs = stock(path, GUIDANCE, 4, [1, 2], lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - stock(path, GUIDANCE, 4, [1, 2])).abs().max() > 0.01


def test_lora_gradients_with_cfg_are_unchanged_by_gradient_checkpointing(path, cond):
    """`--gradient-checkpointing` recomputes the blocks of the list-input transformer: same loss, same gradients."""
    adapter = adapter_of(path)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            adapter.transformer.enable_gradient_checkpointing()
        adapter.transformer.zero_grad()
        adapter.velocity(x, torch.tensor([0.8, 0.3]), cond, GUIDANCE).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in adapter.transformer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(g.abs().max() > 0 for g in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-7)


def test_cached_embeddings_are_bitwise_equal_and_train_without_encoders(adapter, path, tmp_path):
    from accelerate import Accelerator

    texts = cache_texts(PROMPTS, [], with_negatives=True)
    assert texts == sorted({"a photo of a red cat", "a dog", "blurry, low quality", ""})
    inputs = fingerprint_inputs("z-image", str(path), 32, torch.float32, texts)
    build_cache(Accelerator(cpu=True), adapter, texts, tmp_path, inputs, shard_size=3, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    online = PromptEncoder(adapter)(PROMPTS)
    trainer = adapter_of(path, load_text_encoders=False)
    cached = PromptEncoder(trainer, cache)(PROMPTS)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))
    # Padding beyond each caption is masked out: the transformer sees the same caption lists.
    padded = {k: torch.nn.functional.pad(v, (0, 0, 0, 8) if v.ndim == 3 else (0, 8)) for k, v in online.items()}
    assert torch.equal(adapter.velocity(x, 0.6, padded, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))
    encoder_only = adapter_of(path, text_only=True)
    assert not hasattr(encoder_only, "transformer")
    assert all(torch.equal(encoder_only.encode_prompts([t])[k], adapter.encode_prompts([t])[k])
               for t in texts for k in ("prompt_embeds", "prompt_embeds_mask"))


def test_captions_are_the_pipelines_and_truncation_counts_the_chat_template(adapter, cond, path):
    pipe_embeds, _ = adapter.pipe.encode_prompt([p.prompt for p in PROMPTS], device="cpu",
                                                do_classifier_free_guidance=False, max_sequence_length=32)
    lengths = cond["prompt_embeds_mask"].sum(dim=1).tolist()
    assert lengths == [len(e) for e in pipe_embeds] and lengths[0] > lengths[1]
    for row, embeds in enumerate(pipe_embeds):
        assert torch.equal(cond["prompt_embeds"][row, : lengths[row]], embeds)
        assert cond["prompt_embeds"][row, lengths[row]:].abs().max() == 0
    # "a dog" is 4 tokens bare but 12 in its chat template: a max length of 8 truncates it.
    assert len(adapter.pipe.tokenizer("a dog").input_ids) == 4 and lengths[1] == 12
    short = adapter_of(path, max_sequence_length=8, text_only=True)
    assert short.count_truncated(["a dog"]) == 1 and adapter.count_truncated(["a dog"]) == 0


def test_bf16_weights_keep_float32_outputs_and_cfg_needs_negatives(path):
    adapter = adapter_of(path, dtype=torch.bfloat16)
    cond = PromptEncoder(adapter)(PROMPTS)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    v = adapter.velocity(x, 0.5, cond, GUIDANCE)
    assert adapter.transformer.dtype == torch.bfloat16 and v.dtype == torch.float32 and torch.isfinite(v).all()
    positives = {k: t for k, t in cond.items() if not k.startswith("negative_")}
    assert adapter.velocity(x, 0.5, positives, 1.0).dtype == torch.float32  # no CFG: no negatives needed
    with pytest.raises(ValueError, match="needs negative prompt embeddings"):
        adapter.velocity(x, 0.5, positives, GUIDANCE)


def test_bad_input_is_refused_with_one_line(path):
    with pytest.raises(UserError, match="resolution 40 is not a positive multiple of 16 up to 8192, as Z-Image"):
        load_adapter("z-image", str(path), "cpu", torch.float32, 40, max_sequence_length=32)
    with pytest.raises(UserError, match="max_sequence_length 1536 is too long for this Z-Image transformer"):
        load_adapter("z-image", str(path), "cpu", torch.float32, 32, max_sequence_length=1536)
    with pytest.raises(UserError, match="cannot load a Z-Image pipeline from .*not ZImagePipeline"):
        from common.models import tiny_model_path

        load_adapter("z-image", str(tiny_model_path("flux1")), "cpu", torch.float32, 32)


def test_tiny_build_is_deterministic(tmp_path, monkeypatch, path):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    assert_tiny_rebuild_equals("z-image", path, tmp_path)
