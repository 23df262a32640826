"""Wan2.2 image-to-video A14B (`--model wan2.2-i2v`) on its tiny pipeline: Wan2.1 I2V's first-frame condition
(tests/test_wan_i2v.py) with Wan2.2's two experts (tests/test_wan22.py). Parity with `WanImageToVideoPipeline`
(each expert at its own CFG scale), the ratio invariant, both LoRA files loading into the stock pipeline, the cache
(cached = online, bitwise), and one-line refusals; plus the 512-token padding that lets Wan2.1 I2V run the tiny
preset's --max-sequence-length."""

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, condition_inputs, fingerprint_inputs, open_cache
from common.checkpoint import LORA_FILE_2
from common.data import Prompt, check_conditions, load_images, load_prompts
from common.distributed import lora_state_dict
from common.dynamics import sde_step
from common.models import ADAPTERS, load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from common.utils import UserError
from conftest import SLOW, ode_sample, read_metrics, run_script, sde_trajectory

RESOLUTION, FRAMES = 32, 5
GUIDANCE = (4.0, 2.0)  # (high, low): unequal, so that a sample sent to the wrong expert's scale shows


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("wan2.2-i2v")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("i2v22")
    (folder / "images").mkdir()
    for name, colour, size, box in (("red", (200, 30, 30), (48, 40), (4, 8, 20, 24)),
                                    ("blue", (30, 30, 200), (40, 56), (10, 2, 30, 14))):
        image = Image.new("RGB", size, "white")
        image.paste(colour, box)
        image.save(folder / "images" / f"{name}.png")
    (folder / "train.jsonl").write_text(
        '{"prompt": "the cat walks away", "negative_prompt": "blurry, static", "image": "images/red.png"}\n'
        '{"prompt": "a ball rolls", "image": "images/blue.png"}\n')
    return load_prompts(folder, "train")


def adapter_of(path, **kwargs):
    kwargs.setdefault("num_frames", FRAMES)
    return load_adapter("wan2.2-i2v", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=32, **kwargs)


@pytest.fixture(scope="module")
def adapter(path):
    return adapter_of(path)


def stock(path, records, guidance, steps, seeds, output_type, lora=None):
    """The pipeline's own generation, one call per condition image; UniPC at order 1 without the corrector is our
    Euler step (tests/test_adapters.py)."""
    pipe = WanImageToVideoPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
        pipe.load_lora_weights(str(lora), weight_name=LORA_FILE_2, load_into_transformer_2=True)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, solver_order=1,
                                                         disable_corrector=list(range(steps)))
    high, low = guidance
    outputs = []
    for record, seed in zip(records, seeds):
        (image,) = load_images(record.images)
        outputs.append(pipe(image=image, prompt=record.prompt, negative_prompt=record.negative_prompt,
                            height=RESOLUTION, width=RESOLUTION, num_frames=FRAMES, num_inference_steps=steps,
                            guidance_scale=high, guidance_scale_2=low, generator=sample_generators([seed], "cpu"),
                            output_type=output_type, max_sequence_length=32).frames)
    return torch.cat(outputs)


def test_ode_rollout_reproduces_the_pipeline_with_both_experts(adapter, path, records):
    cond = PromptEncoder(adapter)(records)
    # No CLIP tokens (the transformer has no image projection); the prompt keeps its own length.
    assert cond.keys() == {f"{p}{k}" for p in ("", "negative_") for k in ("prompt_embeds", "image_condition")}
    assert cond["prompt_embeds"].shape == (2, 32, 32)
    assert cond["image_condition"].shape == (2, 4 + 4, 2, 4, 4)
    t = adapter._timestep(adapter.sigmas(4)[:-1])
    assert (t >= 900).any() and (t < 900).any()  # both experts run
    finals = {}
    for guidance in ((1.0, 1.0), GUIDANCE):
        finals[guidance] = ode_sample(adapter, cond, 4, [3, 4], guidance)
        theirs = stock(path, records, guidance, 4, [3, 4], "latent")
        torch.testing.assert_close(finals[guidance], theirs, rtol=0, atol=2e-5)
    assert (finals[(1.0, 1.0)] - finals[GUIDANCE]).abs().max() > 0.05  # the guided path was tested
    # The low-noise expert's own scale matters: one scale for both gives other latents.
    assert (ode_sample(adapter, cond, 4, [3, 4], GUIDANCE[0]) - finals[GUIDANCE]).abs().max() > 1e-3
    videos = adapter.decode(finals[GUIDANCE])
    torch.testing.assert_close(videos, stock(path, records, GUIDANCE, 4, [3, 4], "pt"), rtol=0, atol=1e-5)


