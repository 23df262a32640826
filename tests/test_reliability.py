"""What a user's mistakes and accidents do: a damaged run folder on --resume, errors under `accelerate launch`,
non-finite numbers, and bad input. Each must end in one `error:` line and a non-zero exit, and never destroy or
corrupt what is on disk."""

import hashlib
import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, slow_except

TINY = ["--preset", "tiny", "--eval-every", "0"]
BASE = TINY + ["--epochs", "4", "--save-every", "2"]  # checkpoints epoch_000001 and epoch_000003


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout[-1000:]
    assert lines and lines[-1].startswith("error: "), result.stderr[-3000:]
    return lines[-1]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_flux_path):
    out = tmp_path_factory.mktemp("base") / "run"
    run_script("algos/grpo.py", *BASE, "--output-dir", out)
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def resume(out, *extra, script="algos/grpo.py", epochs=6, check=True):
    return run_script(script, *TINY, "--epochs", str(epochs), "--save-every", "2", "--output-dir", out, "--resume",
                      *extra, check=check)


# ---- 1. --resume never destroys a run --------------------------------------------------------------------------
@pytest.mark.parametrize("damage", slow_except(["latest deleted", "latest names a missing folder", "latest truncated"],
                                                "latest truncated"))
def test_resume_does_not_trust_latest(run_copy, damage):
    latest = run_copy / "checkpoints" / "latest"
    if damage == "latest deleted":
        latest.unlink()
    elif damage == "latest names a missing folder":
        latest.write_text("epoch_000099")
    else:
        latest.write_text("")
    result = resume(run_copy)
    assert f"resumed from {run_copy / 'checkpoints' / 'epoch_000003'} at epoch 4" in result.stdout
    assert [m["epoch"] for m in read_metrics(run_copy)] == list(range(6))
    assert sorted(p.name for p in (run_copy / "checkpoints").glob("epoch_*")) == ["epoch_000003", "epoch_000005"]


@pytest.mark.parametrize("damage,why", [
    pytest.param("meta.json", "meta.json is missing", marks=SLOW),
    pytest.param("pytorch_lora_weights.safetensors",
                 "pytorch_lora_weights.safetensors does not match its sha256 in meta.json", marks=SLOW),
    ("training_state.pt", "training_state.pt does not match its sha256 in meta.json"),
])
def test_resume_skips_an_incomplete_newest_checkpoint_and_says_why(run_copy, damage, why):
    broken = run_copy / "checkpoints" / "epoch_000003" / damage
    if damage == "meta.json":
        broken.unlink()
    else:
        broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # a write cut short
    result = resume(run_copy)
    assert f"skipped checkpoints that do not load completely: epoch_000003 ({why})" in result.stdout
    assert f"resumed from {run_copy / 'checkpoints' / 'epoch_000001'} at epoch 2" in result.stdout
    assert [m["epoch"] for m in read_metrics(run_copy)] == list(range(6))


def test_resume_refuses_a_run_without_a_complete_checkpoint_and_changes_nothing(run_copy):
    for folder in (run_copy / "checkpoints").glob("epoch_*"):
        (folder / "meta.json").unlink()
    before = snapshot(run_copy)
    line = error_line(resume(run_copy, check=False))
    assert "holds a run but no complete checkpoint (epoch_000003 (meta.json is missing); epoch_000001" in line
    assert "refusing to start it again from scratch" in line
    assert snapshot(run_copy) == before


def test_resume_drops_a_metrics_line_cut_by_a_kill(run_copy):
    metrics = run_copy / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"epoch": 4, "reward_me')
    resume(run_copy)
    assert [m["epoch"] for m in read_metrics(run_copy)] == list(range(6))


