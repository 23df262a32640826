# Build the embedding cache: encode every train and test prompt (and negative prompts for models with
# true CFG) once, so training runs never load the text encoders; for conditioned models (editing,
# image-to-video) also what depends on each prompt's condition images (their VAE latents, image-dependent
# prompt embeddings), so training never VAE-encodes a condition. See common/cache.py for the format.
#   python preprocess.py --model flux1 --model-path black-forest-labs/FLUX.1-dev --dataset data/prompts
#   accelerate launch preprocess.py ...   (each process encodes its share)
import time
from dataclasses import dataclass
from typing import Literal

import torch
from accelerate import Accelerator

from common.cache import (build_cache, cache_entries, condition_inputs, default_cache_root, fingerprint_inputs,
                          open_cache)
from common.cli import ModelName, parse_args
from common.data import check_conditions, load_prompts
from common.models import ADAPTERS, load_adapter, resolve_model_path
from common.utils import UserError, resolve_dtype


@dataclass
class Args:
    model: ModelName = "flux1"
    """model family"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` or `toy` for the offline ones (unset: the published model)"""
    dataset: str | None = None
    """folder with train/test .jsonl or .txt prompt files (unset: the training scripts' default for --model)"""
    cache_dir: str | None = None
    """root folder of embedding caches (unset: $FLOWRL_CACHE/embeddings, where training looks)"""
    max_sequence_length: int | None = None
    """prompt length in tokens: must equal the training run's (unset: the model's own, as the training scripts')"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """embedding dtype: must equal the training run's (auto: bf16 on GPU, float32 on CPU)"""
    resolution: int = 512
    """conditioned models: the training run's --resolution (the condition tensors depend on it)"""
    condition_size: int | None = None
    """conditioned models: the training run's --condition-size"""
    num_frames: int | None = None
    """image-to-video: the training run's --num-frames"""
    shard_size: int = 256
    """prompts per safetensors shard"""
    force: bool = False
    """rebuild even when a complete matching cache exists"""


def check(args: Args) -> None:
    from common.cli import CONDITIONED_MODELS, VIDEO_MODELS

    if args.condition_size is not None and args.model not in CONDITIONED_MODELS:
        raise UserError(f"--condition-size applies to conditioned models ({', '.join(CONDITIONED_MODELS)}), "
                        f"not to {args.model}")
    if args.num_frames is not None and args.model not in VIDEO_MODELS:
        raise UserError(f"--num-frames applies to video models ({', '.join(VIDEO_MODELS)}), not to {args.model}")
    if args.shard_size < 1:
        raise UserError(f"--shard-size must be at least 1, got {args.shard_size}")
    if args.max_sequence_length < 1:
        raise UserError(f"--max-sequence-length must be at least 1, got {args.max_sequence_length}")


if __name__ == "__main__":
    args = parse_args(Args, description="Build the embedding cache of a dataset's prompts.", check=check)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    dtype = resolve_dtype(args.dtype, accelerator.device)
    model_path = resolve_model_path(args.model, args.model_path)
    records = load_prompts(args.dataset, "train") + load_prompts(args.dataset, "test")
    check_conditions(records, *ADAPTERS[args.model].condition_images, args.model)
    entries = cache_entries(records, [], with_negatives=ADAPTERS[args.model].true_cfg)
    condition = condition_inputs(args.model, args.resolution, args.condition_size, args.num_frames)
    inputs = fingerprint_inputs(args.model, model_path, args.max_sequence_length, dtype, list(entries), condition)
    root = args.cache_dir or default_cache_root()
    existing = open_cache(root, inputs, explicit=False)
    if existing is not None and not args.force:
        accelerator.print(f"a complete cache already exists: {existing.folder}")
    else:
        start = time.time()
        adapter = load_adapter(args.model, model_path, accelerator.device, dtype, args.resolution,
                               max_sequence_length=args.max_sequence_length, text_only=True,
                               num_frames=args.num_frames, condition_size=args.condition_size)
        adapter.check_condition_shapes(records)
        folder = build_cache(accelerator, adapter, entries, root, inputs, args.shard_size)
        what = "entries" if condition else "texts"
        accelerator.print(f"encoded {len(entries)} {what} on {accelerator.num_processes} process(es) in "
                          f"{time.time() - start:.1f} s -> {folder}")
    accelerator.end_training()
