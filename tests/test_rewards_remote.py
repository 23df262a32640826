"""Remote rewards: round trips to the reference server on 127.0.0.1 (bounded request counts), server errors,
a server that is down, and the server's command line."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from common.utils import UserError
from conftest import REPO, free_port
from rewards import load_rewards, score_samples
from rewards.clip import build_tiny_clip
from rewards.server import make_server


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-clip")
    build_tiny_clip(folder, seed=4)
    return folder


class serving:
    """A reference server for `reward` in a thread on a free port of 127.0.0.1."""

    def __init__(self, reward):
        self.server = make_server(reward, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def images_on_grid(count, seed=0):
    return torch.randint(0, 256, (count, 3, 36, 36), generator=torch.Generator().manual_seed(seed)).float() / 255


def test_round_trip_matches_local_scores(clip_dir):
    local = load_rewards([f"pickscore,path={clip_dir}", f"pickscore_rank,path={clip_dir}"])
    images, prompts, ids = images_on_grid(6), ["a cat", "a dog", "a cat", "a dog", "a cat", "a dog"], torch.tensor([1, 2] * 3)
    expected = score_samples(local, images, prompts, ids)
    with serving(local[0]) as point, serving(local[1]) as rank:
        remote = load_rewards([f"remote:0.5,url={point.url},batch_size=4", f"remote,url={rank.url},name=rank"])
        assert [(r.name, r.weight, r.groupwise) for r in remote] == [("pickscore", 0.5, False), ("rank", 1.0, True)]
        got = score_samples(remote, images, prompts, ids)
        assert point.server.requests_served == 2  # 6 samples in batches of 4
        assert rank.server.requests_served == 2  # one request per group, never split
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


def test_server_side_failure_is_reported_with_both_names(clip_dir):
    (local,) = load_rewards([f"pickscore,path={clip_dir}"])
    local.score = lambda images, prompts: [float("nan")] * len(prompts)
    with serving(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},name=far"])
        with pytest.raises(UserError) as info:
            score_samples([remote], images_on_grid(2), ["a", "b"], torch.zeros(2))
    message = str(info.value)
    assert message.startswith("reward 'far' raised RuntimeError") and "answered 500" in message
    assert "reward 'pickscore' returned NaN or inf for 2 of 2 samples" in message and "\n" not in message


def test_server_down_gives_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.time()
    with pytest.raises(UserError) as info:
        load_rewards([f"remote,url={url},retries=2,backoff=0.05,timeout=2"])
    assert time.time() - start < 10
    message = str(info.value)
    assert message.startswith(f"reward server {url} is not reachable") and "after 3 tries" in message
    assert "python -m rewards.server" in message and "\n" not in message


def test_server_going_down_mid_run_stops_the_run():
    (local,) = load_rewards(["jpeg_compressibility"])
    with serving(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},retries=1,backoff=0.05,timeout=2"])
    with pytest.raises(UserError, match="is not reachable .* after 2 tries; it answered earlier in this run"):
        score_samples([remote], images_on_grid(2), ["a", "b"], torch.zeros(2))


def test_server_command_line():
    command = [sys.executable, "-m", "rewards.server", "--reward", "jpeg_incompressibility", "--port", "0"]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            line = process.stdout.readline()  # "serving reward ... on http://127.0.0.1:PORT" (empty if it died)
            assert "serving reward 'jpeg_incompressibility' (groupwise=False) on http://127.0.0.1:" in line, \
                line or process.stderr.read()
            url = line.split(" on ")[-1].strip()
            (remote,) = load_rewards([f"remote,url={url}"])
            images = images_on_grid(3, seed=1)
            got = score_samples([remote], images, ["a", "b", "c"], torch.zeros(3))
            expected = score_samples(load_rewards(["jpeg_incompressibility"]), images, ["a", "b", "c"], torch.zeros(3))
            assert remote.name == "jpeg_incompressibility" and torch.equal(got, expected)
        finally:
            process.terminate()


def test_a_server_slower_than_the_timeout_is_retried_then_reported():
    (local,) = load_rewards(["jpeg_compressibility"])
    score = local.score
    local.score = lambda images, prompts: (time.sleep(0.6), score(images, prompts))[1]
    with serving(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},retries=1,backoff=0.05,timeout=0.3"])
        # it accepts the connection, so it is running: reported as stuck, not as unreachable
        with pytest.raises(UserError, match="did not answer /score \\(1 images\\) \\(no answer within 0.3 s.*\\) "
                                            "after 2 tries; it is running but stuck"):
            score_samples([remote], images_on_grid(1), ["a"], torch.zeros(1))
