"""Reward models on a Qwen-VL backbone: a reward head read at special tokens of a chat prompt.

- HPSv3 (Ma et al., arXiv:2508.03789; PyPI `hpsv3`): Qwen2-VL-7B-Instruct fine-tuned on human preferences. The
  image (resized to exactly 256·28·28 pixels) and an instruction naming the prompt go in one user turn ending in the
  added token `<|Reward|>`; its last hidden state through an MLP H→1024→16→2 gives (μ, σ) and μ is the score.
- EditReward (TIGER-Lab, arXiv:2509.26346): Qwen2.5-VL-7B-Instruct judging an edit: the source image, the edited
  image and the instruction in one user turn ending in `<|Reward|>`. Two MLP heads, each on its own prompt
  (instruction following, visual quality), each giving (μ, log σ); the score is the mean of their μ.
- VideoAlign's VideoReward (Liu et al., arXiv:2501.13918): Qwen2-VL-2B-Instruct on a video clip; one prompt with
  the three added tokens `<|VQ_reward|>`, `<|MQ_reward|>`, `<|TA_reward|>`; a bias-free linear head H→3 read at
  token k gives dimension k (visual quality, motion quality, text alignment), normalised by the checkpoint's own
  means and standard deviations; the score is their sum.

The backbone is the transformers class of the base model (no trust_remote_code), built from the base's config with
the checkpoint's vocabulary size (the references add their tokens and resize the embeddings) and loaded from the
checkpoint's safetensors (or torch.load(weights_only=True)). Images go through transformers' PIL Qwen2-VL image
processor (no torchvision) after rounding to uint8, as the references read PNG files; video frames are patchified
the same way two frames at a time (Qwen2-VL's temporal patch). The prompt is the base's chat template written out:
the default system turn, then the user turn, then `<|im_start|>assistant\\n` (add_generation_prompt). Facts and
sources: docs/rewards.md.
"""

import functools
import json
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError
from rewards.clip import to_pil

SYSTEM_PROMPT = "You are a helpful assistant."  # the Qwen2-VL / Qwen2.5-VL chat template's default system turn
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

HPSV3_CHECKPOINT, HPSV3_FILE, HPSV3_BASE = "MizzenAI/HPSv3", "HPSv3.safetensors", "Qwen/Qwen2-VL-7B-Instruct"
HPSV3_PIXELS = 256 * 28 * 28  # min_pixels = max_pixels in HPSv3's inference: every image becomes 448×448 (square)
# The instruction of HPSv3's data collator (INSTRUCTION + prompt_with_special_token), verbatim.
HPSV3_INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 
Textual prompt - {text_prompt}



Please provide the overall ratings of this image: <|Reward|>

END
"""  # noqa: W291 (the reference's trailing spaces are part of the prompt)


def _resolve(path: str, filename: str) -> Path:
    """A checkpoint file: `path` itself, `path/filename` for a folder, else `filename` of the hub repo `path`."""
    local = Path(path)
    if local.is_file():
        return local
    if local.is_dir():
        return local / filename
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(path, filename))
    except Exception as error:  # offline, unknown repo or file
        raise UserError(f"cannot load the reward checkpoint {path!r}/{filename}: "
                        f"{str(error).splitlines()[0]}") from None


def load_state(file: Path) -> dict:
    """A state dict from safetensors or a weights-only torch pickle (`{"model": ...}` unwrapped, as the references)."""
    if not file.exists():
        raise UserError(f"reward checkpoint {file} does not exist")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(file)
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state.get("model", None), dict) else state


def backbone_state(state: dict) -> dict:
    """The checkpoint's Qwen-VL weights under the names of transformers' Qwen2VLModel / Qwen2_5_VLModel: keys saved
    by the ForConditionalGeneration class of transformers ≥ 4.52 (`model.language_model.*`, `model.visual.*`) or
    of older versions (`model.*` for the language model, `visual.*`); lm_head and the reward heads are dropped."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.language_model.") or key.startswith("model.visual."):
            out[key.removeprefix("model.")] = value
        elif key.startswith("visual."):
            out[key] = value
        elif key.startswith("model."):
            out["language_model." + key.removeprefix("model.")] = value
    return out