# Every flag but those listed in common.cli.RESUMABLE_FLAGS defines the run: the shared ones (what is sampled, how it
# is rewarded, what is trained) and each script's own (its loss), e.g. grpo's --clip-range.
@pytest.mark.parametrize("flags,needles", [
    (["--seed", "2"], ["--seed is 2 but the run in"]),
    pytest.param(["--group-size", "4"], ["--group-size is 4 but the run in"], marks=SLOW),
    pytest.param(["--prompts-per-epoch", "4"], ["--prompts-per-epoch is 4 but the run in"], marks=SLOW),
    pytest.param(["--lora-rank", "4"], ["--lora-rank is 4 but the run in"], marks=SLOW),
    (["--reward", "jpeg_incompressibility"], ["--reward is ['jpeg_incompressibility'] but the run in", "with []"]),
    (["--resolution", "32"], ["--resolution is 32 but the run in", "with 64"]),
    (["--clip-range", "0.5"], ["--clip-range is 0.5 but the run in", "with 0.01"]),
    pytest.param(["--max-sequence-length", "16"], ["--max-sequence-length is 16 but the run in"], marks=SLOW),
    pytest.param(["--num-steps", "4"], ["--num-steps is 4 but the run in"], marks=SLOW),
    (["--model", "sd3", "--resolution", "32"], ["--model is 'sd3' but the run in", "; --resolution is 32 but",
                                                "these define the run, so they cannot"]),
])
def test_resume_refuses_flags_that_change_the_run(run_copy, flags, needles):
    before = snapshot(run_copy)
    line = error_line(resume(run_copy, *flags, check=False))
    assert all(needle in line for needle in needles) and line.endswith("cannot change on resume"), line
    assert snapshot(run_copy) == before


def test_every_flag_that_may_change_on_resume_is_a_flag_of_some_script():
    """A misspelt name in RESUMABLE_FLAGS would let nothing change and refuse nothing more: each names a flag."""
    import dataclasses
    import importlib.util

    from common.cli import RESUMABLE_FLAGS, TrainArgs

    names = {spec.name for spec in dataclasses.fields(TrainArgs)}
    for script in sorted((REPO / "algos").glob("*.py")):
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(script.stem, script))
        module.__spec__.loader.exec_module(module)
        names |= {spec.name for spec in dataclasses.fields(module.Args)}
    assert set(RESUMABLE_FLAGS) <= names, set(RESUMABLE_FLAGS) - names


def test_resume_refuses_other_training_prompts_and_names_every_other_changed_flag(run_copy, tmp_path):
    """The training prompts are compared by content: an edited dataset is refused, the same prompts in another
    folder resume (with a note, as for every other flag that may change)."""
    from common.data import DEFAULT_DATASET

    edited, moved = tmp_path / "edited", tmp_path / "moved"
    for folder in (edited, moved):
        shutil.copytree(DEFAULT_DATASET, folder)
    train = edited / "train.txt"
    train.write_text(train.read_text() + "one more prompt\n")
    before = snapshot(run_copy)
    line = error_line(resume(run_copy, "--dataset", edited, check=False))
    assert line == (f"error: --resume: the training prompts of {edited} are not those of the run in {run_copy}; it "
                    f"defines the run, so it cannot change on resume")
    assert snapshot(run_copy) == before

    result = resume(run_copy, "--dataset", moved, "--learning-rate", "0.01", "--batch-size", "4", epochs=5)
    notes = [line for line in result.stdout.splitlines() if line.startswith("note: --")]
    assert notes == [f"note: --dataset is {str(moved)!r}, not {DEFAULT_DATASET!r} as when epoch_000003 was saved",
                     "note: --epochs is 5, not 4 as when epoch_000003 was saved",
                     "note: --batch-size is 4, not 8 as when epoch_000003 was saved",
                     "note: --learning-rate is 0.01, not 0.03 as when epoch_000003 was saved"], result.stdout
    assert [m["epoch"] for m in read_metrics(run_copy)] == [0, 1, 2, 3, 4]


def test_resume_refuses_another_algorithm(run_copy):
    before = snapshot(run_copy)
    line = error_line(resume(run_copy, "--train-timesteps", "3", script="algos/nft.py", check=False))
    assert "the script is 'nft' but the run in" in line and "'grpo'" in line
    assert snapshot(run_copy) == before


