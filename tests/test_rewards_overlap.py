"""Rewards scored while the rollout goes on (common.scoring.RolloutScoring, --reward-workers): the same scores as
scoring after the rollout, bit for bit, in every script and with two processes; one-line errors for a raising, a
wrong-length and a stuck reward; a stop signal during scoring; the remote client's concurrent pooled requests."""

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from common.scoring import RolloutScoring
from common.utils import UserError
from conftest import ACCELERATE_2CPU, REPO, SLOW, read_metrics, run_script, slow_except
from rewards import load_rewards, score_samples
from rewards.remote import decode_images, encode_images
from rewards.server import make_server

from test_matrix import STEPS  # each script's smallest rollout (4 steps; MixGRPO 6)

SCRIPTS = ["awm", "crd", "dgpo", "dpo", "dppo", "grpo", "grpo_guard", "mixgrpo", "nft", "vgrpo"]  # opd: test_opd.py
# 8 samples in micro-batches of 4 at 32 px; a groupwise reward beside a pointwise one
SMALL = ["--preset", "tiny", "--epochs", "2", "--eval-every", "0", "--prompts-per-epoch", "2", "--group-size", "4",
         "--batch-size", "4", "--resolution", "32", "--max-sequence-length", "16",
         "--reward", "jpeg_compressibility", "--reward", "overlap_rewards:GroupContrast",
         "--reward", "overlap_rewards:Channels:0.5"]
TIME_KEYS = {"epoch_time_s", "rollout_time_s", "reward_time_s", "train_time_s", "tflops", "mfu", "peak_memory_gb"}
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def reward_threads():
    return [t for t in threading.enumerate() if t.name.startswith("reward-worker")]


def images_and_ids(count=12, seed=0):
    images = torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    return images, torch.tensor([3, 1, 3, 2, 1, 3, 2, 2, 1, 3, 1, 2][:count])  # groups interleaved over batches


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_micro_batches_score_as_the_whole_epoch(workers):
    rewards = load_rewards(["jpeg_compressibility", "overlap_rewards:GroupContrast", "overlap_rewards:Sleepy,seconds=0.01"])
    images, ids = images_and_ids()
    prompts = [f"p{i}" for i in range(len(ids))]
    scoring = RolloutScoring(rewards, prompts, ids, workers=workers)
    for start in range(0, len(ids), 5):  # micro-batches of 5, 5, 2
        scoring.submit(images[start:start + 5])
    got = scoring.collect()
    expected = torch.cat([score_samples(rewards[:1], images[s:s + 5], prompts[s:s + 5], ids[s:s + 5])
                          for s in range(0, len(ids), 5)])
    assert torch.equal(got[:, 0], expected[:, 0])  # pointwise: one call per micro-batch
    assert torch.equal(got[:, 1:], score_samples(rewards[1:], images, prompts, ids))  # groupwise: whole groups
    assert got[:, 1].abs().sum() > 0 and not reward_threads()


def test_a_failure_is_raised_at_the_next_submit_and_nothing_is_returned():
    rewards = load_rewards(["overlap_rewards:Boom"])
    images, ids = images_and_ids(8)
    scoring = RolloutScoring(rewards, ["p"] * 8, ids, workers=2)
    scoring.submit(images[:4])
    scoring.submit(images[4:])  # the second call raises in a worker
    with pytest.raises(UserError, match=r"^reward 'Boom' raised ValueError at overlap_rewards.py:\d+: boom on the "
                                        r"second micro-batch$"):
        for _ in range(100):  # the next submit (or collect) raises it
            time.sleep(0.02)
            scoring._raise_first_failure(done_only=True)
    time.sleep(0.2)
    assert not reward_threads()


def test_the_remote_client_sends_micro_batches_concurrently_on_kept_connections():
    (local,) = load_rewards(["overlap_rewards:Sleepy,seconds=0.4"])
    server = make_server(local, "127.0.0.1", 0, concurrency=4)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (remote,) = load_rewards([f"remote,url={url},connections=4"])
        images, ids = images_and_ids(12, seed=3)
        prompts = [f"p{i}" for i in range(12)]
        for round_ in range(2):  # the second round reuses the first's connections
            start = time.time()
            scoring = RolloutScoring([remote], prompts, ids, workers=4)
            for s in range(0, 12, 3):
                scoring.submit(images[s:s + 3])
            got = scoring.collect()
            elapsed = time.time() - start
            # four requests of 0.4 s in flight together: well under the 1.6 s one at a time; every answer its own
            assert elapsed < 1.2, elapsed
            assert torch.equal(got[:, 0], decode_images(encode_images(images)).double().flatten(1).mean(1))
        assert 1 <= len(remote.score.client.idle) <= 4 and server.requests_served == 8
    finally:
        server.shutdown()
        server.server_close()


# ---- the scripts: --reward-workers 0 and the default give the same run ------------------------------------------

