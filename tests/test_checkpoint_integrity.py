"""Checkpoints are checked (common/checkpoint.py): meta.json, written last, records the sha256 of every other file
of the checkpoint; --resume skips a checkpoint whose files do not match, whose meta.json names another epoch, or
whose weights are not finite, says which file, and continues from the previous one into the run an uninterrupted
run gives. Checkpoints written before the hashes still resume."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.checkpoint import LORA_FILE
from conftest import SLOW, read_metrics, run_script, slow_except

TINY = ["--preset", "tiny", "--eval-every", "0"]
BASE = TINY + ["--epochs", "4", "--save-every", "2"]  # checkpoints epoch_000001 and epoch_000003
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu",
             "peak_memory_gb"}  # measured
SKIPPED = "skipped checkpoints that do not load completely: epoch_000003 ({})"


def _runs(tmp_path_factory, *flags) -> tuple[Path, Path]:
    """A 4-epoch run to damage and resume, and the uninterrupted 6-epoch run it must become."""
    base, reference = (tmp_path_factory.mktemp("run") / "run" for _ in range(2))
    run_script("algos/grpo.py", *BASE, *flags, "--output-dir", base)
    run_script("algos/grpo.py", *TINY, "--epochs", "6", "--save-every", "2", *flags, "--output-dir", reference)
    return base, reference


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_flux_path):
    return _runs(tmp_path_factory)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory, tiny_flux_path):
    return _runs(tmp_path_factory, "--full-finetune")


def copy_of(runs, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs[0], out)
    return out


def resume(out, *flags):
    return run_script("algos/grpo.py", *TINY, "--epochs", "6", "--save-every", "2", *flags, "--output-dir", out,
                      "--resume")


def weights(folder: Path) -> dict:
    files = [folder / LORA_FILE] if (folder / LORA_FILE).exists() else sorted(folder.glob("transformer/*.safetensors"))
    return {k: v for f in files for k, v in load_file(f).items()}


def assert_equal_runs(out: Path, reference: Path) -> None:
    """The metrics lines (but the measured times) and the final weights are the same."""
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(out)) == strip(read_metrics(reference))
    ours, expected = (weights(run / "checkpoints" / "epoch_000005") for run in (out, reference))
    assert ours.keys() == expected.keys() and all(torch.equal(ours[k], expected[k]) for k in expected)


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)


def edit_meta(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_meta_json_is_written_last_and_lists_the_sha256_of_every_other_file(lora_runs):
    folder = lora_runs[0] / "checkpoints" / "epoch_000003"
    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file() and p.name != "meta.json"}
    hashes = json.loads((folder / "meta.json").read_text())["sha256"]
    assert sorted(hashes) == sorted(files) == [LORA_FILE, "rng_0.pt", "training_state.pt"]
    assert all(hashes[name] == hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items())
    assert (folder / "meta.json").stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in files.values())


@pytest.mark.parametrize("name", slow_except([LORA_FILE, "training_state.pt", "rng_0.pt"], LORA_FILE))
def test_a_flipped_bit_skips_the_checkpoint_naming_the_file(lora_runs, tmp_path, name):
    out = copy_of(lora_runs, tmp_path)
    flip_bit(out / "checkpoints" / "epoch_000003" / name)
    result = resume(out)
    assert SKIPPED.format(f"{name} does not match its sha256 in meta.json") in result.stdout
    assert f"resumed from {out / 'checkpoints' / 'epoch_000001'} at epoch 2" in result.stdout
    assert_equal_runs(out, lora_runs[1])


@SLOW
def test_a_flipped_bit_in_full_fine_tuned_weights_skips_the_checkpoint(full_runs, tmp_path):
    out = copy_of(full_runs, tmp_path)
    shard = next((out / "checkpoints" / "epoch_000003" / "transformer").glob("*.safetensors"))
    flip_bit(shard)
    result = resume(out, "--full-finetune")
    assert SKIPPED.format(f"transformer/{shard.name} does not match its sha256 in meta.json") in result.stdout
    assert f"resumed from {out / 'checkpoints' / 'epoch_000001'} at epoch 2" in result.stdout
    assert_equal_runs(out, full_runs[1])


def test_a_hand_edited_epoch_in_meta_json_skips_the_checkpoint(lora_runs, tmp_path):
    out = copy_of(lora_runs, tmp_path)
    edit_meta(out / "checkpoints" / "epoch_000003", lambda meta: meta.update(epoch=5))
    result = resume(out)
    assert SKIPPED.format("meta.json says epoch 5 but the folder is epoch_000003") in result.stdout
    assert f"resumed from {out / 'checkpoints' / 'epoch_000001'} at epoch 2" in result.stdout
    assert_equal_runs(out, lora_runs[1])


@SLOW
def test_a_checkpoint_written_before_the_hashes_still_resumes(lora_runs, tmp_path):
    out = copy_of(lora_runs, tmp_path)
    edit_meta(out / "checkpoints" / "epoch_000003", lambda meta: meta.pop("sha256"))
    result = resume(out)
    assert "skipped" not in result.stdout
    assert f"resumed from {out / 'checkpoints' / 'epoch_000003'} at epoch 4" in result.stdout
    assert_equal_runs(out, lora_runs[1])


@pytest.mark.parametrize("damage,why", [("nan", f"{LORA_FILE} holds non-finite weights"),
                                        ("truncated", f"{LORA_FILE} does not load")])
@SLOW
def test_without_hashes_damaged_weights_are_still_found(lora_runs, tmp_path, damage, why):
    out = copy_of(lora_runs, tmp_path)
    folder = out / "checkpoints" / "epoch_000003"
    edit_meta(folder, lambda meta: meta.pop("sha256"))
    lora = folder / LORA_FILE
    if damage == "nan":
        state = load_file(lora)
        name = next(iter(state))
        state[name].view(-1)[0] = float("nan")
        save_file(state, lora, metadata={"format": "pt"})
    else:
        lora.write_bytes(lora.read_bytes()[: lora.stat().st_size // 2])
    result = resume(out)
    assert SKIPPED.format(why) in result.stdout
    assert f"resumed from {out / 'checkpoints' / 'epoch_000001'} at epoch 2" in result.stdout
