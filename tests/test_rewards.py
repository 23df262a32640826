"""Reward catalogue: CLIP-based rewards on tiny random CLIPs (real transformers classes, saved and loaded through
the same code path as the published checkpoints) against independent computations from the model's own outputs;
JPEG; spec parsing; shared backbones; custom rewards by import path; failing rewards; multi-reward aggregation;
groupwise rewards over two processes."""

import gc
import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from common.advantages import compute_advantages
from common.utils import UserError
from conftest import ACCELERATE_2CPU, SLOW, read_metrics, run_script
from rewards import load_rewards, parse_reward_spec, score_samples
from rewards.clip import build_tiny_clip


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-clip")
    build_tiny_clip(folder, seed=1)
    return folder


def quantised_images(count, seed=0, size=40):
    """Images already on the 1/255 grid, so every path (PIL, PNG over HTTP) sees exactly these pixels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, size, size), generator=generator).float() / 255


def independent_clip(folder, images, prompts):
    """Fresh model + processor; the model's forward gives normalised embeddings and logit_scale; numpy float64."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    pixels = np.round(images.numpy() * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    inputs = processor(text=prompts, images=[Image.fromarray(p) for p in pixels], padding=True,
                       truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    text, image = out.text_embeds.double().numpy(), out.image_embeds.double().numpy()
    return text, image, float(model.logit_scale.detach().exp()), model


PROMPTS = ["a red cube", 'a sign that says "open"', "two dogs on a beach", "x", "a long prompt " * 30]


def test_pickscore_and_clip_match_independent_computation(clip_dir):
    images = quantised_images(len(PROMPTS))
    text, image, scale, _ = independent_clip(clip_dir, images, PROMPTS)
    cosine = (text * image).sum(1)
    pickscore, clip = load_rewards([f"pickscore,path={clip_dir}", f"clip:0.5,path={clip_dir},batch_size=2"])
    assert (pickscore.name, pickscore.weight, clip.name, clip.weight) == ("pickscore", 1.0, "clip", 0.5)
    raw = score_samples([pickscore, clip], images, PROMPTS, torch.arange(len(PROMPTS)))
    assert raw.shape == (len(PROMPTS), 2) and raw.dtype == torch.float64
    np.testing.assert_allclose(raw[:, 0].numpy(), scale * cosine / 26, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(raw[:, 1].numpy(), cosine, rtol=1e-4, atol=1e-6)
    assert np.abs(cosine).max() > 1e-3  # the comparison is not between two near-zero vectors


def test_aesthetic_matches_independent_mlp_from_pth_safetensors_and_folder(clip_dir, tmp_path):
    from safetensors.torch import save_file

    images = quantised_images(4, seed=3)
    _, image, _, _ = independent_clip(clip_dir, images, ["x"] * 4)
    torch.manual_seed(5)
    sizes = [768, 1024, 128, 64, 16, 1]
    state = {}
    for index, (n_in, n_out) in zip([0, 2, 4, 6, 7], zip(sizes, sizes[1:])):
        state[f"layers.{index}.weight"] = torch.randn(n_out, n_in) / n_in ** 0.5
        state[f"layers.{index}.bias"] = torch.randn(n_out)
    torch.save(state, tmp_path / "head.pth")
    save_file(state, tmp_path / "head.safetensors")
    (tmp_path / "folder").mkdir()
    torch.save(state, tmp_path / "folder" / "aesthetic-model.pth")
    expected = image  # LAION's head is linear layers only (dropout is off in eval)
    for index in [0, 2, 4, 6, 7]:
        expected = expected @ state[f"layers.{index}.weight"].double().numpy().T + state[f"layers.{index}.bias"].double().numpy()
    for head in ["head.pth", "head.safetensors", "folder"]:
        (reward,) = load_rewards([f"aesthetic,path={clip_dir},head={tmp_path / head}"])
        scores = score_samples([reward], images, ["x"] * 4, torch.zeros(4))[:, 0].numpy()
        np.testing.assert_allclose(scores, expected[:, 0], rtol=1e-4, atol=1e-5)


def test_reward_model_runs_in_given_dtype(clip_dir):
    images = quantised_images(3)
    (full,) = load_rewards([f"clip,path={clip_dir}"])
    (half,) = load_rewards([f"clip,path={clip_dir}"], dtype=torch.bfloat16)
    assert next(half.score.model.parameters()).dtype == torch.bfloat16
    assert next(full.score.model.parameters()).dtype == torch.float32
    a, b = (score_samples([r], images, PROMPTS[:3], torch.zeros(3))[:, 0] for r in (full, half))
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=0, atol=0.05 * float(a.abs().max()))  # bf16 rounding


