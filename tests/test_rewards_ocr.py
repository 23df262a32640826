"""OCR reward: the score formula against an independent edit distance, and both real engines on rendered text."""

import functools

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from conftest import require_system
from rewards import load_rewards, score_samples
from rewards.ocr import levenshtein, ocr_score, ocr_target


def recursive_levenshtein(a: str, b: str) -> int:
    """The textbook recursive definition (independent of the two-row programme under test)."""

    @functools.cache
    def d(i, j):
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


def test_levenshtein_against_the_recursive_definition():
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("flaw", "lawn") == 2
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = ("".join(rng.choice(list("abc"), size=rng.integers(0, 9))) for _ in range(2))
        assert levenshtein(a, b) == recursive_levenshtein(a, b), (a, b)


@pytest.mark.parametrize("recognised, prompt, expected", [
    ("Hello World", 'a sign that says "hello world"', 1.0),                 # case and spaces ignored
    ("xxhelloworldyy", 'a sign that says "hello world"', 1.0),              # target inside the recognised text
    ("hellp world", 'a poster "Hello World" and "Other"', 1 - 1 / 10),      # first quoted pair only
    ("", 'a sign that says "hello"', 0.0),                                  # nothing recognised
    ("a completely different long text", 'a sign "abc"', 0.0),             # distance clamped to len(target)
    ("cat", "cat on a mat", 1 - 6 / 9),                                     # no quotes: the whole prompt
    ("", 'an empty sign ""', 1.0),
    ("boo", 'an empty sign ""', 0.0),
])
def test_ocr_score(recognised, prompt, expected):
    assert ocr_score(recognised, prompt) == pytest.approx(expected)


def test_ocr_target():
    assert ocr_target('say "a b" then "c"') == "a b"
    assert ocr_target('one " quote only') == 'one " quote only'


def require_opencv():
    """RapidOCR's image handling (opencv-python) loads libGL and GLib, which come from apt, not pip."""
    require_system("libgl1", library="GL")
    require_system("libglib2.0-0", library="glib-2.0")


def render(text: str, size: int = 256) -> torch.Tensor:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((12, size // 2 - 16), text, fill="black", font=ImageFont.load_default(size=30))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.mark.parametrize("engine", ["rapidocr", "tesseract"])
def test_ocr_engines_read_rendered_text(engine):
    if engine == "rapidocr":
        require_opencv()
    else:
        require_system("tesseract-ocr", program="tesseract")
    (reward,) = load_rewards([f"ocr,engine={engine}"])
    noise = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    images = torch.stack([render("Flow Matching"), render("OPEN 24 HOURS"), render("goodbye moon"), noise])
    prompts = ['a shop sign that says "flow matching"', 'a neon sign reading "Open 24 hours" at night',
               'a shop sign that says "flow matching"', 'a shop sign that says "flow matching"']
    scores = score_samples([reward], images, prompts, torch.arange(4))[:, 0].numpy()
    assert scores[0] >= 0.9 and scores[1] >= 0.9, scores
    assert scores[2] <= 0.4 and scores[3] <= 0.2, scores


def render_scene(text: str, rng, size: int = 384) -> torch.Tensor:
    """Light text, slightly rotated and blurred, on a noisy gradient: closer to generated scene text."""
    background = rng.random((size, size, 3)) * 80 + np.linspace(60, 180, size)[None, :, None]
    layer = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    colour = tuple(int(c) for c in rng.integers(180, 256, 3)) + (255,)
    ImageDraw.Draw(layer).text((30, size // 2 - 20), text, fill=colour, font=ImageFont.load_default(size=40))
    layer = layer.rotate(float(rng.uniform(-12, 12)), resample=Image.BICUBIC)
    image = Image.alpha_composite(Image.fromarray(background.astype(np.uint8)).convert("RGBA"), layer)
    image = image.convert("RGB").filter(ImageFilter.GaussianBlur(1))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def test_default_engine_reads_scene_like_text():
    require_opencv()
    rng = np.random.default_rng(0)
    words = ["Fresh Bread", "No Parking", "Sale 50% Off"]
    (reward,) = load_rewards(["ocr"])
    scores = reward.score(torch.stack([render_scene(w, rng) for w in words]), [f'a sign: "{w}"' for w in words])
    assert min(scores) >= 0.9, scores
