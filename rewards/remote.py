"""Remote rewards over HTTP, so that rewards with conflicting dependencies (GenEval's mmdet, HPSv2,
ImageReward, VLM judges) run in their own environment or on other machines. Standard library only.

Server (rewards/server.py; any reward this package loads, built-in or MODULE:ATTR; run it where that reward's
packages are installed):
    python -m rewards.server --reward pickscore --host 127.0.0.1 --port 8000 [--device cuda] [--dtype bfloat16]
Client, in the training command:
    --reward remote:1.0,url=http://127.0.0.1:8000[,timeout=120,retries=3,batch_size=32,connections=4,name=...]
The client keeps up to `connections` keep-alive connections and has at most that many requests in flight: the
training scripts' reward workers (--reward-workers) send the rollout's micro-batches concurrently through it.

Protocol: GET /info -> {"name", "groupwise", "wants_conditions", "max_request_bytes"}; POST /score {"prompts":
[...], "images": [base64 PNG, ...]} (plus "conditions": [[base64 PNG, ...] per sample] for a reward that wants
them) -> {"scores": [one number per image]} or, when the reward fails, status 500 {"error": "..."}; a body over
max_request_bytes gets 413. Images travel as 8-bit PNG (lossless for the round(255·x) images that the built-in
rewards score anyway).
"""

import base64
import http.client
import io
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse

import numpy as np
import torch

from common.utils import UserError

RETRYABLE_STATUS = (502, 503, 504)


