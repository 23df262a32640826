"""The SD3.5, Qwen-Image and Wan2.1 adapters on their tiny pipelines: parity with each diffusers pipeline (true
CFG included), the schedules against numpy, the ratio invariant with CFG, LoRA round trips, the embedding cache
with negative prompts, bad input and deterministic tiny builds."""

import math

import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler
from peft import get_peft_model_state_dict

from common.cache import PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache
from common.data import Prompt
from common.dynamics import sde_step
from common.models import ADAPTERS, load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import ode_sample, sde_trajectory

MODELS = ("sd3", "qwen-image", "wan")
GUIDANCE = {"sd3": 4.5, "qwen-image": 4.0, "wan": 5.0}  # the references' CFG scales
RESOLUTION = {"sd3": 64, "qwen-image": 64, "wan": 32}
FRAMES = 5  # Wan: 4k + 1 frames -> 2 latent frames
# Different lengths and different negative prompts, so masks, padding and the negative batch all matter.
PROMPTS = [Prompt("a photo of a red cat", "blurry, low quality"), Prompt("a dog", "")]


@pytest.fixture(scope="module")
def paths():
    from common.models import tiny_model_path

    return {model: tiny_model_path(model) for model in MODELS}


def make_adapter(model, path, dtype=torch.float32, **kwargs):
    extra = {"num_frames": FRAMES} if model == "wan" else {}
    return load_adapter(model, str(path), "cpu", dtype, RESOLUTION[model], max_sequence_length=32, **extra, **kwargs)


@pytest.fixture(scope="module")
def adapters(paths):
    return {model: make_adapter(model, paths[model]) for model in MODELS}


def run_pipeline(model, path, prompts, guidance, steps, seeds, output_type, lora=None):
    """The diffusers pipeline's own generation from prompt strings. Wan's pipeline runs its UniPC scheduler at
    order 1 with the corrector off: for flow matching that is the DDIM step, i.e. exactly the Euler step, over
    the same σ and timesteps (the default order-2 UniPC is a different integrator of the same ODE)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    args = dict(prompt=[p.prompt for p in prompts], negative_prompt=[p.negative_prompt for p in prompts],
                num_inference_steps=steps, generator=sample_generators(seeds, "cpu"), output_type=output_type,
                height=RESOLUTION[model], width=RESOLUTION[model], max_sequence_length=32)
    if model == "qwen-image":
        return pipe(true_cfg_scale=guidance, **args).images
    if model == "sd3":
        return pipe(guidance_scale=guidance, **args).images
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, solver_order=1,
                                                         disable_corrector=list(range(steps)))
    return pipe(guidance_scale=guidance, num_frames=FRAMES, **args).frames


@pytest.mark.parametrize("model", MODELS)
def test_ode_rollout_reproduces_the_diffusers_pipeline_with_and_without_cfg(adapters, paths, model):
    adapter = adapters[model]
    cond = PromptEncoder(adapter)(PROMPTS)
    assert {"negative_prompt_embeds", "prompt_embeds"} <= cond.keys()
    finals = {}
    for guidance in (1.0, GUIDANCE[model]):
        final = ode_sample(adapter, cond, 6, [3, 4], guidance)
        theirs = run_pipeline(model, paths[model], PROMPTS, guidance, 6, [3, 4], "latent")
        torch.testing.assert_close(final, theirs, rtol=0, atol=2e-5)
        finals[guidance] = final
    # CFG moves the result far beyond the tolerance, so the parity above did test the guided path.
    assert (finals[1.0] - finals[GUIDANCE[model]]).abs().max() > 0.05
    images = adapter.decode(finals[GUIDANCE[model]])
    theirs = run_pipeline(model, paths[model], PROMPTS, GUIDANCE[model], 6, [3, 4], "pt")
    expected_shape = (2, FRAMES, 3, 32, 32) if model == "wan" else (2, 3, 64, 64)
    assert images.shape == theirs.shape == expected_shape and images.dtype == torch.float32
    torch.testing.assert_close(images, theirs, rtol=0, atol=1e-5)


def _shift(s, k):
    return k * s / (1 + (k - 1) * s)


@pytest.mark.parametrize("model", MODELS)
def test_schedules_match_numpy(adapters, model):
    """Each model's pipeline schedule, recomputed in float64 from the formulas of the scheduler configs."""
    adapter, n = adapters[model], 10
    sigmas = adapter.sigmas(n).double().numpy()
    assert len(sigmas) == n + 1 and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    if model == "sd3":
        # Static shift 3 applied to a linspace of the shifted training range [shift(1/1000), 1]: twice shifted.
        expected = _shift(np.linspace(1.0, _shift(1 / 1000, 3.0), n), 3.0)
        assert abs(expected[-1] - 0.0089) < 1e-4  # algorithms.md §1: ≈ 0.009 at N = 10, not 1/N
    elif model == "qwen-image":
        cfg = adapter.scheduler.config
        seq_len = (64 // 16) ** 2  # packed image tokens at 64x64
        slope = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
        mu = cfg.base_shift + slope * (seq_len - cfg.base_image_seq_len)
        t = np.linspace(1.0, 1 / n, n)
        shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1))  # exponential time shift
        one_minus = 1 - shifted
        expected = 1 - one_minus / (one_minus[-1] / (1 - cfg.shift_terminal))  # last σ stretched to shift_terminal
        assert abs(expected[-1] - 0.02) < 1e-12
    else:
        expected = _shift(np.linspace(1.0, 1 / 1000, n + 1)[:-1], 3.0)  # UniPC flow sigmas, flow_shift 3
        # The transformer sees UniPC's integer timesteps; σ_0 = 1 exactly (UniPC's 1e-6 guard is undone).
        native = UniPCMultistepScheduler.from_config(adapter.scheduler.config)
        native.set_timesteps(n)
        assert torch.equal(adapter._timestep(adapter.sigmas(n)[:-1]), native.timesteps)
        assert torch.equal(native.timesteps, torch.from_numpy(np.minimum(np.floor(expected * 1000), 999)).long())
    np.testing.assert_allclose(sigmas[:-1], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_ratio_is_exactly_one_with_cfg(adapters, model):
    """Training re-evaluates the stored flow-sde steps with the same CFG forward and batch: ratio == 1."""
    adapter = adapters[model]
    cond = PromptEncoder(adapter)(PROMPTS * 2)
    sigmas = adapter.sigmas(5)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7,
                                                      GUIDANCE[model], steps=range(4))
    assert log_probs.shape == (4, 4) and torch.isfinite(log_probs).all()
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE[model])
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


