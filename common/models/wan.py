"""Wan2.1 text-to-video (`WanPipeline`)."""

from pathlib import Path

import torch

from common.models.base import _Adapter
from common.models.tiny_parts import TINY_SEED, tiny_t5_tokenizer
from common.utils import UserError


class WanAdapter(_Adapter):
    """Wan2.1 text-to-video over `WanPipeline`'s components: UMT5 encoder, the Wan 3D causal VAE, latents
    (batch, C, 1 + (F − 1)/4, H/8, W/8), true CFG. Decoded videos are (batch, F, 3, H, W).

    The schedule is the checkpoint's UniPC flow schedule (σ from `set_timesteps`, as the pipeline and
    Flow-GRPO's Wan trainer use), integrated by our Euler/SDE steps instead of UniPC's multistep updates.
    The transformer sees the scheduler's integer timestep, ⌊1000·σ⌋, capped at 999 as UniPC's is."""

    pipeline_class_name = "WanPipeline"
    default_guidance_scale = 4.5  # true CFG scale of the references (Wan2.1, Flow-GRPO)
    display_name = "Wan"
    text_components = ("text_encoder", "tokenizer")
    long_tokenizer = "tokenizer"
    true_cfg = True
    video = True
    # Flow-GRPO's Wan2.1 LoRA targets (the add_* projections exist only in image-to-video checkpoints).
    lora_target_modules = [
        "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v",
    ]

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int = 33):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        self._check_checkpoint(model_path)
        self.vae_scale_factor = self.pipe.vae_scale_factor_spatial
        self.temporal_factor = self.pipe.vae_scale_factor_temporal
        self._check_resolution(resolution, self.vae_scale_factor * self.config.patch_size[1])
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise UserError(f"num_frames {num_frames} is not {self.temporal_factor}k + 1 (e.g. 33 or 81), "
                            f"as the Wan VAE requires")
        self.height = self.width = resolution
        self.num_frames = num_frames

    def _check_checkpoint(self, model_path: str) -> None:
        if self.pipe.transformer_2 is not None or self.pipe.config.get("expand_timesteps", False):
            raise UserError(f"{model_path!r} is a Wan2.2 two-expert or per-token-timestep checkpoint: use --model "
                            f"wan2.2 or wan2.2-5b")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """UMT5 states of the cleaned prompt, zeroed past its end and padded to max_sequence_length
        (`WanPipeline.encode_prompt`)."""
        self._require_text_encoders()
        prompt_embeds, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                   max_sequence_length=self.max_sequence_length, device=self.device)
        return {"prompt_embeds": prompt_embeds}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, latent frames, H/8, W/8), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.config.in_channels, (self.num_frames - 1) // self.temporal_factor + 1,
                 self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's σ for `num_steps`, as `WanPipeline` sets them, ending at 0. UniPC lowers σ_0 = 1 by
        1e-6 only to keep its log-SNR finite; Euler/SDE steps need no such guard (and flow-sde's σ = 1 rule
        needs σ_0 = 1 exactly), so it is put back."""
        self.scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = self.scheduler.sigmas.float().clone()
        if abs(float(sigmas[0]) - 1.0) < 1e-5:
            sigmas[0] = 1.0
        return sigmas.to(self.device)

    def _timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """UniPC's timestep int64(1000·σ): truncated, at most num_train_timesteps − 1."""
        steps = self.scheduler.config.num_train_timesteps
        return (sigma.double() * steps).floor().clamp(max=steps - 1).long()

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.5, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32; with guidance_scale > 1 negative and positive conditioning run as one
        batch of 2B and combine as v_neg + w·(v_pos − v_neg), as the pipeline does."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        cfg = self._with_negatives(cond, guidance_scale)
        return self._guided(latents, sigma, cond, guidance_scale if cfg else None, transformer)

    def _transformer_timestep(self, sigma: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The timestep input of the transformer (Wan2.2-5B: one per latent token)."""
        return self._timestep(sigma)

    def _model_input(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's hidden_states (image-to-video: the condition channels after the latents)."""
        return latents

    def _extra_inputs(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The transformer's inputs besides latents, timestep and text (Wan2.1 I2V: the CLIP image tokens)."""
        return {}

    def _guided(self, latents: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale,
                transformer) -> torch.Tensor:
        """The transformer's output at per-sample σ; with `guidance_scale` (a number, or per sample shaped to
        broadcast over the latents; None: no CFG) negative and positive conditioning run as one batch."""
        timestep, embeds = self._transformer_timestep(sigma, latents), cond["prompt_embeds"]
        x, extra = self._model_input(latents, cond), self._extra_inputs(cond)
        cfg = guidance_scale is not None
        if cfg:  # only the text differs between the branches: the condition inputs are the positive ones twice
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            extra = {name: torch.cat([value, value]) for name, value in extra.items()}
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep, encoder_hidden_states=embeds.to(self.dtype),
                        return_dict=False, **{name: value.to(self.dtype) for name, value in extra.items()})[0].float()
        return self._cfg_combine(out, guidance_scale) if cfg else out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Latents -> videos in [0, 1], float32, shape (batch, frames, 3, H, W)."""
        latents = latents.to(self.vae.dtype)
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = self.vae.decode(latents / inv_std + mean, return_dict=False)[0]  # (batch, 3, F, H, W)
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)


def build_tiny_wan(path: Path) -> None:
    """Wan2.1-T2V-like: UMT5 encoder, the Wan 3D causal VAE (8x spatial, 4x temporal), the Wan DiT and the
    real checkpoint's UniPC flow scheduler (flow_shift 3)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                   relative_attention_num_buckets=8)
    )
    vae = _tiny_wan_vae()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)
    pipe.save_pretrained(path, safe_serialization=True)


def _tiny_wan_vae():
    """The Wan2.1 3D causal VAE (8x spatial, 4x temporal) with 4 latent channels and non-trivial statistics."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 2.5, 1.0],
    )