def build_head(state: dict, prefix: str) -> torch.nn.Module:
    """The reward head saved under `prefix` (e.g. `rm_head.`): one Linear (`prefix + weight`), or a Sequential whose
    Linear layers sit at the saved indices with a ReLU after each but the last (the references' ranknet heads:
    Linear, ReLU, Dropout, Linear, ReLU, Linear at 0, 3, 5; Dropout is the identity at evaluation)."""
    head = {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}
    if not head:
        raise UserError(f"the reward checkpoint has no {prefix.rstrip('.')} weights")
    if "weight" in head:
        linear = torch.nn.Linear(head["weight"].shape[1], head["weight"].shape[0], bias="bias" in head)
        linear.load_state_dict(head)
        return linear.float().eval().requires_grad_(False)
    indices = sorted({int(key.split(".")[0]) for key in head})
    layers = [torch.nn.Identity() for _ in range(indices[-1] + 1)]
    for k, index in enumerate(indices):
        weight = head[f"{index}.weight"]
        layers[index] = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=f"{index}.bias" in head)
        if k < len(indices) - 1:
            layers[index + 1] = torch.nn.ReLU()
    module = torch.nn.Sequential(*layers)
    module.load_state_dict(head)
    return module.float().eval().requires_grad_(False)


@functools.cache
def load_backbone(checkpoint: str, base: str, model_class: str, special_tokens: tuple, device: torch.device,
                  dtype: torch.dtype):
    """(backbone, tokenizer, image processor, the checkpoint's state dict): loaded once per process and settings."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    file = Path(checkpoint)
    state = load_state(file)
    try:
        tokenizer = AutoTokenizer.from_pretrained(base)
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(base)
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load the reward's base model {base!r}: {str(error).splitlines()[0]}") from None
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    weights = backbone_state(state)
    embed = weights.get("language_model.embed_tokens.weight")
    if embed is None:
        raise UserError(f"reward checkpoint {file} holds no Qwen-VL language model (language_model.embed_tokens)")
    if embed.shape[0] < len(tokenizer):
        raise UserError(f"reward checkpoint {file} has {embed.shape[0]} token embeddings but the tokenizer of "
                        f"{base!r} with the reward's tokens has {len(tokenizer)}: wrong base= for this checkpoint")
    config.text_config.vocab_size = embed.shape[0]
    config._attn_implementation = "sdpa"
    # Parameters on the meta device, buffers (rotary frequencies) real; the checkpoint's tensors are assigned.
    with init_empty_weights(include_buffers=False):
        backbone = getattr(transformers, model_class)(config)
    missing, unexpected = backbone.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise UserError(f"reward checkpoint {file} does not fit {model_class} of {base!r}: missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}")
    backbone = backbone.to(device, dtype).eval().requires_grad_(False)
    return backbone, tokenizer, image_processor, state


def chat_text(parts: list[str]) -> str:
    """The chat template of Qwen2-VL / Qwen2.5-VL Instruct for one user turn of `parts` (vision placeholders
    already expanded, text as is) and add_generation_prompt."""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{''.join(parts)}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def patchify_frames(frames: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, list[int]]:
    """Normalised frames (T, C, H, W), T a multiple of `temporal`, H and W of patch·merge -> Qwen-VL patches
    (t·h·w, C·temporal·patch²) in the vision tower's order (each merge×merge block of patches contiguous) and the
    grid [t, h, w]."""
    count, channels, height, width = frames.shape
    t, h, w = count // temporal, height // patch, width // patch
    patches = frames.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * temporal * patch * patch), [t, h, w]


class QwenVLReward:
    """A Qwen-VL backbone, its tokenizer with the reward's added tokens, the image processor and the heads."""

    model_class = "Qwen2VLModel"
    special_tokens: tuple = ("<|Reward|>",)
    pixels = HPSV3_PIXELS  # min_pixels = max_pixels of each image (or frame)

    def __init__(self, checkpoint: Path, base: str, device, dtype, batch_size):
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.backbone, self.tokenizer, self.image_processor, state = load_backbone(
            str(checkpoint), str(base), self.model_class, tuple(self.special_tokens), self.device, dtype)
        self.heads = self.load_heads(state)
        self.batch_size = int(batch_size)
        self.special_ids = self.tokenizer.convert_tokens_to_ids(list(self.special_tokens))

    def load_heads(self, state: dict) -> dict:
        return {"rm_head": build_head(state, "rm_head.").to(self.device)}

    def image_inputs(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """PIL images -> (pixel_values, image_grid_thw) of the PIL Qwen2-VL image processor at exactly `pixels`."""
        out = self.image_processor(images=images, size={"shortest_edge": self.pixels, "longest_edge": self.pixels},
                                   return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def placeholder(self, grid, token: str) -> str:
        merge = self.image_processor.merge_size
        return f"<|vision_start|>{token * (int(torch.as_tensor(grid).prod()) // merge ** 2)}<|vision_end|>"

    def special_states(self, texts: list[str], pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                       video_grid_thw=None) -> torch.Tensor:
        """The backbone's last hidden states at the reward tokens, float32 (B, number of reward tokens, H), for one
        chat text per sample (its placeholders expanded); right padding, as the references."""
        tokens = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        length = max(len(t) for t in tokens)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([t + [pad] * (length - len(t)) for t in tokens])
        attention_mask = torch.tensor([[1] * len(t) + [0] * (length - len(t)) for t in tokens])
        # Which tokens are image (1) and video (2) placeholders: the M-RoPE position ids follow them.
        image_id, video_id = self.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
        mm_token_type_ids = (input_ids == image_id).long() + 2 * (input_ids == video_id).long()
        vision = {k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype) for k, v in (
            ("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw),
            ("pixel_values_videos", pixel_values_videos), ("video_grid_thw", video_grid_thw)) if v is not None}
        hidden = self.backbone(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                               mm_token_type_ids=mm_token_type_ids.to(self.device), **vision).last_hidden_state
        rows = []
        for i, ids in enumerate(input_ids.tolist()):
            positions = []
            for token in self.special_ids:
                found = [p for p, t in enumerate(ids) if t == token]
                if len(found) != 1:
                    raise ValueError(f"the reward prompt holds {len(found)} reward tokens "
                                     f"{self.tokenizer.convert_ids_to_tokens(token)}, expected 1")
                positions.append(found[0])
            rows.append(hidden[i, positions])
        return torch.stack(rows).float()


class HPSv3(QwenVLReward):
    """`--reward hpsv3`: HPSv3's μ. `path`: checkpoint (hub id, folder or file); `base`: the Qwen2-VL it was trained
    from (config, tokenizer, image processor)."""

    def __init__(self, device=None, dtype=torch.float32, path=HPSV3_CHECKPOINT, base=HPSV3_BASE, batch_size="8"):
        super().__init__(_resolve(path, HPSV3_FILE), base, device, dtype, batch_size)

    def __call__(self, images, prompts):
        scores = []
        for start in range(0, len(images), self.batch_size):
            pil = to_pil(images[start:start + self.batch_size])
            pixel_values, grid = self.image_inputs(pil)
            texts = [chat_text([self.placeholder(g, "<|image_pad|>"), HPSV3_INSTRUCTION.format(text_prompt=p)])
                     for g, p in zip(grid, prompts[start:start + self.batch_size])]
            states = self.special_states(texts, pixel_values=pixel_values, image_grid_thw=grid)
            scores.append(self.heads["rm_head"](states[:, 0])[:, 0])
        return torch.cat(scores)


def save_tiny_qwen_vl(folder: Path, model_class: str, special_tokens: tuple, heads: dict, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL or Qwen2.5-VL reward model (2 layers, width 32, a 1-block vision tower) in the
    references' layout: `folder/base` holds the base's config, tokenizer and image processor; `folder/model.safetensors`
    the fine-tuned weights under ForConditionalGeneration names with the embeddings resized to the added tokens, and
    the heads (`heads`: prefix -> list of Linear (in, out, bias) sizes, e.g. {"rm_head.": [(32, 16, True), ...]}).
    Returns the checkpoint file."""
    import transformers
    from safetensors.torch import save_file
    from transformers import Qwen2VLImageProcessorPil

    from common.tiny import tiny_qwen2_tokenizer

    tokenizer = tiny_qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config_class = getattr(transformers, model_class.replace("Model", "Config"))
    vision = dict(depth=1, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2) if model_class == "Qwen2VLModel" \
        else dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0])
    config = config_class(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096, rope_theta=1e6,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>")),
        vision_config=vision, image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    full = getattr(transformers, model_class.replace("Model", "ForConditionalGeneration"))(config)
    base = Path(folder) / "base"
    full.save_pretrained(base, safe_serialization=True)  # the base model as released (config.json read from here)
    tokenizer.save_pretrained(base)
    Qwen2VLImageProcessorPil().save_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    full.resize_token_embeddings(len(tokenizer))  # as the references do before fine-tuning
    state = {key: value.contiguous() for key, value in full.state_dict().items()}
    for prefix, sizes in heads.items():
        layers = [torch.nn.Linear(i, o, bias=b) for i, o, b in sizes]
        if len(layers) == 1:
            state.update({prefix + k: v for k, v in layers[0].state_dict().items()})
        else:  # the ranknet layout: Linear at 0, 3, 5, ...: index = 3·k for the first two, then +2
            index = 0
            for k, layer in enumerate(layers):
                state.update({f"{prefix}{index}.{name}": v for name, v in layer.state_dict().items()})
                index += 3 if k < len(layers) - 2 else 2
    for key in [k for k in state if k == "lm_head.weight" and config.tie_word_embeddings]:
        state[key] = state[key].clone()
    checkpoint = Path(folder) / "model.safetensors"
    save_file(state, checkpoint)
    return checkpoint