@pytest.mark.filterwarnings("error:You have passed exclude_modules", "error:While injecting the PEFT adapters")
@pytest.mark.parametrize("model", MODELS)
def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(paths, model, tmp_path):
    """LoRA with α ≠ r (the references' r 64 / α 128 pattern) on the adapter's default targets less its unused
    modules (as training adds it), lora_B perturbed: the pipeline that loads the saved file generates what our
    rollout generates, and differs from the base."""
    adapter = make_adapter(model, paths[model])
    cond = PromptEncoder(adapter)(PROMPTS)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules, adapter.unused_modules(adapter.transformer))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE[model])
    base = run_pipeline(model, paths[model], PROMPTS, GUIDANCE[model], 4, [1, 2], "latent")
    theirs = run_pipeline(model, paths[model], PROMPTS, GUIDANCE[model], 4, [1, 2], "latent", lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 0.01


@pytest.mark.parametrize("model", MODELS)
def test_cached_embeddings_with_negatives_are_bitwise_equal_and_train_without_encoders(adapters, paths, model,
                                                                                      tmp_path):
    from accelerate import Accelerator

    adapter = adapters[model]
    texts = cache_texts(PROMPTS, [], with_negatives=ADAPTERS[model].true_cfg)
    assert texts == sorted({"a photo of a red cat", "a dog", "blurry, low quality", ""})
    inputs = fingerprint_inputs(model, str(paths[model]), 32, torch.float32, texts)
    build_cache(Accelerator(cpu=True), adapter, texts, tmp_path, inputs, shard_size=3, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    online = PromptEncoder(adapter)(PROMPTS)
    # Training from the cache loads no text encoder at all, yet conditions the same forward identically.
    trainer = make_adapter(model, paths[model], load_text_encoders=False)
    cached = PromptEncoder(trainer, cache)(PROMPTS)
    assert cached.keys() == online.keys() and any(k.startswith("negative_") for k in cached)
    assert all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == [] and trainer.pipe.text_encoder is None
    with pytest.raises(RuntimeError, match="text encoders were not loaded"):
        trainer.encode_prompts(["a cat"])
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE[model]), adapter.velocity(x, 0.6, online, GUIDANCE[model]))
    # preprocess.py's text-only load encodes the same bits.
    encoder_only = make_adapter(model, paths[model], text_only=True)
    assert not hasattr(encoder_only, "transformer")
    assert all(torch.equal(encoder_only.encode_prompts([t])[k], adapter.encode_prompts([t])[k])
               for t in texts for k in ("prompt_embeds",))


