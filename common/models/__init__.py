"""Model adapters: one small class per model family over its diffusers pipeline components.

An adapter encodes prompts, makes the initial noise, gives the σ schedule, runs ONE velocity forward and
decodes latents to images (`decode(latents, cond)`: given the conditioning they were sampled with, which only
LTX-2's image-to-video reads, its clean first frame being no part of the latents). Rollout and training both call
`velocity`, so they cannot drift apart.
Weights live in the model dtype (bf16 on GPUs); everything that leaves `velocity` is float32.
"""

import inspect

import torch

from common.models.flux import FluxAdapter
from common.models.flux2 import Flux2Adapter, Flux2KleinAdapter
from common.models.hunyuan_video15 import HunyuanVideo15Adapter, HunyuanVideo15ImageToVideoAdapter
from common.models.kontext import FluxKontextAdapter
from common.models.qwen_image21 import QwenImage21Adapter
from common.models.ltx2 import LTX2Adapter, LTX2ImageToVideoAdapter
from common.models.qwen_image_edit import QwenImageEditAdapter
from common.models.wan_i2v import WanImageToVideoAdapter
from common.models.qwen_image import QwenImageAdapter
from common.models.sd3 import SD3Adapter
from common.models.wan import WanAdapter
from common.models.wan22 import Wan22Adapter, Wan22ImageToVideoAdapter, Wan22TI2VAdapter
from common.models.z_image import ZImageAdapter
from common.utils import UserError

DEFAULT_MODEL_PATHS = {
    "flux1": "black-forest-labs/FLUX.1-dev",
    "sd3": "stabilityai/stable-diffusion-3.5-medium",
    "qwen-image": "Qwen/Qwen-Image",
    "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    "flux1-kontext": "black-forest-labs/FLUX.1-Kontext-dev",
    "qwen-image-edit": "Qwen/Qwen-Image-Edit-2511",
    "wan-i2v": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
    "wan2.2": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    "wan2.2-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    "wan2.2-i2v": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    "hunyuan-video-1.5": "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v",  # the pipelines' docstring ids
    "hunyuan-video-1.5-i2v": "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
    "flux2": "black-forest-labs/FLUX.2-dev",
    "flux2-klein": "black-forest-labs/FLUX.2-klein-base-9B",  # the non-distilled base
    "z-image": "Tongyi-MAI/Z-Image-Turbo",  # the distilled one; Tongyi-MAI/Z-Image is its base
    "qwen-image-2.1": "Qwen/Qwen-Image-2.1",  # text-to-image and editing in one model
    "ltx2": "Lightricks/LTX-2",
    "ltx2-i2v": "Lightricks/LTX-2",  # one checkpoint, loaded as LTX2ImageToVideoPipeline
}
MODELS = tuple(DEFAULT_MODEL_PATHS)


def resolve_model_path(model: str, model_path: str | None) -> str:
    """`tiny` -> the locally built tiny pipeline; `toy` -> the shipped toy-world pipeline (FLUX.1 only); None ->
    the model's published checkpoint."""
    from common.tiny import tiny_model_path
    from common.toy import toy_model_path

    if model_path == "tiny":
        return str(tiny_model_path(model))
    if model_path == "toy":  # the toy world's pretrained FLUX.1 (common/toy.py); a UserError for other models
        return str(toy_model_path(model))
    return model_path or DEFAULT_MODEL_PATHS[model]


ADAPTERS = {"flux1": FluxAdapter, "sd3": SD3Adapter, "qwen-image": QwenImageAdapter, "wan": WanAdapter,
            "flux1-kontext": FluxKontextAdapter, "qwen-image-edit": QwenImageEditAdapter,
            "wan-i2v": WanImageToVideoAdapter, "wan2.2": Wan22Adapter, "wan2.2-5b": Wan22TI2VAdapter,
            "wan2.2-i2v": Wan22ImageToVideoAdapter, "hunyuan-video-1.5": HunyuanVideo15Adapter,
            "hunyuan-video-1.5-i2v": HunyuanVideo15ImageToVideoAdapter,
            "flux2": Flux2Adapter, "flux2-klein": Flux2KleinAdapter,
            "z-image": ZImageAdapter, "qwen-image-2.1": QwenImage21Adapter, "ltx2": LTX2Adapter,
            "ltx2-i2v": LTX2ImageToVideoAdapter}


def default_max_sequence_length(model: str) -> int:
    """The text length `model` encodes when none is given: its adapter's default, which is its pipeline's own
    (docs/models.md lists them), so that a LoRA trained here meets the text conditioning the stock pipeline gives."""
    return inspect.signature(ADAPTERS[model]).parameters["max_sequence_length"].default


def load_adapter(model: str, model_path: str | None, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int | None = None, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int | None = None, condition_size: int | None = None, train_experts: str | None = None):
    """The adapter of `model`; `load_text_encoders=False` when training from the embedding cache,
    `text_only=True` to load nothing but the text encoders and condition encoders (preprocess.py). `num_frames`
    (video models only), `condition_size` (conditioned models only) and `max_sequence_length` default to the
    adapter's own; `train_experts` (high, low or both: whose LoRA is trained) applies to two-expert models only."""
    if model not in ADAPTERS:
        raise UserError(f"unknown model {model!r}; choose one of: {', '.join(ADAPTERS)}")
    if max_sequence_length is None:
        max_sequence_length = default_max_sequence_length(model)
    extra = {}
    if num_frames is not None:
        if not ADAPTERS[model].video:
            raise UserError(f"num_frames applies to video models, not to {model}")
        extra["num_frames"] = num_frames
    if condition_size is not None:
        if ADAPTERS[model].condition_images[1] == 0:
            raise UserError(f"condition_size applies to conditioned models, not to {model}")
        extra["condition_size"] = condition_size
    if train_experts is not None:
        if not getattr(ADAPTERS[model], "two_experts", False):
            raise UserError(f"train_experts applies to two-expert models (wan2.2, wan2.2-i2v), not to {model}")
        extra["train_experts"] = train_experts
    path = resolve_model_path(model, model_path)
    return ADAPTERS[model](path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                           **extra)
