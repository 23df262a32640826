"""The reward server (rewards/server.py) and the judge server (rewards/vlm_server.py) against costly or broken
requests: a pixel cap read from the images' headers before any is decoded (a 300 KB PNG that unpacks to 67 million
pixels), 400 with a message for an image that cannot be read (and the judge's client saying so in one line), and a
request whose client hung up while it waited for its turn dropped unscored, so that retries do not pile up."""

import base64
import http.client
import json
import struct
import threading
import time
import zlib

import pytest
import torch

from common.utils import UserError
from conftest import script_error
from rewards import load_rewards, score_samples
from rewards.server import DEFAULT_MAX_PIXELS, make_server
from rewards.vlm_server import Judge, build_tiny_judge
from test_vlm_judge import images_on_grid, serving as serving_judge

BOMB_SIDE = 8200  # 67,240,000 pixels: just over the default cap of 2**26


def black_png(width: int, height: int) -> bytes:
    """A valid all-black RGB PNG, compressed row by row: a few hundred KB that decode to width x height x 3 bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    packer, rows, data = zlib.compressobj(9), b"\0" * ((1 + 3 * width) * 256), []
    for start in range(0, height, 256):
        data.append(packer.compress(rows[:(1 + 3 * width) * min(256, height - start)]))
    data.append(packer.flush())
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", b"".join(data)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def bomb() -> str:
    return base64.b64encode(black_png(BOMB_SIDE, BOMB_SIDE)).decode()


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-judge")
    build_tiny_judge(folder)
    return Judge(str(folder))


class serving_reward:
    """The reference reward server of `reward` in a thread on a free port of 127.0.0.1."""

    def __init__(self, reward, **options):
        self.server = make_server(reward, "127.0.0.1", 0, **options)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def post(connection: http.client.HTTPConnection, route: str, payload: dict) -> tuple[int, dict]:
    connection.request("POST", route, body=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def judge_request(image: str) -> dict:
    return {"model": "tiny-judge", "max_tokens": 1, "logprobs": True, "top_logprobs": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                                     {"type": "text", "text": "Is it dark? Answer yes or no."}]}]}


def test_the_reward_server_refuses_too_many_pixels_before_decoding_them(bomb):
    assert len(bomb) < 400_000 and BOMB_SIDE**2 > DEFAULT_MAX_PIXELS
    (local,) = load_rewards(["jpeg_compressibility"])
    with serving_reward(local) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.server.server_address[1], timeout=30)
        start = time.time()
        status, answer = post(connection, "/score", {"prompts": ["a"], "images": [bomb]})
        seconds = time.time() - start
        assert status == 400 and server.server.requests_served == 0, answer
        assert answer["error"] == (f"the request's 1 images hold {BOMB_SIDE**2} pixels, over this server's limit of "
                                   f"{DEFAULT_MAX_PIXELS} (--max-pixels): send fewer or smaller images per request")
        assert seconds < 5  # decoding it would take 200 MB and seconds; the header is read in microseconds
        # condition images count too; under the cap, the same request is scored
        status, answer = post(connection, "/score", {"prompts": ["a"], "images": [base64.b64encode(
            black_png(64, 64)).decode()], "conditions": [[bomb]]})
        assert status == 400 and f"hold {BOMB_SIDE**2 + 64 * 64} pixels" in answer["error"]
    with serving_reward(local, max_pixels=2 * 64 * 64) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.server.server_address[1], timeout=30)
        small = base64.b64encode(black_png(64, 64)).decode()
        assert post(connection, "/score", {"prompts": ["a", "b"], "images": [small, small]})[0] == 200
        status, answer = post(connection, "/score", {"prompts": ["a", "b", "c"], "images": [small] * 3})
        assert status == 400 and "hold 12288 pixels, over this server's limit of 8192" in answer["error"]


@pytest.mark.parametrize("image, message", [
    ("bm90IGFuIGltYWdl", "image 1 of the request is not a readable image (UnidentifiedImageError: "),
    (base64.b64encode(black_png(64, 64)[:60]).decode(), "image 1 of the request cannot be decoded ("),
])
def test_an_unreadable_image_is_answered_400_by_both_servers(judge, image, message):
    (local,) = load_rewards(["jpeg_compressibility"])
    with serving_reward(local) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.server.server_address[1], timeout=30)
        status, answer = post(connection, "/score", {"prompts": ["a"], "images": [image]})
        assert status == 400 and answer["error"].startswith(message), answer
    with serving_judge(judge) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.server.server_address[1], timeout=30)
        status, answer = post(connection, "/v1/chat/completions", judge_request(image))
        assert status == 400 and answer["error"]["message"].startswith(message), answer
        connection.request("GET", "/v1/models")  # the same connection goes on: answered, not hung up
        assert connection.getresponse().status == 200 and server.server.requests_served == 0


def test_the_judge_client_reports_a_refused_sample_in_one_line(judge, monkeypatch):
    with serving_judge(judge) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},retries=1,backoff=0.05"])
        monkeypatch.setattr("rewards.vlm_judge.encode_images", lambda images: ["bm90IGFuIGltYWdl"] * len(images))
        with pytest.raises(UserError) as info:
            score_samples([reward], images_on_grid(2), ["a", "b"], torch.zeros(2))
    message = str(info.value)
    assert message.startswith(f"judge server {server.url} refused a sample's question: server {server.url} answered "
                              f"400: image 1 of the request is not a readable image") and "\n" not in message


def test_the_judge_server_refuses_too_many_pixels(judge, bomb):
    from rewards.vlm_server import make_judge_server

    server = make_judge_server(judge, "tiny-judge", "127.0.0.1", 0, max_pixels=36 * 36 * 2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        (reward,) = load_rewards([f"vlm_judge,url={url},conditions=true"])
        (score,) = reward.score(images_on_grid(1), ["a"], [[images_on_grid(1)[0]]])["score"]  # two: at the cap
        assert 0 <= score <= 1
        with pytest.raises(UserError) as info:  # three images of 36 x 36: over the cap of two
            reward.score(images_on_grid(1), ["a"], [[images_on_grid(1)[0]] * 2])
        assert str(info.value) == (f"judge server {url} refused a sample's question: server {url} answered 400: the "
                                   f"request's 3 images hold 3888 pixels, over this server's limit of 2592 "
                                   f"(--max-pixels): send fewer or smaller images per request")
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        start = time.time()
        status, answer = post(connection, "/v1/chat/completions", judge_request(bomb))
        assert status == 400 and f"hold {BOMB_SIDE**2} pixels" in answer["error"]["message"] and time.time() - start < 5
    finally:
        server.shutdown()
        server.server_close()


def test_the_reward_server_drops_requests_whose_client_gave_up(capfd):
    (local,) = load_rewards(["jpeg_compressibility"])
    score, calls, release = local.score, [], threading.Event()

    def busy(images, prompts):  # the first request holds the server until the test releases it
        calls.append(len(prompts))
        release.wait(30)
        return score(images, prompts)

    local.score = busy
    with serving_reward(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},timeout=0.3,retries=2,backoff=0.05"])
        with pytest.raises(UserError, match="after 3 tries; it is running but stuck"):
            score_samples([remote], images_on_grid(1), ["a"], torch.zeros(1))
        time.sleep(0.5)  # the server notices the last hang-up (it looks every 0.1 s)
        release.set()
        time.sleep(0.5)  # what would be scored after the first request is, by now
        assert calls == [1] and server.server.requests_served == 1  # the two retries were dropped unscored
    assert capfd.readouterr().err.count("the client hung up while its request waited; dropped it unscored") == 2


def test_the_judge_server_drops_requests_whose_client_gave_up(judge):
    with serving_judge(judge) as server:
        (reward,) = load_rewards([f"vlm_judge,url={server.url},timeout=0.3,retries=2,backoff=0.05"])
        answered = server.server.requests_served
        with judge.lock:  # the model busy with another request meanwhile
            with pytest.raises(UserError, match="after 3 tries; it is running but stuck"):
                reward.score(images_on_grid(1), ["a"])
            time.sleep(0.5)
        time.sleep(0.5)
        assert server.server.requests_served == answered  # nothing ran for the three abandoned requests


def test_max_pixels_flags_are_checked_in_one_line():
    assert script_error("rewards/server.py", "--reward", "jpeg_compressibility", "--max-pixels", "0") == \
        "error: --max-pixels must be at least 1, got 0"
    assert script_error("rewards/vlm_server.py", "--model-path", "tiny", "--max-pixels", "-1") == \
        "error: --max-logprobs and --max-pixels must be at least 1 and --timeout a positive number"
