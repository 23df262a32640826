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
rewards score anyway). The connection pool, retries and their errors: rewards/client.py.
"""

import base64
import io
import json

import numpy as np
import torch

from common.utils import UserError
from rewards.client import PooledClient, shown


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
    """Client of a reward server, over `rewards.client.PooledClient` (retries with backoff, pooled keep-alive
    connections, the one-line errors for a server that is down or stuck). The server's name and groupwise flag are
    read once, at load, so a down server, or something at the URL that is not a reward server, fails before
    training with one line. An answer to /score that is not one number per image is a RuntimeError naming the
    server. Thread-safe: up to `connections` requests are in flight at once, each on its own kept-alive connection."""

    thread_safe = True  # common.scoring may call it from several threads at once

    def __init__(self, url: str = "", timeout: str = "120", retries: str = "3", batch_size: str = "32",
                 backoff: str = "1.0", notice_after: str = "5", connections: str = "4"):
        self.client = PooledClient(url, "the remote reward", "reward server",
                                   "start it with `python -m rewards.server --reward NAME --port PORT`",
                                   "remote reward", timeout, retries, backoff, notice_after, connections)
        try:
            self.batch_size = int(batch_size)
        except ValueError:
            raise UserError("the remote reward's option batch_size= must be an integer") from None
        self.url, self.max_request_bytes, self.groupwise = self.client.url, None, False
        not_a_server = "(is it a reward server? python -m rewards.server)"
        try:
            info = self._request("/info")
        except RuntimeError as error:  # it answered, but not as a reward server does
            raise UserError(f"{error} {not_a_server}") from None
        self.client.reached = True  # from now on a refused connection means the server went down
        # "wants_conditions" and "max_request_bytes" are optional: older servers omit them
        if not (isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("groupwise"), bool)
                and isinstance(info.get("wants_conditions", False), bool)
                and type(info.get("max_request_bytes", 1)) is int and info.get("max_request_bytes", 1) > 0):
            raise UserError(f"server {self.url} answered /info with {shown(info)}, not an object with \"name\" (a "
                            f"string), \"groupwise\" (true or false) and optional \"wants_conditions\" (true or "
                            f"false), \"max_request_bytes\" (a positive integer) {not_a_server}")
        self.name, self.groupwise = info["name"], info["groupwise"]
        self.wants_conditions = info.get("wants_conditions", False)
        self.max_request_bytes = info.get("max_request_bytes")

    def _request(self, route: str, payload: dict | None = None, what: str | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        what = what or route
        if data is not None and self.max_request_bytes is not None and len(data) > self.max_request_bytes:
            fewer = ("a groupwise reward sends whole groups: lower --group-size" if self.groupwise else
                     f"lower batch_size= (now {self.batch_size})")
            raise UserError(f"a {what} request is {len(data)} bytes, over the {self.max_request_bytes} that reward "
                            f"server {self.url} accepts: {fewer}, or restart the server with a larger --max-request-mb")
        return self.client.request(route, data, what)

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
                raise RuntimeError(f"server {self.url} answered /score with {shown(answer)}, not an object with a "
                                   f"\"scores\" list")
            if len(got) != len(chunk):
                raise RuntimeError(f"server {self.url} answered /score with {len(got)} scores for {len(chunk)} images")
            for i, value in enumerate(got):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise RuntimeError(f"server {self.url} answered /score with {shown(value)} as score {i}, not a "
                                       f"number")
            scores += got
        return scores
