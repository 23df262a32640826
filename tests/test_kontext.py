"""FLUX.1 Kontext (`--model flux1-kontext`) on its tiny pipeline: parity with `FluxKontextPipeline` (a fixed
condition size and the pipeline's own preferred-resolution resize), a LoRA that the stock pipeline loads, the
embedding cache holding the condition latents (cached = online, bitwise; a changed image file is a new entry)."""

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from peft import get_peft_model_state_dict
from PIL import Image

from common.cache import PromptEncoder, build_cache, cache_entries, fingerprint_inputs, open_cache
from common.data import Prompt, load_prompts
from common.models import load_adapter
from common.sampling import sample_generators
from common.training import add_lora
from conftest import SLOW, ode_sample

RESOLUTION, GUIDANCE = 32, 2.5


def scene(colour, size=(32, 32), box=(4, 8, 20, 24)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(colour, box)
    return image


@pytest.fixture(scope="module")
def path():
    from common.models import tiny_model_path

    return tiny_model_path("flux1-kontext")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two prompts, each with its condition image (relative paths, as a dataset gives them)."""
    folder = tmp_path_factory.mktemp("edits")
    (folder / "images").mkdir()
    scene((200, 30, 30)).save(folder / "images" / "red.png")
    scene((30, 30, 200), box=(10, 2, 30, 14)).save(folder / "images" / "blue.webp", lossless=True)
    (folder / "train.jsonl").write_text('{"prompt": "make it green", "image": "images/red.png"}\n'
                                        '{"prompt": "move it left", "images": ["images/blue.webp"]}\n')
    return folder


def adapter_of(path, **kwargs):
    kwargs.setdefault("condition_size", 32)
    return load_adapter("flux1-kontext", str(path), "cpu", torch.float32, RESOLUTION, max_sequence_length=32, **kwargs)


def stock(path, records, steps, seeds, output_type, lora=None, auto_resize=False):
    pipe = FluxKontextPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    outputs = []
    for record, seed in zip(records, seeds):  # one call per condition image: the pipeline takes one per batch
        (image,) = [Image.open(p).convert("RGB") for p in record.images]
        outputs.append(pipe(image=image, prompt=record.prompt, guidance_scale=GUIDANCE, height=RESOLUTION,
                            width=RESOLUTION, num_inference_steps=steps, max_sequence_length=32,
                            generator=sample_generators([seed], "cpu"), output_type=output_type,
                            max_area=RESOLUTION ** 2, _auto_resize=auto_resize).images)
    return torch.cat(outputs)


def test_ode_rollout_reproduces_the_kontext_pipeline(path, dataset):
    records = load_prompts(dataset, "train")
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    assert cond["image_latents"].shape == (2, 4, 16) and cond["image_ids"].shape == (2, 4, 3)
    ours = ode_sample(adapter, cond, 6, [3, 4], GUIDANCE)
    theirs = stock(path, records, 6, [3, 4], "latent")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    torch.testing.assert_close(adapter.decode(ours), stock(path, records, 6, [3, 4], "pt"), rtol=0, atol=1e-5)
    # The condition matters: the same prompts and noise with the two images swapped give other edits.
    swapped = PromptEncoder(adapter)([Prompt(r.prompt, images=o.images, image_digests=o.image_digests)
                                      for r, o in zip(records, records[::-1])])
    assert (ode_sample(adapter, swapped, 6, [3, 4], GUIDANCE) - ours).abs().max() > 1e-3


def test_default_condition_size_is_the_pipelines_preferred_resolution(path, dataset):
    """No --condition-size: a 32×32 condition becomes 1024×1024 (the preferred Kontext resolution of aspect 1),
    4096 condition tokens, as `FluxKontextPipeline` does by default."""
    records = load_prompts(dataset, "train")[:1]
    adapter = adapter_of(path, condition_size=None)
    assert adapter.condition_shape(48, 32) == (832, 1248) and adapter.condition_shape(32, 32) == (1024, 1024)
    cond = PromptEncoder(adapter)(records)
    assert cond["image_latents"].shape == (1, 64 * 64, 16)
    torch.testing.assert_close(ode_sample(adapter, cond, 2, [5], GUIDANCE),
                               stock(path, records, 2, [5], "latent", auto_resize=True), rtol=0, atol=2e-5)


def test_saved_lora_loads_into_the_pipeline_and_reproduces_our_model(path, dataset, tmp_path):
    records = load_prompts(dataset, "train")
    adapter = adapter_of(path)
    cond = PromptEncoder(adapter)(records)
    add_lora(adapter.transformer, 4, 8, adapter.lora_target_modules)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    adapter.save_lora(tmp_path, get_peft_model_state_dict(adapter.transformer))
    ours = ode_sample(adapter, cond, 4, [1, 2], GUIDANCE)
    base = stock(path, records, 4, [1, 2], "latent")
    theirs = stock(path, records, 4, [1, 2], "latent", lora=tmp_path)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    assert (theirs - base).abs().max() > 0.01


def test_cache_holds_the_condition_latents_bitwise_and_a_changed_image_is_a_new_entry(path, dataset, tmp_path):
    from accelerate import Accelerator

    records = load_prompts(dataset, "train")
    entries = cache_entries(records, [], with_negatives=False)
    assert [text for text, _ in entries.values()] == ["make it green", "move it left"]
    inputs = fingerprint_inputs("flux1-kontext", str(path), 32, torch.float32, list(entries),
                                condition={"resolution": RESOLUTION, "condition_size": 32})
    encoder_only = adapter_of(path, text_only=True)  # preprocess.py's load: text encoders and the VAE
    assert not hasattr(encoder_only, "transformer")
    build_cache(Accelerator(cpu=True), encoder_only, entries, tmp_path, inputs, shard_size=1, progress=False)
    cache = open_cache(tmp_path, inputs, explicit=True)
    online = PromptEncoder(adapter_of(path))(records)
    trainer = adapter_of(path, load_text_encoders=False)
    cached = PromptEncoder(trainer, cache)(records)
    assert cached.keys() == online.keys() >= {"image_latents", "image_ids", "prompt_embeds"}
    assert all(torch.equal(cached[k], online[k]) for k in cached)
    assert trainer.text_encoders == []
    # Rewriting an image file changes its record's entry: the old cache has no entry for it (and its fingerprint
    # differs, so a training run would not pick it).
    scene((0, 160, 0)).save(dataset / "images" / "red.png")
    changed = load_prompts(dataset, "train")
    assert changed[0].entry() != records[0].entry() and changed[1].entry() == records[1].entry()
    assert changed[0].entry() not in cache and records[0].entry() in cache
    assert fingerprint_inputs("flux1-kontext", str(path), 32, torch.float32,
                              list(cache_entries(changed, [], False)), inputs["condition"]) != inputs
    scene((200, 30, 30)).save(dataset / "images" / "red.png")  # back, for the other tests of the module
    assert np.array_equal(np.asarray(Image.open(dataset / "images" / "red.png")), np.asarray(scene((200, 30, 30))))


@pytest.mark.parametrize("train,flags,message", [
    ('{"prompt": "make it green", "image": "images/red.png"}\n', ["--model", "flux1"],
     "train.jsonl:1: has a condition image, but flux1 is a text-only model"),
    ('{"prompt": "make it green"}\n', ["--model", "flux1-kontext"],
     "train.jsonl:1: flux1-kontext needs a condition image"),
    ('{"prompt": "a", "image": "images/red.png"}\n{"prompt": "b", "image": "images/none.png"}\n',
     ["--model", "flux1-kontext"], "train.jsonl:2: condition image 'images/none.png' does not exist"),
    ('{"prompt": "a", "image": "images/red.png"}\n{"prompt": "b", "image": "images/wide.png"}\n',
     ["--model", "flux1-kontext"], "train.jsonl:2: its condition image becomes 1248×832 but"),
    ('{"prompt": "a", "image": "images/red.png"}\n', ["--model", "flux1-kontext", "--condition-size", "20"],
     "--condition-size 20 is not a positive multiple of 16"),
    ('{"prompt": "a"}\n', ["--model", "flux1", "--condition-size", "32"], "--condition-size applies to conditioned"),
])
def test_bad_conditions_stop_every_script_before_anything_is_written(dataset, tmp_path, train, flags, message):
    from conftest import script_error

    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    scene((200, 30, 30)).save(folder / "images" / "red.png")
    scene((30, 30, 200), size=(48, 32)).save(folder / "images" / "wide.png")
    (folder / "train.jsonl").write_text(train)
    (folder / "test.jsonl").write_text(train.splitlines()[0] + "\n")
    error = script_error("algos/nft.py", "--preset", "tiny", "--model-path", "tiny", "--resolution", "32",
                         "--prompts-per-epoch", "1",
                         "--dataset", folder, *flags, "--output-dir", tmp_path / "out")
    assert message in error, error
    # nothing written but the lock file (a real process also removes both at exit; in-process, atexit has not run)
    assert not (tmp_path / "out").exists() or {p.name for p in (tmp_path / "out").iterdir()} <= {".lock"}


@SLOW
def test_two_processes_train_on_conditions(tmp_path, edit_dataset):
    """grpo on flux1-kontext under 2 processes equals the one-process run (the K samples of a prompt share its
    condition, whichever process draws them)."""
    from conftest import ACCELERATE_2CPU, read_metrics, run_script

    args = ["--preset", "tiny", "--model", "flux1-kontext", "--model-path", "tiny", "--resolution", "32",
            "--condition-size", "32", "--dataset", edit_dataset, "--epochs", "2", "--prompts-per-epoch", "2",
            "--group-size", "4", "--batch-size", "4", "--num-steps", "4", "--updates-per-epoch", "1",
            "--eval-every", "1", "--eval-num-prompts", "2", "--max-sequence-length", "16", "--save-every", "0"]
    run_script("algos/grpo.py", *args, "--output-dir", tmp_path / "one")
    run_script("algos/grpo.py", *args, "--output-dir", tmp_path / "two", launcher=ACCELERATE_2CPU, timeout=300)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [m["num_processes"] for m in two] == [2, 2]
    for a, b in zip(one, two):
        for key in ("reward_mean", "eval_reward_mean", "loss", "grad_norm", "ratio_dev_first"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key


@SLOW
def test_preprocess_caches_conditions_and_training_from_it_equals_online(tmp_path, edit_dataset):
    """preprocess.py stores the condition latents with the text embeddings; a run that finds the cache loads no
    text encoder and logs what the online run logs."""
    from conftest import read_metrics, run_script

    shape = ["--model", "flux1-kontext", "--model-path", "tiny", "--dataset", edit_dataset, "--resolution", "32",
             "--condition-size", "32", "--max-sequence-length", "16"]
    result = run_script("preprocess.py", *shape, "--cache-dir", tmp_path / "cache")
    assert "encoded 6 entries" in result.stdout, result.stdout
    args = [*shape, "--preset", "tiny", "--epochs", "2", "--prompts-per-epoch", "2", "--group-size", "4",
            "--batch-size", "4", "--num-steps", "4", "--train-timesteps", "2", "--eval-every", "1",
            "--eval-num-prompts", "2", "--save-every", "0"]
    cached = run_script("algos/nft.py", *args, "--cache-dir", tmp_path / "cache", "--output-dir", tmp_path / "c")
    assert f"prompt embeddings: {tmp_path / 'cache'}" in cached.stdout
    run_script("algos/nft.py", *args, "--no-cache", "--output-dir", tmp_path / "o")
    measured = ("_time_s", "tflops", "mfu", "peak_memory_gb")
    strip = lambda ms: [{k: v for k, v in m.items() if not k.endswith(measured)}  # noqa: E731
                        for m in ms]
    assert strip(read_metrics(tmp_path / "c")) == strip(read_metrics(tmp_path / "o"))
    # Another condition size is another cache: the explicit one is refused as stale, naming what differs.
    stale = run_script("algos/nft.py", *args, "--condition-size", "16", "--cache-dir", tmp_path / "cache",
                       "--output-dir", tmp_path / "s", check=False)
    assert stale.returncode == 2 and "differs in: condition" in stale.stderr, stale.stderr
