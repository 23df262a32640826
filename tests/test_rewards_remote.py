"""Remote rewards: round trips to the reference server on 127.0.0.1 (bounded request counts), server errors,
a server that is down, the server's command line, one server for several clients (stalled clients, socket timeout,
size limit, serialised scoring), and answers that are not a reward server's."""

import http.server
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from common.utils import UserError
from conftest import REPO, free_port, script_error
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


# ---- one server for several clients: concurrency, socket timeout, size limit ------------------------------------

def _raw_response(sock, within: float) -> bytes:
    """Everything the server sends on `sock` until it closes the connection, waiting at most `within` seconds."""
    sock.settimeout(within)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_stalled_client_does_not_block_another_client():
    (local,) = load_rewards(["jpeg_compressibility"])
    with serving(local) as server:  # the default socket timeout (60 s) keeps the stalled connections open
        port = server.server.server_address[1]
        silent = socket.create_connection(("127.0.0.1", port))  # connects and sends nothing
        half = socket.create_connection(("127.0.0.1", port))  # half a request: headers, then part of the body
        half.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"prompts\": [")
        try:
            start = time.time()
            (remote,) = load_rewards([f"remote,url={server.url},timeout=10,retries=0"])
            got = score_samples([remote], images_on_grid(2), ["a", "b"], torch.zeros(2))
            assert time.time() - start < 5 and got.shape == (2, 1)
        finally:
            silent.close()
            half.close()


def test_the_server_drops_a_silent_connection_after_its_timeout():
    (local,) = load_rewards(["jpeg_compressibility"])
    server = make_server(local, "127.0.0.1", 0, timeout=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as silent:
            start = time.time()
            assert _raw_response(silent, within=5) == b"" and time.time() - start < 3
    finally:
        server.shutdown()
        server.server_close()


def test_an_oversized_body_gets_413_before_it_is_sent():
    (local,) = load_rewards(["jpeg_compressibility"])
    server = make_server(local, "127.0.0.1", 0, max_request_bytes=1000)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1])) as client:
            start = time.time()  # only the headers go out: the server must answer without waiting for the body
            client.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
            head, _, body = _raw_response(client, within=5).partition(b"\r\n\r\n")
            assert time.time() - start < 3
        assert head.split(b"\r\n")[0].split()[1] == b"413" and server.requests_served == 0
        assert "100000000 bytes exceeds this server's limit of 1000" in json.loads(body)["error"]
        # a client learns the limit from /info and refuses a larger request itself, naming batch_size=
        (remote,) = load_rewards([f"remote,url=http://127.0.0.1:{server.server_address[1]},batch_size=8"])
        with pytest.raises(UserError) as info:
            score_samples([remote], images_on_grid(4), list("abcd"), torch.zeros(4))
        assert "over the 1000 that reward server" in str(info.value) and "lower batch_size= (now 8)" in str(info.value)
        assert "\n" not in str(info.value)
    finally:
        server.shutdown()
        server.server_close()


def test_requests_are_read_concurrently_but_scored_one_at_a_time():
    (local,) = load_rewards(["jpeg_compressibility"])
    score, state, guard = local.score, {"inside": 0, "most": 0}, threading.Lock()

    def tracked(images, prompts):
        with guard:
            state["inside"] += 1
            state["most"] = max(state["most"], state["inside"])
        time.sleep(0.2)
        with guard:
            state["inside"] -= 1
        return score(images, prompts)

    local.score = tracked
    with serving(local) as server:
        (remote,) = load_rewards([f"remote,url={server.url},batch_size=1"])
        results = [None] * 3

        def client(i):
            results[i] = score_samples([remote], images_on_grid(2, seed=i), ["a", "b"], torch.zeros(2))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all(r is not None for r in results) and server.server.requests_served == 6
    assert state["most"] == 1


# ---- the client: anything but a reward server's answer is one line naming the URL --------------------------------

class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each route with the server's `answers[route]`: (status, body bytes)."""

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.server.answers[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


class scripted:
    def __init__(self, info=(200, b'{"name": "fake", "groupwise": false}'), score=(200, b'{"scores": [0.5, 0.25]}')):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
        self.server.answers = {"/info": info, "/score": score}
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("info, message", [
    ((404, b"<html>\n<body>Not Found</body>\n</html>\n"), "answered 404: <html> <body>Not Found</body> </html>"),
    ((500, b'{"error": "reward model not loaded"}'), "answered 500: reward model not loaded"),
    ((200, b"<html>hello</html>"), "answered /info with something that is not JSON: '<html>hello</html>'"),
    ((200, b'["fake", false]'), 'answered /info with ["fake", false], not an object with "name"'),
    ((200, b'{"name": "fake"}'), 'answered /info with {"name": "fake"}, not an object with "name"'),
    ((200, b'{"name": "fake", "groupwise": "no"}'), "not an object with \"name\" (a string), \"groupwise\" (true"),
])
def test_a_bad_info_answer_is_one_line_naming_the_url(info, message):
    with scripted(info=info) as fake:
        with pytest.raises(UserError) as error:
            load_rewards([f"remote,url={fake.url},retries=0"])
    text = str(error.value)
    assert f"server {fake.url} " in text and message in text and "rewards.server" in text and "\n" not in text


@pytest.mark.parametrize("url", ["http://127.0.0.1:port", "http://:8000", "http://[::1"])
def test_a_malformed_url_is_one_line(url):
    with pytest.raises(UserError, match="the remote reward needs url=http://HOST:PORT"):
        load_rewards([f"remote,url={url}"])


@pytest.mark.parametrize("score, message", [
    (b'{"scores": {"0": 0.5, "1": 0.25}}', 'answered /score with {"scores": {"0": 0.5, "1": 0.25}}, not an object '
                                         'with a "scores" list'),
    (b"[0.5, 0.25]", 'answered /score with [0.5, 0.25], not an object with a "scores" list'),
    (b'{"scores": [0.5]}', "answered /score with 1 scores for 2 images"),
    (b'{"scores": [0.5, "0.25"]}', 'answered /score with "0.25" as score 1, not a number'),
    (b'{"scores": [true, 0.25]}', "answered /score with true as score 0, not a number"),
    (b'{"scores": [0.5, null]}', "answered /score with null as score 1, not a number"),
    (b"not json", "answered /score (2 images) with something that is not JSON: 'not json'"),
])
def test_a_bad_score_answer_is_one_line_naming_the_url(score, message):
    with scripted(score=(200, score)) as fake:
        (remote,) = load_rewards([f"remote,url={fake.url},retries=0"])
        with pytest.raises(UserError) as error:
            score_samples([remote], images_on_grid(2), ["a", "b"], torch.zeros(2))
    text = str(error.value)
    assert text.startswith("reward 'fake' raised RuntimeError") and f"server {fake.url} " in text
    assert message in text and "\n" not in text


def test_server_flags_are_checked_in_one_line():
    assert script_error("rewards/server.py", "--reward", "jpeg_compressibility", "--timeout", "0") == \
        "error: --timeout must be a positive number, got 0.0"
    assert script_error("rewards/server.py", "--reward", "jpeg_compressibility", "--max-request-mb", "nan") == \
        "error: --max-request-mb must be a positive number, got nan"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = script_error("rewards/server.py", "--reward", "jpeg_compressibility", "--port", port)
    assert message.startswith(f"error: cannot listen on 127.0.0.1:{port} (Address already in use)")
    assert "give them all its url=" in message
