"""The toy world (worlds/toy/, data/toy/): grammar and split, the reward's calibration on
ground truth, wrong prompts and noise, and the shipped pretrained pipeline with its pinned held-out score."""

import numpy as np
import pytest
import torch

from common.models import load_adapter, resolve_model_path
from common.sampling import sample, sample_generators
from common.utils import UserError
from rewards import load_rewards
from worlds.toy.reward import ToyReward
from worlds.toy.world import (MAX_SEQUENCE_LENGTH, RESOLUTION, load_toy_split, parse_prompt, render, render_batch,
                              toy_model_path, toy_prompts, toy_split, toy_words)

# The shipped model's held-out score under the pinned protocol of `test_shipped_model_held_out_score`
# (36 test prompts × seeds 0..3, Euler ODE, 8 steps), as measured when data/toy/model/ was made.
PINNED = {"strict": 0.4375, "partial": 0.8375}


def test_grammar_has_180_prompts_and_round_trips():
    prompts = toy_prompts()
    assert len(prompts) == len(set(prompts)) == 3 * 4 * 3 * 5
    assert {"a red circle", "two blue squares on the left", "three yellow triangles at the bottom"} <= set(prompts)
    for prompt in prompts:
        assert parse_prompt(prompt).text() == prompt
    for bad in ["a red circles", "two red circle", "four red circles", "a purple circle", "a red circle in the middle"]:
        with pytest.raises(ValueError):
            parse_prompt(bad)


def test_split_holds_out_36_and_keeps_every_word_in_training():
    train, test = load_toy_split()
    assert (train, test) == toy_split()  # the shipped files are the documented split
    assert len(test) == 36 and len(train) == 144 and not set(train) & set(test)
    assert set(train) | set(test) == set(toy_prompts())
    assert {word for prompt in train for word in prompt.split()} == toy_words()


