"""Qwen-Image-Edit-2509/2511 (`QwenImageEditPlusPipeline`): one or several condition images. Each condition image
is seen twice, as in the pipeline: by the Qwen2.5-VL text encoder (at about 384×384, inside the chat template as
"Picture k: <vision tokens>"), and as packed VAE latents appended to the target's image tokens (at about
1024×1024); the transformer's output is cut back to the target's tokens. 2511's zero_cond_t (condition tokens
modulated at t = 0) is the transformer's own business: it reads the per-image `img_shapes` passed here."""

from pathlib import Path

import torch

from common.models.base import component_class_name
from common.models.qwen_image import (QwenImageAdapter, _qwen_image_scheduler, _tiny_qwen_transformer, _tiny_qwen_vae,
                                      _tiny_qwen_vl)
from common.models.tiny_parts import TINY_SEED, _qwen2_tokenizer_with_words
from common.utils import UserError

# How `QwenImageEditPlusPipeline._get_qwen_prompt_embeds` introduces each condition image to the text encoder
# (a local string there): counted here to size the embedding padding. The tests check the count against the
# pipeline's own embedding length.
PICTURE_FRAMING = "Picture {}: <|vision_start|><|vision_end|>"


def processor_needs_torchvision(model_path: str) -> bool:
    """Whether the VL processor the pipeline at `model_path` names cannot be built here: transformers 5 gives
    Qwen2VLProcessor and Qwen3VLProcessor a video processor, which needs torchvision, although the editing pipelines
    feed them images only. (The tiny pipelines save an image-only processor: `build_tiny_qwen_image_edit` below.)"""
    import transformers
    from transformers.utils import is_torchvision_available

    processor = getattr(transformers, component_class_name(model_path, "processor") or "", None)
    return not is_torchvision_available() and processor is not None and \
        "video_processor" in processor.get_attributes()


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit over `QwenImageEditPlusPipeline`'s components: `QwenImageAdapter` (packed 2x2 latents, σ fed
    to the transformer, the target-only σ shift, true CFG with the norm rescale, decoding) plus condition images.
    `encode_prompts` returns, per prompt and its condition images:

    - `prompt_embeds`, `prompt_embeds_mask`: the text encoder's last hidden states over the chat template that
      holds the prompt after "Picture 1: <image 1> Picture 2: <image 2> ...", minus the template's 64-token system
      prefix (`encode_prompt(prompt, image=...)`), zero-padded with a 0/1 mask to max_sequence_length plus the
      tokens of the images' framing and vision tokens. So `max_sequence_length` bounds the text part as for
      Qwen-Image (prompt and the template's closing tokens; longer texts are cut at the end, as QwenImagePipeline
      does, whereas the Edit pipeline never truncates) and the images always fit;
    - `image_latents`: the condition images' packed VAE latents (mode, normalised), concatenated in order along
      the sequence, in the model dtype (the pipeline casts them to it);
    - `image_shapes`: (images, 2) packed latent grid (h/2, w/2) of each condition, from which `velocity` rebuilds
      the transformer's `img_shapes`.

    All of them depend only on the prompt and its images, so the embedding cache holds them and training from it
    loads neither the text encoder nor the processor (the VAE is loaded anyway to decode).

    Sizes. Without `condition_size`, each image is resized as the pipeline does: to an area of 1024² for the VAE and
    384² for the text encoder, both at the image's aspect ratio in multiples of 32 (`calculate_dimensions`), the
    latter then fitted by the processor's own resize. Rows of different prompts must stack, so every condition
    image of a run must give one VAE size and one vision-token count, and every prompt one number of images
    (`check_condition_shapes`; in practice: one aspect ratio). With `condition_size=N`, every condition image is
    first resized to N×N and then treated as the pipeline treats an N×N image whose VAE area is N²: N×N for the
    VAE, 384×384 for the text encoder (the pipeline's rule applied to the square image)."""

    pipeline_class_name = "QwenImageEditPlusPipeline"
    display_name = "Qwen-Image-Edit"
    condition_images = (1, None)
    condition_components = ("vae",)  # condition latents are cached: preprocess.py VAE-encodes them
    # The processor (Qwen2VLProcessor) only prepares the text encoder's input: the cache makes all three unneeded.
    text_components = ("text_encoder", "tokenizer", "processor")

    def __init__(self, model_path: str, device, dtype: torch.dtype, resolution: int,
                 max_sequence_length: int = 512, load_text_encoders: bool = True, text_only: bool = False,
                 condition_size: int | None = None):
        loads_processor = load_text_encoders or "processor" not in self.text_components
        if loads_processor and processor_needs_torchvision(model_path):
            raise UserError(f"{self.display_name}'s prompt encoding needs torchvision: this transformers builds "
                            f"its VL processor only with it (for a video half editing never uses); pip install "
                            f"torchvision, or train from an embedding cache made where it is installed")
        super().__init__(model_path, device, dtype, resolution, max_sequence_length, load_text_encoders, text_only)
        # Condition preprocessing is set up for text-only loads too: preprocess.py encodes the conditions.
        self.vae_scale_factor = self.pipe.vae_scale_factor
        self.multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 latent packing
        if condition_size is not None and (condition_size <= 0 or condition_size % self.multiple):
            raise UserError(f"--condition-size {condition_size} is not a positive multiple of {self.multiple}, as "
                            f"{self.display_name} requires")
        self.condition_size = condition_size

    def _sizes(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((height, width) of the VAE input, (height, width) of the text encoder's input) for an image of this
        size, before the processor's own fitting (see the class docstring)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit

        if self.condition_size is not None:
            width = height = self.condition_size
            vae = (height, width)
        else:
            vae = edit.calculate_dimensions(edit.VAE_IMAGE_SIZE, width / height)[::-1]
        return vae, edit.calculate_dimensions(edit.CONDITION_IMAGE_SIZE, width / height)[::-1]

    def condition_shape(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) a condition image of this size is resized to for the VAE."""
        return self._sizes(width, height)[0]

    def _vision_tokens(self, width: int, height: int) -> int:
        """How many vision tokens the processor makes of a condition image of this size."""
        image_processor = self.pipe.processor.image_processor
        patches = image_processor.get_number_of_image_patches(*self._sizes(width, height)[1])
        return patches // image_processor.merge_size ** 2

    def check_condition_shapes(self, records) -> None:
        """As for every conditioned model (one VAE size), and beyond it one number of condition images per prompt
        and one vision-token count (the embedding rows' length): the processor can give images of one VAE size
        different counts. One line naming the first record that differs."""
        super().check_condition_shapes(records)
        from common.data import condition_image_size

        first = None
        for record in records:
            tokens = []
            if self.text_encoders:  # else a cache holds the embeddings already
                for path in record.images:
                    tokens.append(self._vision_tokens(*condition_image_size(path)))
            shape = (len(record.images), set(tokens))
            if first is None:
                first = (shape, record.source)
            elif shape[0] != first[0][0]:
                raise UserError(f"{record.source}: {shape[0]} condition images but {first[1]} has {first[0][0]}: "
                                f"one run of {self.display_name} needs one number of condition images per prompt")
            elif len(shape[1] | first[0][1]) > 1:
                raise UserError(f"{record.source}: its condition images give {sorted(shape[1])} vision tokens but "
                                f"{first[1]}'s give {sorted(first[0][1])}: one run needs one count; give "
                                f"--condition-size N (a square) or images of one aspect ratio")

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: list[list]) -> dict[str, torch.Tensor]:
        """The text encoder's states of each prompt seeing its condition images, and the images' packed latents, one
        row per prompt (see the class docstring). Every condition image of the call must give one size."""
        self._require_text_encoders()
        if len(images) != len(prompts) or not all(images):
            raise ValueError(f"{self.display_name} takes one or more condition images per prompt")
        pipe, rows = self.pipe, {"prompt_embeds": [], "prompt_embeds_mask": [], "image_latents": [], "image_shapes": []}
        first = None
        for text, group in zip(prompts, images):
            pixels, seen, shapes = [], [], []
            for image in group:
                (vae_h, vae_w), (vl_h, vl_w) = self._sizes(*image.size)
                shape = (vae_h, vae_w, self._vision_tokens(*image.size))
                first = first or (shape, image.size)
                if shape != first[0]:
                    raise UserError(f"a {image.size[0]}×{image.size[1]} condition image becomes {vae_w}×{vae_h} "
                                    f"with {shape[2]} vision tokens, but the first ({first[1][0]}×{first[1][1]}) "
                                    f"becomes {first[0][1]}×{first[0][0]} with {first[0][2]}: one run needs one "
                                    f"size; give --condition-size N (a square) or images of one aspect ratio")
                if self.condition_size is not None:  # the square image is what the pipeline would be given
                    image = pipe.image_processor.resize(image, vae_h, vae_w)
                seen.append(pipe.image_processor.resize(image, vl_h, vl_w))
                pixels.append(pipe.image_processor.preprocess(image, vae_h, vae_w).unsqueeze(2))  # one frame
                shapes.append((vae_h // self.multiple, vae_w // self.multiple))
            embeds, mask = pipe.encode_prompt(prompt=[text], image=seen, device=self.device)
            if mask is None:  # the pipeline drops an all-ones mask
                mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            framing = sum(len(pipe.tokenizer(PICTURE_FRAMING.format(k + 1)).input_ids) for k in range(len(group)))
            length = self.max_sequence_length + framing + len(group) * shape[2]
            embeds, mask = embeds[:, :length], mask[:, :length].long()
            rows["prompt_embeds"].append(torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[1])))
            rows["prompt_embeds_mask"].append(torch.nn.functional.pad(mask, (0, length - mask.shape[1])))
            latents = []
            for image in pixels:  # as `prepare_latents`: cast to the model dtype, VAE mode, normalised, packed
                encoded = pipe._encode_vae_image(image.to(self.device, self.dtype), generator=None)
                _, channels, _, h, w = encoded.shape
                latents.append(pipe._pack_latents(encoded, 1, channels, h, w))
            rows["image_latents"].append(torch.cat(latents, dim=1))
            rows["image_shapes"].append(torch.tensor([shapes], dtype=torch.long, device=self.device))
        return {key: torch.cat(values) for key, values in rows.items()}

    def velocity(self, latents: torch.Tensor, sigma, cond: dict[str, torch.Tensor],
                 guidance_scale: float = 4.0, transformer=None) -> torch.Tensor:
        """v_θ(x_σ, σ, c) of the target's tokens in float32: `QwenImageAdapter.velocity` (text masks, timestep
        rounding, true CFG with the norm rescale, which the pipeline also applies to the cut output) over a
        transformer that sees the target's tokens followed by every condition's, with `img_shapes` listing the
        target and then each condition. Both CFG branches see the same condition latents, as in the pipeline (the
        cache's negative_image_* copies are equal and unused)."""
        model = self.transformer if transformer is None else transformer
        condition = cond["image_latents"]
        shapes = [(1, int(h), int(w)) for h, w in cond["image_shapes"][0]]  # one shape per run (checked on encoding)

        def with_conditions(hidden_states, img_shapes, **kwargs):
            copies = hidden_states.shape[0] // condition.shape[0]  # 2 under CFG: [negative batch, positive batch]
            sequence = torch.cat([hidden_states, condition.to(hidden_states.dtype).repeat(copies, 1, 1)], dim=1)
            out = model(hidden_states=sequence, img_shapes=[target + shapes for target in img_shapes], **kwargs)[0]
            return (out[:, :hidden_states.shape[1]],)

        return super().velocity(latents, sigma, cond, guidance_scale, transformer=with_conditions)


def _image_only_processor(image_processor, tokenizer, chat_template: str | None = None):
    """The VL processor of the tiny Qwen editing pipelines: transformers' `PaddleOCRVLProcessor`, which does for
    images and text what Qwen2VLProcessor and Qwen3VLProcessor do (each <|image_pad|> becomes
    image_grid_thw.prod() / merge_size² copies; the image processor's pixel_values and grids) but has no video
    processor: transformers 5 builds theirs only with torchvision, which has no CPU wheel beside this project's
    torch, and the pipelines never feed videos. tests/test_qwen_image21.py checks the equality on the tiny models.
    With the slow (PIL) Qwen2VL image processor nothing of it needs torchvision."""
    from transformers import PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def build_tiny_qwen_image_edit(path: Path) -> None:
    """Qwen-Image-Edit-2511-like: `build_tiny_qwen_image`'s 2-layer Qwen2.5-VL, whose 1-block vision tower now sees the
    condition images through the slow Qwen2VL image processor (4 to 16 vision tokens per image) in an image-only
    processor (`_image_only_processor`), the QwenImage VAE, scheduler and MMDiT, the latter with 2511's zero_cond_t
    (condition tokens modulated at t = 0). The tokenizer is `tiny_qwen2_tokenizer` plus merges that make each word
    of the Edit pipeline's chat-template prefix and of "Picture 1: " one token, as the real vocabulary does, so
    that the prefix the pipeline drops (`prompt_template_encode_start_idx` = 64 tokens) is exactly the system
    prompt + "user\n"."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessorPil

    torch.manual_seed(TINY_SEED)
    vae, transformer = _tiny_qwen_vae(), _tiny_qwen_transformer(zero_cond_t=True)
    scheduler = _qwen_image_scheduler()
    # The pipeline first without its text side: its own chat template says which words the tokenizer needs.
    pipe = QwenImageEditPlusPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, processor=None,
                                     transformer=transformer)
    tokenizer = _qwen2_tokenizer_with_words(pipe.prompt_template_encode.split("{}")[0] + "Picture 1: ")
    text_encoder = _tiny_qwen_vl(tokenizer)
    # 28 = patch 14 x merge 2: one image token per 28x28 pixels, 4 to 16 tokens per image.
    processor = _image_only_processor(Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28),
                                      tokenizer)
    pipe.register_modules(text_encoder=text_encoder, tokenizer=tokenizer, processor=processor)
    pipe.save_pretrained(path, safe_serialization=True)
