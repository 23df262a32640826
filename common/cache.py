"""Embedding cache: prompt text (and its condition images) -> text-encoder outputs (and condition tensors),
built once by `preprocess.py`.

With a cache the training scripts never load the text encoders or tokenizers. A cache lives in
CACHE_ROOT/<model>-<fingerprint>/ and holds safetensors shards plus `manifest.json`. The fingerprint
covers everything that changes an embedding: model type, model path and revision, the text encoders' and
tokenizers' files, max sequence length, dtype, the exact prompt texts and CACHE_VERSION, so a stale cache
never matches. Every row carries a sha256 in the manifest, checked when the row is read; shard sizes are
checked when the cache is opened (a truncated shard is refused). A cache is built in a temporary folder
and renamed into place after its manifest is written: an interrupted build leaves nothing that looks
complete.

Texts are always encoded ONE AT A TIME, here and online, so cached and online embeddings are bitwise equal
(batched encoders may differ in the last bit with the batch composition).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from accelerate.utils import gather_object
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from common.data import Prompt
from common.models import ADAPTERS
from common.utils import UserError, disk_writes

CACHE_VERSION = 2  # bump whenever the encoding code changes what it stores
MANIFEST = "manifest.json"


def default_cache_root() -> Path:
    from common.models.tiny_parts import tiny_cache_root

    return tiny_cache_root() / "embeddings"


def cache_entries(train, test, with_negatives: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The entries a run needs, sorted by key (`Prompt.entry`: the text, and for conditioned models the contents
    of its condition images): key -> (text, condition image paths). Every prompt, plus negative prompts ("" included)
    for true CFG, with their prompt's condition images."""
    entries = {}
    for p in [*train, *test]:
        entries[p.entry()] = (p.prompt, p.images)
        if with_negatives:
            entries[p.entry(negative=True)] = (p.negative_prompt, p.images)
            entries[Prompt("", images=p.images, image_digests=p.image_digests).entry()] = ("", p.images)
    return dict(sorted(entries.items()))


def condition_inputs(model: str, resolution: int, condition_size: int | None, num_frames: int | None) -> dict | None:
    """The run settings a conditioned model's cached condition tensors depend on (None for text-only models):
    the condition size, and the output size and frames that image-to-video conditions are built at."""
    adapter = ADAPTERS[model]
    if adapter.condition_images[1] == 0:
        return None
    return {"resolution": resolution, "condition_size": condition_size,
            "num_frames": num_frames if adapter.video else None}


def cache_texts(train, test, with_negatives: bool) -> list[str]:
    """The sorted keys of `cache_entries` (for text-only models: the unique texts)."""
    return list(cache_entries(train, test, with_negatives))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _local_model_folder(model_path: str, components: tuple[str, ...] = ()) -> tuple[Path, str | None]:
    """A local folder holding the pipeline's small files (and `components`' configs), and the hub revision when
    there is one."""
    if Path(model_path).is_dir():
        return Path(model_path), None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(model_path, allow_patterns=["model_index.json", "text_encoder*/*.json",
                                                                   "tokenizer*/*", "processor*/*",
                                                                   *(f"{c}/*.json" for c in components)]))
    except Exception as err:  # offline and not in the hub cache, a typo, no access...
        raise UserError(f"cannot read the text encoder configs of {model_path!r}: {str(err).splitlines()[0]}")
    return folder, folder.name  # snapshots/<commit hash>


