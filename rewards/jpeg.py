"""JPEG (in)compressibility (DDPO, arXiv:2305.13301): the size of the image saved as JPEG at quality 95.

Scale: kilobytes = bytes / 1000, as DDPO. (Flow-GRPO and DiffusionNFT divide by 500 instead; only the
reward's scale differs, and group-normalised advantages do not see it.)
"""

import io

import numpy as np
import torch
from PIL import Image


def jpeg_kilobytes(images: torch.Tensor) -> np.ndarray:
    """images: (B, 3, H, W) floats in [0, 1] -> JPEG size of each in kB."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return np.asarray(sizes, dtype=np.float64)


def jpeg_compressibility(images, prompts):
    return -jpeg_kilobytes(images)


def jpeg_incompressibility(images, prompts):
    return jpeg_kilobytes(images)