def test_ratio_is_exactly_one_across_the_boundary(adapter, records):
    cond = PromptEncoder(adapter)(records * 2)
    sigmas = adapter.sigmas(4)
    latents, next_latents, log_probs = sde_trajectory(adapter, cond, sigmas, range(4), "flow-sde", 0.7, GUIDANCE)
    for j in range(4):
        v = adapter.velocity(latents[:, j], sigmas[j], cond, GUIDANCE)
        _, log_prob, _, _ = sde_step("flow-sde", v, latents[:, j], sigmas[j], sigmas[j + 1], 0.7,
                                     prev_sample=next_latents[:, j])
        assert (torch.exp(log_prob - log_probs[:, j]) - 1).abs().max() < 1e-6
    # A mixed batch (one sample per expert) equals each sample alone.
    x, pair = latents[:2, 1], {k: v[:2] for k, v in cond.items()}
    both = adapter.velocity(x, torch.tensor([0.95, 0.5]), pair, GUIDANCE)
    for i, sigma in enumerate((0.95, 0.5)):
        alone = adapter.velocity(x[i:i + 1], sigma, {k: v[i:i + 1] for k, v in cond.items()}, GUIDANCE)
        torch.testing.assert_close(both[i:i + 1], alone, rtol=0, atol=1e-6)


def test_saved_lora_files_load_into_the_pipeline_and_reproduce_our_model(path, records, tmp_path):
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    torch.manual_seed(0)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapter.save_lora(tmp_path, lora_state_dict(adapter.transformer, adapter.transformer.state_dict()))
    assert (tmp_path / LORA_FILE_2).exists()
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE)
    base = stock(path, records, GUIDANCE, 4, [1, 2], "latent")
    theirs = stock(path, records, GUIDANCE, 4, [1, 2], "latent", lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 0.01


def test_cache_equals_online_bitwise(adapter, path, records, tmp_path):
    from accelerate import Accelerator

    entries = cache_entries(records, [], with_negatives=True)
    condition = condition_inputs("wan2.2-i2v", RESOLUTION, None, FRAMES)
    inputs = fingerprint_inputs("wan2.2-i2v", str(path), 32, torch.float32, list(entries), condition)
    encoder_only = adapter_of(path, text_only=True)  # UMT5 and the VAE; neither expert
    assert not hasattr(encoder_only, "transformer") and encoder_only.pipe.transformer_2 is None
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=2, progress=False)
    trainer = adapter_of(path, load_text_encoders=False)
    cached = PromptEncoder(trainer, open_cache(tmp_path, inputs, explicit=True))(records)
    online = PromptEncoder(adapter)(records)
    assert cached.keys() == online.keys() and all(torch.equal(cached[k], online[k]) for k in cached)
    x = adapter.noise(sample_generators([0, 1], "cpu"))
    assert torch.equal(trainer.velocity(x, 0.6, cached, GUIDANCE), adapter.velocity(x, 0.6, online, GUIDANCE))