def test_renderer_is_deterministic_and_places_objects_in_the_requested_half():
    first = render("three green triangles on the left", np.random.default_rng(3))
    assert first.shape == (RESOLUTION, RESOLUTION, 3) and first.dtype == np.uint8
    assert np.array_equal(first, render("three green triangles on the left", np.random.default_rng(3)))
    assert first[:, RESOLUTION // 2:].max() == 0 and first[:, :RESOLUTION // 2].max() > 200
    bottom = render("two red squares at the bottom", np.random.default_rng(4))
    assert bottom[:RESOLUTION // 2].max() == 0


@pytest.mark.parametrize("resolution", [32, 64])
def test_ground_truth_scores_one_on_every_prompt(resolution):
    prompts = toy_prompts() * (3 if resolution == 32 else 1)
    images = render_batch(prompts, np.random.default_rng(resolution), resolution)
    checks = ToyReward().checks(images, prompts)
    assert set(checks) == {"colour", "count", "shape", "position", "clean", "partial", "strict"}
    for name, values in checks.items():
        assert values.shape == (len(prompts),) and values.min() == 1.0, name


def test_wrong_prompts_and_noise_score_low():
    prompts = toy_prompts()
    rng = np.random.default_rng(0)
    images = render_batch(prompts, rng)
    wrong = [prompts[(i + int(rng.integers(1, len(prompts)))) % len(prompts)] for i in range(len(prompts))]
    reward = ToyReward()
    assert reward(images, wrong).mean() < 0.3
    assert ToyReward(mode="strict")(images, wrong).mean() < 0.05
    noise = torch.rand(len(prompts), 3, RESOLUTION, RESOLUTION, generator=torch.Generator().manual_seed(0))
    checks = reward.checks(noise, prompts)
    assert checks["strict"].max() == 0.0 and checks["partial"].mean() < 0.3
    assert ToyReward(mode="strict")(torch.zeros(2, 3, 32, 32), prompts[:2]).tolist() == [0.0, 0.0]


def test_each_check_catches_its_own_mistake():
    reward, rng = ToyReward(), np.random.default_rng(1)
    image = render_batch(["two red squares on the left"], rng)

    def failed(prompt, image=image):
        return {name for name, values in reward.checks(image, [prompt]).items() if values[0] < 1}

    assert failed("two red squares on the left") == set()
    assert failed("three red squares on the left") == {"count", "partial", "strict"}
    assert failed("two red circles on the left") == {"shape", "partial", "strict"}
    assert failed("two red squares on the right") == {"position", "partial", "strict"}
    assert failed("two blue squares on the left") == {"colour", "count", "shape", "position", "clean", "partial",
                                                     "strict"}
    extra = image + render_batch(["a green circle on the right"], rng)  # disjoint halves: the sum is clean
    assert failed("two red squares on the left", extra) == {"clean", "partial", "strict"}


def test_registered_and_modes():
    (toy,) = load_rewards(["toy,mode=strict"])
    images = render_batch(["a red circle", "a red circle"], np.random.default_rng(0))
    assert toy.name == "toy" and list(toy.score(images, ["a red circle", "a blue circle"])) == [1.0, 0.0]
    with pytest.raises(ValueError):
        ToyReward(mode="lenient")
    with pytest.raises(UserError, match=r"^--reward 'toy,mode=lenient': toy reward mode 'lenient' is not one of partial, "
                       r"strict, colour"):
        load_rewards(["toy,mode=lenient"])


def test_model_path_toy_resolves_to_the_shipped_folder():
    assert resolve_model_path("flux1", "toy") == str(toy_model_path())
    with pytest.raises(UserError, match="FLUX.1"):
        resolve_model_path("sd3", "toy")
    files = {p.relative_to(toy_model_path()).as_posix() for p in toy_model_path().rglob("*") if p.is_file()}
    assert "model_index.json" in files and not any(f.endswith((".bin", ".pt", ".pth", ".ckpt")) for f in files)
    assert sum(p.stat().st_size for p in toy_model_path().rglob("*") if p.is_file()) < 5e6


@pytest.fixture(scope="module")
def toy_adapter():
    return load_adapter("flux1", "toy", "cpu", torch.float32, resolution=RESOLUTION,
                        max_sequence_length=MAX_SEQUENCE_LENGTH)


def test_shipped_pipeline_loads_and_generates(toy_adapter):
    assert toy_adapter.latent_h == 16 and toy_adapter.image_ids.shape[0] == 64  # 64 packed image tokens
    cond = toy_adapter.encode_prompts(["a red circle", "three blue squares at the top"])
    assert cond["prompt_embeds"].shape == (2, MAX_SEQUENCE_LENGTH, 32)
    noise = toy_adapter.noise(sample_generators([0, 1], "cpu"))
    images = toy_adapter.decode(sample(lambda x, s: toy_adapter.velocity(x, s, cond), noise, toy_adapter.sigmas(4)))
    assert images.shape == (2, 3, RESOLUTION, RESOLUTION) and torch.isfinite(images).all()


def test_shipped_model_held_out_score(toy_adapter):
    """The base model's held-out success, pinned: 36 test prompts × seeds 0..3, Euler ODE with the adapter's
    `sigmas(8)`. A change here means the shipped weights, the sampler or the reward changed."""
    _, test = load_toy_split()
    prompts = [p for p in test for _ in range(4)]
    cond = toy_adapter.encode_prompts(prompts)
    noise = toy_adapter.noise(sample_generators([s for _ in test for s in range(4)], "cpu"))
    x0 = sample(lambda x, s: toy_adapter.velocity(x, s, cond), noise, toy_adapter.sigmas(8))
    checks = ToyReward().checks(toy_adapter.decode(x0), prompts)
    assert checks["strict"].mean() == pytest.approx(PINNED["strict"], abs=0.02)
    assert checks["partial"].mean() == pytest.approx(PINNED["partial"], abs=0.01)


def test_pretrain_continue_from_trains_only_the_transformer_of_a_shipped_pipeline(tmp_path):
    """worlds/toy/pretrain.py --continue-from (supervised fine-tuning, docs/results/toy-world.md "The ceiling"): the VAE and
    text encoders are kept byte for byte, the transformer is trained further, and the result loads as a pipeline."""
    from diffusers import FluxPipeline

    from conftest import REPO, run_script

    model, out = REPO / "data" / "toy" / "model", tmp_path / "sft"
    run_script("worlds/toy/pretrain.py", "--continue-from", model, "--out", out, "--steps", "3", "--pool", "1",
               "--batch", "4", "--warmup", "1", timeout=600)
    for part in ("vae", "text_encoder", "text_encoder_2"):
        (name,) = [p.name for p in (model / part).glob("*.safetensors")]
        assert (out / part / name).read_bytes() == (model / part / name).read_bytes(), part
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (out / weights).read_bytes() != (model / weights).read_bytes()
    assert isinstance(FluxPipeline.from_pretrained(out), FluxPipeline)
