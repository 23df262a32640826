# Build the embedding cache: encode every train and test prompt (and negative prompts for models with
# true CFG) once, so training runs never load the text encoders. See common/cache.py for the format.
#   python preprocess.py --model flux1 --model-path black-forest-labs/FLUX.1-dev --dataset data/prompts
#   accelerate launch preprocess.py ...   (each process encodes its share)
import time
from dataclasses import dataclass

import torch
import tyro
from accelerate import Accelerator

from common.cache import build_cache, cache_texts, default_cache_root, fingerprint_inputs, open_cache
from common.data import DEFAULT_DATASET, load_prompts
from common.models import ADAPTERS, load_adapter, resolve_model_path
from common.utils import UserError, install_user_error_hook, quiet_libraries, resolve_dtype


@dataclass
class Args:
    model: str = "flux1"
    """model family; one of common.models.ADAPTERS"""
    model_path: str | None = None
    """hub id or local folder of the pipeline; `tiny` for the offline tiny one (default: the published model)"""
    dataset: str = DEFAULT_DATASET
    """folder with train/test .jsonl or .txt prompt files"""
    cache_dir: str | None = None
    """root folder of embedding caches (default: $FLOWRL_CACHE/embeddings, where training looks)"""
    max_sequence_length: int = 512
    """prompt length in tokens: must equal the training run's"""
    dtype: str = "auto"
    """embedding dtype: must equal the training run's (auto: bf16 on GPU, float32 on CPU)"""
    shard_size: int = 256
    """prompts per safetensors shard"""
    force: bool = False
    """rebuild even when a complete matching cache exists"""


if __name__ == "__main__":
    install_user_error_hook()
    quiet_libraries()
    args = tyro.cli(Args)
    if args.model not in ADAPTERS:
        raise UserError(f"unknown model {args.model!r}; choose one of: {', '.join(ADAPTERS)}")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    dtype = resolve_dtype(args.dtype, accelerator.device)
    model_path = resolve_model_path(args.model, args.model_path)
    texts = cache_texts(load_prompts(args.dataset, "train"), load_prompts(args.dataset, "test"),
                        with_negatives=ADAPTERS[args.model].true_cfg)
    inputs = fingerprint_inputs(args.model, model_path, args.max_sequence_length, dtype, texts)
    root = args.cache_dir or default_cache_root()
    existing = open_cache(root, inputs, explicit=False)
    if existing is not None and not args.force:
        accelerator.print(f"a complete cache already exists: {existing.folder}")
    else:
        start = time.time()
        adapter = load_adapter(args.model, model_path, accelerator.device, dtype, resolution=0,
                               max_sequence_length=args.max_sequence_length, text_only=True)
        folder = build_cache(accelerator, adapter, texts, root, inputs, args.shard_size)
        accelerator.print(f"encoded {len(texts)} texts on {accelerator.num_processes} process(es) in "
                          f"{time.time() - start:.1f} s -> {folder}")
    accelerator.end_training()