def test_bad_input_and_the_other_wan_checkpoints_are_refused_with_one_line(path, records):
    from common.models import tiny_model_path

    cases = [(lambda: adapter_of(path, num_frames=6), "num_frames 6 is not 4k \\+ 1"),
             (lambda: adapter_of(path, condition_size=64), "--condition-size 64 differs from --resolution 32"),
             (lambda: adapter_of(tiny_model_path("wan-i2v")),
              "is a single-transformer \\(Wan2.1\\) image-to-video checkpoint: use --model wan-i2v"),
             (lambda: load_adapter("wan-i2v", str(path), "cpu", torch.float32, RESOLUTION, num_frames=FRAMES),
              "is a Wan2.2 two-expert image-to-video checkpoint: use --model wan2.2-i2v")]
    # A prompt without its first frame: the check setup.py and preprocess.py run before loading anything.
    text_only = [Prompt("a cat", "", (), (), source="train.txt:1")]
    cases.append((lambda: check_conditions(text_only, *ADAPTERS["wan2.2-i2v"].condition_images, "wan2.2-i2v"),
                  'train.txt:1: wan2.2-i2v needs a condition image \\("image": "path"\\) on every line'))
    for make, message in cases:
        with pytest.raises(UserError, match=message) as error:
            make()
        assert "\n" not in str(error.value)


def test_wan21_i2v_pads_a_short_prompt_to_the_512_text_tokens(records):
    """--preset tiny's --max-sequence-length 32 on Wan2.1 I2V: the prompt is cut at 32 tokens and zero-padded to
    the 512 rows its attention splits at, so for a prompt of ≤ 32 tokens the velocity is the one at 512."""
    from common.models import tiny_model_path

    path = tiny_model_path("wan-i2v")
    short, full = (load_adapter("wan-i2v", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=n,
                                num_frames=FRAMES) for n in (32, 512))
    a, b = PromptEncoder(short)(records), PromptEncoder(full)(records)
    assert a["prompt_embeds"].shape == b["prompt_embeds"].shape == (2, 512, 32)
    assert (a["prompt_embeds"][:, 32:] == 0).all()
    x = full.noise(sample_generators([0, 1], "cpu"))
    torch.testing.assert_close(short.velocity(x, 0.6, a, 5.0), full.velocity(x, 0.6, b, 5.0), rtol=0, atol=1e-5)
    with pytest.raises(UserError, match="max_sequence_length 600 is not in 1..512, as Wan I2V requires"):
        load_adapter("wan-i2v", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=600)


def test_conditioned_models_default_to_the_toy_edit_dataset(monkeypatch):
    """--preset tiny runs a conditioned model as it is: unset, --dataset is data/toy_edit (prompts with condition
    images) for them and data/prompts for the others."""
    from common.cli import TrainArgs, parse_args
    from common.data import DEFAULT_CONDITIONED_DATASET, DEFAULT_DATASET

    for model, dataset in (("wan2.2-i2v", DEFAULT_CONDITIONED_DATASET), ("wan-i2v", DEFAULT_CONDITIONED_DATASET),
                           ("wan", DEFAULT_DATASET)):
        monkeypatch.setattr("sys.argv", ["grpo.py", "--model", model])
        assert parse_args(TrainArgs, {}).dataset == dataset
    monkeypatch.setattr("sys.argv", ["grpo.py", "--model", "wan-i2v", "--dataset", "mine"])
    assert parse_args(TrainArgs, {}).dataset == "mine"


@SLOW
def test_two_processes_run_the_tiny_preset_as_it_is(tmp_path):
    """`--preset tiny --model wan2.2-i2v --model-path tiny` with the default dataset, on two processes, each backward
    through one expert (GRPO trains one step per backward)."""
    from conftest import ACCELERATE_2CPU

    args = ["--preset", "tiny", "--model", "wan2.2-i2v", "--model-path", "tiny", "--resolution", "32", "--num-frames",
            "5", "--epochs", "1", "--prompts-per-epoch", "1", "--group-size", "4", "--batch-size", "2", "--num-steps",
            "4", "--updates-per-epoch", "1", "--eval-every", "0"]
    run_script("algos/grpo.py", *args, "--output-dir", tmp_path, launcher=ACCELERATE_2CPU)
    (metrics,) = read_metrics(tmp_path)
    assert metrics["num_processes"] == 2 and metrics["grad_norm"] > 0