def test_stale_temporary_checkpoint_folders_are_removed(run_copy):
    stale = run_copy / "checkpoints" / ".epoch_000005.tmp"
    stale.mkdir()
    (stale / "training_state.pt").write_bytes(b"half")
    result = resume(run_copy, epochs=5)
    assert "removed unfinished checkpoint writes: .epoch_000005.tmp" in result.stdout
    assert not stale.exists() and (run_copy / "checkpoints" / "epoch_000004").is_dir()


def test_a_planted_temporary_metrics_symlink_is_not_written_through(run_copy, tmp_path):
    """The metrics rewrite at resume goes through metrics.jsonl.tmp: a symlink left there (by accident or planted)
    is replaced, never followed into the file it points at."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (run_copy / "metrics.jsonl.tmp").symlink_to(victim)
    resume(run_copy, epochs=5)
    assert victim.read_text() == "keep me\n"
    assert [m["epoch"] for m in read_metrics(run_copy)] == [0, 1, 2, 3, 4]


@SLOW
def test_resuming_on_another_process_count_says_so(run_copy):
    result = run_script("algos/grpo.py", *TINY, "--epochs", "5", "--save-every", "2", "--output-dir", run_copy,
                        "--resume", launcher=ACCELERATE_2CPU)
    assert ("note: epoch_000003 was saved by 1 process and resumes on 2: prompts and noise are drawn as before"
            in result.stdout)
    assert [m["num_processes"] for m in read_metrics(run_copy)] == [1, 1, 1, 1, 2]


# ---- 2. errors reach the terminal under accelerate launch -------------------------------------------------------
@SLOW
def test_one_line_error_under_accelerate_launch(tmp_path):
    result = run_script("algos/grpo.py", "--preset", "tiny", "--reward", "foo", "--output-dir", tmp_path / "out",
                        launcher=ACCELERATE_2CPU, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: unknown reward 'foo'; choose from: aesthetic"), \
        result.stderr[-3000:]


def test_the_error_line_is_reported_once_per_launch_and_again_in_the_next(tmp_path):
    """The processes of one launch share a parent (the launcher's agent): one of them prints the line. Standalone
    launches all have TORCHELASTIC_RUN_ID "none", so a later launch (another parent) must print it again."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path), "TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}
    code = "from common.utils import _first_report as f; print(f('bad --reward'), f('bad --reward'), f('other'))"
    launch = [sys.executable, "-c", code]
    for _ in range(2):  # `sh` stands for the launcher: a new parent per launch (`; true` keeps sh from exec-ing)
        out = subprocess.run(["sh", "-c", f"{subprocess.list2cmdline(launch)}; true"], cwd=REPO, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == ["True", "False", "True"], out


@SLOW
def test_the_readme_two_process_command_runs_the_tiny_preset(tmp_path):
    """README: accelerate launch --multi_gpu --num_processes 2 ... algos/grpo.py --preset tiny (1 micro-batch of 8
    samples per process used to fail to split into 2 updates)."""
    run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "2", "--eval-every", "0", "--output-dir", tmp_path,
               launcher=ACCELERATE_2CPU)
    assert [m["num_processes"] for m in read_metrics(tmp_path)] == [2, 2]
    # The main process hashed both processes' RNG files, each after its rank wrote it.
    folder = tmp_path / "checkpoints" / "epoch_000001"
    hashes = json.loads((folder / "meta.json").read_text())["sha256"]
    for name in ("rng_0.pt", "rng_1.pt"):
        assert hashes[name] == hashlib.sha256((folder / name).read_bytes()).hexdigest()


# ---- 3. non-finite numbers stop the run ------------------------------------------------------------------------
def test_nan_weights_stop_the_run_before_anything_is_written(tiny_flux_path, tmp_path):
    model = tmp_path / "nan-model"
    shutil.copytree(tiny_flux_path, model)
    weights = next((model / "transformer").glob("*.safetensors"))
    state = load_file(weights)
    name = next(k for k in state if k.startswith("proj_out"))
    state[name] = torch.full_like(state[name], float("nan"))
    save_file(state, weights, metadata={"format": "pt"})
    out = tmp_path / "out"
    result = run_script("algos/grpo.py", *TINY, "--epochs", "3", "--save-every", "1", "--model-path", model,
                        "--output-dir", out, check=False)
    line = error_line(result)
    assert result.returncode == 3
    assert line.startswith("error: epoch 0: the gradient norm is nan; stopping before the optimizer step")
    assert not list(out.glob("checkpoints/epoch_*"))
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""


