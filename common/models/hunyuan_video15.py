"""HunyuanVideo-1.5 text-to-video (`HunyuanVideo15Pipeline`) and image-to-video (`HunyuanVideo15ImageToVideoPipeline`).

The transformer takes [noisy latents, condition latents, mask] along channels and three context streams: the Qwen2.5-VL
text (third-to-last hidden state over a chat template whose 108-token system prefix is dropped), ByT5 embeddings of
the prompt's quoted text (zeros and an empty mask when it quotes none) and SigLIP image tokens. For text-to-video the
condition latents, the mask and the image tokens are zeros (the transformer then masks the image tokens out); for
image-to-video the condition latents hold the image's VAE latents in the first latent frame, the mask is 1 there, and
the image tokens are SigLIP's last hidden state of the image."""

import inspect
from pathlib import Path

import numpy as np
import torch

from common.checkpoint import LORA_FILE
from common.models.base import FirstFrameConditioned, _Adapter, lora_metadata
from common.models.tiny_parts import (_QWEN_TEMPLATE_WORDS, TINY_SEED, _byte_level_bpe, _merge_into_single_tokens,
                                      tiny_qwen2_tokenizer)
from common.utils import UserError


class HunyuanVideo15Adapter(_Adapter):
    """HunyuanVideo-1.5 T2V over `HunyuanVideo15Pipeline`'s components: latents (batch, C, 1 + (F − 1)/4, H/16, W/16),
    σ = linspace(1, 0, N + 1)[:-1] shifted by the scheduler's flow shift (FlowMatchEuler), the transformer fed the
    scheduler's timestep 1000·σ, true CFG v_neg + w·(v_pos − v_neg) as the pipeline's ClassifierFreeGuidance computes
    it (negative and positive in one batch of 2B here; the pipeline runs them one after the other).

    `encode_prompts` returns the pipeline's four text tensors (`encode_prompt`): `prompt_embeds` and its 0/1
    `prompt_embeds_mask` (max_sequence_length rows: the pipeline's `tokenizer_max_length`, 1000 in the pipeline),
    `prompt_embeds_2` and `prompt_embeds_mask_2` (ByT5, 256 rows). The masks let texts of any length stack and cache;
    the transformer moves the valid tokens first and masks the rest."""

    pipeline_class_name = "HunyuanVideo15Pipeline"
    display_name = "HunyuanVideo-1.5"
    default_guidance_scale = 6.0  # the official repo's optimal setting for the 480p and 720p T2V and I2V models
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    long_tokenizer = "tokenizer"
    true_cfg = True
    video = True
    # preprocess.py loads the VAE too: the pipelines' __init__ read `vae.config` whenever a `vae` attribute exists,
    # even None (diffusers 0.42), so a pipeline without it cannot be built.
    model_components = ("transformer",)
    # Attention of both streams (the dual-stream blocks and the text token refiner), as Wan's and Qwen-Image's targets.
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
    # HunyuanVideo15Transformer3DModel projects only the video stream out of its last block
    last_block_text_outputs = ("attn.to_add_out", "ff_context")
    text_inputs = {"prompt_embeds": "encoder_hidden_states", "prompt_embeds_mask": "encoder_attention_mask",
                   "prompt_embeds_2": "encoder_hidden_states_2", "prompt_embeds_mask_2": "encoder_attention_mask_2"}

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 1000, load_text_encoders: bool = True, text_only: bool = False,
                 num_frames: int = 33):
        self._load(model_path, device, dtype, load_text_encoders, text_only, max_sequence_length)
        self.pipe.tokenizer_max_length = max_sequence_length  # the Qwen text length (the pipeline's is 1000)
        self.vae_scale_factor = self.pipe.vae_scale_factor_spatial
        self.temporal_factor = self.pipe.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            raise UserError(f"num_frames {num_frames} is not {self.temporal_factor}k + 1 (e.g. 33 or 121), as the "
                            f"{self.display_name} VAE requires")
        self.height = self.width = resolution
        self.num_frames = num_frames
        if text_only:
            return
        self._check_resolution(resolution, self.vae_scale_factor * self.config.patch_size)
        self._check_guider(model_path)

    def _check_guider(self, model_path: str) -> None:
        """Our CFG is ClassifierFreeGuidance's plain formula over every step; a checkpoint whose guider rescales,
        uses the original formulation or guides only some steps would differ silently, so it is refused. A
        CFG-distilled checkpoint (guidance 1, or the guider disabled) runs without CFG by default, as its pipeline."""
        guider = self.pipe.guider
        if guider is None:
            return
        config = guider.config
        if config.get("guidance_rescale", 0.0) or config.get("use_original_formulation", False) or \
                (config.get("start", 0.0), config.get("stop", 1.0)) != (0.0, 1.0):
            raise UserError(f"{model_path!r}: its guider ({type(guider).__name__}, {dict(config)}) is not plain CFG "
                            f"over every step, which is all {self.display_name} supports here")
        if not config.get("enabled", True) or config.get("guidance_scale", 6.0) <= 1:
            self.default_guidance_scale = 1.0

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's Qwen and ByT5 embeddings and masks of each prompt (see the class docstring)."""
        self._require_text_encoders()
        embeds, mask, embeds_2, mask_2 = self.pipe.encode_prompt(prompt=prompts, device=self.device, dtype=self.dtype,
                                                                 batch_size=len(prompts))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": embeds_2,
                "prompt_embeds_mask_2": mask_2}

    def count_truncated(self, texts: list[str]) -> int:
        """How many texts the pipeline cuts: the templated prompt, less the dropped system prefix, is cut at
        max_sequence_length tokens (the generation prompt's tokens count too)."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        tokenizer = getattr(self.pipe, "tokenizer", None)
        if tokenizer is None:
            return 0
        count = 0
        for text in texts:
            ids = tokenizer.apply_chat_template(format_text_input([text], self.pipe.system_message),
                                                add_generation_prompt=True, tokenize=True, return_dict=True)
            count += len(ids["input_ids"][0]) - self.pipe.prompt_template_encode_start_idx > self.max_sequence_length
        return count

    def noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial latents (batch, C, latent frames, H/16, W/16), one generator per sample, float32."""
        from diffusers.utils.torch_utils import randn_tensor

        shape = (len(generators), self.vae.config.latent_channels, (self.num_frames - 1) // self.temporal_factor + 1,
                 self.height // self.vae_scale_factor, self.width // self.vae_scale_factor)
        return randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's σ: linspace(1, 0, N + 1) without its 0, through the scheduler's flow shift, then 0."""
        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return self.scheduler.sigmas.float().clone().to(self.device)

    def _condition(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """[condition latents, mask] to concatenate after the latents, and the image tokens: zeros for text-to-video
        (`prepare_cond_latents_and_mask`, and the pipeline's zero image_embeds of 729 SigLIP tokens)."""
        batch, _, frames, height, width = latents.shape
        channels = torch.zeros(batch, latents.shape[1] + 1, frames, height, width, device=latents.device)
        image = torch.zeros(batch, self.pipe.vision_num_semantic_tokens, self.config.image_embed_dim,
                            device=latents.device)
        return channels, image

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 6.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) in float32; with guidance_scale > 1 the negative and positive prompts run as one batch of
        2B, v_neg + w·(v_pos − v_neg); both branches see the same condition channels and image tokens."""
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(batch)
        timestep = sigma * self.scheduler.config.num_train_timesteps  # the scheduler's timesteps, float
        channels, image = self._condition(latents, cond)
        x = torch.cat([latents, channels], dim=1)
        texts = {name: cond[key] for key, name in self.text_inputs.items()}
        cfg = self._with_negatives(cond, guidance_scale)
        if cfg:
            texts = {name: torch.cat([cond[f"negative_{key}"], cond[key]]) for key, name in self.text_inputs.items()}
            x, timestep, image = torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([image, image])
        model = self.transformer if transformer is None else transformer
        with self._autocast():
            out = model(hidden_states=x.to(self.dtype), timestep=timestep.to(self.dtype), image_embeds=image.to(self.dtype),
                        return_dict=False, **{k: v.to(self.dtype) for k, v in texts.items()})[0].float()
        return self._cfg_combine(out, guidance_scale) if cfg else out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Latents -> videos in [0, 1], float32, (batch, frames, 3, H, W): the VAE of latents / scaling_factor, one
        sample at a time (the VAE's mid-block attention broadcasts its (batch, N, N) causal mask against (batch, 1, N,
        N) queries, which fails for a batch of more than one in diffusers 0.42)."""
        scaled = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = torch.cat([self.vae.decode(sample[None], return_dict=False)[0] for sample in scaled])
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)

    def save_lora(self, directory, lora_state_dict: dict[str, torch.Tensor], adapter_name: str = "default") -> None:
        """The LoRA in diffusers' format with its peft config as metadata. The HunyuanVideo-1.5 pipelines have no
        LoRA loader mixin: the stock pipeline loads it with `pipe.transformer.load_lora_adapter(folder,
        prefix="transformer", weight_name="pytorch_lora_weights.safetensors")`."""
        from diffusers.loaders.lora_base import LoraBaseMixin

        metadata = lora_metadata(self.pipe.transformer, adapter_name, lora_state_dict)
        LoraBaseMixin._save_lora_weights(str(directory), {"transformer": lora_state_dict}, {"transformer": metadata},
                                         weight_name=LORA_FILE)


