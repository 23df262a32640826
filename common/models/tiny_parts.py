"""Deterministic tiny pipelines of the real diffusers/transformers classes, for tests and CPU demos.

`--model-path tiny` builds one of these once, saves it with `save_pretrained` under a cache folder and
then loads it through the ordinary `from_pretrained` path, exactly like a real checkpoint. Weights are
random (seeded) and tokenizers are built in memory, so nothing is downloaded.
"""

import inspect
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch

# Bump when a builder changes, so stale tiny models on disk are not reused.
TINY_VERSION = 2
TINY_SEED = 0


def tiny_cache_root() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl"))


def _characters() -> list[str]:
    return sorted(set(string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation))


def tiny_clip_tokenizer(max_length: int = 77):
    """A byte-level-like CLIP BPE tokenizer with no merges: one token per character."""
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    pieces = specials + _characters() + [c + "</w>" for c in _characters()]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int = 32):
    """A unigram T5 tokenizer over single characters (ids 0/1/2 = pad/eos/unk, as in T5)."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in _characters()] + [("▁" + c, -2.5) for c in _characters()]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _build_flux1(path: Path, pipeline_class: str = "FluxPipeline") -> None:
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


def _tiny_sd3_vae(latent_channels: int, scaling_factor: float, shift_factor: float):
    """A 4-block AutoencoderKL: 8x downsampling, as in the real SD3 / FLUX.1 VAEs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8], layers_per_block=1,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )


def _build_sd3(path: Path) -> None:
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


# The words of QwenImagePipeline's chat-template prefix. With the real Qwen2 tokenizer each is ONE token, so the
# prefix the pipeline drops (`prompt_template_encode_start_idx` = 34) is exactly the system prompt + "user\n".
_QWEN_TEMPLATE_WORDS = (
    "system Describe user assistant".split()
    + ["Ġ" + w for w in "the image by detailing color shape size texture quantity text spatial relationships "
                          "of objects and background".split()]
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level vocabulary (one token per byte) plus, for each word, a left-to-right merge chain (w0+w1,
    (w0w1)+w2, ...), so that each word is a single token as in a real vocabulary."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    merges = []
    for word in words:
        token = word[0]
        for ch in word[1:]:
            if (token, ch) not in merges:
                merges.append((token, ch))
            token += ch
            vocab.setdefault(token, len(vocab))
    return vocab, merges


_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]


def _qwen2_tokenizer(vocab: dict[str, int], merges: list, image_token: bool):
    """A Qwen2Tokenizer of this vocabulary with the chat/vision special tokens; with `image_token` it also names
    <|image_pad|> its image token (what an image-only VL processor reads, see `_image_only_processor`)."""
    from transformers import Qwen2Tokenizer

    if not image_token:
        return Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=_QWEN_SPECIALS[1:],
                              model_max_length=2048)
    # extra_special_tokens as a dict replaces the list of additional special tokens: add them afterwards
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens={"image_token": "<|image_pad|>"},
                               model_max_length=2048)
    tokenizer.add_tokens(_QWEN_SPECIALS[1:], special_tokens=True)  # already in the vocabulary: no new ids
    return tokenizer


def _merge_into_single_tokens(vocab: dict[str, int], merges: list[tuple[str, str]], words) -> None:
    """Extend a byte-level BPE (in place) until each of `words` (pre-tokenized, byte-level) is one token: merge the
    first two pieces BPE leaves until one remains. New merges rank last, so they never change how an earlier word is
    split."""
    from tokenizers.models import BPE

    for word in dict.fromkeys(words):
        while len(pieces := [t.value for t in BPE(vocab=vocab, merges=merges).tokenize(word)]) > 1:
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))


def tiny_qwen2_tokenizer():
    """A byte-level BPE Qwen2 tokenizer: the 256 byte symbols, merges that make each word of the Qwen-Image
    chat template a single token (as in the real vocabulary), and the chat/vision special tokens."""
    vocab, merges = _byte_level_bpe(_QWEN_TEMPLATE_WORDS)
    for token in _QWEN_SPECIALS:
        vocab[token] = len(vocab)
    return _qwen2_tokenizer(vocab, merges, image_token=False)


