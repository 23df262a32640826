"""Qwen-Image (`QwenImagePipeline`)."""

from pathlib import Path

import numpy as np
import torch

from common.models.base import _Adapter
from common.models.tiny_parts import TINY_SEED, tiny_qwen2_tokenizer
from common.utils import UserError


class QwenImageAdapter(_Adapter):
    """Qwen-Image over `QwenImagePipeline`'s components: a Qwen2.5-VL text encoder behind a chat template,
    packed 2x2 latents like FLUX.1, σ fed to the transformer, true CFG with the pipeline's norm rescale.

    Prompt embeddings have one row per text token; `encode_prompts` zero-pads them to `max_sequence_length`
    with a mask so that texts of any length stack (and cache); `velocity` trims the padding no row of the
    batch uses and masks the rest, so padded tokens never reach the image tokens."""

    pipeline_class_name = "QwenImagePipeline"
    default_guidance_scale = 4.0  # true CFG scale of the references (Qwen-Image, Flow-GRPO)
    display_name = "Qwen-Image"
    max_sequence_limit = 1024
    text_components = ("text_encoder", "tokenizer")
    long_tokenizer = "tokenizer"
    true_cfg = True
    # Flow-GRPO's Qwen-Image LoRA targets: attention of both streams and both streams' MLPs.
    lora_target_modules = [
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    ]
    # QwenImageTransformer2DModel projects only the image stream out of its last block
    last_block_text_outputs = ("attn.to_add_out", "txt_mlp")

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        if text_only:
            return
        if getattr(self.config, "guidance_embeds", False):
            raise UserError(f"{model_path!r} is a guidance-distilled Qwen-Image transformer, which this adapter "
                            f"does not support (it runs true CFG)")
        self.vae_scale_factor = self.pipe.vae_scale_factor
        multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        self._check_resolution(resolution, multiple)
        self.height = self.width = resolution
        self.latent_h = self.latent_w = 2 * (resolution // multiple)
        patch = self.config.patch_size ** 2  # 2x2 latents fold into one token's channels (Qwen-Image; 2.1: 1x1)
        self.num_channels = self.config.in_channels // patch
        self.image_tokens = self.latent_h * self.latent_w // patch  # the target's tokens

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The last hidden state of the text encoder over the chat template minus its 34-token system prefix
        (`QwenImagePipeline.encode_prompt`), zero-padded to max_sequence_length, and its 0/1 mask."""
        self._require_text_encoders()
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = self.max_sequence_length - embeds.shape[1]
        return {"prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
                "prompt_embeds_mask": torch.nn.functional.pad(mask.long(), (0, pad))}

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial packed latents (batch, (h/2)·(w/2), 4C), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        batch = len(generators)
        shape = (batch, 1, self.num_channels, self.latent_h, self.latent_w)  # the pipeline's 1-frame layout
        latents = randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)
        return self.pipe._pack_latents(latents, batch, self.num_channels, self.latent_h, self.latent_w)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """σ_0 = 1 … σ_N = 0 exactly as `QwenImagePipeline` builds it (linspace, resolution-dependent shift μ,
        the scheduler's shift_terminal)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        cfg = self.scheduler.config
        mu = calculate_shift(self.image_tokens, cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        retrieve_timesteps(self.scheduler, num_steps, "cpu", sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return self.scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32. With guidance_scale > 1: negative and positive in one batch of 2B,
        v = v_neg + w·(v_pos − v_neg), rescaled per token to the norm of v_pos (QwenImagePipeline's true CFG)."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        embeds, mask, x = cond["prompt_embeds"], cond["prompt_embeds_mask"], latents
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_embeds_mask"], mask])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        keep = int(mask.sum(dim=1).max())  # text columns some row of this batch uses
        embeds, mask = embeds[:, :keep], mask[:, :keep]
        mask = None if bool(mask.all()) else mask  # the pipeline passes a mask only when a text is padded
        # The pipeline feeds (1000·σ in the latents' dtype) / 1000: the same rounding here.
        timestep = (sigma * self.scheduler.config.num_train_timesteps).to(self.dtype) / self.scheduler.config.num_train_timesteps
        img_shapes = [[(1, self.latent_h // 2, self.latent_w // 2)]] * x.shape[0]
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep, guidance=None,
                                   encoder_hidden_states_mask=mask, encoder_hidden_states=embeds.to(self.dtype),
                                   img_shapes=img_shapes, return_dict=False)[0].float()
        if cfg:
            text = out.chunk(2)[1]
            combined = self._cfg_combine(out, guidance_scale)
            out = combined * (torch.norm(text, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, shape (batch, 3, H, W) (the VAE's single frame)."""
        latents = self.pipe._unpack_latents(latents, self.height, self.width, self.vae_scale_factor).to(self.vae.dtype)
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        images = self.vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def _tiny_qwen_vl(tokenizer):
    """A 2-layer Qwen2.5-VL with a 1-block vision tower (the real tower's 14-pixel patches and 2×2 merge)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1e6,
            # mrope_section sums to head_dim / 2 = 8 (temporal, height, width rotary frequencies)
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    ))


def _tiny_qwen_vae():
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 2.5, 1.0],
    )


def _tiny_qwen_transformer(**extra):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * 4, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), **extra,
    )


def _qwen_image_scheduler():
    """Qwen-Image's scheduler config: exponential resolution-dependent shift, last σ stretched to 0.02."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )


def build_tiny_qwen_image(path: Path) -> None:
    """Qwen-Image-like: a 2-layer Qwen2.5-VL (with a 1-block vision tower, never used for text-to-image), the
    QwenImage MMDiT, the Wan-style 3D VAE with 8x downsampling and the real scheduler config."""
    from diffusers import QwenImagePipeline

    tokenizer = tiny_qwen2_tokenizer()
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_qwen_vl(tokenizer)
    vae, transformer = _tiny_qwen_vae(), _tiny_qwen_transformer()
    pipe = QwenImagePipeline(scheduler=_qwen_image_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.save_pretrained(path, safe_serialization=True)