def encode_images(images: torch.Tensor) -> list[str]:
    from rewards.clip import to_pil

    out = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def decode_images(encoded: list[str]) -> torch.Tensor:
    from PIL import Image

    arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")) for text in encoded]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def _shown(value) -> str:
    """A JSON value as the server sent it, cut short for an error line."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


class RemoteReward:
    """Client of a reward server. Connection failures and timeouts are retried with exponential backoff
    (1 s, 2 s, 4 s, ...); a server that stays unreachable stops the run with a UserError naming its URL, and one
    that answered /info but then hangs is reported as stuck, not unreachable. A request still waiting after
    `notice_after` seconds prints one line saying what it waits for. The server's name and groupwise flag are read
    once, at load, so a down server, or something at the URL that is not a reward server, fails before training
    with one line. An answer to /score that is not one number per image is a RuntimeError naming the server.
    Thread-safe: up to `connections` requests are in flight at once, each on its own kept-alive connection."""

    thread_safe = True  # common.scoring may call it from several threads at once

    def __init__(self, url: str = "", timeout: str = "120", retries: str = "3", batch_size: str = "32",
                 backoff: str = "1.0", notice_after: str = "5", connections: str = "4"):
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
        except ValueError:  # such a port, or an unclosed "[" of an IPv6 address
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"the remote reward needs url=http://HOST:PORT (got {url!r})")
        try:
            self.timeout, self.retries = float(timeout), int(retries)
            self.batch_size, self.backoff = int(batch_size), float(backoff)
            self.notice_after, self.connections = float(notice_after), int(connections)
        except ValueError:
            raise UserError("remote reward options timeout/backoff must be numbers and retries/batch_size/"
                            "connections integers") from None
        if self.connections < 1:
            raise UserError(f"remote reward option connections= must be at least 1, got {self.connections}")
        self.parts, self.idle, self.slots = parts, [], threading.BoundedSemaphore(self.connections)
        self.url, self.reached, self.max_request_bytes = url.rstrip("/"), False, None
        not_a_server = "(is it a reward server? python -m rewards.server)"
        try:
            info = self._request("/info")
        except RuntimeError as error:  # it answered, but not as a reward server does
            raise UserError(f"{error} {not_a_server}") from None
        self.reached = True  # from now on a refused connection means the server went down
        # "wants_conditions" and "max_request_bytes" are optional: older servers omit them
        if not (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("groupwise"), bool)
                and isinstance(info.get("wants_conditions", False), bool)
                and type(info.get("max_request_bytes", 1)) is int and info.get("max_request_bytes", 1) > 0):
            raise UserError(f"server {self.url} answered /info with {_shown(info)}, not an object with \"name\" (a "
                            f"string), \"groupwise\" (true or false) and optional \"wants_conditions\" (true or "
                            f"false), \"max_request_bytes\" (a positive integer) {not_a_server}")
        self.name, self.groupwise = info["name"], info["groupwise"]
        self.wants_conditions = info.get("wants_conditions", False)
        self.max_request_bytes = info.get("max_request_bytes")

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
        return kind(self.parts.hostname, self.parts.port, timeout=self.timeout)

    def _exchange(self, route: str, data: bytes | None) -> bytes:
        """One request on a pooled connection; an error status raises urllib's HTTPError, a failure to connect its
        URLError, as urlopen would. A kept-alive connection that the server closed meanwhile (its idle --timeout)
        is replaced once, without counting as a try."""
        with self.slots:
            try:
                connection, reused = self.idle.pop(), True
            except IndexError:  # none idle (the pop is atomic: other threads may take one meanwhile)
                connection, reused = self._connect(), False
            while True:
                try:
                    connection.request("GET" if data is None else "POST", self.parts.path.rstrip("/") + route,
                                       body=data, headers={"Content-Type": "application/json"})
                    response = connection.getresponse()
                    body = response.read()
                    break
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    connection.close()
                    if not reused:
                        raise
                    reused, connection = False, self._connect()
                except (TimeoutError, socket.timeout, ConnectionError, http.client.HTTPException):
                    connection.close()
                    raise
                except OSError as error:  # e.g. an unknown host name
                    connection.close()
                    raise urllib.error.URLError(error) from None
            if response.will_close:
                connection.close()
            else:
                self.idle.append(connection)
        if response.status >= 400:
            raise urllib.error.HTTPError(self.url + route, response.status, response.reason, response.headers,
                                         io.BytesIO(body))
        return body

    def _open(self, route: str, data: bytes | None, what: str):
        """The request in a thread, so that a slow server is reported after a few seconds instead of in silence."""
        result = {}

        def fetch():
            try:
                result["body"] = self._exchange(route, data)
            except BaseException as error:  # re-raised in the caller's thread
                result["error"] = error

        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        thread.join(self.notice_after)
        if thread.is_alive():
            print(f"remote reward: waiting for {self.url} to answer {what} (gives up after {self.timeout:g} s)",
                  file=sys.stderr, flush=True)
            thread.join()
        if "error" in result:
            raise result["error"]
        try:
            return json.loads(result["body"])
        except ValueError:
            body = result["body"][:80].decode(errors="replace")
            raise RuntimeError(f"server {self.url} answered {what} with something that is not JSON: {body!r}") from None

    def _request(self, route: str, payload: dict | None = None, what: str | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        what = what or route
        if data is not None and self.max_request_bytes is not None and len(data) > self.max_request_bytes:
            fewer = ("a groupwise reward sends whole groups: lower --group-size" if self.groupwise else
                     f"lower batch_size= (now {self.batch_size})")
            raise UserError(f"a {what} request is {len(data)} bytes, over the {self.max_request_bytes} that reward "
                            f"server {self.url} accepts: {fewer}, or restart the server with a larger --max-request-mb")
        reason, answered = "", False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._open(route, data, what)
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")
                if error.code not in RETRYABLE_STATUS:
                    try:
                        body = json.loads(body)["error"]
                    except (ValueError, KeyError, TypeError):  # not our server's JSON (an HTML page?): one line
                        body = " ".join(body.split())[:200]
                    raise RuntimeError(f"server {self.url} answered {error.code}: {body}") from None
                reason, answered = f"HTTP {error.code}", True
            except (TimeoutError, socket.timeout) as error:
                reason, answered = f"no answer within {self.timeout:g} s ({error})", True
            except (urllib.error.URLError, ConnectionError) as error:
                cause = getattr(error, "reason", error)
                if isinstance(cause, (TimeoutError, socket.timeout)):
                    reason, answered = f"no answer within {self.timeout:g} s", True
                else:
                    reason = str(cause)
            except http.client.HTTPException as error:  # something listens there, but does not speak HTTP
                raise RuntimeError(f"server {self.url} did not answer {what} in HTTP ({type(error).__name__}: "
                                   f"{error})") from None
        if answered:  # it accepted the connection: running, but stuck or too slow
            raise UserError(f"reward server {self.url} did not answer {what} ({reason}) after {self.retries + 1} "
                            f"tries; it is running but stuck or too slow (raise timeout=)")
        hint = ("it answered earlier in this run, so it has stopped; restart it" if self.reached else
                "start it with `python -m rewards.server --reward NAME --port PORT`")
        raise UserError(f"reward server {self.url} is not reachable ({reason}) after {self.retries + 1} tries; {hint}")

    def __call__(self, images: torch.Tensor, prompts: list[str], conditions=None) -> list[float]:
        # A groupwise reward must see its whole group in one request.
        step = len(prompts) if self.groupwise else self.batch_size
        scores = []
        for start in range(0, len(prompts), max(step, 1)):
            chunk = list(prompts[start:start + step])
            payload = {"prompts": chunk, "images": encode_images(images[start:start + step])}
            if conditions is not None:
                payload["conditions"] = [encode_images(torch.stack(c)) if c else [] for c in
                                         conditions[start:start + step]]
            answer = self._request("/score", payload, what=f"/score ({len(chunk)} images)")
            got = answer.get("scores") if isinstance(answer, dict) else None
            if not isinstance(got, list):  # a JSON object of scores would otherwise be read as its keys
                raise RuntimeError(f"server {self.url} answered /score with {_shown(answer)}, not an object with a "
                                   f"\"scores\" list")
            if len(got) != len(chunk):
                raise RuntimeError(f"server {self.url} answered /score with {len(got)} scores for {len(chunk)} images")
            for i, value in enumerate(got):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise RuntimeError(f"server {self.url} answered /score with {_shown(value)} as score {i}, not a "
                                       f"number")
            scores += got
        return scores