def _qwen2_tokenizer_with_words(text: str):
    """`tiny_qwen2_tokenizer` plus merges that make each word of `text` (a pipeline's chat-template prefix) one
    token, as the real vocabulary does; named image token (see `_qwen2_tokenizer`). New merges rank last, so they
    never change how an earlier word (or a Qwen-Image template word) is split."""
    import json
    import re

    base = tiny_qwen2_tokenizer()
    model = json.loads(base.backend_tokenizer.to_str())["model"]
    vocab, merges = dict(model["vocab"]), [tuple(pair) for pair in model["merges"]]
    chunks = re.split("|".join(map(re.escape, _QWEN_SPECIALS)), text)
    words = [w for chunk in chunks for w, _ in base.backend_tokenizer.pre_tokenizer.pre_tokenize_str(chunk)]
    _merge_into_single_tokens(vocab, merges, words)
    return _qwen2_tokenizer(vocab, merges, image_token=True)


def _image_only_processor(image_processor, tokenizer, chat_template: str | None = None):
    """The VL processor of the tiny Qwen editing pipelines: transformers' `PaddleOCRVLProcessor`, which does for
    images and text what Qwen2VLProcessor and Qwen3VLProcessor do (each <|image_pad|> becomes
    image_grid_thw.prod() / merge_size² copies; the image processor's pixel_values and grids) but has no video
    processor: transformers 5 builds theirs only with torchvision, which has no CPU wheel beside this project's
    torch, and the pipelines never feed videos. tests/test_qwen_image21.py checks the equality on the tiny models.
    With the slow (PIL) Qwen2VL image processor nothing of it needs torchvision."""
    from transformers import PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


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


def _build_qwen_image(path: Path) -> None:
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


def _build_wan(path: Path) -> None:
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


def _tiny_umt5(tokenizer):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                       num_layers=2, relative_attention_num_buckets=8))


def _build_wan22(path: Path) -> None:
    """Wan2.2-T2V-A14B-like: `_build_wan`'s UMT5 and Wan2.1 VAE, two transformers of one config (the high-noise
    `transformer` and the low-noise `transformer_2`, initialised differently) and the real pipeline's
    boundary_ratio 0.875; the UniPC flow schedule at shift 3 puts steps on both sides of the boundary."""
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = _tiny_wan_vae()
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64,
    ) for _ in range(2)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0],
                       transformer_2=experts[1], vae=vae, scheduler=scheduler, boundary_ratio=0.875)
    pipe.save_pretrained(path, safe_serialization=True)


def _build_wan22_5b(path: Path) -> None:
    """Wan2.2-TI2V-5B-like: UMT5, the Wan2.2 VAE (residual up/down blocks, a 2×2 pixel patchify: 16× spatial, 4×
    temporal; its latent channels scaled from 48 to 8), one transformer taking per-token timesteps, and the
    pipeline's expand_timesteps; UniPC flow schedule at the real checkpoint's shift 5."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.1, -0.2, 0.3, 0.0, 0.05, -0.1, 0.2, 0.0], latents_std=[1.5, 2.0, 2.5, 1.0, 1.2, 0.8, 1.1, 1.3],
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=8, out_channels=8,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64,
    )
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler, expand_timesteps=True)
    pipe.save_pretrained(path, safe_serialization=True)


def _build_flux1_kontext(path: Path) -> None:
    _build_flux1(path, "FluxKontextPipeline")


def _build_qwen_image_edit(path: Path) -> None:
    """Qwen-Image-Edit-2511-like: `_build_qwen_image`'s 2-layer Qwen2.5-VL, whose 1-block vision tower now sees the
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


def _build_wan_i2v(path: Path) -> None:
    """Wan2.1-I2V-like: `_build_wan`'s UMT5 and VAE, a CLIP vision encoder whose penultimate hidden states feed
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


def _build_wan22_i2v(path: Path) -> None:
    """Wan2.2-I2V-A14B-like: `_build_wan`'s UMT5 and VAE, no CLIP image encoder, two transformers of one config
    without an image projection that take the noise, the first-frame mask (4) and the condition latents
    (in_channels = 2·z_dim + 4, as the real 36 = 2·16 + 4), the A14B I2V boundary 0.9 and sample shift 5 (Wan2.2's
    wan/configs/wan_i2v_A14B.py) as boundary_ratio and UniPC flow shift: 4 steps put two timesteps on each side of
    the boundary (999, 937 | 833, 625)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_length=512)
    torch.manual_seed(TINY_SEED)
    text_encoder = _tiny_umt5(tokenizer)
    vae = _tiny_wan_vae()
    experts = [WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=2 * 4 + 4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=64,
    ) for _ in range(2)]
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=experts[0],
                                   transformer_2=experts[1], vae=vae, scheduler=scheduler, boundary_ratio=0.9)
    pipe.save_pretrained(path, safe_serialization=True)


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


