"""Remote rewards over HTTP, so that rewards with conflicting dependencies (GenEval's mmdet, HPSv2,
ImageReward, VLM judges) run in their own environment or on other machines. Standard library only.

Server (rewards/server.py; any reward this package loads, built-in or MODULE:ATTR; run it where that reward's
packages are installed):
    python -m rewards.server --reward pickscore --host 127.0.0.1 --port 8000 [--device cuda] [--dtype bfloat16]
Client, in the training command:
    --reward remote:1.0,url=http://127.0.0.1:8000[,timeout=120,retries=3,batch_size=32,name=...]

Protocol: GET /info -> {"name", "groupwise", "wants_conditions"}; POST /score {"prompts": [...], "images":
[base64 PNG, ...]} (plus "conditions": [[base64 PNG, ...] per sample] for a reward that wants them) -> {"scores":
[...]} or, when the reward fails, status 500 {"error": "..."}. Images travel as 8-bit PNG
(lossless for the round(255·x) images that the built-in rewards score anyway).
"""

import base64
import io
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

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


class RemoteReward:
    """Client of a reward server. Connection failures and timeouts are retried with exponential backoff
    (1 s, 2 s, 4 s, ...); a server that stays unreachable stops the run with a UserError naming its URL, and one
    that answered /info but then hangs is reported as stuck, not unreachable. A request still waiting after
    `notice_after` seconds prints one line saying what it waits for. The server's name and groupwise flag are read
    once, at load, so a down server fails before training."""

    def __init__(self, url: str = "", timeout: str = "120", retries: str = "3", batch_size: str = "32",
                 backoff: str = "1.0", notice_after: str = "5"):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"the remote reward needs url=http://HOST:PORT (got {url!r})")
        try:
            self.timeout, self.retries = float(timeout), int(retries)
            self.batch_size, self.backoff = int(batch_size), float(backoff)
            self.notice_after = float(notice_after)
        except ValueError:
            raise UserError("remote reward options timeout/backoff must be numbers and retries/batch_size "
                            "integers") from None
        self.url, self.reached = url.rstrip("/"), False
        info = self._request("/info")
        self.reached = True  # from now on a refused connection means the server went down
        self.name, self.groupwise = str(info["name"]), bool(info["groupwise"])
        self.wants_conditions = bool(info.get("wants_conditions", False))  # servers before conditions omit it

    def _open(self, request, what: str):
        """urlopen in a thread, so that a slow server is reported after a few seconds instead of in silence."""
        result = {}

        def fetch():
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    result["body"] = response.read()
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
        return json.loads(result["body"])

    def _request(self, route: str, payload: dict | None = None, what: str | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        what = what or route
        reason, answered = "", False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._open(request, what)
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")
                if error.code not in RETRYABLE_STATUS:
                    try:
                        body = json.loads(body)["error"]
                    except (ValueError, KeyError, TypeError):
                        pass
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
            scores += answer["scores"]
        return scores
