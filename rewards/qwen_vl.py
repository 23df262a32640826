"""Reward models on a Qwen-VL backbone: a reward head read at special tokens of a chat prompt.

- HPSv3 (Ma et al., arXiv:2508.03789; PyPI `hpsv3`): Qwen2-VL-7B-Instruct fine-tuned on human preferences. The
  image (resized to about 256·28·28 pixels, sides multiples of 28) and an instruction naming the prompt go in one user
  turn ending in the added token `<|Reward|>`; its last hidden state, computed with positions 0..L-1 (no 2-D image
  positions, as transformers 4.45.2 ran it), through an MLP H→1024→16→2 gives (μ, σ) and μ is the score.
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
import itertools
import json
import math
from pathlib import Path

import numpy as np
import torch

from common.utils import UserError
from rewards.clip import to_pil
from rewards.weights import checkpoint_file, load_state, local_path, snapshot_folder

SYSTEM_PROMPT = "You are a helpful assistant."  # the Qwen2-VL / Qwen2.5-VL chat template's default system turn
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

HPSV3_CHECKPOINT, HPSV3_FILE, HPSV3_BASE = "MizzenAI/HPSv3", "HPSv3.safetensors", "Qwen/Qwen2-VL-7B-Instruct"
HPSV3_PIXELS = 256 * 28 * 28  # min_pixels = max_pixels in HPSv3's inferencer: sides multiples of 28 near that area
# (qwen-vl-utils' smart_resize; 448×448 for a square image, 392×560 for 32×48)
# The released instruction, verbatim (trailing spaces included): INSTRUCTION + prompt_with_special_token of
# hpsv3/dataset/data_collator_qwen.py in the hpsv3==1.0.0 wheel, which its inferencer (hpsv3/inference.py) sends.
HPSV3_INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


""" + """
Please provide the overall ratings of this image: <|Reward|>

END
"""

EDITREWARD_CHECKPOINT, EDITREWARD_BASE = "TIGER-Lab/EditReward-Qwen2.5-VL-7B", "Qwen/Qwen2.5-VL-7B-Instruct"
EDITREWARD_FILES = ("model.safetensors", "model.pth")  # the files its inferencer looks for, in this order
EDITREWARD_PIXELS = 256 * 28 * 28  # source and edited image alike
# EditReward's two per-head prompts (dataset/prompts.py INSTRUCTION_EDIT_FOLLOWING / _QUALITY), verbatim, each followed
# by its data collator's prompt_with_special_token.
EDITREWARD_SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"
EDITREWARD_FOLLOWING = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how accurately, completely, and exclusively the model executed the given text instruction.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Semantic Accuracy:**  
  Assess whether the edited content accurately captures the semantics of the instruction. The edited result should precisely match the intended meaning. For example, if the instruction is "replace apples with oranges," the object must clearly be oranges, not other fruits.

- **Completeness of Editing:**  
  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "replace a red car with a blue bicycle"), both the color change and the object replacement must be done without omissions.

- **Exclusivity of Edit (No Over-Editing):**  
  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) should remain unaltered. For example, if the instruction only involves replacing an object, the background, lighting, and unrelated objects should not be unnecessarily modified.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  
- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  
- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended changes.  
- **1 (Very Poor):** Instruction ignored or completely wrong execution.

Text instruction - {text_prompt}
"""
EDITREWARD_QUALITY = """
You are tasked with evaluating an edited image **in comparison with the original source image** based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst and 4 being the best.  
This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited image is, while remaining consistent with the source image.

**Inputs Provided:**  
- Source Image (before editing)  
- Edited Image (after applying the instruction)  
- Text Instruction  

**Sub-Dimensions to Evaluate:**

- **Plausibility & Physical Consistency:**  
  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, reflections, perspective, size, and interactions with the environment should all appear natural compared to the source image.

- **Artifact-Free Quality:**  
  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or seams around edited regions. High-quality results should be free from such visible artifacts.

- **Aesthetic Quality:**  
  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.

**Scoring Criteria:**
- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  
- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not significantly distract.  
- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the edit unnatural.  
- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.

