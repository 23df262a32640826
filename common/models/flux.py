"""FLUX.1 [dev]/[schnell] (`FluxPipeline`)."""

from pathlib import Path

import numpy as np
import torch

from common.models.base import _Adapter
from common.models.tiny_parts import TINY_SEED, tiny_clip_tokenizer, tiny_t5_tokenizer


class FluxAdapter(_Adapter):
    """FLUX.1 (dev/schnell) over `FluxPipeline`'s components. Guidance-distilled: the guidance scale is an
    embedding input, not true CFG."""

    pipeline_class_name = "FluxPipeline"
    display_name = "FLUX.1"
    text_components = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
    long_tokenizer = "tokenizer_2"
    true_cfg = False  # guidance is an embedding input: no negative prompts to encode
    default_guidance_scale = 3.5  # FLUX.1-dev's guidance embedding (Flow-GRPO)
    # Attention and feed-forward projections of both block types (Flow-GRPO's FLUX LoRA targets).
    lora_target_modules = [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
        "proj_mlp", "proj_out",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        self._check_resolution(resolution, multiple)
        self.height = self.width = resolution
        self.latent_h = 2 * (resolution // multiple)
        self.latent_w = 2 * (resolution // multiple)
        self.num_channels = self.config.in_channels // 4
        self.image_ids = self.pipe._prepare_latent_image_ids(
            1, self.latent_h // 2, self.latent_w // 2, self.device, dtype)

    # ----- text ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning for a batch of prompts: batch-first tensors on the adapter's device.
        (Call inside `text_encoders_on_device()` on an accelerator, or it runs the encoders on the CPU.)"""
        self._require_text_encoders()
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
                 guidance_scale: float = 3.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. `sigma` is a float or a (batch,) tensor. `transformer`: another policy's
        module (a frozen copy) instead of the adapter's own; the same call for every policy, so they cannot drift."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        guidance = torch.full((batch,), guidance_scale, device=latents.device) if self.config.guidance_embeds else None
        prompt_embeds = cond["prompt_embeds"]
        text_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        hidden_states, image_ids = self._image_sequence(latents, cond)
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(
                hidden_states=hidden_states.to(self.dtype),
                timestep=sigma.to(self.dtype),  # FLUX takes σ (the pipeline passes timestep / 1000)
                guidance=guidance,
                pooled_projections=cond["pooled_prompt_embeds"].to(self.dtype),
                encoder_hidden_states=prompt_embeds.to(self.dtype),
                txt_ids=text_ids,
                img_ids=image_ids,
                return_dict=False,
            )[0]
        return out[:, : latents.shape[1]].float()  # the target's tokens (Kontext appends condition tokens)

    def _image_sequence(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]):
        """The image tokens the transformer sees and their position ids: the target's alone."""
        return latents, self.image_ids

    # ----- images -------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def build_tiny_flux1(path: Path, pipeline_class: str = "FluxPipeline") -> None:
    """FLUX.1-like; with pipeline_class="FluxKontextPipeline" the same components as FLUX.1 Kontext (which has
    FLUX.1's architecture and configs: the condition tokens are only a longer image sequence)."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(TINY_SEED)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    text_encoder_2 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_2), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                 relative_attention_num_buckets=8)
    )
    # Four blocks keep the VAE's 8x downsampling, as in the real model.
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8], layers_per_block=1,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    # FLUX.1-dev's scheduler config: resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )
    pipe.save_pretrained(path, safe_serialization=True)
