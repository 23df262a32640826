"""Sequence parallelism (common/parallel.py, --sequence-parallel N; docs/distributed.md): two CPU processes (gloo) in
one sequence-parallel group split every transformer call between them and must compute what one process computes
unsplit: the transformer's output, the SDE log-probs, the LoRA gradients after DDP's mean, and a whole grpo.py run."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import (
    ACCELERATE_2CPU,
    REPO,
    SLOW,
    read_metrics,
    run_script,
    script_error,
    slow_except,
)

SKIP = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb",
        "num_processes"}  # measured, or the launch's size


@pytest.mark.parametrize("model", slow_except(["wan", "flux1"], "flux1"))
def test_split_step_equals_the_unsplit_one(tmp_path, model):
    """Wan splits its video tokens only (cross-attention keys, the text, stay whole); FLUX.1 splits the joint
    sequence of text and image tokens, so both of diffusers' plan shapes are covered."""
    from common.models import tiny_model_path

    tiny_model_path(model)  # built here once, not by both processes at the same time
    out = tmp_path / "report.json"
    run_script("tests/sp_step.py", model, out, launcher=ACCELERATE_2CPU)
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        for key in ("velocity", "log_prob"):
            difference, scale = report[key]
            assert difference <= 1e-6 * scale, (key, report[key])
        assert report["grad_count"] > 0
        for name, (difference, scale) in report["grads"].items():
            assert scale > 0 and difference <= 1e-5 * scale, (name, difference, scale)
    # tflops: the processes' counts add up to the unsplit model's work, plus what each repeats outside the split
    # (time embedding and modulations; Wan's patch and text embeddings: the tiny models' share is large, 5% for
    # FLUX.1 and 18% for Wan)
    unsplit, split = reports[0]["flops"]["unsplit"], sum(r["flops"]["split"] for r in reports)
    assert unsplit <= split <= 1.25 * unsplit


def test_one_process_of_a_group_calls_the_rewards_and_both_get_its_scores(tmp_path):
    """Both processes of a group hold the same samples: each reward is called once per sample in the group (not once
    per process), and both processes get the same scores and named columns; a reward's failure is both's one line."""
    out = tmp_path / "report.json"
    run_script("tests/sp_scoring.py", out, launcher=ACCELERATE_2CPU)
    first, second = json.loads(out.read_text())
    assert first["calls"] == {"brightness": 8, "contrast": 8, "judge": 8}
    assert second["calls"] == {"brightness": 0, "contrast": 0, "judge": 0}
    images = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)).double().numpy()
    brightness = images.reshape(8, -1).mean(1)
    group = np.array([1, 1, 2, 2, 1, 1, 2, 2])
    means = {g: brightness[group == g].mean() for g in (1, 2)}
    contrast = brightness - np.array([means[g] for g in group])
    best = {g: brightness[group == g].max() for g in (1, 2)}
    for report in (first, second):
        np.testing.assert_allclose(report["scores"], np.stack([brightness, contrast], 1), rtol=0, atol=1e-12)
        np.testing.assert_allclose(report["columns"]["contrast_below_best"],
                                   np.array([best[g] for g in group]) - brightness, rtol=0, atol=1e-12)
        assert report["error"].startswith("reward 'judge' raised ConnectionError at sp_scoring.py:")
    assert second["error"] == first["error"]


@SLOW
def test_a_split_grpo_run_calls_each_reward_once_per_sample(tmp_path):
    """algos/grpo.py with --sequence-parallel 2: the epoch's scoring and both evaluations call the reward on the
    group's first process only, and the run trains on the scores that process got."""
    calls = tmp_path / "calls"
    calls.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "1", "--eval-every", "1", "--eval-num-prompts", "2",
               "--eval-seeds", "1", "--reward", f"sp_scoring:CountedBrightness,folder={calls}", "--sequence-parallel",
               "2", "--output-dir", tmp_path / "run", launcher=ACCELERATE_2CPU, env=env)
    assert sorted(path.name for path in calls.iterdir()) == ["calls_rank0.jsonl"]
    lines = [json.loads(line) for line in (calls / "calls_rank0.jsonl").read_text().splitlines()]
    scores = [score for line in lines for score in line["scores"]]
    (metrics,) = read_metrics(tmp_path / "run")
    # the evaluation before training (its 2 samples, then each against the other prompt: the prompt gap), the epoch,
    # the evaluation after it
    assert len(scores) == 2 + 2 + metrics["samples_seen"] + 2
    assert metrics["reward_mean"] == pytest.approx(np.mean(scores[4:-2]), rel=1e-12)


