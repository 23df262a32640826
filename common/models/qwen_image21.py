"""Qwen-Image 2.1 (`QwenImage21Pipeline`): one model for text-to-image and editing. A dataset row without "image" is a
text-to-image prompt, a row with one or more condition images an edit (one number of images per run). Each
condition image is seen twice at one size, as in the pipeline: by the Qwen3-VL text encoder (inside the chat template
as "<imageK><vision tokens>" before the prompt) and as VAE latents that the transformer substitutes for those vision
tokens (each vision token stands for 2×2 latent tokens), so the condition tokens sit inside the text sequence and
the target's tokens follow it."""

from pathlib import Path

import torch

from common.models.qwen_image import _qwen_image_scheduler
from common.models.qwen_image_edit import QwenImageEditAdapter, _image_only_processor
from common.models.tiny_parts import TINY_SEED, _qwen2_tokenizer_with_words
from common.utils import UserError


class QwenImage21Adapter(QwenImageEditAdapter):
    """Qwen-Image 2.1 over `QwenImage21Pipeline`'s components: `QwenImageAdapter`'s noise (one 1×1 token per 16×16
    pixels, the pipeline's plain flatten), σ schedule (linspace with the token-count shift μ; a checkpoint's
    `sample_sigmas` grid is not used: the scripts set their own step counts) and decoding, plus the RGBA VAE (decoded
    images are composited over white) and `QwenImageEditAdapter`'s condition-image checks. `encode_prompts` returns,
    per prompt and its condition images (none for text-to-image):

    - `prompt_embeds`, `prompt_embeds_mask`: the Qwen3-VL hidden states of the last decoder layer before its final
      norm (the pipeline's hook) over the chat template minus its system turn, zero-padded with a 0/1 mask to
      max_sequence_length plus each image's framing and vision tokens; longer texts are cut at the end (the pipeline
      never cuts), the images always fit;
    - `image_pad_mask`: 1 at the vision-token positions of those rows (where the condition latents go);
    - with condition images, `image_latents` (their VAE latents, mode, normalised, flattened, concatenated in order)
      and `image_shapes` (images, 2): each condition's latent grid (H/16, W/16).

    The transformer is block-causal and its RoPE counts every text position, padding included, before the target's
    tokens: a padded row gives another velocity than the same row unpadded. So `velocity` runs the rows of each
    text length as one batch, cut to that length (what the pipeline runs for one prompt): a row's velocity never
    depends on the rows batched with it. True CFG (guidance_scale > 1) is the pipeline's plain
    v_neg + w·(v_pos − v_neg), without Qwen-Image's norm rescale; the model is trained for guidance 1.

    Sizes. Without `condition_size`, each image is resized as the pipeline resizes it for an output of `resolution`²:
    to an area of resolution² at its aspect ratio in multiples of 32 (`calculate_dimensions`), for the text encoder
    and the VAE alike. With `condition_size=N`, every condition image becomes N×N. Either way the processor must make
    one vision token per 32×32 pixels of it (its min/max pixels allow the size), else one line."""

    pipeline_class_name = "QwenImage21Pipeline"
    display_name = "Qwen-Image-2.1"
    default_guidance_scale = 1.0  # the model card's and the pipeline's default: no CFG
    condition_images = (0, None)  # text-to-image rows have none
    # The processor (the tokenizer is inside it) is loaded even when training from the cache: the pipeline's
    # constructor reads its chat template. It is small (no weights) and the cache fingerprint covers it.
    text_components = ("text_encoder",)
    # Every linear layer of the single-stream blocks: attention and the SwiGLU feed-forward.
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"]
    last_block_text_outputs = ()  # single-stream blocks: every output is read

    @staticmethod
    def attention_pairs(tokens: int, queries: int, keys: int, attention_kwargs: dict) -> int:
        """The block-causal prefill is computed per segment (one attention call each): each prefix segment of text or
        a condition image against the keys up to its end, the target's tokens against all."""
        segments = attention_kwargs.get("segments")
        if segments is None:
            return queries * keys
        prefix = segments[-1][1] if segments else 0
        return sum((end - start) * end for start, end, _ in segments) + (tokens - prefix) * tokens

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None):
        self.output_area = resolution ** 2  # the default condition size needs it before the output is set up
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only,
                         condition_size)

    def _sequence_tokenizer(self):
        return self.pipe.processor.tokenizer if self.text_encoders else None

    def _sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((height, width) of the VAE input, the same for the text encoder) for an image of this size."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

        if self.condition_size is not None:
            size = (self.condition_size, self.condition_size)
        else:
            size = calculate_dimensions(self.output_area, width / height)[1::-1]
        return size, size

    def _check_vision_tokens(self, width: int, height: int) -> int:
        """The vision tokens of a condition image of this size, which must be its latent tokens / 4."""
        (h, w), tokens = self._sizes(width, height)[0], self._vision_tokens(width, height)
        if tokens * 4 != (h // self.vae_scale_factor) * (w // self.vae_scale_factor):
            raise UserError(f"a {width}×{height} condition image becomes {w}×{h}, which the processor gives {tokens} "
                            f"vision tokens, not one per 32×32 pixels as {self.display_name} needs: give "
                            f"--condition-size N within the processor's pixel bounds")
        return tokens

    def check_condition_shapes(self, records) -> None:
        super().check_condition_shapes(records)
        if self.text_encoders:  # else a cache holds the encodings already
            from common.data import condition_image_size

            for path in {path for record in records for path in record.images}:
                self._check_vision_tokens(*condition_image_size(path))

    def _framing(self, count: int) -> int:
        """Tokens the chat template adds around `count` condition images, their vision tokens aside."""
        pipe = self.pipe
        ti2i = pipe.prompt_template_ti2i.replace("{}", "")
        slot = "<image1><|vision_start|><|image_pad|><|vision_end|>"
        slots = slot + "".join(f" <image{k}><|vision_start|><|image_pad|><|vision_end|>" for k in range(2, count + 1))
        tokenize = pipe.processor.tokenizer
        return len(tokenize(ti2i.replace(slot, slots)).input_ids) - len(tokenize(ti2i.replace(slot, "")).input_ids) \
            - count

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list] | None = None) -> dict[str, torch.Tensor]:
        """The text encoder's states of each prompt seeing its condition images (none: text-to-image), and the
        images' latents, one row per prompt (see the class docstring). Every prompt of the call must have as many
        images, all of one size."""
        self._require_text_encoders()
        images = images if images is not None else [[] for _ in prompts]
        if len(images) != len(prompts) or len({len(group) for group in images}) > 1:
            raise ValueError(f"{self.display_name} takes one list of condition images per prompt, all of one length")
        pipe, first = self.pipe, None
        rows = {"prompt_embeds": [], "prompt_embeds_mask": [], "image_pad_mask": [], "image_latents": [],
                "image_shapes": []}
        for text, group in zip(prompts, images):
            seen, latents, shapes = [], [], []
            for image in group:
                (h, w), _ = self._sizes(*image.size)
                shape = (h, w, self._check_vision_tokens(*image.size))
                first = first or (shape, image.size)
                if shape != first[0]:
                    raise UserError(f"a {image.size[0]}×{image.size[1]} condition image becomes {w}×{h}, but the "
                                    f"first ({first[1][0]}×{first[1][1]}) becomes {first[0][1]}×{first[0][0]}: one "
                                    f"run needs one size; give --condition-size N (a square) or images of one aspect "
                                    f"ratio")
                image = image.convert("RGBA")  # the pipeline's: the VAE reads four channels
                seen.append(pipe.image_processor.resize(image, height=h, width=w))
                # as `prepare_latents`: cast to the model dtype, VAE mode, normalised, flattened
                pixels = pipe.image_processor.preprocess(image, height=h, width=w).unsqueeze(2)
                encoded = pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
                latents.append(pipe._pack_latents(encoded, 1, encoded.shape[1], *encoded.shape[3:]))
                shapes.append((h // self.vae_scale_factor, w // self.vae_scale_factor))
            embeds, mask, pad_mask = pipe.encode_prompt(prompt=[text], image=seen or None, device=self.device)
            if mask is None:  # the pipeline drops an all-ones mask
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            length = self.max_sequence_length + (self._framing(len(group)) + first[0][2] * len(group) if group else 0)
            for key, value in (("prompt_embeds", embeds), ("prompt_embeds_mask", mask.long()),
                               ("image_pad_mask", pad_mask.long())):
                value = value[:, :length]
                pad = (0, 0) * (value.dim() - 2) + (0, length - value.shape[1])
                rows[key].append(torch.nn.functional.pad(value, pad))
            if group:
                rows["image_latents"].append(torch.cat(latents, dim=1))
                rows["image_shapes"].append(torch.tensor([shapes], dtype=torch.long, device=self.device))
        return {key: torch.cat(values) for key, values in rows.items() if values}

    def _branch(self, model, x, timestep, cond: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """The transformer's output at the target's tokens for one CFG branch (`prefix` "" or "negative_"), the rows
        of each text length run together, cut to that length (see the class docstring)."""
        embeds, mask = cond[prefix + "prompt_embeds"], cond[prefix + "prompt_embeds_mask"]
        pad_mask = cond[prefix + "image_pad_mask"].bool()
        condition = cond.get("image_latents")  # both branches see the same images, as in the pipeline
        shapes = [(1, int(h), int(w)) for h, w in cond["image_shapes"][0]] if condition is not None else []
        target = [(1, self.latent_h, self.latent_w)]
        lengths = mask.sum(dim=1)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for length in lengths.unique().tolist():
            rows = (lengths == length).nonzero(as_tuple=True)[0]
            hidden = x[rows] if condition is None else torch.cat([condition[rows], x[rows]], dim=1)
            # one slot per 2x2 target tokens after the text, as the pipeline appends them
            slots = torch.cat([pad_mask[rows, :length], pad_mask.new_ones(len(rows), self.image_tokens // 4)], dim=1)
            with self._autocast():
                result = model(hidden_states=hidden.to(self.dtype), timestep=timestep[rows],
                               encoder_hidden_states=embeds[rows, :length].to(self.dtype),
                               encoder_hidden_states_mask=None, img_shapes=[shapes + target] * len(rows),
                               img_mask=slots, return_dict=False)[0]
            out[rows] = result[:, -x.shape[1]:].float()
        return out

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 1.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) of the target's tokens in float32; with guidance_scale > 1 the pipeline's true CFG
        v_neg + w·(v_pos − v_neg), each branch run as the pipeline runs it (its own text length)."""
        model = self.transformer if transformer is None else transformer
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        # The pipeline feeds (1000·σ in the latents' dtype) / 1000: the same rounding here.
        steps = self.scheduler.config.num_train_timesteps
        timestep = (sigma * steps).to(self.dtype) / steps
        out = self._branch(model, latents, timestep, cond, "")
        if self._with_negatives(cond, guidance_scale):
            uncond = self._branch(model, latents, timestep, cond, "negative_")
            out = uncond + guidance_scale * (out - uncond)
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cond=None) -> torch.Tensor:
        """Latents -> RGB images in [0, 1], float32, (batch, 3, H, W): the VAE's RGBA output (the pipeline's
        "pt" images) composited over white, the background the pipeline gives its text encoder for RGBA inputs."""
        images = super().decode(latents)
        if images.shape[1] == 4:
            alpha = images[:, 3:]
            images = images[:, :3] * alpha + (1 - alpha)
        return images


# Qwen3-VL's chat template for messages whose content is a list of parts, as QwenImage21Pipeline passes them
# (it applies the template to its system message to count the tokens it drops).
_QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- elif part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_qwen_image21(path: Path) -> None:
    """Qwen-Image-2.1-like: a 2-layer Qwen3-VL whose 1-block vision tower has the real 16-pixel patches and 2×2
    merge (one vision token per 32×32 pixels = 2×2 latent tokens, the slots the transformer fills with condition
    latents) behind the slow Qwen2VL image processor in an image-only processor (`_image_only_processor`), the
    RGBA Qwen-Image-2.1 VAE (4 channels in and out, 16× spatial: five levels), the single-stream block-causal
    transformer with causal_condition, and Qwen-Image's scheduler config (2.1's is not published apart from the
    checkpoint; its README: flow-matching Euler with dynamic shifting). The tokenizer makes each word of the
    pipeline's system prompt one token, as the real vocabulary does."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(TINY_SEED)
    z_dim = 8
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True], in_channels=4, out_channels=4,
        latents_mean=[0.1, -0.2, 0.3, 0.0, 0.2, -0.1, 0.0, 0.1], latents_std=[1.5, 2.0, 2.5, 1.0, 1.2, 1.8, 2.2, 1.4],
    )
    # head_dim 16 = sum(axes_dims_rope); context_in_dim = the text encoder's width.
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=z_dim, out_channels=z_dim, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6), causal_condition=True,
    )
    system = "Comprehend and analyze the provided prompt."  # QwenImage21Pipeline.sys_prompt
    tokenizer = _qwen2_tokenizer_with_words(f"system\n{system}\nuser\n assistant\n<image1>")
    ids = tokenizer.convert_tokens_to_ids
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
            # mrope_section sums to head_dim / 2 = 8 (temporal, height, width rotary frequencies)
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    ))
    # Qwen3-VL's image processor settings (16-pixel patches, mean = std = 0.5), 1 to 64 vision tokens per image.
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                               min_pixels=32 * 32, max_pixels=64 * 32 * 32)
    processor = _image_only_processor(image_processor, tokenizer, _QWEN3_VL_CHAT_TEMPLATE)
    pipe = QwenImage21Pipeline(scheduler=_qwen_image_scheduler(), vae=vae, text_encoder=text_encoder,
                               processor=processor, transformer=transformer)
    pipe.save_pretrained(path, safe_serialization=True)