Text instruction - {text_prompt}
"""

VIDEOALIGN_CHECKPOINT, VIDEOALIGN_BASE = "KwaiVGI/VideoReward", "Qwen/Qwen2-VL-2B-Instruct"
VIDEOALIGN_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
VIDEOALIGN_DIMENSIONS = ("visual_quality", "motion_quality", "text_alignment")  # VQ, MQ, TA: head outputs 0, 1, 2
VIDEO_MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' floor for a video frame (VideoAlign's vision_process.py)
# VideoAlign's prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN (prompt_template_type "detailed_special"), verbatim.
VIDEOALIGN_PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""


def read_file_state(source: str, base: str) -> dict:
    return load_state(Path(source))


def backbone_key(key: str) -> str | None:
    """A checkpoint key under the name of transformers' Qwen2VLModel / Qwen2_5_VLModel, or None for lm_head and the
    reward heads: keys saved by the ForConditionalGeneration class of transformers ≥ 4.52 (`model.language_model.*`,
    `model.visual.*`) or of older versions (`model.*` for the language model, `visual.*`)."""
    if key.startswith(("model.language_model.", "model.visual.")):
        return key.removeprefix("model.")
    if key.startswith("visual."):
        return key
    if key.startswith("model."):
        return "language_model." + key.removeprefix("model.")
    return None


def backbone_state(state: dict) -> dict:
    return {name: value for key, value in state.items() if (name := backbone_key(key)) is not None}


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
def load_backbone(source: str, read_state, base: str, model_class: str, special_tokens: tuple, device: torch.device,
                  dtype: torch.dtype):
    """(backbone, tokenizer, image processor, the heads' tensors of the checkpoint `read_state(source, base)`): loaded
    once per process and settings."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    state = read_state(source, base)
    base = str(local_path(base, "the reward's base model") or base)
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
        raise UserError(f"reward checkpoint {source} holds no Qwen-VL language model (language_model.embed_tokens)")
    if embed.shape[0] < len(tokenizer):
        raise UserError(f"reward checkpoint {source} has {embed.shape[0]} token embeddings but the tokenizer of "
                        f"{base!r} with the reward's tokens has {len(tokenizer)}: wrong base= for this checkpoint")
    config.text_config.vocab_size = embed.shape[0]
    config._attn_implementation = "sdpa"
    # Parameters on the meta device, buffers (rotary frequencies) real; the checkpoint's tensors are assigned.
    with init_empty_weights(include_buffers=False):
        backbone = getattr(transformers, model_class)(config)
    missing, unexpected = backbone.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise UserError(f"reward checkpoint {source} does not fit {model_class} of {base!r}: missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}")
    backbone = backbone.to(device, dtype).eval().requires_grad_(False)
    # Only the heads stay cached with the backbone (not lm_head, which no reward reads, nor the rest of the state).
    heads = {k: v for k, v in state.items() if backbone_key(k) is None and not k.startswith("lm_head.")}
    return backbone, tokenizer, image_processor, heads


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
    sequential_positions = False  # True: positions 0..L-1 in all three M-RoPE sections instead of the 3-D ones

    def __init__(self, source: str, read_state, base: str, device, dtype, batch_size):
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.backbone, self.tokenizer, self.image_processor, state = load_backbone(
            str(source), read_state, str(base), self.model_class, tuple(self.special_tokens), self.device, dtype)
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
        # None: the model's own M-RoPE positions (3-D over the vision tokens); else 0..L-1 in all three sections.
        position_ids = torch.arange(length).expand(len(tokens), length).to(self.device) \
            if self.sequential_positions else None
        hidden = self.backbone(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                               mm_token_type_ids=mm_token_type_ids.to(self.device), position_ids=position_ids,
                               **vision).last_hidden_state
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

    # hpsv3's Qwen2VLRewardModelBT.forward (model/qwen2vl_trainer.py) calls the language model with position_ids=None,
    # which transformers 4.45.2 (the package's pin) fills with 0..L-1 for all three M-RoPE sections: the model was
    # trained and is served without the image's 2-D positions (4.45.2 computes those only when generating).
    sequential_positions = True

    def __init__(self, device=None, dtype=torch.float32, path=HPSV3_CHECKPOINT, base=HPSV3_BASE, batch_size="8"):
        super().__init__(str(checkpoint_file(path, (HPSV3_FILE,))), read_file_state, base, device, dtype, batch_size)

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


class EditReward(QwenVLReward):
    """`--reward editreward`: EditReward's score of an edit against its source (the sample's first condition image),
    the mean of its two heads' μ; the heads' μ are logged as columns `instruction_following` and `visual_quality`."""

    model_class = "Qwen2_5_VLModel"
    pixels = EDITREWARD_PIXELS
    wants_conditions = True

    def __init__(self, device=None, dtype=torch.float32, path=EDITREWARD_CHECKPOINT, base=EDITREWARD_BASE,
                 batch_size="8"):
        super().__init__(str(checkpoint_file(path, EDITREWARD_FILES)), read_file_state, base, device, dtype, batch_size)

    def load_heads(self, state: dict) -> dict:
        return {name: build_head(state, f"rm_heads.{name}.").to(self.device) for name in ("head_0", "head_1")}

    def __call__(self, images, prompts, conditions):
        if any(not c for c in conditions):
            raise ValueError("editreward judges an edit against its source: every sample needs a condition image")
        heads = {"instruction_following": [], "visual_quality": []}
        for start in range(0, len(images), self.batch_size):
            stop = min(start + self.batch_size, len(images))
            sources = [to_pil(c[0][None])[0] for c in conditions[start:stop]]  # each at its file's own size
            edited = to_pil(images[start:stop])
            # One image list per sample, source first: the processor's patches come in that order.
            pixel_values, grid = self.image_inputs([image for pair in zip(sources, edited) for image in pair])
            for (column, instruction), head in zip((("instruction_following", EDITREWARD_FOLLOWING),
                                                    ("visual_quality", EDITREWARD_QUALITY)), ("head_0", "head_1")):
                texts = [chat_text([self.placeholder(grid[2 * i], "<|image_pad|>"),
                                    self.placeholder(grid[2 * i + 1], "<|image_pad|>"),
                                    instruction.format(text_prompt=prompt) + EDITREWARD_SUFFIX])
                         for i, prompt in enumerate(prompts[start:stop])]
                states = self.special_states(texts, pixel_values=pixel_values, image_grid_thw=grid)
                heads[column].append(self.heads[head](states[:, 0])[:, 0])
        columns = {name: torch.cat(values) for name, values in heads.items()}
        # The reference's "mean" pooling of the two heads' (μ, log σ): the score is the mean μ.
        return {"score": (columns["instruction_following"] + columns["visual_quality"]) / 2, **columns}


def _canonical(key: str) -> str:
    """A ForConditionalGeneration key in the names of transformers ≥ 4.52 (heads and lm_head unchanged)."""
    name = backbone_key(key)
    return key if name is None else "model." + name


def videoalign_state(source: str, base: str) -> dict:
    """VideoReward's weights (ForConditionalGeneration names, and rm_head) from the folder `source`, as its
    inference loads them: the latest checkpoint-N, either a full `model.pth` or the base model's weights updated by
    the checkpoint's non-LoRA tensors (`non_lora_state_dict.pth`: the resized embeddings, the head, ...) with its
    LoRA merged in, W + s·B·A, s = α/r (α/√r with rsLoRA) from model_config.json's peft_lora_config: what the PEFT
    model computes."""

    folder = Path(source)
    steps = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    if not steps:
        raise UserError(f"the VideoAlign checkpoint folder {folder} holds no checkpoint-N folder")
    checkpoint = steps[-1]
    if (checkpoint / "model.pth").exists():
        return load_state(checkpoint / "model.pth")
    state = {}
    for file in sorted(snapshot_folder(base).glob("*.safetensors")):
        state.update({_canonical(key): value for key, value in load_state(file).items()})
    non_lora = load_state(checkpoint / "non_lora_state_dict.pth")
    for key, value in non_lora.items():
        key = key.removeprefix("base_model.model.").replace(".modules_to_save.default.", ".")
        if ".original_module." not in key:
            state[_canonical(key)] = value
    lora_config = json.loads((folder / "model_config.json").read_text())["peft_lora_config"]
    rank, alpha = lora_config["lora_r"], lora_config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if lora_config.get("use_rslora") else alpha / rank
    lora = load_state(checkpoint / "adapter_model.safetensors")
    for key in [k for k in lora if k.endswith(".lora_A.weight")]:
        target = _canonical(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight")
        down, up = lora[key].float(), lora[key.replace(".lora_A.", ".lora_B.")].float()
        state[target] = (state[target].float() + scale * up @ down).to(state[target].dtype)
    return state


def qwen_vl_utils_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = 28) -> tuple:
    """qwen-vl-utils' smart_resize (as VideoAlign's vision_process.py has it): sides multiples of `factor`, the
    area within [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class VideoAlign(QwenVLReward):
    """`--reward videoalign`: VideoReward's three dimensions of a whole clip, normalised by the checkpoint's
    inference_config, logged as columns visual_quality, motion_quality, text_alignment; the score is their sum.
    `fps`: the frame rate of the model's clips (Wan: 16), from which frames are sampled at the checkpoint's rate."""

    special_tokens = VIDEOALIGN_TOKENS
    video = True

    def __init__(self, device=None, dtype=torch.float32, path=VIDEOALIGN_CHECKPOINT, base=VIDEOALIGN_BASE, fps="16",
                 batch_size="2"):
        folder = snapshot_folder(path)
        try:
            config = json.loads((folder / "model_config.json").read_text())
            data, model = config["data_config"], config["model_config"]
        except (OSError, ValueError, KeyError) as error:
            raise UserError(f"cannot read {folder / 'model_config.json'} of the VideoAlign checkpoint: {error}") \
                from None
        found = (model.get("reward_token"), model.get("output_dim"), data.get("prompt_template_type"),
                 data.get("sample_type", "uniform"))
        if found != ("special", 3, "detailed_special", "uniform"):
            raise UserError(f"VideoAlign checkpoint {path!r} has (reward_token, output_dim, prompt_template_type, "
                            f"sample_type) = {found}; this reward reads ('special', 3, 'detailed_special', 'uniform')")
        self.num_frames, self.sample_fps = data.get("num_frames"), float(data.get("fps") or 2.0)
        self.max_pixels, self.clip_fps = int(data.get("max_frame_pixels", 240 * 320)), float(fps)
        norm = config.get("inference_config") or {}
        self.mean = torch.tensor([float(norm.get(f"{d}_mean", 0.0)) for d in ("VQ", "MQ", "TA")])
        self.std = torch.tensor([float(norm.get(f"{d}_std", 1.0)) for d in ("VQ", "MQ", "TA")])
        super().__init__(str(folder), videoalign_state, base, device, dtype, batch_size)

    def frame_count(self, total: int) -> int:
        """qwen-vl-utils' smart_nframes: `num_frames` of the checkpoint, else the clip resampled at its fps (at
        least 4 frames, at most 768 and the clip's), rounded to an even count."""
        if self.num_frames:
            count = round(self.num_frames / 2) * 2
        else:
            lowest, highest = 4, math.floor(min(768, total) / 2) * 2
            count = round(min(max(total / self.clip_fps * self.sample_fps, lowest), highest) / 2) * 2
        count = min(count, total)
        if count < 2:
            raise ValueError(f"VideoAlign needs clips of at least 2 frames, got {total}")
        return count

    def video_inputs(self, clip: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """One clip (F, 3, H, W) in [0, 1] -> (pixel_values_videos, grid [t, h, w]): frames sampled uniformly
        (linspace, rounded), as uint8 (a decoded file), resized bicubic with antialiasing to qwen-vl-utils' size,
        rounded to uint8 again (torchvision's resize of uint8 frames), normalised, the last frame repeated to an even
        count, patchified."""
        index = torch.linspace(0, len(clip) - 1, self.frame_count(len(clip))).round().long()
        frames = (clip[index].detach().float().cpu().clamp(0, 1) * 255).round()
        height, width = qwen_vl_utils_resize(*frames.shape[-2:], VIDEO_MIN_PIXELS, self.max_pixels)
        frames = torch.nn.functional.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False,
                                                 antialias=True).clamp(0, 255).round() / 255
        mean, std = torch.tensor(OPENAI_CLIP_MEAN)[:, None, None], torch.tensor(OPENAI_CLIP_STD)[:, None, None]
        frames = ((frames - mean) / std).double().numpy()
        if len(frames) % 2:
            frames = np.concatenate([frames, frames[-1:]])
        patches, grid = patchify_frames(frames, 14, 2, 2)
        return torch.from_numpy(patches).float(), grid

    def __call__(self, images, prompts):
        dimensions = []
        for start in range(0, len(images), self.batch_size):
            clips = [self.video_inputs(clip) for clip in images[start:start + self.batch_size]]
            grid = torch.tensor([g for _, g in clips])
            texts = [chat_text([self.placeholder(g, "<|video_pad|>"), VIDEOALIGN_PROMPT.format(text_prompt=p)])
                     for g, p in zip(grid, prompts[start:start + self.batch_size])]
            states = self.special_states(texts, pixel_values_videos=torch.cat([p for p, _ in clips]),
                                         video_grid_thw=grid)
            # Token k's output k (the reference's diagonal of the (B, 3, 3) head outputs).
            dimensions.append(self.heads["rm_head"](states).diagonal(dim1=1, dim2=2))
        scores = (torch.cat(dimensions).cpu() - self.mean) / self.std
        return {"score": scores.sum(1), **{name: scores[:, k] for k, name in enumerate(VIDEOALIGN_DIMENSIONS)}}


def tiny_qwen_vl_base(folder: Path, model_class: str, special_tokens: tuple, seed: int = 0):
    """A tiny random Qwen2-VL or Qwen2.5-VL (2 layers, width 32, a 1-block vision tower) saved as its base model in
    `folder/base` (config, weights, tokenizer, PIL image processor); returns the ForConditionalGeneration model with its
    embeddings resized to the reward's added tokens, as the references do before fine-tuning."""
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    from common.models.tiny_parts import tiny_qwen2_tokenizer

    tokenizer = tiny_qwen2_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config_class = getattr(transformers, model_class.replace("Model", "Config"))
    vision = ({"depth": 1, "embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2}
              if model_class == "Qwen2VLModel" else
              {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
               "fullatt_block_indexes": [0]})
    config = config_class(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 8192,
                     "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                     "bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
                     "pad_token_id": ids("<|endoftext|>")},
        vision_config=vision, image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    full = getattr(transformers, model_class.replace("Model", "ForConditionalGeneration"))(config).eval()
    base = Path(folder) / "base"
    full.save_pretrained(base, safe_serialization=True)
    tokenizer.save_pretrained(base)
    Qwen2VLImageProcessorPil().save_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    full.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return full


def _ranknet_state(prefix: str, sizes: list) -> dict:
    """Random ranknet head weights in the references' layout (Linear at 0, 3, 5: Linear, ReLU, Dropout, Linear,
    ReLU, Linear); `sizes`: (in, out) of each Linear."""
    state, index = {}, 0
    for k, (fan_in, fan_out) in enumerate(sizes):
        layer = torch.nn.Linear(fan_in, fan_out)
        state.update({f"{prefix}{index}.{name}": value for name, value in layer.state_dict().items()})
        index += 3 if k < len(sizes) - 2 else 2
    return state


def save_tiny_qwen_vl(folder: Path, model_class: str, special_tokens: tuple, heads: tuple, seed: int = 0,
                      head_widths: tuple = (16, 8)) -> Path:
    """A tiny random HPSv3 / EditReward-style checkpoint: `folder/base` (tiny_qwen_vl_base) and
    `folder/model.safetensors`, the fine-tuned model's whole state dict (ForConditionalGeneration names) with a random
    ranknet head 32→`head_widths`→2 under each prefix of `heads` (e.g. ("rm_head.",)). Returns the checkpoint file."""
    from safetensors.torch import save_file

    full = tiny_qwen_vl_base(folder, model_class, special_tokens, seed)
    state = {key: value.contiguous().clone() for key, value in full.state_dict().items()}
    for prefix in heads:
        state.update(_ranknet_state(prefix, list(itertools.pairwise((32, *head_widths, 2)))))
    checkpoint = Path(folder) / "model.safetensors"
    save_file(state, checkpoint)
    return checkpoint


TINY_LORA_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def save_tiny_videoalign(folder: Path, seed: int = 0, num_frames=None, inference_config=None) -> Path:
    """A tiny random VideoReward in its release layout: `folder/base` (the base Qwen2-VL), `folder/model_config.json`
    and `folder/checkpoint-7/` holding a rank-4 LoRA of the language model (adapter_model.safetensors, PEFT's key names,
    random non-zero B) and the non-LoRA trained tensors (non_lora_state_dict.pth: the resized embeddings and the
    bias-free rm_head 32→3). Returns `folder`."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from safetensors.torch import save_file

    full = tiny_qwen_vl_base(folder, "Qwen2VLModel", VIDEOALIGN_TOKENS, seed)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TINY_LORA_TARGETS, lora_dropout=0.0), full)
    for name, parameter in full.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    checkpoint = Path(folder) / "checkpoint-7"
    checkpoint.mkdir(parents=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in get_peft_model_state_dict(full).items()},
              checkpoint / "adapter_model.safetensors")
    head = torch.nn.Linear(32, 3, bias=False)
    non_lora = {"base_model.model.model.language_model.embed_tokens.weight":
                full.model.language_model.embed_tokens.weight.detach().clone(),
                "base_model.model.rm_head.weight": head.weight.detach().clone()}
    torch.save(non_lora, checkpoint / "non_lora_state_dict.pth")
    config = {
        "data_config": {"max_frame_pixels": 112 * 112, "num_frames": num_frames, "fps": 2.0,
                        "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special",
                        "sample_type": "uniform"},
        "model_config": {"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "output_dim": 3,
                         "use_special_tokens": True, "reward_token": "special"},
        "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8, "use_rslora": False},
    }
    if inference_config is not None:
        config["inference_config"] = inference_config
    (Path(folder) / "model_config.json").write_text(json.dumps(config, indent=2))
    return Path(folder)