def _build_hunyuan_video15(path: Path) -> None:
    """HunyuanVideo-1.5 480p T2V-like: `_tiny_hunyuan_video15_components` and a 1-block HunyuanVideo-1.5 DiT (one
    token-refiner layer) that takes [noise, condition latents, mask] (in_channels = 2·4 + 1, as the real 65 = 2·32 + 1)
    and the three context streams (Qwen text, ByT5 glyphs, SigLIP-width image tokens, all zero for text-to-video),
    and the pipeline's ClassifierFreeGuidance at the published scale 6."""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    components = _tiny_hunyuan_video15_components()
    pipe = HunyuanVideo15Pipeline(transformer=_tiny_hunyuan_video15_transformer("t2v"),
                                  guider=ClassifierFreeGuidance(guidance_scale=6.0), **components)
    pipe.save_pretrained(path, safe_serialization=True)


def _build_hunyuan_video15_i2v(path: Path) -> None:
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


# A Qwen3-style chat template: ZImagePipeline formats every prompt as one user turn with a generation prompt and
# thinking left on, which renders as below in the real Qwen3 template (no <think> block is added then).
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _build_z_image(path: Path) -> None:
    """Z-Image-Turbo-like: a 2-layer Qwen3 text encoder (the pipeline reads its second-to-last hidden state) behind
    a Qwen3-style chat template, the single-stream Z-Image DiT (noise and caption refiners, then joint layers; 3-axis
    RoPE with the real axis lengths), FLUX's 4-block VAE with its scaling and shift, and the real checkpoint's
    scheduler (static shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    ))
    vae = _tiny_sd3_vae(4, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE constants, as Z-Image's
    # head_dim 16 = sum(axes_dims); axes_lens as the real model (caption positions on axis 0, image rows, columns).
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 4, 4], axes_lens=[1536, 512, 512],
    )
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)
    pipe.save_pretrained(path, safe_serialization=True)


def tiny_mistral_tokenizer():
    """A byte-level BPE tokenizer in Mistral's chat format ([SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]) with
    merges that make each word of FLUX.2's system message one token, so that the templated prefix is short as with
    the real tokenizer. The real checkpoint wraps its tokenizer in a PixtralProcessor, which needs torchvision; the
    text-to-image path calls only its `apply_chat_template`, which a tokenizer with the same template answers."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _byte_level_bpe([word for word, _ in pre_tokenizer.pre_tokenize_str(SYSTEM_MESSAGE)])
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer, backend.decoder = pre_tokenizer, decoders.ByteLevel()
    backend.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                "[/SYSTEM_PROMPT]", "[IMG]"])
    # Message content is a list of {"type": "text", "text": ...} parts, as Flux2Pipeline formats it.
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% set text = m['content'] if m['content'] is string else "
        "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
        "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
        "{% endfor %}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=2048, chat_template=template)


def _tiny_flux2_vae():
    """AutoencoderKLFlux2 with 8x downsampling; its batch norm over the 2x2-patchified latents gets non-trivial
    running statistics, so that a missed (de)normalisation shows."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                             norm_num_groups=4)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    return vae


def _tiny_flux2_transformer(guidance_embeds: bool):
    """Flux2Transformer2DModel: one double- and one single-stream block, 4-axis RoPE, the text width 3 × the
    tiny text encoder's hidden size (the pipelines stack three of its hidden layers)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * 4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * 16, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)


def _flux2_scheduler():
    """FLUX.2's scheduler config: the pipeline passes its empirical μ, which the exponential time shift uses."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


def _build_flux2(path: Path) -> None:
    """FLUX.2 [dev]-like: a Mistral3 (Pixtral vision tower unused, 30 text layers so that the pipeline's hidden
    layers 10, 20, 30 exist), the FLUX.2 VAE with its latent batch norm, a guidance-embedding Flux2 transformer."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tiny_mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=2048, bos_token_id=ids("<s>"), eos_token_id=ids("</s>"),
                         pad_token_id=ids("<pad>")),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=32, patch_size=8),
        image_token_index=ids("[IMG]")))
    pipe = Flux2Pipeline(scheduler=_flux2_scheduler(), vae=_tiny_flux2_vae(), text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=_tiny_flux2_transformer(guidance_embeds=True))
    pipe.save_pretrained(path, safe_serialization=True)