class HunyuanVideo15ImageToVideoAdapter(FirstFrameConditioned, HunyuanVideo15Adapter):
    """HunyuanVideo-1.5 I2V over `HunyuanVideo15ImageToVideoPipeline`'s components: `HunyuanVideo15Adapter` plus the
    condition image, the video's first frame, centre-cropped to the output size (the pipeline's
    `resize(..., resize_mode="crop")`; the pipeline picks that size from the image's aspect-ratio bucket, here it is
    `--resolution`, square). `encode_prompts` returns, with the text tensors:

    - `image_condition`: [the image's VAE latents (mode, × scaling_factor) in the first latent frame and zeros after,
      a mask of 1 on the first latent frame], C + 1 channels, as `prepare_cond_latents_and_mask` builds them;
    - `image_embeds`: SigLIP's last hidden state of the cropped image (`encode_image`), the transformer's image tokens.

    Both depend only on the prompt's image, so the embedding cache holds them and training loads neither SigLIP nor
    the text encoders. Step-distilled (meanflow) checkpoints, which take the next step's timestep too, are refused."""

    pipeline_class_name = "HunyuanVideo15ImageToVideoPipeline"
    display_name = "HunyuanVideo-1.5 I2V"
    text_components = (*HunyuanVideo15Adapter.text_components, "image_encoder", "feature_extractor")
    condition_components = ("vae",)  # condition latents are cached: preprocess.py VAE-encodes them

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 1000, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None, num_frames: int = 33):
        self._check_condition_size(condition_size, resolution)
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                         num_frames)
        if self.pipe.image_encoder is not None:  # frozen like the text encoders, parked on the CPU between uses
            self.pipe.image_encoder.requires_grad_(False).to(self.offload_device)
            self.text_encoders.append(self.pipe.image_encoder)
        elif load_text_encoders:
            raise UserError(f"{model_path!r} has no SigLIP image_encoder: it is not a {self.display_name} checkpoint")
        self.condition_size = condition_size
        if not text_only and self.config.use_meanflow:
            raise UserError(f"{model_path!r} is a step-distilled (meanflow) checkpoint, whose transformer takes the "
                            f"next step's timestep too; only the 50-step I2V checkpoints are supported")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        """Text tensors, SigLIP image tokens and first-frame condition channels, one row per prompt (see the class
        docstring)."""
        self._check_one_image_each(prompts, images)
        cond = super().encode_prompts(prompts)
        pipe, frames = self.pipe, (self.num_frames - 1) // self.temporal_factor + 1
        embeds, conditions = [], []
        for (image,) in images:
            image = pipe.video_processor.resize(image, height=self.height, width=self.width, resize_mode="crop")
            embeds.append(pipe.encode_image(image, 1, self.device, self.dtype))
            first = pipe._get_image_latents(pipe.vae, pipe.video_processor, image, self.height, self.width,
                                            self.device)  # (1, C, 1, H/16, W/16)
            latents = torch.cat([first, first.new_zeros(1, first.shape[1], frames - 1, *first.shape[3:])], dim=2)
            mask = torch.zeros_like(latents[:, :1])
            mask[:, :, 0] = 1.0
            conditions.append(torch.cat([latents, mask], dim=1).to(self.dtype))
        return {**cond, "image_embeds": torch.cat(embeds), "image_condition": torch.cat(conditions)}

    def _condition(self, latents: torch.Tensor, cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return cond["image_condition"].to(latents.dtype), cond["image_embeds"]


# Qwen2.5's chat template, as HunyuanVideo15Pipeline formats each prompt (a system turn, the user turn, the generation
# prompt), without the tool and vision branches the text-to-video path never reaches.
_QWEN25_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tiny_hunyuan_video15_components():
    """HunyuanVideo-1.5's text side and VAE at tiny width: a 3-layer Qwen2.5-VL text model (the pipeline reads its
    third-to-last hidden state) behind Qwen2.5's chat template, whose byte-level tokenizer makes each word of the
    pipeline's system prompt one token (as the real vocabulary does for most of them); ByT5 (the real byte tokenizer,
    which needs no files) with a 2-layer T5 encoder for the quoted glyph text; the 16× spatial, 4× temporal
    AutoencoderKLHunyuanVideo15 with 4 latent channels; FlowMatchEuler at the 480p models' flow shift 5."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from transformers import (ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, Qwen2Tokenizer, T5Config,
                              T5EncoderModel)

    # The pipeline's system prompt: its encoder's default argument (the pipeline sets the same text in __init__).
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    base = tiny_qwen2_tokenizer()
    vocab, merges = _byte_level_bpe(_QWEN_TEMPLATE_WORDS)
    _merge_into_single_tokens(vocab, merges, [w for text in (system, "system user assistant")
                                              for w, _ in base.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for token in specials:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials[1:],
                               model_max_length=4096)
    tokenizer.chat_template = _QWEN25_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=4096, rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>")))
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=16, d_ff=32, d_kv=8, num_heads=2,
                                             num_layers=2, relative_attention_num_buckets=8))
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer_2, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))


def build_tiny_hunyuan_video15(path: Path) -> None:
    """HunyuanVideo-1.5 480p T2V-like: `_tiny_hunyuan_video15_components` and a 1-block HunyuanVideo-1.5 DiT (one
    token-refiner layer) that takes [noise, condition latents, mask] (in_channels = 2·4 + 1, as the real 65 = 2·32 + 1)
    and the three context streams (Qwen text, ByT5 glyphs, SigLIP-width image tokens, all zero for text-to-video),
    and the pipeline's ClassifierFreeGuidance at the published scale 6."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    components = _tiny_hunyuan_video15_components()
    pipe = HunyuanVideo15Pipeline(transformer=_tiny_hunyuan_video15_transformer("t2v"),
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0), **components)
    pipe.save_pretrained(path, safe_serialization=True)


def build_tiny_hunyuan_video15_i2v(path: Path) -> None:
    """HunyuanVideo-1.5 480p I2V-like: the T2V tiny's components and transformer config (task_type i2v), and a
    1-layer SigLIP vision tower (32 px in 8 px patches: 16 image tokens; the real 384 px in 14 px patches gives 729)
    whose width is the transformer's image_embed_dim, with SigLIP's own preprocessing at 32 px."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    components = _tiny_hunyuan_video15_components()
    image_encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=32, patch_size=8))
    pipe = HunyuanVideo15ImageToVideoPipeline(
        transformer=_tiny_hunyuan_video15_transformer("i2v"), guider=ClassifierFreeGuidance(guidance_scale=6.0),
        image_encoder=image_encoder, feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}),
        **components)
    pipe.save_pretrained(path, safe_serialization=True)


def _tiny_hunyuan_video15_transformer(task_type: str):
    from diffusers import HunyuanVideo15Transformer3DModel

    # head_dim 16 = sum(rope_axes_dim), as 128 = 16 + 56 + 56; target_size 32: the I2V bucket of a square image
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * 4 + 1, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=32, text_embed_2_dim=16,
        image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=32, task_type=task_type)
