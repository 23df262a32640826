"""Model adapters: one small class per model family over its diffusers pipeline components.

An adapter encodes prompts, makes the initial noise, gives the σ schedule, runs ONE velocity forward and
decodes latents to images. Rollout and training both call `velocity`, so they cannot drift apart.
Weights live in the model dtype (bf16 on GPUs); everything that leaves `velocity` is float32.
"""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError

MODELS = ("flux1",)
DEFAULT_MODEL_PATHS = {"flux1": "black-forest-labs/FLUX.1-dev"}


def resolve_model_path(model: str, model_path: str | None) -> str:
    """`tiny` -> the locally built tiny pipeline; None -> the model's published checkpoint."""
    from common.tiny import tiny_model_path

    if model_path == "tiny":
        return str(tiny_model_path(model))
    return model_path or DEFAULT_MODEL_PATHS[model]


class FluxAdapter:
    """FLUX.1 (dev/schnell) over `FluxPipeline`'s components. Guidance-distilled: the guidance scale is an
    embedding input, not true CFG."""

    pipeline_class_name = "FluxPipeline"
    true_cfg = False  # guidance is an embedding input: no negative prompts to encode
    # Attention and feed-forward projections of both block types (Flow-GRPO's FLUX LoRA targets).
    lora_target_modules = [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp", "proj_out",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        from diffusers import FluxPipeline

        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sequence_length = max_sequence_length
        # Frozen encoders wait on the CPU between uses when training on an accelerator.
        self.offload_device = torch.device("cpu")
        skip = {} if load_text_encoders else dict(text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None)
        if text_only:  # preprocess.py: only the text encoders
            skip.update(transformer=None, vae=None)
        try:
            self.pipe = FluxPipeline.from_pretrained(model_path, dtype=dtype, **skip)
        except (OSError, ValueError) as err:
            raise UserError(f"cannot load a FLUX.1 pipeline from {model_path!r}: {str(err).splitlines()[0]}") from err
        self.pipe.set_progress_bar_config(disable=True)
        for module in (self.pipe.text_encoder, self.pipe.text_encoder_2):
            if module is not None:
                module.requires_grad_(False).to(self.offload_device)
        if text_only:
            return
        self.transformer = self.pipe.transformer.to(self.device)
        self.config = self.transformer.config
        self.vae = self.pipe.vae.to(self.device)
        self.scheduler = self.pipe.scheduler
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        if resolution <= 0 or resolution % multiple:
            raise UserError(f"resolution {resolution} is not a positive multiple of {multiple}, as FLUX.1 requires")
        self.height = self.width = resolution
        self.latent_h = 2 * (resolution // multiple)
        self.latent_w = 2 * (resolution // multiple)
        self.num_channels = self.config.in_channels // 4
        self.image_ids = self.pipe._prepare_latent_image_ids(
            1, self.latent_h // 2, self.latent_w // 2, self.device, dtype)
        self.vae.requires_grad_(False)
        self.transformer.requires_grad_(False)

    # ----- text ---------------------------------------------------------------------------------------
    @contextmanager
    def text_encoders_on_device(self):
        """Bring the frozen text encoders to the accelerator for a round of encoding, then back to the CPU."""
        encoders = [m for m in (self.pipe.text_encoder, self.pipe.text_encoder_2) if m is not None]
        for module in encoders:
            module.to(self.device)
        try:
            yield
        finally:
            for module in encoders:
                module.to(self.offload_device)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning for a batch of prompts: batch-first tensors on the adapter's device.
        (Call inside `text_encoders_on_device()` on an accelerator, or it runs the encoders on the CPU.)"""
        if self.pipe.text_encoder is None:
            raise RuntimeError("text encoders were not loaded (training from the embedding cache)")
        prompt_embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    # ----- latents and schedule -----------------------------------------------------------------------
    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial packed latents, one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.num_channels, self.latent_h, self.latent_w)
        latents = randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)
        return self.pipe._pack_latents(latents, len(generators), self.num_channels, self.latent_h, self.latent_w)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as `FluxPipeline` builds it (linspace + resolution-dependent shift)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        cfg = self.scheduler.config
        mu = calculate_shift((self.latent_h // 2) * (self.latent_w // 2), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    # ----- the one forward ----------------------------------------------------------------------------
    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 3.5) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. `sigma` is a float or a (batch,) tensor."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        guidance = torch.full((batch,), guidance_scale, device=latents.device) if self.config.guidance_embeds else None
        prompt_embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        autocast = (torch.autocast(self.device.type, dtype=self.dtype)
                    if self.dtype != torch.float32 else nullcontext())
        with autocast:
            out = self.transformer(
                hidden_states=latents.to(self.dtype),
                timestep=sigma.to(self.dtype),  # FLUX takes σ (the pipeline passes timestep / 1000)
                guidance=guidance,
                pooled_projections=cond["pooled_prompt_embeds"].to(self.dtype),
                encoder_hidden_states=prompt_embeds.to(self.dtype),
                txt_ids=text_ids,
                img_ids=self.image_ids,
                return_dict=False,
            )[0]
        return out.float()

    # ----- images -------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def save_lora(self, directory: str | Path, lora_state_dict: dict[str, torch.Tensor]) -> None:
        """Write LoRA weights in the diffusers format `FluxPipeline.load_lora_weights` reads."""
        from diffusers import FluxPipeline

        FluxPipeline.save_lora_weights(str(directory), transformer_lora_layers=lora_state_dict,
                                       safe_serialization=True)


ADAPTERS = {"flux1": FluxAdapter}


def load_adapter(model: str, model_path: str | None, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
    """The adapter of `model`; `load_text_encoders=False` when training from the embedding cache,
    `text_only=True` to load nothing but the text encoders (preprocess.py)."""
    if model not in ADAPTERS:
        raise UserError(f"unknown model {model!r}; choose one of: {', '.join(ADAPTERS)}")
    path = resolve_model_path(model, model_path)
    return ADAPTERS[model](path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only)
