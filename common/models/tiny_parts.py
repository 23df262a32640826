"""What the tiny pipelines share: the cache they are saved in, their version and seed, and the in-memory tokenizers and
the VAE that several families' builders use.

`--model-path tiny` builds a deterministic tiny pipeline of the real diffusers/transformers classes once (each
family's `build_tiny_*` in its file in common/models/, named by its registry row; `common.models.tiny_model_path`),
saves it with `save_pretrained` under a cache folder and then loads it through the ordinary `from_pretrained` path,
exactly like a real checkpoint. Weights are random (seeded) and tokenizers are built in memory, so nothing is
downloaded.
"""

import os
import string
from pathlib import Path

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


def _tiny_sd3_vae(latent_channels: int, scaling_factor: float, shift_factor: float):
    """A 4-block AutoencoderKL: 8x downsampling, as in the real SD3 / FLUX.1 VAEs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, norm_num_groups=4,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8], layers_per_block=1,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )


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
    <|image_pad|> its image token (what an image-only VL processor reads, see `_image_only_processor` in
    common/models/qwen_image_edit.py)."""
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
