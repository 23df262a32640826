"""The embedding cache: bitwise equality with online encoding, invalidation, corruption, processes."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator

from common.cache import (EmbeddingCache, PromptEncoder, build_cache, cache_texts, fingerprint_inputs, open_cache)
from common.data import DEFAULT_DATASET, Prompt, load_prompts
from common.models import load_adapter
from common.utils import UserError
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script

TEXTS = cache_texts(load_prompts(DEFAULT_DATASET, "train"), load_prompts(DEFAULT_DATASET, "test"), False)


@pytest.fixture(scope="module")
def adapter(tiny_flux_path):
    return load_adapter("flux1", str(tiny_flux_path), "cpu", torch.float32, 64, max_sequence_length=32)


@pytest.fixture(scope="module")
def built(tmp_path_factory, adapter, tiny_flux_path):
    root = tmp_path_factory.mktemp("cache")
    inputs = fingerprint_inputs("flux1", str(tiny_flux_path), 32, torch.float32, TEXTS)
    folder = build_cache(Accelerator(cpu=True), adapter, TEXTS, root, inputs, shard_size=20, progress=False)
    return root, inputs, folder


def test_cached_embeddings_are_bitwise_equal_to_online_ones(built, adapter):
    root, inputs, _ = built
    cache = open_cache(root, inputs, explicit=True)
    texts = [TEXTS[5], TEXTS[0], TEXTS[-1], TEXTS[5]]
    cached, online = PromptEncoder(adapter, cache)(texts), PromptEncoder(adapter)(texts)
    assert cached.keys() == online.keys() == {"prompt_embeds", "pooled_prompt_embeds"}
    assert all(torch.equal(cached[k], online[k]) for k in cached)
    assert len(cache.manifest["shards"]) == 3 and cache.manifest["inputs"] == inputs


@pytest.mark.parametrize("change", ["max_sequence_length", "prompt", "dtype"])
def test_any_input_change_gives_another_fingerprint_and_a_stale_error(built, tiny_flux_path, tmp_path, change):
    root, inputs, _ = built
    args = dict(model="flux1", model_path=str(tiny_flux_path), max_sequence_length=32, dtype=torch.float32,
                texts=TEXTS)
    if change == "max_sequence_length":
        args["max_sequence_length"] = 16
    elif change == "prompt":
        args["texts"] = TEXTS[:-1] + [TEXTS[-1] + "!"]
    else:
        args["dtype"] = torch.bfloat16
    other = fingerprint_inputs(**args)
    assert open_cache(root, other, explicit=False) is None
    key = "texts_sha256" if change == "prompt" else change
    with pytest.raises(UserError, match=f"is stale \\(it differs in: .*{key}"):
        open_cache(root, other, explicit=True)


def test_the_same_model_in_another_folder_matches_the_cache(built, tiny_flux_path, tmp_path):
    """A local model is known by its text encoders' files, not its path: the tiny model rebuilt under another
    $FLOWRL_CACHE, or a checkpoint moved, still finds its embeddings."""
    root, inputs, _ = built
    moved = str(shutil.copytree(tiny_flux_path, tmp_path / "elsewhere" / "tiny-flux1"))
    assert fingerprint_inputs("flux1", moved, 32, torch.float32, TEXTS) == inputs
    assert open_cache(root, inputs, explicit=False) is not None


def test_changed_tokenizer_file_changes_the_fingerprint(tiny_flux_path, tmp_path):
    copy = shutil.copytree(tiny_flux_path, tmp_path / "copy")
    before = fingerprint_inputs("flux1", str(copy), 32, torch.float32, TEXTS)
    config = copy / "tokenizer_2" / "tokenizer_config.json"
    config.write_text(config.read_text().replace("32", "33"))
    assert fingerprint_inputs("flux1", str(copy), 32, torch.float32, TEXTS)["encoders"] != before["encoders"]


def test_truncated_and_corrupted_shards_are_refused(built, tmp_path):
    _, _, folder = built
    copy = shutil.copytree(folder, tmp_path / folder.name)
    shard = copy / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF  # flip a byte inside the last row's data
    shard.write_bytes(bytes(data))
    cache = EmbeddingCache(copy)  # sizes still match...
    last_row_text = [t for t, (s, r, _) in cache.manifest["index"].items() if s == 1 and r == 19][0]
    with pytest.raises(UserError, match="row 19 is corrupted"):
        cache.lookup([last_row_text])
    cache.lookup([TEXTS[0]])  # ...and untouched rows still read
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(UserError, match="shard_00001.safetensors is truncated"):
        EmbeddingCache(copy)


def test_interrupted_build_leaves_no_complete_looking_cache(adapter, tiny_flux_path, tmp_path, monkeypatch):
    inputs = fingerprint_inputs("flux1", str(tiny_flux_path), 32, torch.float32, TEXTS)
    calls = []
    original = adapter.encode_prompts

    def dies_midway(prompts):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return original(prompts)

    monkeypatch.setattr(adapter, "encode_prompts", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        build_cache(Accelerator(cpu=True), adapter, TEXTS, tmp_path, inputs, shard_size=20, progress=False)
    assert open_cache(tmp_path, inputs, explicit=False) is None
    assert not list(tmp_path.glob("*/manifest.json"))


@SLOW
def test_two_process_preprocess_equals_one_process(tmp_path, tiny_flux_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--model-path", "tiny", "--max-sequence-length", "32", "--shard-size", "10"]
    run_script("preprocess.py", *args, "--cache-dir", one)
    run_script("preprocess.py", *args, "--cache-dir", two, launcher=ACCELERATE_2CPU)
    [f1], [f2] = list(one.glob("flux1-*")), list(two.glob("flux1-*"))
    assert f1.name == f2.name
    files = sorted(p.name for p in f1.iterdir())
    assert files == sorted(p.name for p in f2.iterdir()) and len(files) == 7  # 56 texts / 10 + manifest
    assert all((f1 / name).read_bytes() == (f2 / name).read_bytes() for name in files)


COUNT_ENCODERS = """
import json, runpy, sys
import transformers
created = []
for cls in (transformers.CLIPTextModel, transformers.T5EncoderModel):
    init = cls.__init__
    def counting(self, *a, __init=init, **k):
        created.append(type(self).__name__)
        __init(self, *a, **k)
    cls.__init__ = counting