def test_a_full_disk_while_saving_stops_with_one_line_and_keeps_the_last_checkpoint(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    before = snapshot(out / "checkpoints" / "epoch_000003")
    wrapper = ("import runpy, sys, torch; save = torch.save\n"
               "def full(obj, f, *a, **k):\n"
               "    if str(getattr(f, 'name', f)).endswith('training_state.pt'):  # a path or a file object\n"
               "        raise RuntimeError('[enforce fail at inline_container.cc:664] . unexpected pos 128 vs 64: "
               "No space left on device')\n"
               "    return save(obj, f, *a, **k)\n"
               "torch.save = full\n"
               f"sys.argv = ['grpo.py'] + sys.argv[1:]; runpy.run_path({str(REPO / 'algos/grpo.py')!r}, "
               "run_name='__main__')")
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", wrapper, *TINY, "--epochs", "6", "--save-every", "2",
                             "--output-dir", str(out), "--resume"], cwd=REPO, capture_output=True, text=True)
    line = error_line(result)
    assert result.returncode == 3
    assert "cannot write the checkpoint of epoch 5" in line and "No space left on device" in line
    assert "the previous checkpoints are intact" in line
    assert snapshot(out / "checkpoints" / "epoch_000003") == before
    assert not list((out / "checkpoints").glob(".epoch_*"))
    assert (out / "checkpoints" / "latest").read_text() == "epoch_000003"


# ---- 4. one line for every bad input ----------------------------------------------------------------------------
def _bad_dataset(tmp_path, kind):
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.txt").write_text("a cat\n")
    if kind == "non-utf8":
        (data / "train.txt").write_bytes("a cat\na dog\nna\xefve caf\xe9\n".encode("latin-1"))
    else:
        (data / "train.txt").write_text("a cat\n")
        (data / "train.jsonl").write_text('{"prompt": "a cat"}\n')
    return data


# (Bad flag values are refused by the scripts' own checks, tested in each script's test file: test_grpo.py has
# --group-size 0, --learning-rate -1, --epochs 0 and -2, ...)
@pytest.mark.parametrize("case", ["no model_index.json", "non-utf8", "both txt and jsonl", "output is a file",
                                  "output not writable"])
def test_bad_input_gives_one_line_and_writes_nothing(tiny_flux_path, tmp_path, case):
    out = tmp_path / "out"
    flags = []
    if case == "no model_index.json":
        model = tmp_path / "model"
        shutil.copytree(tiny_flux_path, model)
        (model / "model_index.json").unlink()
        flags, expected = ["--model-path", model], f"cannot load a FLUX.1 pipeline from {str(model)!r}"
    elif case in ("non-utf8", "both txt and jsonl"):
        data = _bad_dataset(tmp_path, case)
        flags = ["--dataset", data]
        expected = (f"{data / 'train.txt'}:3: not UTF-8 text (byte 0xef at column 3)" if case == "non-utf8"
                    else f"dataset folder {str(data)!r} has both train.jsonl and train.txt: keep one")
    elif case == "output is a file":
        out.write_text("notes")
        expected = f"--output-dir {out} is a file, not a folder"
    elif case == "output not writable":
        out = Path("/proc/flowrl-test-out")  # not writable even by root
        expected = f"--output-dir {out} is not writable"
    line = error_line(run_script("algos/grpo.py", *TINY, "--output-dir", out, *flags, check=False))
    assert expected in line, line
    if case == "output is a file":
        assert out.read_text() == "notes"
    elif case != "output not writable":
        assert not out.exists()  # not even an empty folder (seen left behind by a failed model load)


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_a_flag_tyro_refuses_is_one_line_whatever_the_encoding(tmp_path, encoding):
    """tyro boxes its errors with "─" on a UTF-8 stdout and with "-" otherwise; both become the same line."""
    result = run_script("algos/grpo_guard.py", *TINY, "--dynamics", "cps", "--output-dir", tmp_path / "out",
                        env={"PYTHONIOENCODING": encoding}, check=False)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: invalid choice 'cps' for argument '--dynamics'. Expected one of ('flow-sde',"
        + (" )" if encoding == "utf-8" else ")") + ". (see --help)"], result.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_preprocess_bad_shard_size_leaves_nothing(tmp_path):
    result = run_script("preprocess.py", "--model-path", "tiny", "--max-sequence-length", "32", "--shard-size", "0",
                        "--cache-dir", tmp_path, check=False)
    assert error_line(result) == "error: --shard-size must be at least 1, got 0"
    assert not any(tmp_path.iterdir())


