"""Wan2.1 image-to-video (`WanImageToVideoPipeline`): the condition image is the first frame. Its CLIP embeddings
join the text as extra cross-attention tokens, and its VAE latents (the first frame followed by black frames) with
a first-frame mask are concatenated to the noisy latents along channels, as the pipeline does. Wan2.2 I2V A14B
(common/models/wan22.py) adds its two experts to this condition, without the CLIP tokens."""

from pathlib import Path

import torch

from common.models.base import FirstFrameConditioned
from common.models.tiny_parts import TINY_SEED, tiny_t5_tokenizer
from common.models.wan import WanAdapter, _tiny_wan_vae
from common.utils import UserError


class WanImageToVideoAdapter(FirstFrameConditioned, WanAdapter):
    """Wan2.1-I2V over `WanImageToVideoPipeline`'s components: `WanAdapter` (UMT5, the Wan VAE, the UniPC σ
    schedule and integer timesteps, true CFG) plus the condition image, which is the video's first frame at the
    output size. `encode_prompts` returns, per prompt and its image:

    - `prompt_embeds`: UMT5 states (as `WanAdapter`), zero-padded to 512 rows (`text_tokens`);
    - `image_embeds`: the CLIP vision encoder's penultimate hidden states (`pipe.encode_image`), the
      transformer's `encoder_hidden_states_image`;
    - `image_condition`: (4 mask + z_dim) channels × latent frames × H/8 × W/8, the tensor `prepare_latents`
      builds and the pipeline concatenates after the noisy latents, in the model dtype (the pipeline casts the
      concatenation to it, so storing it cast changes nothing).

    All three depend only on the prompt and its image, so the embedding cache holds them and training loads
    neither the text nor the image encoder."""

    pipeline_class_name = "WanImageToVideoPipeline"
    display_name = "Wan I2V"
    default_guidance_scale = 5.0  # the pipeline's default and its model card's example
    # CLIP (image_encoder, image_processor) only feeds `image_embeds`, which the cache holds.
    text_components = ("text_encoder", "tokenizer", "image_encoder", "image_processor")
    condition_components = ("vae",)  # condition latents are cached: preprocess.py VAE-encodes them
    # WanAttnProcessor takes all but the last 512 context tokens as image tokens (hardcoded) where the transformer
    # has an image projection (Wan2.1): the prompt embeddings are zero-padded to 512 rows whatever
    # max_sequence_length (which bounds the prompt, up to 512), as the pipeline pads them at its 512.
    text_tokens = 512
    max_sequence_limit = 512
    two_experts = False  # Wan2.2 I2V A14B (common/models/wan22.py) is the two-expert subclass

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None, num_frames: int = 33):
        self._check_condition_size(condition_size, resolution)
        from diffusers.utils import is_ftfy_available

        if load_text_encoders and not is_ftfy_available():  # WanImageToVideoPipeline cleans prompts with it, unguarded
            raise UserError(f"{self.display_name}'s prompt encoding needs the ftfy package: pip install ftfy")
        self._refuse_other_wan(model_path)
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        # What the condition tensors need is set before the text-only return: preprocess.py builds them.
        self.vae_scale_factor = self.pipe.vae_scale_factor_spatial
        self.temporal_factor = self.pipe.vae_scale_factor_temporal
        transformer_config = (self.pipe.transformer.config if self.pipe.transformer is not None
                              else self._transformer_config(model_path))
        # Wan2.1's transformer takes CLIP image tokens; Wan2.2 A14B's has no image projection and the pipeline
        # encodes none (its `image_dim is not None` test, followed here).
        self.image_tokens = transformer_config["image_dim"] is not None
        if not self.image_tokens and not self.two_experts:
            raise UserError(f"{model_path!r}: its transformer has no image projection (image_dim); only Wan2.1 "
                            f"image-to-video checkpoints are supported")
        if self.image_tokens and self.pipe.image_encoder is not None:  # frozen, parked on the CPU between uses
            self.pipe.image_encoder.requires_grad_(False).to(self.offload_device)
            self.text_encoders.append(self.pipe.image_encoder)
        elif self.image_tokens and load_text_encoders:
            raise UserError(f"{model_path!r} has no CLIP image_encoder: it is not a Wan2.1 image-to-video checkpoint")
        self._check_resolution(resolution, self.vae_scale_factor * transformer_config["patch_size"][1])
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise UserError(f"num_frames {num_frames} is not {self.temporal_factor}k + 1 (e.g. 33 or 81), "
                            f"as the Wan VAE requires")
        self.height = self.width = resolution
        self.num_frames = num_frames
        self.condition_size = condition_size

    def _refuse_other_wan(self, model_path: str) -> None:
        """Send a Wan2.1 image-to-video checkpoint to wan-i2v and a Wan2.2 A14B one (two experts switched at
        boundary_ratio) to wan2.2-i2v, and refuse TI2V's per-token timesteps, from model_index.json alone, before
        any weights load. Unreadable configs are left to `_load`, which reports them."""
        import diffusers

        try:
            config = diffusers.DiffusionPipeline.load_config(model_path)
        except (OSError, ValueError):
            return
        if config.get("_class_name") != self.pipeline_class_name:
            return
        if config.get("expand_timesteps", False):
            raise UserError(f"{model_path!r} is a Wan2.2 TI2V (per-token-timestep) image-to-video checkpoint; only "
                            f"Wan2.1 (--model wan-i2v) and Wan2.2 A14B (--model wan2.2-i2v) image-to-video "
                            f"checkpoints are supported")
        two_experts = ((config.get("transformer_2") or [None])[0] is not None
                       and config.get("boundary_ratio") is not None)
        if two_experts != self.two_experts:
            kind, model = (("a Wan2.2 two-expert", "wan2.2-i2v") if two_experts
                           else ("a single-transformer (Wan2.1)", "wan-i2v"))
            raise UserError(f"{model_path!r} is {kind} image-to-video checkpoint: use --model {model}")

    def _transformer_config(self, model_path: str) -> dict:
        """The transformer's config without its weights (text-only loads)."""
        import diffusers

        try:
            return diffusers.WanTransformer3DModel.load_config(model_path, subfolder="transformer")
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read the transformer config of {model_path!r}: "
                            f"{str(err).splitlines()[0]}") from err

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        """Prompt embeddings, CLIP image embeddings and first-frame condition latents, one row per prompt (see the
        class docstring)."""
        self._check_one_image_each(prompts, images)
        cond = super().encode_prompts(prompts)
        if self.image_tokens:
            text = cond["prompt_embeds"]
            cond["prompt_embeds"] = torch.cat(
                [text, text.new_zeros(len(prompts), self.text_tokens - text.shape[1], text.shape[2])], dim=1)
        pipe, channels = self.pipe, self.pipe.vae.config.z_dim
        latent_shape = (1, channels, (self.num_frames - 1) // self.temporal_factor + 1,
                        self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        embeds, conditions = [], []
        for (image,) in images:
            if self.image_tokens:  # CLIP sees the image as given, as in the pipeline
                embeds.append(pipe.encode_image(image, self.device))
            pixels = pipe.video_processor.preprocess(image, height=self.height, width=self.width)
            # Given latents, prepare_latents draws no noise (the global RNG stays untouched); its condition is the
            # VAE mode of [first frame, zeros...], normalised, after the first-frame mask.
            _, condition = pipe.prepare_latents(
                pixels.to(self.device, torch.float32), 1, channels, self.height, self.width, self.num_frames,
                torch.float32, self.device, generator=None, latents=torch.zeros(latent_shape, device=self.device))
            conditions.append(condition.to(self.dtype))
        cond["image_condition"] = torch.cat(conditions)
        return {**cond, "image_embeds": torch.cat(embeds)} if self.image_tokens else cond

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, z_dim, latent frames, H/8, W/8), float32: the VAE's channels, not the
        transformer's in_channels (which add the mask and condition channels)."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.vae.config.z_dim, (self.num_frames - 1) // self.temporal_factor + 1,
                 self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def _model_input(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """[x_σ, image_condition] along channels, as the pipeline concatenates them."""
        return torch.cat([latents, cond["image_condition"].to(latents.dtype)], dim=1)

    def _extra_inputs(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The CLIP image tokens, where the transformer takes them (Wan2.1; Wan2.2 I2V has no image projection)."""
        return {"encoder_hidden_states_image": cond["image_embeds"]} if "image_embeds" in cond else {}


def build_tiny_wan_i2v(path: Path) -> None:
    """Wan2.1-I2V-like: `build_tiny_wan`'s UMT5 and VAE, a CLIP vision encoder whose penultimate hidden states feed
    the transformer's image projection (image_dim), and a transformer that takes the noise, the first-frame mask
    (one channel per frame of a latent frame: 4) and the condition latents: in_channels = 2·z_dim + 4."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config,
                              UMT5EncoderModel)

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                   relative_attention_num_buckets=8)
    )
    # 32x32 inputs in 8x8 patches: 16 patch tokens + the class token, as ViT-H/14's 256 + 1 at 224.
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         image_size=32, patch_size=8, projection_dim=16)
    )
    # The real checkpoint's preprocessing (CLIP mean/std, shortest-edge resize, centre crop) at 32 pixels.
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    vae = _tiny_wan_vae()
    # added_kv_proj_dim = the inner dim (as in the 14B model): the image tokens are projected to it first.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * 4 + 4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64, image_dim=16,
        added_kv_proj_dim=24,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, image_encoder=image_encoder,
                                   image_processor=image_processor, transformer=transformer, vae=vae,
                                   scheduler=scheduler)
    pipe.save_pretrained(path, safe_serialization=True)
