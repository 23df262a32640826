"""A vision-language model as a yes/no judge, asked over an OpenAI-compatible chat-completions endpoint (the API
that `vllm serve` provides; rewards/vlm_server.py is a small one of this package's own). Standard library only.

    --reward vlm_judge,url=http://HOST:PORT,model=NAME[,question=...][,question_file=PATH][,conditions=true]
             [,top_logprobs=20,timeout=120,retries=3,backoff=1.0,connections=8,name=...]

Each sample is one request: the image (a PNG data URL; for an edit, `conditions=true`, the sample's condition
images first, then the result) and the question, the template with `{prompt}` replaced by the sample's prompt,
asking for one token with its top log-probabilities (`max_tokens=1, logprobs=true, top_logprobs=K,
temperature=0`). The score is

    P(yes) = Σ_{t ∈ yes} exp(lp_t) / (Σ_{t ∈ yes} exp(lp_t) + Σ_{t ∈ no} exp(lp_t))

over the returned top-K entries whose token, stripped of whitespace and lower-cased, is "yes" (yes) or "no" (no):
"Yes", " yes" and "YES" all count, each token id once as the server lists it. The normalisation drops the mass of
every other token, so the score is the judge's answer given that it answers yes or no. A side absent from the top K
counts 0 (its mass is below the K-th entry's); when neither appears the score is 0.5 (no evidence either way), and
the judge prints one line the first time this happens, since a judge that rarely answers yes or no needs another
question or a larger top_logprobs. Requests run `connections` at a time on pooled keep-alive connections, with the
retries, backoff and one-line errors of rewards/client.py (`thread_safe`: training scores while it rolls out).
At load the judge lists the server's models (GET /v1/models: model= may be left out when it serves one) and asks
one text-only question, so that a server that is down, serves another model or answers without log-probabilities
stops the run before training, in one line naming the URL.
"""

import json
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.utils import UserError
from rewards.client import PooledClient, shown
from rewards.remote import encode_images

DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'
DEFAULT_EDIT_QUESTION = ('The first image is the original and the last one the edited image. Does the edited image '
                         'follow the instruction "{prompt}"? Answer yes or no.')
PROBE_QUESTION = "Is the sky usually blue on a clear day? Answer yes or no."


def p_yes(top_logprobs: list[tuple[str, float]]) -> float | None:
    """The normalised P(yes) of (token, log-probability) pairs, computed in log space (no underflow); None when no
    token is a yes or a no."""
    sides = {"yes": [], "no": []}
    for token, logprob in top_logprobs:
        side = sides.get(token.strip().lower())
        if side is not None:
            side.append(logprob)
    if not sides["yes"] and not sides["no"]:
        return None
    if not sides["no"]:
        return 1.0
    if not sides["yes"]:
        return 0.0
    log_yes, log_no = (max(v) + math.log(sum(math.exp(x - max(v)) for x in v)) for v in sides.values())
    return 1.0 / (1.0 + math.exp(log_no - log_yes)) if log_no - log_yes < 700 else 0.0


