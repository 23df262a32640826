"""ImageReward (Xu et al., arXiv:2304.05977; PyPI `image-reward`): BLIP fine-tuned on human preferences.

The prompt (BERT-base-uncased tokens with BLIP's added [DEC] and [ENC], padded to 35, first token [CLS] as the
reference leaves it) goes through BLIP's text encoder, cross-attending to the ViT-L/16 image embeddings; the first
token's last hidden state through the LAION-style MLP 768→1024→128→64→16→1 (no activations) is the raw score,
standardised with the release's mean 0.16717362830052426 and std 1.0333394966054072. Images: resized bicubic so the
short side is 224 (long side floor(224·long/short)), centre-cropped to 224 (offsets round((side − 224)/2)), CLIP's
mean and std: torchvision's Resize + CenterCrop on the PIL image, written out here (no torchvision).

The release (`THUDM/ImageReward`: ImageReward.pt, a state dict of BLIP + head, and med_config.json) loads into
transformers' own BlipVisionModel and BlipTextModel (same architecture; BLIP's vision key names mapped to theirs),
with torch.load(weights_only=True). Facts and sources: docs/rewards.md.
"""

import functools
import json
import re
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError
from rewards.clip import laion_mlp, to_pil
from rewards.weights import checkpoint_file, load_state

IMAGEREWARD_CHECKPOINT, IMAGEREWARD_FILE, IMAGEREWARD_CONFIG = "THUDM/ImageReward", "ImageReward.pt", "med_config.json"
IMAGEREWARD_TOKENIZER = "bert-base-uncased"
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072
MAX_TOKENS = 35
VIT_HEAD_DIM = 64  # BLIP's ViT-B (768, 12 heads) and ViT-L (1024, 16 heads) both have 64-wide heads
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# BLIP's ViT names -> transformers' BlipVisionModel names ({} is a block's index).
_VISION_NAMES = [
    ("cls_token", "embeddings.class_embedding"), ("pos_embed", "embeddings.position_embedding"),
    ("patch_embed.proj.", "embeddings.patch_embedding."), ("norm.", "post_layernorm."),
    ("blocks.{}.norm1.", "encoder.layers.{}.layer_norm1."), ("blocks.{}.norm2.", "encoder.layers.{}.layer_norm2."),
    ("blocks.{}.attn.qkv.", "encoder.layers.{}.self_attn.qkv."),
    ("blocks.{}.attn.proj.", "encoder.layers.{}.self_attn.projection."), ("blocks.{}.mlp.", "encoder.layers.{}.mlp."),
]


def rename_vision(name: str, to_transformers: bool = True) -> str | None:
    """A ViT parameter's name in BLIP's module -> in BlipVisionModel (or back); None for another name."""
    for blip, hf in _VISION_NAMES:
        source, target = (blip, hf) if to_transformers else (hf, blip)
        match = re.match(re.escape(source).replace(r"\{\}", r"(\d+)"), name)
        if match and (source.endswith(".") or name == source):
            return target.format(*match.groups()) + name[match.end():]
    return None


def vision_state(state: dict) -> dict:
    """`blip.visual_encoder.*` of the release under BlipVisionModel's names."""
    names = {key: rename_vision(key.removeprefix("blip.visual_encoder.")) for key in state
             if key.startswith("blip.visual_encoder.")}
    return {name: state[key] for key, name in names.items() if name is not None}


