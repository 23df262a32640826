"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`)."""

from pathlib import Path

import torch

from common.models.base import _Adapter
from common.models.tiny_parts import TINY_SEED, _tiny_sd3_vae, tiny_clip_tokenizer, tiny_t5_tokenizer


class SD3Adapter(_Adapter):
    """Stable Diffusion 3 / 3.5 over `StableDiffusion3Pipeline`'s components: two CLIP encoders + T5, an MMDiT
    that takes diffusers' timestep 1000·σ, true classifier-free guidance with negative prompts."""

    pipeline_class_name = "StableDiffusion3Pipeline"
    default_guidance_scale = 4.5  # true CFG scale of the references (SD3.5-M, Flow-GRPO)
    display_name = "SD3"
    max_sequence_limit = 512  # the T5 input
    text_components = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
    long_tokenizer = "tokenizer_3"
    true_cfg = True
    # Flow-GRPO's SD3.5 LoRA targets: the joint attention's image and text projections (not `attn2`).
    lora_target_modules = [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 256, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self.vae_scale_factor = self.pipe.vae_scale_factor
        patch = self.config.patch_size
        largest = self.config.pos_embed_max_size * patch * self.vae_scale_factor if self.config.pos_embed_max_size else None
        self._check_resolution(resolution, self.vae_scale_factor * patch, largest)
        self.height = self.width = resolution

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """CLIP-L/CLIP-G hidden states (zero-padded to the T5 width) followed by the T5 states, and both CLIP
        pooled projections side by side, as `StableDiffusion3Pipeline.encode_prompt` builds them."""
        self._require_text_encoders()
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, H/8, W/8), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.config.in_channels, self.height // self.vae_scale_factor,
                 self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's own schedule, called with no sigmas as `StableDiffusion3Pipeline` does: a linspace
        of the (already shifted) training range, shifted by 3 again, so the last σ before 0 is ≈ 0.009 at N = 10."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (calculate_shift,
                                                                                        retrieve_timesteps)

        cfg, kwargs = self.scheduler.config, {}
        if cfg.get("use_dynamic_shifting", False):  # not SD3.5's config; kept as the pipeline has it
            patch = self.config.patch_size
            seq_len = (self.height // self.vae_scale_factor // patch) * (self.width // self.vae_scale_factor // patch)
            kwargs["mu"] = calculate_shift(seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                           cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", **kwargs)
        return self.scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32; with guidance_scale > 1 the negative and positive conditioning run as one
        batch of 2B and combine as v_neg + w·(v_pos − v_neg), as the pipeline does."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        timestep = sigma * self.scheduler.config.num_train_timesteps  # the scheduler's own float32 product
        embeds, pooled, x = cond["prompt_embeds"], cond["pooled_prompt_embeds"], latents
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep,
                                   encoder_hidden_states=embeds.to(self.dtype),
                                   pooled_projections=pooled.to(self.dtype), return_dict=False)[0].float()
        return self._cfg_combine(out, guidance_scale) if cfg else out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Latents -> images in [0, 1], float32, shape (batch, 3, H, W)."""
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def build_tiny_sd3(path: Path) -> None:
    """SD3.5-Medium-like: two CLIP-with-projection encoders + T5, an MMDiT with RMS qk-norm and one
    dual-attention block, the static-shift-3 scheduler of the real checkpoint."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer, tokenizer_2, tokenizer_3 = tiny_clip_tokenizer(), tiny_clip_tokenizer(), tiny_t5_tokenizer()
    torch.manual_seed(TINY_SEED)

    def clip(hidden: int, projection: int):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ))

    # The two CLIP hidden sizes (16 + 16) are zero-padded up to the T5 width (32) and concatenated along the
    # sequence; the pooled vector is both CLIP projections side by side (16 + 16 = pooled_projection_dim).
    text_encoder, text_encoder_2 = clip(16, 16), clip(16, 16)
    text_encoder_3 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_3), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                 relative_attention_num_buckets=8)
    )
    vae = _tiny_sd3_vae(4, scaling_factor=1.5305, shift_factor=0.0609)
    # pos_embed_max_size x patch_size x 8 = 256: the largest resolution this tiny model takes.
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5's scheduler config
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(path, safe_serialization=True)
