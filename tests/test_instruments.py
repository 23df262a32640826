"""The throughput instruments: --attention-backend (diffusers' set_attention_backend on every transformer, refused
with one line where it cannot run) and the FLOPs count behind metrics.jsonl's `tflops` / `mfu`, checked against
torch's own FlopCounterMode on every tiny model, forward and LoRA / full backward."""

import copy
import typing

import pytest
import torch
from PIL import Image
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from common.cli import AttentionBackend
from common.flops import FlopCounter, default_peak_tflops
from common.models import ADAPTERS, MODELS, load_adapter, tiny_model_path
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import SLOW, read_metrics, run_script, script_error

FAST_MODELS = ("flux1", "wan2.2")  # the fast tier: one image model, and the two-expert video model


@pytest.fixture(autouse=True)
def restore_the_default_attention_backend():
    """set_attention_backend makes its backend the process's default: the later tests of this worker get theirs."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    yield
    _AttentionBackendRegistry.set_active_backend(default)


def tiny_adapter(model):
    video = ADAPTERS[model].video
    return load_adapter(model, tiny_model_path(model), "cpu", torch.float32, 32 if video else 64,
                        512 if model == "wan-i2v" else 32, condition_size=32 if model == "flux1-kontext" else None)


def batch(adapter):
    texts = ["a cat", "a dog"]
    if adapter.condition_images[1] != 0:
        cond = adapter.encode_prompts(texts, [[Image.new("RGB", (32, 32), (200, 10, 10))]] * 2)
    else:
        cond = adapter.encode_prompts(texts)
    guidance = 1.0 if adapter.true_cfg else adapter.default_guidance_scale
    return adapter.noise(sample_generators([0, 1], "cpu")), cond, guidance


def torch_count(fn) -> int:
    """FlopCounterMode's total; attention through the math kernel, which it counts (its CPU flash kernel it
    does not)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


# ---- FLOPs -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [m if m in FAST_MODELS else pytest.param(m, marks=SLOW) for m in MODELS])
def test_forward_and_lora_backward_counts_equal_torchs_flop_counter(model):
    adapter = tiny_adapter(model)
    x, cond, guidance = batch(adapter)
    counter = FlopCounter()
    counter.attach(adapter.transformer, adapter=adapter)
    with torch.no_grad():
        expected = torch_count(lambda: adapter.velocity(x, 0.6, cond, guidance))
    assert expected > 0 and counter.take() == expected
    add_lora(adapter.transformer, 4, 4, adapter.lora_target_modules)
    counter.attach(adapter.transformer, adapter=adapter)  # the new LoRA factors; the hooked layers are not hooked twice
    expected = torch_count(lambda: adapter.velocity(x, 0.6, cond, guidance).square().mean().backward())
    assert counter.take() == expected


def test_full_backward_checkpointing_copies_and_pauses():
    adapter = tiny_adapter("flux1")
    x, cond, guidance = batch(adapter)
    transformer = adapter.transformer.requires_grad_(True)
    counter = FlopCounter()
    counter.attach(transformer, adapter=adapter)
    step = lambda: adapter.velocity(x, 0.6, cond, guidance).square().mean().backward()  # noqa: E731
    expected = torch_count(step)
    assert counter.take() == expected
    # a frozen deepcopy (a full fine-tune's reference) counts into the same counter, and only its forward
    frozen = copy.deepcopy(transformer).requires_grad_(False)
    counter.attach(frozen, adapter=adapter)
    with torch.no_grad():
        forward = torch_count(lambda: adapter.velocity(x, 0.6, cond, guidance, transformer=frozen))
    assert counter.take() == forward and 0 < forward < expected
    # gradient checkpointing recomputes the blocks in the backward: not counted, so the same work as without it
    transformer.enable_gradient_checkpointing()
    transformer.train()
    step()
    assert counter.take() == expected
    with counter.paused(), torch.no_grad():
        adapter.velocity(x, 0.6, cond, guidance)
    assert counter.take() == 0
    counter.detach()  # the hooks of the modules it attached to are gone (a deepcopy keeps its copies of them)
    assert not any(hasattr(m, "_flop_counter_hooked") for m in transformer.modules())
    step()
    assert counter.take() == 0


