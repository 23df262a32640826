"""--init-lora DIR and --merge-init-lora (common/init_lora.py, every script through common.setup), on nft.py and
the tiny FLUX.1: a run started from a LoRA evaluates, before its first update, as the run that saved it did at its
end; merged, that model is also the reference (the KL to it starts at 0); evaluate.py scores both as trained; bad
input is one line."""

import json

import pytest

from conftest import read_metrics, run_script, script_error

NFT = ["--preset", "tiny", "--eval-num-prompts", "2", "--kl-beta", "0.1"]


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, tiny_flux_path):
    out = tmp_path_factory.mktemp("source")
    run_script("algos/nft.py", *NFT, "--epochs", "2", "--eval-every", "2", "--output-dir", out)
    return out


@pytest.mark.parametrize("merge", [False, True])
def test_a_run_starts_from_the_lora_and_merged_it_is_the_reference(source_run, tmp_path, merge):
    out = tmp_path / "run"
    run_script("algos/nft.py", *NFT, "--epochs", "1", "--eval-every", "1", "--init-lora", source_run,
               *(["--merge-init-lora"] if merge else []), "--output-dir", out)
    source_end = read_metrics(source_run)[-1]["eval_reward_mean"]
    base, first = read_metrics(out, base=True)
    assert base["epoch"] == -1
    # the same model before the first update: loaded exactly, or merged into the base weights (float rounding)
    assert base["eval_reward_mean"] == pytest.approx(source_end, abs=1e-9 if not merge else 1e-4)
    if merge:
        assert first["kl"] == 0  # the reference is the merged model, which the policy still is before its step
    else:
        assert first["kl"] > 0  # the reference is the base model, which the loaded LoRA moved away from
    # evaluate.py applies the run's --init-lora / --merge-init-lora: it reproduces the run's last evaluation
    scored = tmp_path / "scored.json"
    run_script("evaluate.py", "--run", out, "--base", "--output", scored, "--grid-dir", tmp_path / "grids")
    results = json.loads(scored.read_text())
    assert results[0]["eval_reward_mean"] == pytest.approx(base["eval_reward_mean"], abs=1e-9)
    assert results[1]["eval_reward_mean"] == pytest.approx(first["eval_reward_mean"], abs=1e-9)


def test_evaluate_scores_a_lora_given_by_flags(source_run, tmp_path):
    scored = tmp_path / "scored.json"
    run_script("evaluate.py", "--model", "flux1", "--model-path", "tiny", "--resolution", "64",
               "--max-sequence-length", "32", "--eval-num-prompts", "2", "--batch-size", "8", "--eval-num-steps", "6",
               "--init-lora", source_run, "--output", scored, "--grid-dir", tmp_path / "grids")
    (result,) = json.loads(scored.read_text())
    assert result["eval_reward_mean"] == pytest.approx(read_metrics(source_run)[-1]["eval_reward_mean"], abs=1e-9)


@pytest.mark.parametrize("flags,message", [
    (["--merge-init-lora"], "--merge-init-lora merges the LoRA given by --init-lora: give --init-lora DIR"),
    (["--init-lora", "/nonexistent"], "--init-lora /nonexistent is not a folder"),
    (["--init-lora", "SRC", "--lora-rank", "4"], "has LoRA rank 8 and alpha 8; pass --lora-rank 8 --lora-alpha 8"),
    (["--init-lora", "SRC", "--full-finetune"], "--init-lora with --full-finetune: add --merge-init-lora"),
    (["--init-lora", "SRC", "--model", "sd3"], "was trained on flux1, this run is sd3"),
])
def test_bad_input_gives_one_line_error(source_run, tmp_path, flags, message):
    flags = [str(source_run / "checkpoints" / "epoch_000001") if f == "SRC" else f for f in flags]
    assert message in script_error("algos/nft.py", *NFT, "--epochs", "1", "--output-dir", tmp_path / "out", *flags)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