def test_malformed_cache_manifest_is_one_line(tmp_path):
    run_script("preprocess.py", "--model-path", "tiny", "--max-sequence-length", "32", "--cache-dir", tmp_path)
    (manifest,) = tmp_path.glob("*/manifest.json")
    manifest.write_text("{not json")
    result = run_script("algos/grpo.py", *TINY, "--epochs", "1", "--cache-dir", tmp_path, "--output-dir",
                        tmp_path / "out", check=False)
    assert f"embedding cache manifest {manifest} is malformed" in error_line(result)


def test_long_prompts_are_counted_in_one_warning(tmp_path):
    result = run_script("algos/grpo.py", *TINY, "--epochs", "1", "--max-sequence-length", "16", "--output-dir",
                        tmp_path / "out")
    warnings = [line for line in result.stdout.splitlines() if "longer than --max-sequence-length" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and " of 56 prompts " in warnings[0]


class _HangingScore(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /info answers at once
        body = json.dumps({"name": "slow", "groupwise": False}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # /score never answers in time
        time.sleep(5)

    def log_message(self, *args):
        pass


def test_a_server_that_hangs_on_score_says_so_early_and_is_not_called_unreachable(capfd):
    from common.utils import UserError
    from rewards.remote import RemoteReward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HangingScore)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        reward = RemoteReward(url=url, timeout="2", retries="0", notice_after="0.5")
        start = time.time()
        with pytest.raises(UserError) as info:
            reward(torch.zeros(2, 3, 8, 8), ["a", "b"])
        waited = time.time() - start
    finally:
        server.shutdown()
        server.server_close()
    notice = capfd.readouterr().err
    assert f"remote reward: waiting for {url} to answer /score (2 images) (gives up after 2 s)" in notice
    assert f"reward server {url} did not answer /score (2 images)" in str(info.value)
    assert "not reachable" not in str(info.value) and waited < 4.5


def test_a_folder_replaced_atomically_is_old_or_new_never_half(tmp_path):
    """The toy worlds' pretrain scripts write their model through `folder_replaced_atomically`: a failure inside
    the block leaves the old folder as it was, with nothing beside it; a success swaps in the new one whole."""
    from common.utils import folder_replaced_atomically

    out = tmp_path / "model"
    out.mkdir()
    (out / "weights").write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with folder_replaced_atomically(out) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("interrupted")
    assert snapshot(out) == {Path("weights"): b"old"} and [p.name for p in tmp_path.iterdir()] == ["model"]
    with folder_replaced_atomically(out) as tmp:
        assert tmp.parent == out.parent and not (tmp / "weights").exists()
        (tmp / "weights").write_text("new")
    assert snapshot(out) == {Path("weights"): b"new"} and [p.name for p in tmp_path.iterdir()] == ["model"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    with folder_replaced_atomically(tmp_path / "fresh" / "model") as tmp:  # a destination that does not exist yet
        (tmp / "weights").write_text("first")
    assert (tmp_path / "fresh" / "model" / "weights").read_text() == "first"
