"""evaluate.py: the training scripts' evaluation after the fact. A run folder supplies its settings; the numbers
equal the run's own logged evaluations to the last digit (the untrained model's with --base, the last one at the
newest checkpoint), for a LoRA, a LoRA with its EMA, and a full fine-tune; a model given by flags equals a run's
base; bad input is one line."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from common import tracking

from conftest import SLOW, read_metrics, run_script, script_error, slow_except

TINY = ["--preset", "tiny", "--epochs", "2", "--eval-every", "1", "--save-every", "1", "--eval-num-prompts", "3",
        "--eval-seeds", "2"]


def eval_keys(line: dict) -> dict:
    return {k: v for k, v in line.items() if k.startswith("eval_")}


@pytest.mark.parametrize("variant", slow_except(["lora", "ema", "full"], "lora"))
def test_a_run_folder_reproduces_its_logged_evaluations(tmp_path, tiny_flux_path, variant):
    out = tmp_path / "run"
    extra = {"lora": [], "ema": ["--ema"], "full": ["--full-finetune", "--learning-rate", "1e-3"]}[variant]
    run_script("algos/nft.py", *TINY, *extra, "--output-dir", out)
    lines = read_metrics(out, base=True)
    result = tmp_path / "eval.json"
    run_script("evaluate.py", "--run", out, "--base", "--output", result, "--grid-dir", tmp_path / "grids")
    base, last = json.loads(result.read_text())
    assert (base["name"], base["epoch"], last["name"], last["epoch"]) == ("run-base", -1, "run", 1)
    assert eval_keys(base) == eval_keys(lines[0]) and lines[0]["epoch"] == -1
    assert eval_keys(last) == eval_keys(lines[-1]) and lines[-1]["epoch"] == 1
    assert eval_keys(base) != eval_keys(last)  # two epochs of training changed the samples
    assert (tmp_path / "grids" / "run.png").exists() and (tmp_path / "grids" / "run-base.png").exists()


@SLOW
def test_a_model_given_by_flags_and_several_runs(tmp_path, tiny_flux_path):
    runs = [tmp_path / "one", tmp_path / "two"]
    for seed, out in enumerate(runs, start=1):
        run_script("algos/grpo.py", *TINY, "--seed", str(seed), "--output-dir", out)
    result = tmp_path / "eval.json"
    printed = run_script("evaluate.py", "--model", "flux1", "--model-path", "tiny", "--resolution", "64",
                         "--max-sequence-length", "32", "--eval-num-prompts", "3", "--eval-seeds", "2",
                         "--eval-num-steps", "8", "--batch-size", "8", "--output", result, "--grid-dir",
                         tmp_path / "grids").stdout
    (base,) = json.loads(result.read_text())
    # grpo's tiny preset: 8 steps, batch 8, the JPEG reward, the model's own guidance
    assert eval_keys(base) == eval_keys(read_metrics(runs[0], base=True)[0])
    assert "| reward_mean | " in printed and " ± " in printed

    # --best-of: each prompt's best sample, averaged over prompts; with one seed it is the mean itself
    flags = ["--model-path", "tiny", "--resolution", "64", "--max-sequence-length", "32", "--eval-num-prompts", "3",
             "--eval-num-steps", "2", "--best-of", "--output", result, "--grid-dir", tmp_path / "grids"]
    run_script("evaluate.py", *flags, "--eval-seeds", "1")
    (one,) = json.loads(result.read_text())
    assert one["eval_reward_mean_best_of_1"] == pytest.approx(one["eval_reward_mean"], abs=1e-12)
    run_script("evaluate.py", *flags, "--eval-seeds", "3")
    (three,) = json.loads(result.read_text())
    assert three["eval_reward_mean_best_of_3"] > three["eval_reward_mean"]

    run_script("evaluate.py", "--run", *runs, "--output", result, "--grid-dir", tmp_path / "grids")
    scored = json.loads(result.read_text())
    assert [r["name"] for r in scored] == ["one", "two"]
    for r, out in zip(scored, runs):
        assert eval_keys(r) == eval_keys(read_metrics(out)[-1])


def test_bad_input_is_one_line(tmp_path):
    assert "no checkpoint (not a run folder" in script_error("evaluate.py", "--run", tmp_path)
    assert "--eval-seeds must be at least 1" in script_error("evaluate.py", "--model-path", "tiny", "--eval-seeds", "0")
    assert script_error("evaluate.py", "--model", "wan9").startswith("error: invalid choice 'wan9' for argument '--model'")


def test_bad_prompt_files_and_output_paths_are_one_line_before_anything_is_loaded(tmp_path):
    """Each is refused before the model loads (here one that would not) and long before any scoring: a --output
    folder that does not exist used to be found only when the results were written."""
    model = ["--model-path", tmp_path / "no-model"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes('{"prompt": "a caf\xe9", "category": "object", "atoms": ["A cup?"], "seed": 1}\n'
                        .encode("latin-1"))
    benchmark = ["evaluate.py", "--benchmark", "geneval2", "--benchmark-prompts", prompts, *model]
    assert script_error(*benchmark) == f"error: {prompts}:1: not UTF-8 text (byte 0xe9 at column 18)"
    prompts.write_text(json.dumps({"prompt": "a cat", "category": "object", "atoms": ["A cat?"], "seed": 2**63}))
    assert script_error(*benchmark) == (f'error: {prompts}:1: needs "seed" or "seeds" (distinct integers from 0 to '
                                        f'2^63 - 1)')

    notes = tmp_path / "notes.txt"
    notes.write_text("keep")
    for flags, line in [
        (["--output", tmp_path / "missing" / "eval.json"],
         f"--output {tmp_path / 'missing' / 'eval.json'}: the folder {tmp_path / 'missing'} does not exist"),
        (["--output", tmp_path], f"--output {tmp_path} is a folder: give the name of the JSON file to write"),
        (["--grid-dir", notes], f"--grid-dir {notes}: it is a file, not a folder"),
        (["--grid-dir", notes / "grids"], f"--grid-dir {notes / 'grids'}: {notes} is a file, not a folder"),
        (["--benchmark", "geneval2", "--benchmark-dir", notes], f"--benchmark-dir {notes}: it is a file, not a folder"),
    ]:
        assert script_error("evaluate.py", *model, *flags) == f"error: {line}"
    assert notes.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "prompts.jsonl"]


def test_a_damaged_newest_checkpoint_is_named_with_the_one_scored_instead(tmp_path, tiny_flux_path):
    out = tmp_path / "run"
    run_script("algos/nft.py", *TINY, "--eval-every", "0", "--output-dir", out)  # checkpoints of epochs 0 and 1
    state = out / "checkpoints" / "epoch_000001" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    result = tmp_path / "eval.json"
    printed = run_script("evaluate.py", "--run", out, "--output", result, "--grid-dir", tmp_path / "grids").stdout
    assert (f"note: --run {out}: skipped checkpoints that do not load completely: epoch_000001 (training_state.pt "
            f"does not match its sha256 in meta.json); scoring epoch_000000 instead") in printed.splitlines()
    (scored,) = json.loads(result.read_text())
    assert (scored["name"], scored["epoch"]) == ("run", 0)


def test_another_process_writing_the_same_grid_between_save_and_rename(tmp_path, monkeypatch):
    """Concurrent evaluations share --grid-dir (runs/evaluate by default); a grid name written by two processes at
    once lost one of them its results (the shared temporary file was renamed away under it)."""
    path, real_replace, interleaved = tmp_path / "run.png", os.replace, []

    def replace_after_another_writer(src, dst):
        if not interleaved:
            interleaved.append(src)
            with monkeypatch.context() as other_process:
                other_process.setattr(tracking.os, "getpid", lambda: 2**22 + 1)
                tracking.save_image_grid(torch.ones(1, 3, 8, 8), path)
        real_replace(src, dst)

    monkeypatch.setattr(tracking.os, "replace", replace_after_another_writer)
    tracking.save_image_grid(torch.zeros(1, 3, 8, 8), path)
    assert interleaved and not list(tmp_path.glob("*.tmp.png"))
    assert np.asarray(Image.open(path)).max() == 0  # the last rename wins: this process's all-black grid