def test_qwen_tokenizer_drops_exactly_the_template_prefix(paths):
    """QwenImagePipeline drops the first 34 tokens of its chat template: in the saved and reloaded tiny tokenizer
    they must be the system prompt and 'user' turn header, as with the real tokenizer."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(paths["qwen-image"]), transformer=None, vae=None)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    prefix = template.split("{}")[0]
    ids = pipe.tokenizer(template.format("a red cat")).input_ids
    assert drop == 34 and len(pipe.tokenizer(prefix).input_ids) == 34
    assert pipe.tokenizer.decode(ids[:drop]) == prefix
    assert pipe.tokenizer.decode(ids[drop:]).startswith("a red cat<|im_end|>")


def test_qwen_padding_and_mask_do_not_change_the_velocity(adapters):
    """Texts are padded to max_sequence_length with a mask; extra masked padding leaves v unchanged and the
    padded rows are zero."""
    adapter = adapters["qwen-image"]
    cond = PromptEncoder(adapter)(PROMPTS)
    lengths = cond["prompt_embeds_mask"].sum(dim=1).tolist()
    short = int(min(lengths))
    assert lengths[0] > lengths[1] and cond["prompt_embeds"][1, short:].abs().max() == 0
    padded = {k: torch.nn.functional.pad(v, (0, 0, 0, 16) if v.ndim == 3 else (0, 16)) for k, v in cond.items()}
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    for guidance in (1.0, 4.0):
        torch.testing.assert_close(adapter.velocity(x, 0.7, padded, guidance), adapter.velocity(x, 0.7, cond, guidance),
                                   rtol=0, atol=1e-6)
    # Masking matters: the same padded embeddings with an all-ones mask give another velocity.
    unmasked = {**cond, "prompt_embeds_mask": torch.ones_like(cond["prompt_embeds_mask"])}
    assert (adapter.velocity(x, 0.7, unmasked, 1.0) - adapter.velocity(x, 0.7, cond, 1.0)).abs().max() > 1e-3


@pytest.mark.parametrize("model", MODELS)
def test_bf16_weights_keep_float32_outputs_and_cfg_needs_negatives(paths, model):
    adapter = make_adapter(model, paths[model], dtype=torch.bfloat16)
    cond = PromptEncoder(adapter)(PROMPTS)
    v = adapter.velocity(adapter.noise(sample_generators([0, 1], "cpu")), 0.5, cond, GUIDANCE[model])
    assert adapter.transformer.dtype == torch.bfloat16 and v.dtype == torch.float32 and torch.isfinite(v).all()
    positives = {k: t for k, t in cond.items() if not k.startswith("negative_")}
    with pytest.raises(ValueError, match="needs negative prompt embeddings"):
        adapter.velocity(adapter.noise(sample_generators([0, 1], "cpu")), 0.5, positives, GUIDANCE[model])


def test_bad_input_is_refused_with_one_line(paths):
    cases = [
        (dict(model="sd3", resolution=72), "resolution 72 is not a positive multiple of 16 up to 256, as SD3"),
        (dict(model="sd3", resolution=512), "resolution 512 is not a positive multiple of 16 up to 256"),
        (dict(model="qwen-image", resolution=40), "resolution 40 is not a positive multiple of 16, as Qwen-Image"),
        (dict(model="wan", resolution=24), "resolution 24 is not a positive multiple of 16, as Wan"),
        (dict(model="wan", resolution=32, num_frames=6), "num_frames 6 is not 4k \\+ 1"),
        (dict(model="sd3", resolution=64, num_frames=5), "num_frames applies to video models, not to sd3"),
        (dict(model="sd3", resolution=64, max_sequence_length=600), "max_sequence_length 600 is not in 1..512"),
        (dict(model="qwen-image", resolution=64, max_sequence_length=2000), "max_sequence_length 2000 is not in"),
    ]
    for kwargs, message in cases:
        model = kwargs.pop("model")
        kwargs.setdefault("max_sequence_length", 32)
        with pytest.raises(UserError, match=message):
            load_adapter(model, str(paths[model]), "cpu", torch.float32, **kwargs)
    with pytest.raises(UserError, match="cannot load a Wan pipeline from .*names StableDiffusion3Pipeline, not WanPipeline"):
        load_adapter("wan", str(paths["sd3"]), "cpu", torch.float32, 32)
    with pytest.raises(UserError, match="unknown model 'sd9'; choose one of: flux1, sd3, qwen-image, wan"):
        load_adapter("sd9", "tiny", "cpu", torch.float32, 64)


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
            else:  # configs and tokenizer files
                assert (rebuilt / name).read_bytes() == (paths[model] / name).read_bytes(), (model, name)