class VlmJudge:
    """P(yes) of a VLM served over an OpenAI-compatible API, one request per sample (see the module docstring)."""

    thread_safe = True  # common.scoring may call it from several threads at once; the pool bounds the requests

    def __init__(self, url: str = "", model: str = "", question: str = "", question_file: str = "",
                 conditions: str = "false", top_logprobs: str = "20", timeout: str = "120", retries: str = "3",
                 backoff: str = "1.0", notice_after: str = "5", connections: str = "8"):
        self.client = PooledClient(url, "the vlm_judge reward", "judge server",
                                   "start it (e.g. `vllm serve MODEL --port PORT`, docs/rewards.md)", "vlm judge",
                                   timeout, retries, backoff, notice_after, connections)
        self.url = self.client.url
        if conditions not in ("true", "false"):
            raise UserError(f"vlm_judge option conditions= takes true or false, got {conditions!r}")
        self.wants_conditions = conditions == "true"
        try:
            self.top_logprobs = int(top_logprobs)
        except ValueError:
            self.top_logprobs = 0
        if self.top_logprobs < 1:
            raise UserError(f"vlm_judge option top_logprobs= must be a positive integer, got {top_logprobs!r}")
        if question and question_file:
            raise UserError("vlm_judge takes question= or question_file=, not both")
        if question_file:
            try:
                question = Path(question_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(f"vlm_judge question_file={question_file}: cannot read it ({error})") from None
        self.question = question or (DEFAULT_EDIT_QUESTION if self.wants_conditions else DEFAULT_QUESTION)
        if "{prompt}" not in self.question:
            raise UserError(f"the vlm_judge question {self.question!r} has no {{prompt}} to put the prompt in")
        # A url that already ends in /v1 (as OpenAI clients take it) is used as it is.
        self.api = "" if self.client.parts.path.rstrip("/").endswith("/v1") else "/v1"
        self.neither, self.lock = 0, threading.Lock()
        try:
            listed = self.client.request(self.api + "/models")
        except RuntimeError as error:
            raise UserError(f"{error} (is it an OpenAI-compatible server? GET {self.api}/models failed)") from None
        self.client.reached = True  # from now on a refused connection means the server went down
        served = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)] \
            if isinstance(listed, dict) and isinstance(listed.get("data"), list) else None
        if not served or not all(isinstance(m, str) for m in served):
            raise UserError(f"judge server {self.url} answered {self.api}/models with {shown(listed)}, not a list of "
                            f"models (is it an OpenAI-compatible server?)")
        if not model and len(served) > 1:
            raise UserError(f"judge server {self.url} serves several models ({', '.join(served)}): choose one with "
                            f"model=")
        if model and model not in served:
            raise UserError(f"judge server {self.url} does not serve model {model!r}; it serves: {', '.join(served)}")
        self.model = model or served[0]
        try:
            self._ask_one([], PROBE_QUESTION)
        except RuntimeError as error:  # e.g. vLLM's 400 for a top_logprobs over its --max-logprobs
            raise UserError(f"judge server {self.url} refused a test question: {error}") from None

    def _ask_one(self, images: list[str], question: str) -> float | None:
        """P(yes) for one question about the PNG (base64) `images`, in order; None when neither token came back."""
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}} for image in images]
        payload = {"model": self.model, "messages": [{"role": "user", "content": content + [
            {"type": "text", "text": question}]}], "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": self.top_logprobs}
        answer = self.client.request(self.api + "/chat/completions", json.dumps(payload).encode(),
                                     what=f"{self.api}/chat/completions")
        try:
            top = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            pairs = [(entry["token"], float(entry["logprob"])) for entry in top]
        except (KeyError, IndexError, TypeError, ValueError):
            top = None
        if not top or any(not isinstance(t, str) or math.isnan(lp) for t, lp in pairs):
            raise UserError(f"judge server {self.url} answered without top log-probabilities ({shown(answer)}); "
                            f"vlm_judge needs \"logprobs\" with \"top_logprobs\" (vLLM: serve with --max-logprobs of "
                            f"at least top_logprobs={self.top_logprobs})")
        return p_yes(pairs)

    def ask(self, images, questions: list[str], conditions=None) -> list[float]:
        """P(yes) for each (image, question) pair, `connections` requests at a time; `conditions[i]`: the
        condition images shown before image i (each (3, h, w) in [0, 1])."""
        encoded = encode_images(images)
        shown_images = [[encode_images(c[None])[0] for c in (conditions[i] if conditions is not None else ())]
                        + [image] for i, image in enumerate(encoded)]
        with ThreadPoolExecutor(max_workers=min(self.client.connections, len(questions)) or 1) as pool:
            answers = list(pool.map(self._ask_one, shown_images, questions))
        missing = sum(a is None for a in answers)
        if missing:
            with self.lock:
                first, self.neither = self.neither == 0, self.neither + missing
            if first:
                print(f"vlm judge: neither yes nor no among the top {self.top_logprobs} tokens of {self.url}'s answer "
                      f"({missing} of {len(answers)} samples); scored 0.5 (ask for one word, or raise top_logprobs=)",
                      file=sys.stderr, flush=True)
        return [0.5 if a is None else a for a in answers]

    def __call__(self, images, prompts: list[str], conditions=None) -> list[float]:
        return self.ask(images, [self.question.replace("{prompt}", p) for p in prompts],
                        conditions if self.wants_conditions else None)

