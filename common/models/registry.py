"""Every --model name, one row each: the family module in common/models/ that holds its adapter, the checkpoint
--model-path defaults to, and what the flags need to know of it. The only place a model name is written outside its
family's file. It imports nothing: parsing flags reads it without loading model code, and common/models/__init__.py
imports a family's module only when its adapter is asked for (tests/test_models.py checks the rows against the
adapters). The order is the one --help lists."""

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Model:
    family: str       # its module in common/models/
    adapter: str      # the adapter class there
    tiny: str         # the function there that builds its tiny pipeline (--model-path tiny)
    checkpoint: str   # the published checkpoint (--model-path unset)
    video: bool = False        # makes videos, takes --num-frames
    conditioned: bool = False  # takes condition images (editing, image-to-video) and --condition-size
    two_experts: bool = False  # a high- and a low-noise expert: takes --train-experts
    audio: bool = False        # makes sound with its videos
    toy: str | None = None     # the shipped toy world's pipeline (--model-path toy), relative to the repository
    text_length: int = 512     # prompt tokens its stock pipeline encodes by default (--max-sequence-length unset)


MODELS = {
    "flux1": Model("flux", "FluxAdapter", "build_tiny_flux1", "black-forest-labs/FLUX.1-dev", toy="data/toy/model"),
    "sd3": Model("sd3", "SD3Adapter", "build_tiny_sd3", "stabilityai/stable-diffusion-3.5-medium", text_length=256),
    "qwen-image": Model("qwen_image", "QwenImageAdapter", "build_tiny_qwen_image", "Qwen/Qwen-Image"),
    "wan": Model("wan", "WanAdapter", "build_tiny_wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", video=True,
                 toy="data/toy_video/model"),
    "flux1-kontext": Model("kontext", "FluxKontextAdapter", "build_tiny_flux1_kontext",
                           "black-forest-labs/FLUX.1-Kontext-dev", conditioned=True, toy="data/toy_edit/model"),
    "qwen-image-edit": Model("qwen_image_edit", "QwenImageEditAdapter", "build_tiny_qwen_image_edit",
                             "Qwen/Qwen-Image-Edit-2511", conditioned=True),
    "wan-i2v": Model("wan_i2v", "WanImageToVideoAdapter", "build_tiny_wan_i2v",
                     "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", video=True, conditioned=True),
    "flux2": Model("flux2", "Flux2Adapter", "build_tiny_flux2", "black-forest-labs/FLUX.2-dev"),
    "flux2-klein": Model("flux2", "Flux2KleinAdapter", "build_tiny_flux2_klein",
                         "black-forest-labs/FLUX.2-klein-base-9B"),  # the non-distilled base
    "z-image": Model("z_image", "ZImageAdapter", "build_tiny_z_image",
                     "Tongyi-MAI/Z-Image-Turbo"),  # the distilled one; Tongyi-MAI/Z-Image is its base
    "wan2.2": Model("wan22", "Wan22Adapter", "build_tiny_wan22", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", video=True,
                    two_experts=True),
    "wan2.2-5b": Model("wan22", "Wan22TI2VAdapter", "build_tiny_wan22_5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                       video=True),
    # text-to-image and editing in one model: conditioned, with rows that have no condition image
    "qwen-image-2.1": Model("qwen_image21", "QwenImage21Adapter", "build_tiny_qwen_image21", "Qwen/Qwen-Image-2.1",
                            conditioned=True),
    "ltx2": Model("ltx2", "LTX2Adapter", "build_tiny_ltx2", "Lightricks/LTX-2", video=True, audio=True,
                  text_length=1024),
    "wan2.2-i2v": Model("wan22", "Wan22ImageToVideoAdapter", "build_tiny_wan22_i2v",
                        "Wan-AI/Wan2.2-I2V-A14B-Diffusers", video=True, conditioned=True, two_experts=True),
    # the pipelines' docstring ids
    "hunyuan-video-1.5": Model("hunyuan_video15", "HunyuanVideo15Adapter", "build_tiny_hunyuan_video15",
                               "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", video=True,
                               text_length=1000),
    "hunyuan-video-1.5-i2v": Model("hunyuan_video15", "HunyuanVideo15ImageToVideoAdapter",
                                   "build_tiny_hunyuan_video15_i2v", "hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v",
                                   video=True, conditioned=True, text_length=1000),
    # one checkpoint, loaded as LTX2ImageToVideoPipeline; one tiny LTX-2 for both modes, as its model_index names
    # LTX2Pipeline
    "ltx2-i2v": Model("ltx2", "LTX2ImageToVideoAdapter", "build_tiny_ltx2", "Lightricks/LTX-2", video=True,
                      conditioned=True, audio=True, text_length=1024),
}

DEFAULT_MODEL = "flux1"  # --model unset
VIDEO_MODELS = tuple(name for name, row in MODELS.items() if row.video)
CONDITIONED_MODELS = tuple(name for name, row in MODELS.items() if row.conditioned)
TWO_EXPERT_MODELS = tuple(name for name, row in MODELS.items() if row.two_experts)
# What `--model-path toy` says for a model without a toy world.
TOY_REFUSAL = ("--model-path toy is a FLUX.1 pipeline (--model flux1), a FLUX.1 Kontext one (--model flux1-kontext) "
               "or a Wan one (--model wan), not {model}")
