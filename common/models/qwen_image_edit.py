"""Qwen-Image-Edit-2509/2511 (`QwenImageEditPlusPipeline`): one or several condition images."""

import torch

from common.models.qwen_image import QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    """IN PROGRESS (helper): see the module docstring."""

    pipeline_class_name = "QwenImageEditPlusPipeline"
    display_name = "Qwen-Image-Edit"
    condition_images = (1, None)
    condition_components = ("vae",)
