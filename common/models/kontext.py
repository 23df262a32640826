"""FLUX.1 Kontext [dev] (`FluxKontextPipeline`): instruction-based image editing. The condition image's VAE latents
are appended to the target's image tokens (position ids with axis 0 set to 1), the transformer's output is cut
back to the target's tokens, and the σ shift comes from the target's token count alone, as in the pipeline."""

from pathlib import Path

import torch

from common.models.flux import FluxAdapter, build_tiny_flux1
from common.utils import UserError


class FluxKontextAdapter(FluxAdapter):
    pipeline_class_name = "FluxKontextPipeline"
    display_name = "FLUX.1 Kontext"
    condition_images = (1, 1)
    condition_components = ("vae",)  # condition latents are cached: preprocess.py VAE-encodes them
    default_guidance_scale = 2.5  # FLUX.1 Kontext [dev]'s guidance embedding in its model card's examples

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None):
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only)
        self.multiple = 2 * self.pipe.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        if condition_size is not None and (condition_size <= 0 or condition_size % self.multiple):
            raise UserError(f"--condition-size {condition_size} is not a positive multiple of {self.multiple}, as "
                            f"{self.display_name} requires")
        self.condition_size = condition_size

    def condition_shape(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) a condition image of this size is resized to: --condition-size square, else as
        `FluxKontextPipeline` does by default (the preferred Kontext resolution nearest its aspect ratio, in
        multiples of 16)."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if self.condition_size is not None:
            return self.condition_size, self.condition_size
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return height // self.multiple * self.multiple, width // self.multiple * self.multiple

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        """The text conditioning of FLUX.1 and each prompt's condition image as packed latents (the VAE's mode,
        shifted and scaled) with their position ids, one row per prompt."""
        cond = super().encode_prompts(prompts)
        pipe, rows, ids = self.pipe, [], []
        for (image,) in images:
            height, width = self.condition_shape(*image.size)
            pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, height, width), height, width)
            latents = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)
            _, channels, h, w = latents.shape
            rows.append(pipe._pack_latents(latents, 1, channels, h, w))
            image_ids = pipe._prepare_latent_image_ids(1, h // 2, w // 2, self.device, rows[-1].dtype)
            image_ids[..., 0] = 1  # axis 0 tells the condition's tokens from the target's
            ids.append(image_ids[None])
        return {**cond, "image_latents": torch.cat(rows), "image_ids": torch.cat(ids)}

    def _image_sequence(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]):
        """Target tokens, then the condition's (every row of a batch has a condition of one shape)."""
        condition = cond["image_latents"].to(latents.dtype)
        return torch.cat([latents, condition], dim=1), torch.cat([self.image_ids, cond["image_ids"][0].to(self.dtype)])


def build_tiny_flux1_kontext(path: Path) -> None:
    build_tiny_flux1(path, "FluxKontextPipeline")