def test_default_peak_by_device_name(monkeypatch):
    assert default_peak_tflops(torch.device("cpu")) is None
    for name, peak in [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce GTX 1080", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert default_peak_tflops(torch.device("cuda", 0)) == peak


def test_a_run_logs_tflops_and_mfu_against_the_given_peak(tmp_path):
    out = tmp_path / "run"
    run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--eval-every", "0", "--peak-tflops", "0.002",
               "--output-dir", out)
    (metrics,) = read_metrics(out)
    assert metrics["tflops"] > 0
    assert metrics["mfu"] == pytest.approx(metrics["tflops"] / 0.002, rel=1e-12)
    assert script_error("algos/grpo.py", "--peak-tflops", "0") == "error: --peak-tflops must be positive, got 0.0"


# ---- attention backends ------------------------------------------------------------------------------------------

def test_backend_names_are_diffusers():
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert set(typing.get_args(AttentionBackend)) == {name.value for name in AttentionBackendName}


@pytest.mark.parametrize("model", FAST_MODELS)
def test_a_backend_reaches_every_transformer_and_keeps_the_velocity(model):
    adapter = tiny_adapter(model)
    x, cond, guidance = batch(adapter)
    with torch.no_grad():
        default = adapter.velocity(x, 0.6, cond, guidance)
        adapter.set_attention_backend("_native_math")
        math = adapter.velocity(x, 0.6, cond, guidance)
    names = [n for n in adapter.model_components if n.startswith("transformer")]
    assert len(names) == (2 if model == "wan2.2" else 1)
    backends = {str(getattr(m.processor, "_attention_backend", "missing")) for n in names
                for m in getattr(adapter.pipe, n).modules() if getattr(m, "processor", None) is not None}
    assert backends == {"AttentionBackendName._NATIVE_MATH"}
    torch.testing.assert_close(math, default, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model, backend, says", [
    ("flux1", "flash", "flash-attn"),          # the package is missing
    ("flux1", "_native_cudnn", "cpu"),         # a CUDA kernel: found by the small attention call
    ("sd3", "native", "do not go through diffusers' attention dispatcher")])
def test_a_backend_that_cannot_run_is_refused_with_one_line(model, backend, says):
    adapter = tiny_adapter(model)
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    default = _AttentionBackendRegistry.get_active_backend()[0]
    with pytest.raises(UserError) as error:
        adapter.set_attention_backend(backend)
    assert _AttentionBackendRegistry.get_active_backend()[0] == default  # a refused backend leaves no trace
    message = str(error.value)
    assert "\n" not in message and says in message, message
    assert backend in message or model == "sd3"  # SD3 refuses every backend alike, naming the flag


def test_the_scripts_refuse_an_unknown_or_unusable_backend():
    unknown = script_error("algos/nft.py", "--attention-backend", "flsh")
    assert "flsh" in unknown and "native" in unknown and "sage" in unknown
    unusable = script_error("algos/grpo.py", "--preset", "tiny", "--attention-backend", "flash")
    assert unusable.startswith("error: --attention-backend flash cannot run training on cpu"), unusable
    sampling = script_error("evaluate.py", "--model-path", "tiny", "--attention-backend", "flash")
    assert sampling.startswith("error: --attention-backend flash cannot run on cpu"), sampling  # no backward there


def test_a_run_on_the_native_backend_equals_one_without_the_flag(tmp_path):
    """Checking the backend draws nothing from the RNG, and `native` is the default kernel: the same run."""
    runs = []
    for name, flags in (("default", []), ("native", ["--attention-backend", "native"])):
        run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--eval-every", "0", *flags,
                   "--output-dir", tmp_path / name)
        runs.append([{k: v for k, v in m.items() if not k.endswith(("_time_s", "tflops", "mfu", "peak_memory_gb"))}
                     for m in read_metrics(tmp_path / name)])
    assert runs[0] == runs[1]