def assert_channel_columns(metrics):
    """Channels' named columns are logged and their mean is its score's mean (all samples of the epoch)."""
    for m in metrics:
        assert (m["reward_Channels_red_mean"] + m["reward_Channels_blue_mean"]) / 2 == pytest.approx(
            m["reward_Channels_mean"], rel=1e-12)
        assert m["reward_Channels_red_std"] > 0


def same_runs(a, b):
    strip = lambda ms: [{k: v for k, v in m.items() if k not in TIME_KEYS} for m in ms]  # noqa: E731
    assert strip(read_metrics(a)) == strip(read_metrics(b))
    wa, wb = (load_file(d / "checkpoints" / "epoch_000001" / "pytorch_lora_weights.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("script", slow_except(SCRIPTS, "grpo"))
def test_every_script_scores_the_same_with_and_without_workers(script, tmp_path, tiny_flux_path):
    serial, overlapped = tmp_path / "serial", tmp_path / "overlapped"
    run_script(f"algos/{script}.py", *SMALL, *STEPS[script], "--reward-workers", "0", "--output-dir", serial, env=ENV)
    run_script(f"algos/{script}.py", *SMALL, *STEPS[script], "--output-dir", overlapped, env=ENV)  # workers on
    assert read_metrics(serial)[0]["reward_GroupContrast_std"] > 0
    assert_channel_columns(read_metrics(serial))
    same_runs(serial, overlapped)


@SLOW
@pytest.mark.parametrize("script", ["grpo"])
def test_two_processes_score_the_same_with_and_without_workers(script, tmp_path, tiny_flux_path):
    serial, overlapped = tmp_path / "serial", tmp_path / "overlapped"
    run_script(f"algos/{script}.py", *SMALL, "--reward-workers", "0", "--output-dir", serial, env=ENV,
               launcher=ACCELERATE_2CPU)
    run_script(f"algos/{script}.py", *SMALL, "--output-dir", overlapped, env=ENV, launcher=ACCELERATE_2CPU)
    assert [m["num_processes"] for m in read_metrics(overlapped)] == [2, 2]
    assert_channel_columns(read_metrics(overlapped))  # gathered from both processes
    same_runs(serial, overlapped)


# ---- failures under the default: one line, nothing trained on or written ----------------------------------------

def failed_run(tmp_path, *rewards):
    out = tmp_path / "run"
    result = run_script("algos/grpo.py", *SMALL[:-6], *[f for r in rewards for f in ("--reward", r)],
                        "--output-dir", out, check=False, env=ENV)
    assert result.returncode == 2, result.stderr[-2000:]  # a UserError's status, not a crash's
    last = result.stderr.strip().splitlines()[-1]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
    return last, result.stderr


def test_a_raising_reward_stops_the_run_in_one_line(tmp_path):
    last, _ = failed_run(tmp_path, "jpeg_compressibility", "overlap_rewards:Boom")
    assert last.startswith("error: reward 'Boom' raised ValueError at overlap_rewards.py:") and \
        last.endswith("boom on the second micro-batch")


@SLOW
def test_a_reward_still_running_when_another_fails_ends_before_the_exit(tmp_path):
    # Busy is inside a torch op when Boom fails; before, the exit aborted the process there (exit 134, "terminate
    # called without an active exception" after the error line) whenever the timing fell that way (CI, once).
    last, _ = failed_run(tmp_path, "overlap_rewards:Busy,seconds=2", "overlap_rewards:Boom")
    assert last.startswith("error: reward 'Boom' raised ValueError")


def test_a_wrong_length_reward_stops_the_run_in_one_line(tmp_path):
    last, _ = failed_run(tmp_path, "overlap_rewards:OneShort")
    assert last == "error: reward 'OneShort' returned shape (3,), expected (4,)"


@SLOW
def test_a_stuck_remote_reward_is_reported_early_then_stops_the_run(tmp_path):
    (local,) = load_rewards(["overlap_rewards:Sleepy,seconds=5"])
    server = make_server(local, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        last, stderr = failed_run(tmp_path, f"remote,url={url},timeout=1,retries=0,notice_after=0.2")
    finally:
        server.shutdown()
        server.server_close()
    assert f"remote reward: waiting for {url} to answer /score (4 images)" in stderr
    assert last == (f"error: reward server {url} did not answer /score (4 images) (no answer within 1 s (timed out)) "
                    f"after 1 tries; it is running but stuck or too slow (raise timeout=)")


def test_sigterm_during_scoring_finishes_the_epoch_and_checkpoints_it(tmp_path):
    out = tmp_path / "run"
    args = SMALL[:-4] + ["--epochs", "3", "--reward", "overlap_rewards:StopsTheRun"]
    result = run_script("algos/grpo.py", *args, "--output-dir", out, check=False, env=ENV)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert "stopped by SIGTERM after epoch 0; checkpoint written" in result.stdout
    assert (out / "checkpoints" / "latest").read_text().strip() == "epoch_000000"
    assert [m["epoch"] for m in read_metrics(out)] == [0]
