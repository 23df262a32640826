"""The FLUX.1 adapter on the tiny pipeline: parity with diffusers, the ratio invariant, bad input."""

import inspect
import shutil

import pytest
import torch
from diffusers import FluxPipeline

from common.dynamics import sde_step
from common.models import load_adapter
from common.sampling import sample_generators
from conftest import ACCELERATE_2CPU, SLOW, ode_sample, run_script, sde_trajectory
from common.utils import UserError


@pytest.fixture(scope="module")
def adapter(tiny_flux_path):
    return load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 64, max_sequence_length=32)


def test_ode_rollout_reproduces_the_diffusers_pipeline(adapter, tiny_flux_path):
    prompts = ["a photo of a cat", "a dog"]
    cond = adapter.encode_prompts(prompts)
    ours = adapter.decode(ode_sample(adapter, cond, 6, [3, 4], 3.5))
    pipe = FluxPipeline.from_pretrained(tiny_flux_path)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompts, height=64, width=64, num_inference_steps=6, guidance_scale=3.5, max_sequence_length=32,
                  generator=sample_generators([3, 4], "cpu"), output_type="pt").images
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_schedule_matches_the_pipeline_and_ends_at_zero(adapter):
    sigmas = adapter.sigmas(8)
    assert len(sigmas) == 9 and sigmas[0] == 1.0 and sigmas[-1] == 0.0 and (sigmas.diff() < 0).all()


@pytest.mark.parametrize("dynamics", ["flow-sde", "dance-sde", "cps"])
def test_ratio_is_exactly_one_before_any_update(adapter, dynamics):
    """Training re-evaluates the stored steps with the same forward and the same batch: ratio == 1."""
    cond = adapter.encode_prompts(["a cat"] * 4)
    sigmas = adapter.sigmas(5)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), dynamics, 0.5, 3.5,
                                                      steps=range(4))
    assert log_probs.shape == (4, 4)
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond)
        _, log_prob, _, _ = sde_step(dynamics, v, latents[:, j], sigmas[j], sigmas[j + 1], 0.5,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6


def test_bf16_weights_keep_float32_outputs(tiny_flux_path):
    adapter = load_adapter("flux1", str(tiny_flux_path), "cpu", torch.bfloat16, 64, max_sequence_length=32)
    cond = adapter.encode_prompts(["a cat"])
    v = adapter.velocity(adapter.noise(sample_generators([0], "cpu")), 0.5, cond)
    assert adapter.transformer.dtype == torch.bfloat16 and v.dtype == torch.float32 and torch.isfinite(v).all()


def test_bad_model_and_resolution(tiny_flux_path):
    with pytest.raises(UserError, match="unknown model 'sd9'; choose one of: flux1"):
        load_adapter("sd9", "tiny", "cpu", torch.float32, 64)
    with pytest.raises(UserError, match="resolution 72 is not a positive multiple of 16"):
        load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 72)


def test_tiny_build_is_deterministic(tmp_path, monkeypatch, tiny_flux_path):
    from safetensors.torch import load_file

    from common.models import tiny_model_path

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    rebuilt = tiny_model_path("flux1")
    assert rebuilt != tiny_flux_path
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(rebuilt / name), load_file(tiny_flux_path / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_flux_path):
    from common.training import add_lora

    grads = {}
    for checkpointing in (False, True):
        adapter = load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 64, max_sequence_length=32)
        torch.manual_seed(0)
        add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
        with torch.no_grad():  # make the LoRA path non-trivial (lora_B starts at zero)
            for name, p in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
        if checkpointing:
            adapter.transformer.enable_gradient_checkpointing()
        adapter.transformer.train()
        cond = adapter.encode_prompts(["a cat", "a dog"])
        x = adapter.noise(sample_generators([0, 1], "cpu"))
        adapter.velocity(x, 0.6, cond).square().mean().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in adapter.transformer.named_parameters()
                                if p.requires_grad}
    assert adapter.transformer.is_gradient_checkpointing
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7)


def test_training_scripts_turn_off_cudnn_attention():
    """cuDNN's attention backward gave wrong or non-finite gradients on an H200 with torch 2.11
    (docs/distributed.md): every training script and the step benchmark switch it off before building anything."""
    from conftest import REPO

    from common.utils import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    # the scripts parse their flags with common.cli.parse_args, which switches it off first
    assert "    avoid_cudnn_attention()\n" in (REPO / "common" / "cli.py").read_text()
    for script in sorted((REPO / "algos").glob("*.py")):
        assert "    args = parse_args(Args, PRESETS" in script.read_text(), script.name
    assert "    avoid_cudnn_attention()\n" in (REPO / "benchmarks" / "flux_step.py").read_text()