def _build_flux2_klein(path: Path) -> None:
    """FLUX.2 [klein] base-like: a Qwen3 causal LM (27 layers: the pipeline stacks hidden layers 9, 18, 27) behind
    Qwen3's chat template with thinking off, the FLUX.2 VAE, a Flux2 transformer without guidance embedding (the
    base model runs true CFG), is_distilled False."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_qwen2_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>")))
    pipe = Flux2KleinPipeline(scheduler=_flux2_scheduler(), vae=_tiny_flux2_vae(), text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=_tiny_flux2_transformer(guidance_embeds=False),
                              is_distilled=False)
    pipe.save_pretrained(path, safe_serialization=True)


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


def _build_qwen_image21(path: Path) -> None:
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


def tiny_gemma_tokenizer(max_length: int = 1024):
    """A Gemma (SentencePiece-style BPE) tokenizer over single characters, with a merge of "▁" and each character
    (a word-initial character is one token), Gemma's special tokens and its left padding."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<image_soft_token>", "<start_of_image>",
                "<end_of_image>"]
    pieces = specials + ["▁"] + _characters() + ["▁" + c for c in _characters()]
    return GemmaTokenizer(vocab={piece: i for i, piece in enumerate(pieces)},
                          merges=[("▁", c) for c in _characters()], model_max_length=max_length)


def _build_ltx2(path: Path) -> None:
    """LTX-2-like: a 2-layer Gemma 3 (Gemma3ForConditionalGeneration, its SigLIP tower one layer, unused for text),
    the LTX-2.0 text connectors (one shared projection of the stacked hidden states, one connector layer per
    stream), the audio-video transformer with both streams and their cross-attention, the LTX-2 video VAE (a 2×2
    pixel patchify and one spatio-temporal block: 4× spatial, 2× temporal; the real one is 32×, 8×) with non-trivial
    latent statistics, the audio VAE (stereo mel spectrogram latents) and the vocoder, and the LTX-Video family's
    scheduler config (μ shift fitted between 1024 and 4096 tokens, terminal σ stretched to 0.1)."""
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = tiny_gemma_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(TINY_SEED)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         sliding_window=16, pad_token_id=ids("<pad>"), eos_token_id=ids("<eos>"),
                         bos_token_id=ids("<bos>")),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=ids("<image_soft_token>"), boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>")))
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3,  # 2 layers + the embeddings, stacked
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_double_precision=False,
        rope_type="split")
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=2 * 2, audio_out_channels=2 * 2, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
        rope_double_precision=False, rope_type="split")
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",), upsample_residual=(False,), upsample_factor=(1,),
        timestep_conditioning=False, patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    with torch.no_grad():  # latent statistics that are not 0 and 1, so that a missed (de)normalisation shows
        vae.latents_mean.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
        vae.latents_std.copy_(torch.tensor([1.5, 2.0, 2.5, 1.0]))
        audio_vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, len(audio_vae.latents_mean)))
        audio_vae.latents_std.copy_(torch.linspace(0.8, 1.6, len(audio_vae.latents_std)))
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    pipe = LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)
    pipe.save_pretrained(path, safe_serialization=True)


TINY_BUILDERS = {"flux1": _build_flux1, "sd3": _build_sd3, "qwen-image": _build_qwen_image, "wan": _build_wan,
                 "flux1-kontext": _build_flux1_kontext, "qwen-image-edit": _build_qwen_image_edit,
                 "wan-i2v": _build_wan_i2v, "wan2.2": _build_wan22, "wan2.2-5b": _build_wan22_5b,
                 "wan2.2-i2v": _build_wan22_i2v, "hunyuan-video-1.5": _build_hunyuan_video15,
                 "hunyuan-video-1.5-i2v": _build_hunyuan_video15_i2v,
                 "z-image": _build_z_image,
                 "flux2": _build_flux2, "flux2-klein": _build_flux2_klein, "qwen-image-2.1": _build_qwen_image21,
                 # one tiny LTX-2 for both modes, as Lightricks/LTX-2 is one checkpoint (model_index: LTX2Pipeline)
                 "ltx2": _build_ltx2, "ltx2-i2v": _build_ltx2}


def tiny_model_path(model: str) -> Path:
    """Path of the saved tiny pipeline for `model`, building it first if needed (safe under several processes)."""
    path = tiny_cache_root() / f"tiny-{model}-v{TINY_VERSION}"
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        # The builders seed torch's global RNG: fork it, or a run that builds the model would draw its LoRA init
        # and noise from another state than a run that finds it built.
        with torch.random.fork_rng(devices=[]):
            TINY_BUILDERS[model](tmp)
        try:
            os.rename(tmp, path)  # atomic; fails if another process won the race
        except OSError:
            if not (path / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