def _weights_digest(file: Path, span: int = 1 << 20) -> str:
    """A weights file's size and the sha256 of its first and last MiB: cheap, and it changes when the file is
    replaced by different weights (safetensors headers and tensor data sit at both ends)."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(span)
        handle.seek(max(0, size - span))
        tail = handle.read(span)
    return f"size={size},sha256={_sha256(head + tail)[:32]}"


def fingerprint_inputs(model: str, model_path: str, max_sequence_length: int, dtype: torch.dtype,
                       texts: list[str], condition: dict | None = None) -> dict:
    """What an embedding depends on. `condition` (conditioned models): the settings that change the condition
    tensors (resolution, condition size); the weights of the components that encode conditions are covered too."""
    known = ADAPTERS.get(model)
    components = (*known.text_components, *known.condition_components) if known else ()
    folder, revision = _local_model_folder(model_path, components)
    if not (folder / "model_index.json").is_file():
        raise UserError(f"{model_path!r} has no model_index.json: it is not a diffusers pipeline folder")
    index = json.loads((folder / "model_index.json").read_text())
    encoders = {}
    # Every component whose output the cache holds: the text components (text encoders, tokenizers, and the image
    # encoders and processors of conditioned models, also where a processor is no text component) and the condition
    # encoders.
    parts = ("text_encoder", "tokenizer", "processor", *components)
    for name in sorted(k for k in index if k.startswith(parts)):
        if index[name] in (None, [None, None]) or not (folder / name).is_dir():
            continue
        for file in sorted((folder / name).iterdir()):
            if file.suffix in (".json", ".txt", ".model") or name.startswith("tokenizer"):
                encoders[f"{name}/{file.name}"] = _sha256(file.read_bytes())
            else:  # weights: too large to hash whole on every start
                encoders[f"{name}/{file.name}"] = _weights_digest(file)
    return {
        "version": CACHE_VERSION,
        "model": model,
        # A local folder is known by its files' contents (above), not its path: the same model moved elsewhere (or
        # rebuilt under another $FLOWRL_CACHE) still matches its cache.
        "model_path": "" if Path(model_path).is_dir() else model_path,
        "revision": revision,
        "encoders": encoders,
        "max_sequence_length": max_sequence_length,
        "dtype": str(dtype),
        "texts_sha256": _sha256("\n".join(texts).encode()),
        "num_texts": len(texts),
        **({"condition": condition} if condition else {}),
    }


def fingerprint(inputs: dict) -> str:
    return _sha256(json.dumps(inputs, sort_keys=True).encode())[:16]


def cache_folder(root: str | Path, inputs: dict) -> Path:
    return Path(root) / f"{inputs['model']}-{fingerprint(inputs)}"


def _row_digest(tensors: dict[str, torch.Tensor]) -> str:
    return _sha256(b"".join(tensors[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(tensors)))


class EmbeddingCache:
    """Read side of a complete cache folder; rows are read lazily from memory-mapped shards."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            self.manifest = json.loads((self.folder / MANIFEST).read_text())
            self.manifest["shards"], self.manifest["index"], self.manifest["keys"]  # noqa: B018
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise UserError(f"embedding cache manifest {self.folder / MANIFEST} is malformed ({type(err).__name__}): "
                            f"rebuild it with preprocess.py --force") from None
        for shard in self.manifest["shards"]:
            path = self.folder / shard["file"]
            size = path.stat().st_size if path.exists() else -1
            if size != shard["bytes"]:
                raise UserError(f"embedding cache shard {path} is truncated or missing ({size} bytes, "
                                f"manifest says {shard['bytes']}): rebuild it with preprocess.py")
        self._handles = {}

    def __contains__(self, text: str) -> bool:
        return text in self.manifest["index"]

    def lookup(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first tensors (CPU) for `texts`, in order; each row's checksum is verified."""
        rows = []
        for text in texts:
            if text not in self.manifest["index"]:
                raise UserError(f"embedding cache {self.folder} has no entry for the prompt {text[:60]!r}")
            shard_id, row, digest = self.manifest["index"][text]
            file = self.manifest["shards"][shard_id]["file"]
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            handle = self._handles[file]
            tensors = {k: handle.get_slice(k)[row:row + 1] for k in self.manifest["keys"]}
            if _row_digest(tensors) != digest:
                raise UserError(f"embedding cache shard {self.folder / file} row {row} is corrupted (checksum "
                                f"mismatch): rebuild it with preprocess.py")
            rows.append(tensors)
        return {k: torch.cat([r[k] for r in rows]) for k in self.manifest["keys"]}


def open_cache(root: str | Path | None, inputs: dict, explicit: bool) -> EmbeddingCache | None:
    """The cache matching `inputs` under `root`, or None. With an explicitly given root, a missing match is
    an error that says which settings differ from the caches that are there (never a silent online run)."""
    root = Path(root) if root is not None else default_cache_root()
    folder = cache_folder(root, inputs)
    if (folder / MANIFEST).exists():
        cache = EmbeddingCache(folder)
        # The folder name is a short hash: the manifest itself must say it was built from these inputs.
        if cache.manifest.get("fingerprint") != fingerprint(inputs):
            saved = cache.manifest.get("inputs") or {}
            differ = sorted(k for k in inputs if json.dumps(saved.get(k)) != json.dumps(inputs[k])) or ["fingerprint"]
            raise UserError(f"the embedding cache {folder} was not built from these settings (its manifest differs "
                            f"in: {', '.join(differ)}): rebuild it with preprocess.py --force or pass --no-cache")
        return cache
    if not explicit:
        return None
    others = sorted(root.glob(f"{inputs['model']}-*/{MANIFEST}"), key=os.path.getmtime)
    if not others:
        raise UserError(f"no embedding cache for model {inputs['model']} in {root}: run preprocess.py first")
    stale = json.loads(others[-1].read_text())["inputs"]
    differ = sorted(k for k in inputs if stale.get(k) != inputs[k])
    raise UserError(f"the embedding cache in {others[-1].parent} is stale (it differs in: {', '.join(differ)}): "
                    f"rebuild it with preprocess.py or pass --no-cache")


def find_cache(model: str, model_path: str, max_sequence_length: int, dtype: torch.dtype, texts: list[str],
               cache_dir: str | None, no_cache: bool, condition: dict | None = None) -> EmbeddingCache | None:
    """What a training script calls: the matching cache, or None to encode online. An explicit --cache-dir
    must match; the default root is used only when it holds a match."""
    if no_cache:
        return None
    try:
        inputs = fingerprint_inputs(model, model_path, max_sequence_length, dtype, texts, condition)
    except UserError:
        if cache_dir is not None:
            raise
        return None  # cannot fingerprint (e.g. offline, model not downloaded yet): encode online
    return open_cache(cache_dir, inputs, explicit=cache_dir is not None)


class PromptEncoder:
    """Text conditioning for a list of prompts (`common.data.Prompt` records or plain strings): from the cache
    when there is one, else encoded online by the adapter's text encoders, one text at a time (see the module
    docstring). Returns batch-first tensors on the adapter's device, one row per prompt. For models with true
    CFG (`adapter.true_cfg`) the negative prompts' embeddings come too, under the keys prefixed `negative_`."""

    def __init__(self, adapter, cache: EmbeddingCache | None = None):
        self.adapter, self.cache = adapter, cache

    def _table(self, entries: dict[str, tuple[str, tuple[str, ...]]]) -> dict[str, torch.Tensor]:
        if self.cache is not None:
            return self.cache.lookup(list(entries))
        with self.adapter.text_encoders_on_device():
            encoded = [self.adapter.encode_entry(text, images) for text, images in entries.values()]
        return {k: torch.cat([e[k] for e in encoded]) for k in encoded[0]}

    def __call__(self, prompts) -> dict[str, torch.Tensor]:
        records = [Prompt(p) if isinstance(p, str) else p for p in prompts]
        entries = {r.entry(): (r.prompt, r.images) for r in records}
        positives = [r.entry() for r in records]
        negatives = []
        if getattr(self.adapter, "true_cfg", False):
            negatives = [r.entry(negative=True) for r in records]
            entries.update({r.entry(negative=True): (r.negative_prompt, r.images) for r in records})
        unique = list(dict.fromkeys(positives + negatives))
        table = self._table({key: entries[key] for key in unique})
        position = {text: i for i, text in enumerate(unique)}
        cond = {}
        for prefix, texts in (("", positives), ("negative_", negatives)):
            if texts:
                order = torch.tensor([position[t] for t in texts])
                cond.update({prefix + k: v[order].to(self.adapter.device) for k, v in table.items()})
        return cond


def build_cache(accelerator, adapter, texts, root: str | Path, inputs: dict, shard_size: int = 256,
                progress: bool = True) -> Path:
    """Encode `texts` with the adapter's text encoders into root/<model>-<fingerprint>/ (all processes call
    this). `texts`: a list of texts, or `cache_entries` (key -> (text, condition images)) for conditioned models.
    Shard k holds entries k·shard_size … (k+1)·shard_size − 1 and is written by process k mod world, so the
    files do not depend on the number of processes."""
    entries = texts if isinstance(texts, dict) else {text: (text, ()) for text in texts}
    texts = list(entries)
    folder = cache_folder(root, inputs)
    tmp = folder.with_name(f".{folder.name}.tmp")
    # A full disk stops the build with one line and removes the temporary folder; a finished cache stays as it was.
    with disk_writes(tmp, "cannot build the embedding cache", then="free space and run it again", remove=[tmp]):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        chunks = [texts[i:i + shard_size] for i in range(0, len(texts), shard_size)]
        mine = [k for k in range(len(chunks)) if k % accelerator.num_processes == accelerator.process_index]
        records = []
        bar = tqdm(total=sum(len(chunks[k]) for k in mine), desc="encoding prompts",
                   disable=not (progress and accelerator.is_main_process))
        with bar, adapter.text_encoders_on_device():  # the bar is closed before an error line is printed
            for k in mine:
                rows = []
                for text in chunks[k]:
                    rows.append({key: value.cpu() for key, value in adapter.encode_entry(*entries[text]).items()})
                    bar.update(1)
                tensors = {key: torch.cat([r[key] for r in rows]).contiguous() for key in rows[0]}
                file = f"shard_{k:05d}.safetensors"
                save_file(tensors, str(tmp / file))
                digests = [_row_digest({key: t[i:i + 1] for key, t in tensors.items()}) for i in range(len(rows))]
                records.append({"shard": k, "file": file, "bytes": (tmp / file).stat().st_size, "keys": sorted(tensors),
                                "texts": chunks[k], "digests": digests})
        records = sorted(gather_object(records), key=lambda r: r["shard"])
        if accelerator.is_main_process:
            index = {text: [r["shard"], row, r["digests"][row]] for r in records for row, text in enumerate(r["texts"])}
            manifest = {"fingerprint": fingerprint(inputs), "inputs": inputs, "keys": records[0]["keys"],
                        "shards": [{"file": r["file"], "bytes": r["bytes"], "rows": len(r["texts"])} for r in records],
                        "index": index}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            if folder.exists():  # same fingerprint rebuilt: swap, never leave a half state
                stale = folder.with_name(f".{folder.name}.old")
                shutil.rmtree(stale, ignore_errors=True)
                os.replace(folder, stale)
                os.replace(tmp, folder)
                shutil.rmtree(stale)
            else:
                os.replace(tmp, folder)
    accelerator.wait_for_everyone()
    return folder