def test_pickscore_rank_is_the_rank_within_each_group(clip_dir):
    images, prompts = quantised_images(12, seed=7), ["a cat"] * 6 + ["a dog"] * 6
    group_ids = torch.tensor([3, 9] * 6)  # interleaved groups of K = 6
    pickscore, rank = load_rewards([f"pickscore,path={clip_dir}", f"pickscore_rank,path={clip_dir}"])
    assert rank.groupwise and not pickscore.groupwise
    raw = score_samples([pickscore, rank], images, prompts, group_ids).numpy()
    for gid in (3, 9):
        members = np.flatnonzero(group_ids.numpy() == gid)
        expected = np.empty(6)
        expected[np.argsort(raw[members, 0])] = np.arange(6) / 6
        np.testing.assert_array_equal(raw[members, 1], expected)


def test_shared_backbones_load_once(tmp_path):
    from transformers import CLIPModel

    for name, seed in [("pick", 2), ("clipl", 3)]:
        build_tiny_clip(tmp_path / name, seed=seed)

    def instances():
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is CLIPModel}

    before = instances()
    rewards = load_rewards([f"pickscore,path={tmp_path / 'pick'}", f"pickscore_rank:0.5,path={tmp_path / 'pick'}",
                            f"clip,path={tmp_path / 'clipl'}", f"aesthetic,path={tmp_path / 'clipl'},head={tmp_path / 'clipl'}"])
    assert len(instances() - before) == 2  # one per (backbone, settings), not one per reward
    assert rewards[0].score.model is rewards[1].score.pickscore.model
    assert rewards[2].score.model is rewards[3].score.model
    assert rewards[0].score.model is not rewards[2].score.model
    load_rewards([f"pickscore,path={tmp_path / 'pick'}"], dtype=torch.bfloat16)  # other settings: a new instance
    assert len(instances() - before) == 3


def test_jpeg_flat_is_more_compressible_than_noise():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images = torch.cat([flat, noise])
    comp, incomp = load_rewards(["jpeg_compressibility", "jpeg_incompressibility"])
    raw = score_samples([comp, incomp], images, ["a", "b"], torch.tensor([0, 0])).numpy()
    kilobytes = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(np.round(image.numpy().transpose(1, 2, 0) * 255).astype(np.uint8)).save(buffer, "JPEG",
                                                                                                  quality=95)
        kilobytes.append(len(buffer.getvalue()) / 1000)
    np.testing.assert_allclose(raw[:, 1], kilobytes)
    np.testing.assert_allclose(raw[:, 0], -np.array(kilobytes))
    assert raw[0, 0] > raw[1, 0] + 3  # flat 0.7 kB, noise 5.4 kB


@pytest.mark.parametrize("spec, expected", [
    ("pickscore", ("pickscore", 1.0, {})),
    ("clip:0.5", ("clip", 0.5, {})),
    ("ocr:2,engine=tesseract", ("ocr", 2.0, {"engine": "tesseract"})),
    ("remote:1e-1,url=http://127.0.0.1:8000,name=hps", ("remote", 0.1, {"url": "http://127.0.0.1:8000", "name": "hps"})),
    ("my_pkg.sub.mod:MyReward", ("my_pkg.sub.mod:MyReward", 1.0, {})),
    ("my_mod:MyReward:-0.25,scale=3", ("my_mod:MyReward", -0.25, {"scale": "3"})),
])
def test_parse_reward_spec(spec, expected):
    assert parse_reward_spec(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("pickscor", "unknown reward 'pickscor'; choose from: aesthetic, audio_loudness, audio_pitch, clip,"),
    ("pickscore:abc", "reward weight in 'pickscore:abc' is not a number"),
    ("pickscore:inf", "reward weight in 'pickscore:inf' is not a number"),
    ("pickscore:1e999", "reward weight in 'pickscore:1e999' is not finite"),
    ("clip,path", "is not KEY=VALUE"),
    ("my-mod:Cls", "cannot read --reward"),
    ("no_such_module_xyz:Cls", "cannot import 'no_such_module_xyz'"),
    ("json:NoSuchThing", "module 'json' has no attribute 'NoSuchThing'"),
    ("jpeg_compressibility,scale=2", "unknown option 'scale'; this reward accepts: name"),
    ("ocr,engine=paddle", "unknown OCR engine 'paddle'; choose one of: rapidocr, tesseract"),
    ("clip,path=/nonexistent/clip", "cannot load the CLIP model '/nonexistent/clip'"),
    ("remote,url=localhost:1", "the remote reward needs url=http://HOST:PORT"),
])
def test_bad_specs_give_one_line_errors(spec, message):
    with pytest.raises(UserError) as info:
        load_rewards([spec])
    assert message in str(info.value) and "\n" not in str(info.value)