@SLOW
def test_grpo_run_equals_the_one_process_run(tmp_path):
    """Two processes of one group (one data-parallel rank) draw, score and train what one process does, up to the
    float32 rounding of the split attention sums (~1e-7). The reward is a continuous one (mean brightness): the
    preset's JPEG size turns such rounding into whole changed bytes, a difference of the reward, not of the runs."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, launch in [("one", []), ("split", ["--sequence-parallel", "2", "--gradient-checkpointing"])]:
        (tmp_path / f"calls_{name}").mkdir()
        run_script("algos/grpo.py", "--preset", "tiny", "--epochs", "2", "--eval-every", "1", "--eval-num-prompts", "2",
                   "--learning-rate", "3e-3", "--reward", f"sp_scoring:CountedBrightness,folder={tmp_path}/calls_{name}",
                   *launch, "--output-dir", tmp_path / name, env=env, launcher=ACCELERATE_2CPU if launch else None)
        runs[name] = read_metrics(tmp_path / name, base=True)  # checkpointing recomputes the split blocks: the same
    one, split = runs["one"], runs["split"]
    assert [m["epoch"] for m in split] == [-1, 0, 1] and all(m.get("num_processes", 2) == 2 for m in split)
    for a, b in zip(one, split):
        assert set(a) == set(b)
        for key in set(a) - SKIP:
            # the loss is a mean of advantages that sum to zero (times ratios ~1): its size is its rounding's
            near_zero = 1e-7 if key in ("loss", "policy_loss") else 1e-12
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=near_zero), (a["epoch"], key)
    assert split[1]["reward_mean"] == pytest.approx(one[1]["reward_mean"], rel=1e-8)  # before any update


def test_refusals_before_anything_is_written(tmp_path):
    base = ["--preset", "tiny", "--epochs", "1", "--output-dir", tmp_path / "out"]
    assert "--sequence-parallel 2 does not divide the 1 processes" in script_error(
        "algos/grpo.py", *base, "--sequence-parallel", "2")
    message = script_error("algos/grpo.py", *base, "--model", "sd3", "--sequence-parallel", "2")
    assert "sd3's transformer has no sequence-parallel plan in diffusers; models with one: flux1, qwen-image, wan" \
        in message
    assert "--sequence-parallel must be at least 1, got 0" in script_error("algos/grpo.py", *base,
                                                                          "--sequence-parallel", "0")
    assert not (tmp_path / "out").exists()


def test_a_head_count_the_degree_does_not_divide_is_refused():
    from diffusers import WanTransformer3DModel

    from common.parallel import enable_sequence_parallel
    from common.models import tiny_model_path
    from common.utils import UserError

    transformer = WanTransformer3DModel.from_pretrained(tiny_model_path("wan") / "transformer")
    with pytest.raises(UserError, match="--sequence-parallel 3 does not divide the 2 attention heads of "
                                        "WanTransformer3DModel"):
        enable_sequence_parallel(transformer, None, 3, torch.device("cpu"))


def test_a_sequence_length_the_degree_does_not_divide_is_refused():
    """FLUX.1's plan splits the text tokens too: 31 of them do not split in two. The check runs before diffusers'
    split (which would stop on an assert), on every process alike, at the first transformer call: before the first
    metrics line. No collective is reached, so one process shows it."""
    from diffusers import FluxTransformer2DModel

    from common.parallel import _add_split_checks
    from common.models import tiny_model_path
    from common.utils import UserError

    transformer = FluxTransformer2DModel.from_pretrained(tiny_model_path("flux1") / "transformer")
    _add_split_checks(transformer, transformer._cp_plan, 2)
    config = transformer.config
    inputs = {"hidden_states": torch.zeros(1, 16, config.in_channels), "timestep": torch.ones(1),
              "guidance": torch.ones(1), "pooled_projections": torch.zeros(1, config.pooled_projection_dim),
              "img_ids": torch.zeros(16, 3), "return_dict": False}
    transformer(encoder_hidden_states=torch.zeros(1, 32, config.joint_attention_dim), txt_ids=torch.zeros(32, 3),
                **inputs)  # 16 image and 32 text tokens split
    with pytest.raises(UserError, match="--sequence-parallel 2 does not divide the sequence length 31 of "
                                        "FluxTransformer2DModel's encoder_hidden_states"):
        transformer(encoder_hidden_states=torch.zeros(1, 31, config.joint_attention_dim), txt_ids=torch.zeros(31, 3),
                    **inputs)
