"""A vision-language model as a yes/no judge, asked over an OpenAI-compatible chat-completions endpoint (the API
that `vllm serve` provides; rewards/vlm_server.py is a small one of this package's own). Standard library only.

    --reward vlm_judge,url=http://HOST:PORT,model=NAME[,question=...][,question_file=PATH][,conditions=true]
             [,top_logprobs=20,max_neither=64,timeout=120,retries=3,backoff=1.0,connections=8,name=...]

Each sample is one request: the image (a PNG data URL; for an edit, `conditions=true`, the sample's condition
images first, then the result) and the question, the template with `{prompt}` replaced by the sample's prompt,
asking for one token with its top log-probabilities (`max_tokens=1, logprobs=true, top_logprobs=K,
temperature=0`). The score is

    P(yes) = Σ_{t ∈ yes} exp(lp_t) / (Σ_{t ∈ yes} exp(lp_t) + Σ_{t ∈ no} exp(lp_t))

over the returned top-K entries whose token, stripped of whitespace and lower-cased, is "yes" (yes) or "no" (no):
"Yes", " yes" and "YES" all count, each token id once as the server lists it. The normalisation drops the mass of
every other token, so the score is the judge's answer given that it answers yes or no. A side absent from the top K
counts 0 (its mass is below the K-th entry's); when neither appears the score is imputed as 0.5 (no evidence either
way): the judge prints one line the first time, marks the sample in its `imputed` column (1, else 0: each epoch's
share is logged as reward_<name>_imputed_mean) and stops the run, as a NaN reward does, once `max_neither` answers
in a row carried neither (a judge that stopped answering yes or no gives constant rewards, which train nothing).
Requests run `connections` at a time on pooled keep-alive connections, with the retries, backoff and one-line
errors of rewards/client.py (`thread_safe`: training scores while it rolls out).
At load the judge lists the server's models (GET /v1/models: model= may be left out when it serves one) and asks
one text-only question, so that a server that is down, serves another model, answers without log-probabilities or
without a yes or no among them stops the run before training, in one line naming the URL. Every later answer must
name the model that answered that question: another model answering mid-run (a restarted server, a load balancer)
stops the run instead of mixing two judges' scores.
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
                 conditions: str = "false", top_logprobs: str = "20", max_neither: str = "64", timeout: str = "120",
                 retries: str = "3", backoff: str = "1.0", notice_after: str = "5", connections: str = "8"):
        self.client = PooledClient(url, "the vlm_judge reward", "judge server",
                                   "start it (e.g. `vllm serve MODEL --port PORT`, docs/rewards.md)", "vlm judge",
                                   timeout, retries, backoff, notice_after, connections)
        self.url = self.client.url
        if conditions not in ("true", "false"):
            raise UserError(f"vlm_judge option conditions= takes true or false, got {conditions!r}")
        self.wants_conditions = conditions == "true"
        for option, text in (("top_logprobs", top_logprobs), ("max_neither", max_neither)):
            try:
                setattr(self, option, int(text))
            except ValueError:
                setattr(self, option, 0)
            if getattr(self, option) < 1:
                raise UserError(f"vlm_judge option {option}= must be a positive integer, got {text!r}")
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
        self.neither, self.neither_in_a_row, self.lock = 0, 0, threading.Lock()
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
        # The "model" of the test question's answer (None if the server omits it): every later answer must repeat it.
        self.answering, self.probing = None, True
        try:
            probe = self._ask_one([], PROBE_QUESTION)
        except RuntimeError as error:  # e.g. vLLM's 400 for a top_logprobs over its --max-logprobs
            raise UserError(f"judge server {self.url} refused a test question: {error}") from None
        self.probing = False
        if probe is None:
            raise UserError(f"judge server {self.url} ({self.model}) answered the test question {PROBE_QUESTION!r} "
                            f"with neither yes nor no among its top {self.top_logprobs} tokens: vlm_judge scores "
                            f"P(yes), so the judge must answer yes or no (use an instruction-tuned VLM, or raise "
                            f"top_logprobs= and the server's --max-logprobs)")

    def _ask_one(self, images: list[str], question: str) -> float | None:
        """P(yes) for one question about the PNG (base64) `images`, in order; None when neither token came back."""
        content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}} for image in images]
        payload = {"model": self.model, "messages": [{"role": "user", "content": content + [
            {"type": "text", "text": question}]}], "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": self.top_logprobs}
        answer = self.client.request(self.api + "/chat/completions", json.dumps(payload).encode(),
                                     what=f"{self.api}/chat/completions")
        answered_as = answer.get("model") if isinstance(answer, dict) else None
        if self.probing:
            self.answering = answered_as
        elif answered_as != self.answering:
            raise UserError(f"judge server {self.url} answered as model {answered_as!r}, but as {self.answering!r} "
                            f"at load: another model answers there now (a restarted server, a load balancer?); "
                            f"stopping rather than mixing two judges' scores")
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

    def _ask_sample(self, images: list[str], question: str) -> float | None:
        try:
            return self._ask_one(images, question)
        except RuntimeError as error:  # the server refused this request (e.g. 400 for an image over its pixel cap)
            raise UserError(f"judge server {self.url} refused a sample's question: {error}") from None

    def ask(self, images, questions: list[str], conditions=None) -> list[float | None]:
        """P(yes) for each (image, question) pair, `connections` requests at a time, None where the answer carried
        neither yes nor no (the caller imputes it); `conditions[i]`: the condition images shown before image i
        (each (3, h, w) in [0, 1]). Stops the run once `max_neither` answers in a row carried neither."""
        encoded = encode_images(images)
        shown_images = [[encode_images(c[None])[0] for c in (conditions[i] if conditions is not None else ())]
                        + [image] for i, image in enumerate(encoded)]
        with ThreadPoolExecutor(max_workers=min(self.client.connections, len(questions)) or 1) as pool:
            answers = list(pool.map(self._ask_sample, shown_images, questions))
        missing = sum(a is None for a in answers)
        with self.lock:
            first = self.neither == 0 and missing > 0
            self.neither += missing
            for answer in answers:
                self.neither_in_a_row = self.neither_in_a_row + 1 if answer is None else 0
                if self.neither_in_a_row >= self.max_neither:
                    raise UserError(f"judge server {self.url} ({self.model}) answered {self.neither_in_a_row} "
                                    f"questions in a row with neither yes nor no among its top {self.top_logprobs} "
                                    f"tokens: their rewards would be a constant 0.5, which trains nothing (ask for "
                                    f"one word, raise top_logprobs=, or check the server; max_neither= sets this "
                                    f"limit)")
        if first:
            print(f"vlm judge: neither yes nor no among the top {self.top_logprobs} tokens of {self.url}'s answer "
                  f"({missing} of {len(answers)} samples); scored 0.5 (ask for one word, or raise top_logprobs=); "
                  f"the share per epoch is logged as the reward's imputed column", file=sys.stderr, flush=True)
        return answers

    def __call__(self, images, prompts: list[str], conditions=None) -> dict:
        answers = self.ask(images, [self.question.replace("{prompt}", p) for p in prompts],
                           conditions if self.wants_conditions else None)
        return {"score": [0.5 if a is None else a for a in answers],
                "imputed": [float(a is None) for a in answers]}