def _not_weights(folder, kind):
    """A reward checkpoint that is not what its name says."""
    from safetensors.torch import save_file

    if kind == "cut-short safetensors":
        save_file({"0.weight": torch.randn(64, 64)}, folder / "head.safetensors")
        data = (folder / "head.safetensors").read_bytes()
        (folder / "head.safetensors").write_bytes(data[: len(data) // 2])
        return folder / "head.safetensors"
    if kind in ("text as safetensors", "text as pth"):
        path = folder / ("head.safetensors" if kind == "text as safetensors" else "head.pth")
        path.write_text("a cat\n" * 100)
        return path
    if kind == "Git LFS pointer":
        path = folder / "head.safetensors"
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1234\n")
        return path
    if kind == "cut-short pth":
        torch.save({"0.weight": torch.randn(64, 64)}, folder / "head.pth")
        data = (folder / "head.pth").read_bytes()
        (folder / "head.pth").write_bytes(data[: len(data) // 2])
        return folder / "head.pth"
    if kind == "pickle of other objects":
        torch.save({"0.weight": torch.zeros(1), "hook": print}, folder / "head.pth")  # pickles builtins.print
        return folder / "head.pth"
    torch.save([torch.zeros(1)], folder / "head.pth")  # "a list"
    return folder / "head.pth"


@pytest.mark.parametrize("kind,why", [
    ("cut-short safetensors", "does not load: not a complete safetensors file (SafetensorError: Error while "
                              "deserializing header"),
    ("text as safetensors", "does not load: not a complete safetensors file (SafetensorError:"),
    ("text as pth", "does not load: not a complete torch.save file ("),
    ("cut-short pth", "does not load: not a complete torch.save file ("),
    ("Git LFS pointer", "does not load: it is a Git LFS pointer, not the weights (fetch them: git lfs pull)"),
    ("pickle of other objects", "does not load: it pickles print, not only tensors, and such a file is not loaded "
                                "(no pickled code runs)"),
    ("a list", "holds a list, not a state dict of tensors"),
])
@pytest.mark.parametrize("spec", ["aesthetic,path={clip},head={file}", "hpsv3,path={file}", "imagereward,path={file}"])
def test_a_reward_checkpoint_that_is_not_weights_is_one_line(clip_dir, tmp_path, kind, why, spec):
    file = _not_weights(tmp_path, kind)
    with pytest.raises(UserError) as info:
        load_rewards([spec.format(clip=clip_dir, file=file)])
    message = str(info.value)
    assert message.startswith(f"reward checkpoint {file} ") and why in message, message
    assert "\n" not in message and "weights_only" not in message


@pytest.mark.parametrize("spec,what", [
    ("hpsv3,path={tmp}/missing.safetensors", "the reward checkpoint"),
    ("editreward,path=./no-such-editreward", "the reward checkpoint"),
    ("videoalign,path=~/no-such-videoalign", "the reward checkpoint"),
    ("imagereward,path=models/ImageReward.pt", "the reward checkpoint"),  # models/ exists here: a local path
    ("pickscore,path=models/pickscore", "the CLIP model"),
    ("aesthetic,path={clip},head=weights/of/a/head.pth", "the aesthetic head"),  # more than one /: no hub id
])
def test_a_missing_local_reward_path_is_not_tried_as_a_hub_id(clip_dir, tmp_path, monkeypatch, spec, what):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    spec = spec.format(tmp=tmp_path, clip=clip_dir)
    path = spec.split("=")[-1]
    with pytest.raises(UserError) as info:
        load_rewards([spec])
    assert str(info.value) == f"cannot load {what} {path!r}: no such file or folder"


def test_duplicate_names_are_refused_and_renamed():
    with pytest.raises(UserError, match="two rewards or judges are named 'jpeg_compressibility'.*name="):
        load_rewards(["jpeg_compressibility", "jpeg_compressibility:2"])
    names = [r.name for r in load_rewards(["jpeg_compressibility", "jpeg_compressibility:2,name=jpeg2"])]
    assert names == ["jpeg_compressibility", "jpeg2"]


CUSTOM = '''
import numpy as np
import torch


class Brightness:
    """Pointwise: scale x mean pixel; records that it ran without autograd."""

    def __init__(self, device=None, dtype=torch.float32, scale="1"):
        self.scale, self.device = float(scale), device

    def __call__(self, images, prompts):
        self.grad_enabled = torch.is_grad_enabled()
        return images.mean(dim=(1, 2, 3)) * self.scale


class GroupCentred:
    """Groupwise: mean pixel minus the group's mean; no constructor arguments at all."""

    groupwise = True
    name = "centred"

    def __call__(self, images, prompts):
        values = images.mean(dim=(1, 2, 3)).numpy()
        return values - values.mean()


def prompt_length(images, prompts):
    return [len(p) for p in prompts]


class Halves:
    """Named columns: the mean pixel of the left and right halves; the score is their sum."""

    def __call__(self, images, prompts):
        half = images.shape[-1] // 2
        left, right = images[..., :half].mean(dim=(1, 2, 3)), images[..., half:].mean(dim=(1, 2, 3))
        return {"score": left + right, "left": left, "right": right}


class Clip:
    """A video reward: the mean of the last frame minus the first (needs the whole clip)."""

    video = True

    def __call__(self, images, prompts):
        return (images[:, -1] - images[:, 0]).mean(dim=(1, 2, 3))


class NoScore:
    def __call__(self, images, prompts):
        return {"left": [0.0] * len(prompts)}


class ShortColumn:
    def __call__(self, images, prompts):
        return {"score": [0.0] * len(prompts), "part": [0.0]}


class Nan:
    def __call__(self, images, prompts):
        return np.full(len(prompts), np.nan)


class WrongShape:
    def __call__(self, images, prompts):
        return np.zeros((len(prompts), 2))


class Raises:
    def __call__(self, images, prompts):
        raise KeyError("missing thing")
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_custom_rewards_by_import_path(custom_module):
    rewards = load_rewards(["my_rewards_mod:Brightness:0.5,scale=3", "my_rewards_mod:GroupCentred",
                            "my_rewards_mod:prompt_length:2"], device="cpu")
    assert [(r.name, r.weight, r.groupwise) for r in rewards] == [
        ("Brightness", 0.5, False), ("centred", 1.0, True), ("prompt_length", 2.0, False)]
    images = quantised_images(6, seed=2).requires_grad_(True)
    prompts, ids = ["a", "bb", "ccc", "dddd", "e", "ff"], torch.tensor([1, 2, 1, 2, 1, 2])
    raw = score_samples(rewards, images, prompts, ids).numpy()
    means = images.detach().double().numpy().mean(axis=(1, 2, 3))
    np.testing.assert_allclose(raw[:, 0], 3 * means, rtol=1e-6)
    for gid in (1, 2):
        m = ids.numpy() == gid
        np.testing.assert_allclose(raw[m, 1], means[m] - means[m].mean(), atol=1e-7)
    np.testing.assert_array_equal(raw[:, 2], [1, 2, 3, 4, 1, 2])
    assert rewards[0].score.grad_enabled is False and rewards[0].score.device == "cpu"
    with pytest.raises(UserError, match="unknown option 'bogus'; this reward accepts: scale, name"):
        load_rewards(["my_rewards_mod:Brightness,bogus=1"])


@pytest.mark.parametrize("attr, message", [
    ("Nan", "reward 'Nan' returned NaN or inf for 3 of 3 samples"),
    ("WrongShape", "reward 'WrongShape' returned shape (3, 2), expected (3,)"),
    ("Raises", "reward 'Raises' raised KeyError at my_rewards_mod.py:"),
])
@pytest.mark.parametrize("groupwise", [False, True])
def test_failing_reward_stops_with_its_name(custom_module, attr, message, groupwise):
    (reward,) = load_rewards([f"my_rewards_mod:{attr}"])
    reward.groupwise = groupwise
    with pytest.raises(UserError) as info:
        score_samples([reward], quantised_images(3), ["a", "b", "c"], torch.zeros(3))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("attr, message", [
    ("NoScore", "reward 'NoScore' returned a dict without a \"score\" entry (keys: left)"),
    ("ShortColumn", "reward 'ShortColumn' returned shape (1,) in its column 'part', expected (3,)"),
])
def test_dict_reward_errors_are_one_line(custom_module, attr, message):
    (reward,) = load_rewards([f"my_rewards_mod:{attr}"])
    with pytest.raises(UserError) as info:
        score_samples([reward], quantised_images(3), ["a", "b", "c"], torch.zeros(3))
    assert str(info.value) == message


def test_named_columns_and_whole_clips(custom_module):
    """Named columns come back per sample (averaged over frames, like the score, for a frame-wise reward on video);
    a video reward gets the whole clip and refuses images."""
    halves, clip = load_rewards(["my_rewards_mod:Halves,name=halves", "my_rewards_mod:Clip"])
    assert (halves.video, clip.video) == (False, True)
    video = torch.rand(4, 3, 3, 8, 10, generator=torch.Generator().manual_seed(0)).double()
    columns = {}
    raw = score_samples([halves, clip], video, list("abcd"), torch.zeros(4), columns=columns).numpy()
    pixels = video.numpy()
    left, right = pixels[..., :5].mean(axis=(2, 3, 4)).mean(1), pixels[..., 5:].mean(axis=(2, 3, 4)).mean(1)
    np.testing.assert_allclose(columns["halves_left"], left, rtol=1e-12)
    np.testing.assert_allclose(columns["halves_right"], right, rtol=1e-12)
    np.testing.assert_allclose(raw[:, 0], left + right, rtol=1e-12)
    np.testing.assert_allclose(raw[:, 1], (pixels[:, -1] - pixels[:, 0]).mean(axis=(1, 2, 3)), rtol=1e-12)
    assert sorted(columns) == ["halves_left", "halves_right"]
    with pytest.raises(UserError, match="^reward 'Clip' scores whole video clips .*, but got images of shape "
                                        r"\(4, 3, 8, 10\): use it with a video model$"):
        score_samples([clip], video[:, 0], list("abcd"), torch.zeros(4))


def numpy_advantages(raw, weights, ids, aggregation, clip=5.0):
    """algorithms.md §3, written out per group in float64 (group std, not global)."""
    out = np.zeros(len(ids))
    if aggregation == "sum":
        r = raw @ weights
        for g in np.unique(ids):
            m = ids == g
            out[m] = (r[m] - r[m].mean()) / (r[m].std() + 1e-4)
    else:
        c = np.zeros(len(ids))
        for k, w in enumerate(weights):
            for g in np.unique(ids):
                m = ids == g
                c[m] += w * (raw[m, k] - raw[m, k].mean()) / max(raw[m, k].std(), 1e-6)
        out = (c - c.mean()) / max(c.std(), 1e-6)
    return np.clip(out, -clip, clip)


@pytest.mark.parametrize("aggregation", ["sum", "gdpo"])
def test_multi_reward_aggregation_against_numpy(clip_dir, custom_module, aggregation):
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.repeat([11, 22, 33], 4))
    prompts = [f"prompt {g}" for g in ids]
    images = torch.cat([quantised_images(6, seed=4), torch.full((6, 3, 40, 40), 0.25)])[rng.permutation(12)]
    rewards = load_rewards([f"pickscore,path={clip_dir}", "jpeg_compressibility:0.02",
                            "my_rewards_mod:Brightness:3"])
    raw = score_samples(rewards, images, prompts, torch.tensor(ids))
    # independent raw scores: the model's forward, PIL JPEG sizes, numpy means
    text, image, scale, _ = independent_clip(clip_dir, images, prompts)
    kilobytes = []
    for x in images:
        buffer = io.BytesIO()
        Image.fromarray(np.round(x.numpy().transpose(1, 2, 0) * 255).astype(np.uint8)).save(buffer, "JPEG", quality=95)
        kilobytes.append(len(buffer.getvalue()) / 1000)
    independent = np.stack([scale * (text * image).sum(1) / 26, -np.array(kilobytes),
                            images.double().numpy().mean(axis=(1, 2, 3))], axis=1)
    np.testing.assert_allclose(raw.numpy(), independent, rtol=1e-4, atol=1e-6)
    weights = [r.weight for r in rewards]
    advantages, _ = compute_advantages(raw, weights, torch.tensor(ids), aggregation, global_std=False)
    np.testing.assert_allclose(advantages.numpy(), numpy_advantages(independent, np.array(weights), ids, aggregation),
                               rtol=1e-3, atol=1e-4)


@SLOW
def test_groupwise_rewards_over_two_processes(clip_dir, tmp_path):
    out = tmp_path / "result.json"
    run_script("tests/rewards_groupwise_dist.py", clip_dir, out, launcher=ACCELERATE_2CPU,
               env={"ACCELERATE_USE_CPU": "true"}, timeout=300)
    result = json.loads(out.read_text())
    assert result["num_processes"] == 2
    assert result["counts"] == [6, 10]  # unequal shares: the padding path is exercised
    assert result["group_sizes"] == [4] * 16  # every group reached its reward whole, wherever its samples were
    assert result["max_abs_diff_pointwise"] < 1e-6
    assert result["max_abs_diff_groupwise"] == 0.0  # the same groups -> the same ranks as one process


def test_grpo_with_several_rewards_and_a_custom_one(tiny_flux_path, clip_dir, custom_module, tmp_path):
    out = tmp_path / "run"
    run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--eval-every", "1", "--eval-num-prompts", "1",
               "--eval-seeds", "2", "--output-dir", out,
               "--advantage-aggregation", "gdpo", "--reward", f"pickscore,path={clip_dir}",
               "--reward", f"pickscore_rank:0.5,path={clip_dir}", "--reward", "my_rewards_mod:Brightness:2,name=bright",
               "--reward", "my_rewards_mod:Halves:0.1,name=halves",
               env={"PYTHONPATH": os.pathsep.join([str(custom_module), os.environ.get("PYTHONPATH", "")])})
    base, metrics = read_metrics(out, base=True)
    for name in ["pickscore", "pickscore_rank", "bright", "halves"]:
        assert np.isfinite(metrics[f"reward_{name}_mean"]) and metrics[f"reward_{name}_std"] > 0
    assert metrics["reward_pickscore_rank_mean"] == pytest.approx(3.5 / 8)  # ranks 0..7 of K = 8, over K
    # A reward's named columns are logged beside it (training and evaluation); here they sum to its score.
    assert metrics["reward_halves_left_mean"] + metrics["reward_halves_right_mean"] == pytest.approx(
        metrics["reward_halves_mean"], rel=1e-6)  # float32 halves
    assert metrics["reward_halves_left_std"] > 0
    for record in (base, metrics):
        assert record["eval_reward_halves_left"] + record["eval_reward_halves_right"] == pytest.approx(
            record["eval_reward_halves"], rel=1e-6)
        assert "eval_reward_halves_left_se" in record


def test_reward_error_in_a_script_is_one_line(tiny_flux_path, custom_module, tmp_path):
    result = run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--output-dir", tmp_path / "run",
                        "--reward", "my_rewards_mod:Raises", check=False, env={"PYTHONPATH": str(custom_module)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: reward 'Raises' raised KeyError at my_rewards_mod.py:")


def test_video_rewards_score_every_frame_and_average():
    from rewards.jpeg import jpeg_kilobytes

    video = torch.rand(3, 5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    video[1] = 0.5  # a flat clip compresses best
    (reward,) = load_rewards(["jpeg_compressibility"])
    scores = score_samples([reward], video, ["a", "b", "c"], torch.tensor([1, 1, 2]))[:, 0]
    expected = [-np.mean([jpeg_kilobytes(video[b, f:f + 1])[0] for f in range(5)]) for b in range(3)]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-12)
    assert scores[1] > scores[0]
