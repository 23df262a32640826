"""Deterministic tiny pipelines of the real diffusers/transformers classes, for tests and CPU demos.

`--model-path tiny` builds one of these once, saves it with `save_pretrained` under a cache folder and
then loads it through the ordinary `from_pretrained` path, exactly like a real checkpoint. Weights are
random (seeded) and tokenizers are built in memory, so nothing is downloaded.
"""

import os
import shutil
import string
import tempfile
from pathlib import Path

import torch

# Bump when a builder changes, so stale tiny models on disk are not reused.
TINY_VERSION = 1
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


def _build_flux1(path: Path) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
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
    pipe = FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )
    pipe.save_pretrained(path, safe_serialization=True)


TINY_BUILDERS = {"flux1": _build_flux1}


def tiny_model_path(model: str) -> Path:
    """Path of the saved tiny pipeline for `model`, building it first if needed (safe under several processes)."""
    path = tiny_cache_root() / f"tiny-{model}-v{TINY_VERSION}"
    if (path / "model_index.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        TINY_BUILDERS[model](tmp)
        try:
            os.rename(tmp, path)  # atomic; fails if another process won the race
        except OSError:
            if not (path / "model_index.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