log, script = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
open(log, "w").write(json.dumps(created))
"""


def test_training_from_the_cache_equals_online_and_never_builds_encoders(tmp_path):
    run_script("preprocess.py", "--model-path", "tiny", "--max-sequence-length", "32", "--cache-dir", tmp_path / "c")
    args = ["--preset", "tiny", "--epochs", "3", "--eval-every", "2", "--eval-num-prompts", "2"]
    runs = {}
    for name, flags in {"cached": ["--cache-dir", tmp_path / "c"], "online": ["--no-cache"]}.items():
        log = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, "-c", COUNT_ENCODERS, str(log), str(REPO / "algos/grpo.py"), *args,
                        *map(str, flags), "--output-dir", str(tmp_path / name)], cwd=REPO, check=True,
                       capture_output=True)
        runs[name] = json.loads(log.read_text())
    assert runs["cached"] == [] and sorted(runs["online"]) == ["CLIPTextModel", "T5EncoderModel"]
    # measurements, not results: times, and the peak resident memory (lower without the encoders, by a few MB)
    measured = ("_time_s", "tflops", "mfu", "peak_memory_gb")
    strip = lambda ms: [{k: v for k, v in m.items() if not k.endswith(measured)}  # noqa: E731
                        for m in ms]
    assert strip(read_metrics(tmp_path / "cached")) == strip(read_metrics(tmp_path / "online"))


def test_stale_explicit_cache_is_refused_by_the_training_script(tmp_path):
    run_script("preprocess.py", "--model-path", "tiny", "--max-sequence-length", "16", "--cache-dir", tmp_path / "c")
    result = run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--cache-dir", tmp_path / "c",
                        "--output-dir", tmp_path / "out", check=False)
    assert result.returncode != 0
    assert "is stale (it differs in: max_sequence_length)" in result.stderr.strip().splitlines()[-1]


def test_negative_prompts_are_cached_for_true_cfg_models():
    prompts = [Prompt("a", "blurry"), Prompt("b")]
    assert cache_texts(prompts, [], with_negatives=True) == ["", "a", "b", "blurry"]
    assert cache_texts(prompts, [], with_negatives=False) == ["a", "b"]


def test_a_folder_whose_manifest_says_other_inputs_is_refused(built, tmp_path):
    """The folder name is a 16-hex-digit hash of the inputs; the manifest inside must agree with it (a copied,
    renamed or hand-edited cache is not trusted by its name)."""
    root, inputs, folder = built
    copy_root = tmp_path / "root"
    copy = shutil.copytree(folder, copy_root / folder.name)
    assert open_cache(copy_root, inputs, explicit=True) is not None
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["inputs"]["max_sequence_length"] = 33
    manifest["fingerprint"] = "0" * 16
    (copy / "manifest.json").write_text(json.dumps(manifest))
    for explicit in (True, False):
        with pytest.raises(UserError, match=r"was not built from these settings \(its manifest differs in: "
                                            r"max_sequence_length\)"):
            open_cache(copy_root, inputs, explicit=explicit)
