"""OCR accuracy (Flow-GRPO, arXiv:2505.05470, text rendering): how much of the prompt's quoted text an OCR
engine reads in the image.

target = the text between the first pair of double quotes (the whole prompt when there is none);
rec = everything the engine recognised, joined. Both lower-cased with spaces removed, then
    score = 1                                   if target ⊂ rec
            1 − min(lev(rec, target), n)/n      otherwise, n = len(target)
so an image where nothing is recognised scores 0. (An empty target scores 1 when nothing is recognised, else 0.)

Engines, both offline with weights from the package registries:
- `rapidocr` (default): PP-OCRv4 detection + recognition ONNX models inside the `rapidocr-onnxruntime` wheel,
  the model family the reference reaches through PaddleOCR; pip-only, a scene-text detector.
- `tesseract`: Debian/Ubuntu `tesseract-ocr` (apt, needs root) through `pytesseract`; a document OCR.
"""

import re

import numpy as np
import torch

from common.utils import UserError

ENGINES = ("rapidocr", "tesseract")
_QUOTED = re.compile(r'"([^"]*)"')


def ocr_target(prompt: str) -> str:
    match = _QUOTED.search(prompt)
    return match.group(1) if match else prompt


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, prompt: str) -> float:
    rec = recognised.replace(" ", "").lower()
    target = ocr_target(prompt).replace(" ", "").lower()
    if not target:
        return float(not rec)
    if target in rec:
        return 1.0
    return 1.0 - min(levenshtein(rec, target), len(target)) / len(target)


class OcrReward:
    """`engine=rapidocr` (default) or `engine=tesseract`."""

    def __init__(self, engine: str = "rapidocr"):
        if engine not in ENGINES:
            raise UserError(f"unknown OCR engine {engine!r}; choose one of: {', '.join(ENGINES)}")
        self.engine = engine
        if engine == "rapidocr":
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError:
                raise UserError("the ocr reward's default engine needs `pip install rapidocr-onnxruntime` "
                                "(or choose --reward ocr,engine=tesseract)") from None
            # PaddleOCR's detector sizing (longest side capped at 960, no upscaling), which the reference runs
            # with; RapidOCR's own default upscales the shorter side to 736, 2-3x slower on 512 px images.
            self.rapidocr = RapidOCR(det_limit_type="max", det_limit_side_len=960)
        else:
            try:
                import pytesseract

                pytesseract.get_tesseract_version()
            except ImportError:
                raise UserError("ocr,engine=tesseract needs `pip install pytesseract`") from None
            except pytesseract.TesseractNotFoundError:
                raise UserError("ocr,engine=tesseract needs the tesseract program: `apt-get install "
                                "tesseract-ocr`") from None
            self.pytesseract = pytesseract

    def recognise(self, image) -> str:
        """All text the engine reads in one PIL image, joined in reading order."""
        if self.engine == "rapidocr":
            # Like the reference (PaddleOCR with cls=False): no text-direction classifier.
            result, _ = self.rapidocr(image, use_cls=False)
            return "".join(text for _, text, _ in result or [])
        return self.pytesseract.image_to_string(image)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> np.ndarray:
        from rewards.clip import to_pil

        return np.array([ocr_score(self.recognise(image), prompt) for image, prompt in zip(to_pil(images), prompts)])
