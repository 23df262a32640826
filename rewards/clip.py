"""CLIP-based rewards: PickScore, its rank within the group, CLIP score and the LAION aesthetic predictor.

- PickScore (Kirstain et al., arXiv:2305.01569): a CLIP-H fine-tuned on human preferences. Score =
  logit_scale·cos(text, image) / 26, as Flow-GRPO (arXiv:2505.05470) divides it; `pickscore_rank` is the
  0-based ascending rank of that score within the group divided by K (best = (K−1)/K).
- CLIP score (Radford et al., arXiv:2103.00020): cos(text, image) of `openai/clip-vit-large-patch14`.
- Aesthetic (LAION improved-aesthetic-predictor, as DDPO arXiv:2305.13301 uses it): the L2-normalised CLIP-L
  image embedding through a linear MLP 768→1024→128→64→16→1 (dropout only, no activations); raw, ≈1–10.

Everything loads by hub id by default and accepts local folders (`path=`, `processor=`, `head=`). Images go
through the model's own processor after rounding to uint8 PIL images, as the references do. `path=tiny`
builds a tiny random CLIP (real transformers classes, saved and reloaded like a checkpoint) for CPU demos.
"""

import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from common.utils import UserError
from rewards.weights import load_state, local_path

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_MODEL = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "trl-lib/ddpo-aesthetic-predictor"  # a copy of LAION's sac+logos+ava1-l14-linearMSE.pth
AESTHETIC_HEAD_FILE = "aesthetic-model.pth"
TINY_CLIP_VERSION = 1


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) floats in [0, 1] -> uint8 PIL images (round(255·x), as the references)."""
    from PIL import Image

    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(array) for array in pixels]


@functools.cache
def load_clip(model_path: str, processor_path: str, device: torch.device, dtype: torch.dtype):
    """(CLIPModel, CLIPProcessor), loaded once per (paths, device, dtype) in a process: rewards that share a
    backbone share the instance."""
    from transformers import CLIPModel, CLIPProcessor

    model_path, processor_path = _tiny_or(model_path), _tiny_or(processor_path)
    model_path = str(local_path(model_path, "the CLIP model") or model_path)
    processor_path = str(local_path(processor_path, "the CLIP processor") or processor_path)
    try:
        processor = CLIPProcessor.from_pretrained(processor_path)
        model = CLIPModel.from_pretrained(model_path, dtype=dtype)
    except (OSError, ValueError) as error:  # a missing folder, an unreachable hub, a malformed repo id
        raise UserError(f"cannot load the CLIP model {model_path!r} / processor {processor_path!r}: "
                        f"{str(error).splitlines()[0]}") from None
    return model.to(device).eval().requires_grad_(False), processor


def _features(output) -> torch.Tensor:
    # transformers v5 returns a ModelOutput whose pooler_output is the projected embedding; v4 a tensor.
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class _ClipReward:
    """A CLIP model and processor, shared through load_clip, and batched embeddings."""

    def __init__(self, model_path, processor_path, device, dtype, batch_size):
        self.device = torch.device(device if device is not None else "cpu")
        self.dtype = dtype
        self.model, self.processor = load_clip(str(model_path), str(processor_path), self.device, dtype)
        self.batch_size = int(batch_size)

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised projected image embeddings, float32 (B, D)."""
        out = []
        for start in range(0, len(images), self.batch_size):
            pil = to_pil(images[start:start + self.batch_size])
            pixels = self.processor(images=pil, return_tensors="pt")["pixel_values"]
            features = _features(self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype)))
            out.append(features.float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = self.processor(text=prompts[start:start + self.batch_size], padding=True, truncation=True,
                                    max_length=self.model.config.text_config.max_position_embeddings,
                                    return_tensors="pt").to(self.device)
            features = _features(self.model.get_text_features(input_ids=tokens["input_ids"],
                                                              attention_mask=tokens["attention_mask"]))
            out.append(features.float())
        embeds = torch.cat(out)
        return embeds / embeds.norm(dim=-1, keepdim=True)

    def cosine(self, images, prompts) -> torch.Tensor:
        return (self.image_embeddings(images) * self.text_embeddings(prompts)).sum(-1)


class PickScore(_ClipReward):
    """logit_scale·cos(text, image)/26. `path`: model (hub id or folder); `processor`: defaults to the published
    CLIP-H processor for the published model and to `path` for any other."""

    def __init__(self, device=None, dtype=torch.float32, path=PICKSCORE_MODEL, processor=None, batch_size="32"):
        processor = processor or (PICKSCORE_PROCESSOR if path == PICKSCORE_MODEL else path)
        super().__init__(path, processor, device, dtype, batch_size)

    def __call__(self, images, prompts):
        return self.model.logit_scale.exp().float() * self.cosine(images, prompts) / 26


class PickScoreRank:
    """Groupwise: 0-based ascending rank of the PickScore within the group / K (ties: earlier sample lower)."""

    groupwise = True

    def __init__(self, device=None, dtype=torch.float32, path=PICKSCORE_MODEL, processor=None, batch_size="32"):
        self.pickscore = PickScore(device, dtype, path, processor, batch_size)

    def __call__(self, images, prompts):
        scores = self.pickscore(images, prompts).cpu()
        ranks = torch.argsort(torch.argsort(scores, stable=True), stable=True)
        return ranks.double() / len(scores)


class ClipScore(_ClipReward):
    """cos(text, image) of a CLIP model (`path`, processor from the same place unless `processor`)."""

    def __init__(self, device=None, dtype=torch.float32, path=CLIP_MODEL, processor=None, batch_size="32"):
        super().__init__(path, processor or path, device, dtype, batch_size)

    def __call__(self, images, prompts):
        return self.cosine(images, prompts)


def load_aesthetic_head(head: str, filename: str = AESTHETIC_HEAD_FILE) -> torch.nn.Sequential:
    """The LAION MLP from a .pth/.safetensors file, a folder holding `filename`, or a hub id."""
    path = local_path(_tiny_or(head), "the aesthetic head")
    if path is not None and path.is_dir():
        path = path / filename
    elif path is None:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(head, filename))
        except Exception as error:  # offline, unknown repo or file
            raise UserError(f"cannot load the aesthetic head {head!r}/{filename}: "
                            f"{str(error).splitlines()[0]}") from None
    state = load_state(path)
    try:
        return laion_mlp({key.removeprefix("layers."): value for key, value in state.items()})
    except (KeyError, RuntimeError) as error:  # other tensors, or other shapes
        raise UserError(f"aesthetic head {path} is not LAION's aesthetic MLP ({str(error).splitlines()[0]})") \
            from None