@functools.cache
def load_imagereward(checkpoint: str, config: str, tokenizer_path: str, device: torch.device, dtype: torch.dtype):
    """(vision model, text model, MLP head, tokenizer), loaded once per process and settings."""
    from transformers import (
        BertTokenizer,
        BlipTextConfig,
        BlipTextModel,
        BlipVisionConfig,
        BlipVisionModel,
    )

    state = load_state(Path(checkpoint))
    try:
        med = json.loads(Path(config).read_text())
        tokenizer = BertTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load ImageReward's med_config {config!r} / tokenizer {tokenizer_path!r}: "
                        f"{str(error).splitlines()[0]}") from None
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})  # BLIP's init_tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    vision_weights = vision_state(state)
    if "embeddings.class_embedding" not in vision_weights:
        raise UserError(f"ImageReward checkpoint {checkpoint} holds no blip.visual_encoder weights")
    width = vision_weights["embeddings.class_embedding"].shape[-1]
    patch = vision_weights["embeddings.patch_embedding.weight"].shape[-1]
    side = round((vision_weights["embeddings.position_embedding"].shape[1] - 1) ** 0.5) * patch
    vision = BlipVisionModel(BlipVisionConfig(
        hidden_size=width, intermediate_size=vision_weights["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=len({k.split(".")[2] for k in vision_weights if k.startswith("encoder.layers.")}),
        num_attention_heads=width // VIT_HEAD_DIM, image_size=side, patch_size=patch, layer_norm_eps=1e-6,
        hidden_act="gelu"))
    vision.load_state_dict(vision_weights)
    # BLIP's BertModel with cross-attention in every layer (transformers builds it for is_decoder configs; the
    # forward below runs it bidirectionally, is_decoder=False), cross-attending to the ViT's width.
    text = BlipTextModel(BlipTextConfig(
        vocab_size=med["vocab_size"], hidden_size=med["hidden_size"], intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"], num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"], layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        hidden_act=med.get("hidden_act", "gelu"), pad_token_id=med.get("pad_token_id", 0),
        encoder_hidden_size=width, is_decoder=True, bos_token_id=tokenizer.bos_token_id,
        sep_token_id=tokenizer.sep_token_id, eos_token_id=tokenizer.sep_token_id), add_pooling_layer=False)
    text_weights = {k.removeprefix("blip.text_encoder."): v for k, v in state.items()
                    if k.startswith("blip.text_encoder.") and not k.endswith("position_ids")}
    missing, unexpected = text.load_state_dict(text_weights, strict=False)
    if [k for k in missing if not k.endswith("position_ids")] or unexpected:
        raise UserError(f"ImageReward checkpoint {checkpoint} does not fit {config}: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    head = laion_mlp({k.removeprefix("mlp.layers."): v for k, v in state.items() if k.startswith("mlp.layers.")})
    models = [m.to(device, dtype).eval().requires_grad_(False) for m in (vision, text)]
    return *models, head.to(device), tokenizer


def preprocess(images, size: int) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> ImageReward's pixels (B, 3, size, size): uint8 PIL, bicubic short side to `size`,
    centre crop, CLIP normalisation (torchvision's Resize, CenterCrop, ToTensor, Normalize)."""
    from PIL import Image

    out = []
    for image in to_pil(images):
        width, height = image.size
        short, long = sorted((width, height))
        scaled = (size, int(size * long / short))
        new_width, new_height = scaled if width <= height else scaled[::-1]
        image = image.resize((new_width, new_height), Image.BICUBIC)
        top, left = round((new_height - size) / 2.0), round((new_width - size) / 2.0)  # Python's round, as torchvision
        image = image.crop((left, top, left + size, top + size))
        pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255
        out.append((pixels - np.array(OPENAI_CLIP_MEAN, np.float32)[:, None, None])
                   / np.array(OPENAI_CLIP_STD, np.float32)[:, None, None])
    return torch.from_numpy(np.stack(out))


class ImageReward:
    """`--reward imagereward`: ImageReward's standardised score. `path`: the release (hub id, folder or the .pt);
    `config`: its med_config.json (default: next to the checkpoint); `tokenizer`: BERT-base-uncased's."""

    def __init__(self, device=None, dtype=torch.float32, path=IMAGEREWARD_CHECKPOINT, config=None,
                 tokenizer=IMAGEREWARD_TOKENIZER, batch_size="32"):
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        file = checkpoint_file(path, (IMAGEREWARD_FILE,))
        if config is None:  # next to the checkpoint: the release's folder, or the .pt file's
            config = file.parent / IMAGEREWARD_CONFIG if Path(path).expanduser().is_file() else checkpoint_file(
                path, (IMAGEREWARD_CONFIG,))
        self.vision, self.text, self.head, self.tokenizer = load_imagereward(
            str(file), str(config), str(tokenizer), self.device, dtype)
        self.image_size = self.vision.config.image_size
        self.batch_size = int(batch_size)

    def __call__(self, images, prompts):
        scores = []
        for start in range(0, len(images), self.batch_size):
            pixels = preprocess(images[start:start + self.batch_size], self.image_size)
            tokens = self.tokenizer(list(prompts[start:start + self.batch_size]), padding="max_length",
                                    truncation=True, max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
            image_embeds = self.vision(pixel_values=pixels.to(self.device, self.dtype)).last_hidden_state
            hidden = self.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                               encoder_hidden_states=image_embeds,
                               encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long,
                                                                 device=self.device)).last_hidden_state
            scores.append(self.head(hidden[:, 0].float())[:, 0])
        return (torch.cat(scores) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def save_tiny_imagereward(folder, seed: int = 0) -> Path:
    """A tiny random ImageReward release in `folder`: ImageReward.pt (a state dict in BLIP's key names of a random
    1-block BlipVisionModel of width 64 with 16-pixel patches at 224 px, a 2-layer BlipTextModel of width 32 with
    cross-attention, and a random 32→1024→128→64→16→1 head), med_config.json and a word-level BERT tokenizer.
    Returns the .pt file."""
    from transformers import (
        BertTokenizer,
        BlipTextConfig,
        BlipTextModel,
        BlipVisionConfig,
        BlipVisionModel,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = ["a", "cat", "dog", "red", "blue", "cube", "on", "the", "of", "an", "image", "photo", "two", "sitting",
             "grass"]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    BertTokenizer(vocab=vocab).save_pretrained(folder)
    med = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "max_position_embeddings": 64, "vocab_size": len(vocab) + 2, "layer_norm_eps": 1e-12,
           "hidden_act": "gelu", "pad_token_id": 0, "encoder_width": 64, "add_cross_attention": True}
    (folder / IMAGEREWARD_CONFIG).write_text(json.dumps(med))
    torch.manual_seed(seed)
    vision = BlipVisionModel(BlipVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                              num_attention_heads=1, image_size=224, patch_size=16,
                                              layer_norm_eps=1e-6))
    text = BlipTextModel(BlipTextConfig(
        vocab_size=med["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, encoder_hidden_size=64, is_decoder=True), add_pooling_layer=False)
    for module in (vision, text):  # larger than the initialisers' weights, so that images and prompts tell apart
        for parameter in module.parameters():
            parameter.data += 0.2 * torch.randn_like(parameter)
    state = {f"blip.visual_encoder.{rename_vision(k, to_transformers=False)}": v
             for k, v in vision.state_dict().items()}
    state.update({f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()})
    head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                               torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    state.update({f"mlp.layers.{k}": 5 * v for k, v in head.state_dict().items()})
    torch.save(state, folder / IMAGEREWARD_FILE)
    return folder / IMAGEREWARD_FILE
