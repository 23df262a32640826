"""Wan2.1 image-to-video (`WanImageToVideoPipeline`): the condition image is the first frame."""

import torch

from common.models.wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    """IN PROGRESS (helper): see the module docstring."""

    pipeline_class_name = "WanImageToVideoPipeline"
    display_name = "Wan I2V"
    condition_images = (1, 1)
    condition_components = ("vae",)