def laion_mlp(state: dict) -> torch.nn.Sequential:
    """The LAION aesthetic predictor's MLP (also ImageReward's head) loaded from `state`: Linear, Dropout, Linear,
    Dropout, Linear, Dropout, Linear, Linear (indices 0, 2, 4, 6, 7), widths in→1024→128→64→16→1, no activations."""
    width = state["0.weight"].shape[1]
    head_module = torch.nn.Sequential(
        torch.nn.Linear(width, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1),
    )
    head_module.load_state_dict(state)
    return head_module.eval().requires_grad_(False)


class Aesthetic(_ClipReward):
    """LAION aesthetic score: MLP head on the normalised CLIP-L image embedding (the head runs in float32)."""

    def __init__(self, device=None, dtype=torch.float32, path=CLIP_MODEL, processor=None, head=None,
                 head_file=AESTHETIC_HEAD_FILE, batch_size="32"):
        super().__init__(path, processor or path, device, dtype, batch_size)
        head = head or (path if path == "tiny" else AESTHETIC_HEAD)
        self.head = load_aesthetic_head(head, head_file).to(self.device)

    def __call__(self, images, prompts):
        return self.head(self.image_embeddings(images)).squeeze(1)


def _tiny_or(path: str) -> str:
    return str(tiny_clip_path()) if path == "tiny" else path


def tiny_clip_path() -> Path:
    """A tiny random CLIP (projection 768, 32×32 images) with its processor and an aesthetic head, saved
    under the tiny-model cache (built once, atomically, as the tiny pipelines)."""
    from common.models.tiny_parts import tiny_cache_root

    path = tiny_cache_root() / f"tiny-clip-v{TINY_CLIP_VERSION}"
    if (path / AESTHETIC_HEAD_FILE).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build_tiny_clip(tmp)
        try:
            os.rename(tmp, path)  # atomic; fails if another process won the race
        except OSError:
            if not (path / AESTHETIC_HEAD_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tiny_clip(folder, seed: int = 0, projection_dim: int = 768, image_size: int = 32) -> None:
    """Save a random CLIPModel + CLIPProcessor (in-memory tokenizer) and a random aesthetic head in `folder`."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    from common.models.tiny_parts import tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8),
        projection_dim=projection_dim,
    )
    CLIPModel(config).save_pretrained(folder, safe_serialization=True)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    head = torch.nn.Sequential(
        torch.nn.Linear(projection_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
        torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16),
        torch.nn.Linear(16, 1),
    )
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, Path(folder) / AESTHETIC_HEAD_FILE)