def test_every_model_name_has_an_adapter_a_default_path_and_a_tiny_build():
    """The --model names the scripts, preprocess.py and evaluate.py parse (common.cli.ModelName) are the registry's,
    and each row's adapter, checkpoint, tiny builder and capabilities are what the family's module has."""
    import sys
    from typing import get_args

    from common.cli import CONDITIONED_MODELS, TWO_EXPERT_MODELS, VIDEO_MODELS, ModelName
    from common.models import ADAPTERS, DEFAULT_MODEL_PATHS, MODELS
    from common.models.registry import MODELS as ROWS

    assert get_args(ModelName) == tuple(ROWS) == MODELS == tuple(ADAPTERS) == tuple(DEFAULT_MODEL_PATHS)
    for model, row in ROWS.items():
        adapter = ADAPTERS[model]
        assert adapter.__module__ == f"common.models.{row.family}" and adapter.__name__ == row.adapter, model
        assert callable(getattr(sys.modules[adapter.__module__], row.tiny)), model
        assert DEFAULT_MODEL_PATHS[model] == row.checkpoint
        assert inspect.signature(adapter).parameters["max_sequence_length"].default == row.text_length, model
        assert (row.video, row.audio, row.two_experts, row.conditioned) == \
            (adapter.video, adapter.audio, getattr(adapter, "two_experts", False), adapter.condition_images[1] != 0), \
            model
        assert (model in VIDEO_MODELS, model in TWO_EXPERT_MODELS, model in CONDITIONED_MODELS) == \
            (row.video, row.two_experts, row.conditioned)
    assert "wan2.2" in TWO_EXPERT_MODELS and "ltx2" in VIDEO_MODELS and "flux1-kontext" in CONDITIONED_MODELS


def test_an_incomplete_tiny_pipeline_in_the_cache_is_rebuilt(tmp_path, monkeypatch):
    """What two ranks building at once used to leave (an empty text_encoder/): never reused, rebuilt whole."""
    from common.models import _complete_pipeline, tiny_model_path
    from common.models.tiny_parts import TINY_VERSION

    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path))
    broken = tmp_path / f"tiny-flux1-v{TINY_VERSION}"
    shutil.copytree(_fresh_tiny(tmp_path / "other", "flux1"), broken)
    shutil.rmtree(broken / "text_encoder")
    (broken / "text_encoder").mkdir()
    assert not _complete_pipeline(broken)
    assert tiny_model_path("flux1") == broken and _complete_pipeline(broken)
    assert (broken / "text_encoder" / "model.safetensors").is_file()


def _fresh_tiny(cache, model):
    import os

    from common.models import tiny_model_path

    previous = os.environ["FLOWRL_CACHE"]
    os.environ["FLOWRL_CACHE"] = str(cache)
    try:
        return tiny_model_path(model)
    finally:
        os.environ["FLOWRL_CACHE"] = previous


@SLOW
def test_two_ranks_build_a_tiny_pipeline_once_and_whole(tmp_path):
    """Both ranks of a launch ask for the tiny Qwen-Image in an empty cache: the folder they leave holds every
    component (transformers saves only on rank 0 under torch.distributed; a rank-1 build lacked the text encoder)."""
    from common.models import _complete_pipeline
    from common.models.tiny_parts import TINY_VERSION

    result = run_script("tests/tiny_build_launch.py", "qwen-image", launcher=ACCELERATE_2CPU,
                        env={"FLOWRL_CACHE": str(tmp_path)})
    assert result.stdout.count(f"tiny-qwen-image-v{TINY_VERSION}") == 2
    built = tmp_path / f"tiny-qwen-image-v{TINY_VERSION}"
    assert _complete_pipeline(built) and any((built / "text_encoder").glob("*.safetensors"))
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary folder left beside it


def test_an_unset_text_length_is_the_model_s_own(monkeypatch):
    """--max-sequence-length unset is the length each model's stock pipeline encodes by default (its __call__'s
    max_sequence_length), in the training scripts, preprocess.py and evaluate.py alike (the embedding cache's key
    takes the scripts' value); a given length stays."""
    import inspect
    import sys

    import diffusers

    import evaluate
    import preprocess
    from common.cli import TrainArgs, parse_args
    from common.models import ADAPTERS

    # HunyuanVideo15Pipeline sets tokenizer_max_length = 1000 in its __init__; QwenImage21Pipeline never cuts a
    # prompt: the adapter's bound
    own = {"hunyuan-video-1.5": 1000, "hunyuan-video-1.5-i2v": 1000, "qwen-image-2.1": 512}
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # parse_args installs the one-line error hook
    for model, adapter in ADAPTERS.items():
        call = inspect.signature(getattr(diffusers, adapter.pipeline_class_name).__call__).parameters
        expected = call["max_sequence_length"].default if "max_sequence_length" in call else own[model]
        for args_class in (TrainArgs, preprocess.Args):
            monkeypatch.setattr(sys, "argv", ["script.py", "--model", model])
            assert parse_args(args_class, check=lambda args: None).max_sequence_length == expected, model
        assert evaluate.settings(evaluate.Args(model=model), None).max_sequence_length == expected, model
    monkeypatch.setattr(sys, "argv", ["script.py", "--model", "ltx2", "--max-sequence-length", "77"])
    assert parse_args(TrainArgs).max_sequence_length == 77
