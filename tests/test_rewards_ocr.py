"""OCR reward: the score formula against an independent edit distance, and both real engines on rendered text."""

import functools

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

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


def render(text: str, size: int = 256) -> torch.Tensor:
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((12, size // 2 - 16), text, fill="black", font=ImageFont.load_default(size=30))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


@pytest.mark.parametrize("engine", ["rapidocr", "tesseract"])
def test_ocr_engines_read_rendered_text(engine):
    (reward,) = load_rewards([f"ocr,engine={engine}"])
    noise = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    images = torch.stack([render("Flow Matching"), render("OPEN 24 HOURS"), render("goodbye moon"), noise])
    prompts = ['a shop sign that says "flow matching"', 'a neon sign reading "Open 24 hours" at night',
               'a shop sign that says "flow matching"', 'a shop sign that says "flow matching"']
    scores = score_samples([reward], images, prompts, torch.arange(4))[:, 0].numpy()
    assert scores[0] >= 0.9 and scores[1] >= 0.9, scores
    assert scores[2] <= 0.4 and scores[3] <= 0.2, scores
