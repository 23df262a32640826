"""A small OpenAI-compatible chat-completions server for a Qwen2-VL or Qwen2.5-VL checkpoint, answering with the
real top log-probabilities of the model's next token: what `vlm_judge` (rewards/vlm_judge.py) asks. It is the
test suite's judge (a tiny random model, `build_tiny_judge`) and works for a small real one on one machine; a real
judge at scale is served by vLLM (`vllm serve Qwen/Qwen2.5-VL-7B-Instruct ...`, docs/rewards.md), which speaks
the same protocol.

    python -m rewards.vlm_server --model-path Qwen/Qwen2.5-VL-3B-Instruct --port 8000 [--device cuda]
        [--dtype bfloat16] [--max-logprobs 20] [--max-pixels 67108864] [--served-model-name NAME]

Routes (the subset of the OpenAI API a judge needs): GET /v1/models -> {"object": "list", "data": [{"id": NAME,
"object": "model"}]}; POST /v1/chat/completions with "messages" (text and `image_url` parts; images as data URLs),
"max_tokens": 1, "logprobs": true, "top_logprobs": K -> one choice whose "logprobs" {"content": [{"token",
"logprob", "bytes", "top_logprobs": [K of those]}]} are the log-softmax of the model's logits for the token after
the chat template's assistant prefix (greedy: "message" holds the most probable token). Only one generated token
is supported (max_tokens 1): a judge needs no more. Requests are read concurrently and the model runs one request
at a time; a request whose client hangs up while it waits is dropped unanswered. A request whose images hold more
than --max-pixels pixels together is refused with 400 from their headers, before any is decoded, and so is one
with an image that cannot be read. The image processor is transformers' PIL one (no torchvision needed).
"""

import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rewards.server import (DEFAULT_MAX_PIXELS, DEFAULT_MAX_REQUEST_MB, DEFAULT_TIMEOUT, BadRequest, JsonHandler,
                            RewardServer, decode_capped)

# A compact Qwen2-VL chat template (the real checkpoints ship their own): image parts become
# <|vision_start|><|image_pad|><|vision_end|>, then the text, then the assistant's turn.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image_url' or part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_judge(folder, seed: int = 17, head_dim: int = 16) -> None:
    """Save a random 2-layer Qwen2-VL (1-block vision tower) with a byte-level BPE tokenizer in which "Yes", "No",
    "yes", "no" and their space-prefixed forms are single tokens, as in the real vocabulary, and the PIL image
    processor at 4 to 16 vision tokens per image. The weights are drawn wider than a real init (initializer_range
    0.5) so that the next-token distribution is far from uniform and P(yes) differs between images. The language
    model has 2 attention heads of `head_dim` (vLLM's CPU attention takes 32 and up). The default seed is one whose
    answer to vlm_judge's load-time test question has a yes or no among its top 2 tokens (at head_dim 16; its top
    11 at 32), as the judge requires: most random draws have none in their top 20."""
    from transformers import Qwen2Tokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from common.models.tiny_parts import _byte_level_bpe

    words = ["user", "assistant", *(p + w for p in ("", "Ġ") for w in ("Yes", "No", "yes", "no"))]
    vocab, merges = _byte_level_bpe(words)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    for token in specials:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=specials[1:],
                               model_max_length=4096)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(seed)
    rotary = head_dim // 2  # M-RoPE splits a head's rotary frequencies 2:3:3 over time, height and width
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=2 * head_dim, intermediate_size=4 * head_dim,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=4096, initializer_range=0.5,
                         rope_scaling={"type": "mrope", "mrope_section": [rotary // 4, 3 * rotary // 8,
                                                                          3 * rotary // 8]},
                         bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                         pad_token_id=ids("<|endoftext|>")),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=2 * head_dim, num_heads=2, mlp_ratio=2,
                           initializer_range=0.5),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        initializer_range=0.5,
    ))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    # 28 = patch 14 x merge 2: one image token per 28x28 pixels
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28).save_pretrained(folder)


class Judge:
    """The model, tokenizer and image processor of a Qwen2-VL-family folder, and `top_logprobs(messages, k)`."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

        self.device = torch.device(device)
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        if not self.tokenizer.chat_template:  # real checkpoints may keep it beside the processor
            for name in ("chat_template.jinja", "chat_template.json"):
                if (file := Path(model_path) / name).exists():
                    text = file.read_text()
                    self.tokenizer.chat_template = json.loads(text)["chat_template"] if name.endswith("json") else text
                    break
        self.image_pad = "<|image_pad|>"
        self.lock = threading.Lock()

    def inputs(self, messages: list[dict], max_pixels: float = math.inf) -> dict:
        """Model inputs for `messages`: the chat template with the generation prompt, each image's one
        <|image_pad|> repeated as many times as the merged vision tokens it becomes, the images' pixels, and the
        token types (1: image) that transformers' processor would add. Images over `max_pixels` together, or one
        that cannot be read, are a BadRequest."""
        urls = []
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"]
                    if not url.startswith("data:") or ";base64," not in url:
                        raise ValueError("image_url must be a data URL (data:image/png;base64,...)")
                    urls.append(url.split(",", 1)[1])
        images = decode_capped(urls, max_pixels)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        extra = {}
        if images:
            vision = self.image_processor(images=images, return_tensors="pt")
            merge = self.image_processor.merge_size ** 2
            pieces = text.split(self.image_pad)
            if len(pieces) != len(images) + 1:
                raise ValueError(f"the chat template placed {len(pieces) - 1} images for the {len(images)} given")
            text = pieces[0] + "".join(self.image_pad * (int(grid.prod()) // merge) + piece
                                       for grid, piece in zip(vision["image_grid_thw"], pieces[1:]))
            extra = {"pixel_values": vision["pixel_values"].to(self.device, self.model.dtype),
                     "image_grid_thw": vision["image_grid_thw"].to(self.device)}
        encoded = self.tokenizer(text, return_tensors="pt")
        ids = encoded["input_ids"].to(self.device)
        if images:  # which positions are image tokens (1) and which text (0): what M-RoPE's positions follow
            extra["mm_token_type_ids"] = (ids == self.tokenizer.convert_tokens_to_ids(self.image_pad)).long()
        return {"input_ids": ids, "attention_mask": encoded["attention_mask"].to(self.device), **extra}

    def top_logprobs(self, messages: list[dict], k: int, max_pixels: float = math.inf,
                     take_turn=None) -> list[tuple[str, float]] | None:
        """The k most probable next tokens after the assistant prefix, as (text, log-probability), best first.
        The model runs one call at a time: `take_turn(lock)` acquires its lock, or returns False to give up (the
        server's, when the client hung up while it waited), and then the answer is None."""
        inputs = self.inputs(messages, max_pixels)
        if take_turn is None:
            self.lock.acquire()
        elif not take_turn(self.lock):
            return None
        try:
            with torch.no_grad():
                logits = self.model(**inputs).logits[0, -1]
        finally:
            self.lock.release()
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logprobs.topk(min(k, len(logprobs)))
        return [(self.tokenizer.decode([i]), v) for i, v in zip(ids.tolist(), values.tolist())]


def make_judge_server(judge: Judge, name: str, host: str = "127.0.0.1", port: int = 0,
                      max_logprobs: int = 20, timeout: float = DEFAULT_TIMEOUT,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_MB * 2**20,
                      max_pixels: int = DEFAULT_MAX_PIXELS) -> RewardServer:
    """An OpenAI-compatible server of `judge` named `name` (the module docstring says what it answers)."""
    socket_timeout, limit = timeout, max_request_bytes

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    class Handler(JsonHandler):
        timeout, max_request_bytes = socket_timeout, limit

        def _error(self, status: int, message: str):  # OpenAI's error shape
            self._send(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

        def do_GET(self):
            if self.path != "/v1/models":
                return self._error(404, f"unknown route {self.path}; use GET /v1/models or POST /v1/chat/completions")
            self._send(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "flow-rl"}]})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._error(404, f"unknown route {self.path}; use POST /v1/chat/completions")
            if (request := self._read_json()) is None:
                return
            if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
                return self._error(400, "the request needs \"messages\", a list")
            if request.get("model", name) != name:
                return self._error(404, f"the model {request.get('model')!r} does not exist; this server has {name!r}")
            if request.get("max_tokens", 1) != 1:
                return self._error(400, "this server generates one token: give max_tokens 1")
            k = request.get("top_logprobs", 0) if request.get("logprobs") else 0
            if type(k) is not int or not 0 <= k <= max_logprobs:
                return self._error(400, f"top_logprobs must be an integer from 0 to {max_logprobs} (--max-logprobs)")
            try:
                top = judge.top_logprobs(request["messages"], max(k, 1), max_pixels, self._take_turn)
            except BadRequest as error:
                return self._error(400, str(error))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                return self._error(400, f"malformed messages: {type(error).__name__}: {error}")
            except Exception as error:  # answered, so that the client reports it instead of a dropped connection
                return self._error(500, f"the judge failed: {type(error).__name__}: {error}")
            if top is None:  # the client hung up while its request waited
                return
            with self.server.connections_lock:
                self.server.requests_served += 1
            choice = {"index": 0, "message": {"role": "assistant", "content": top[0][0]}, "finish_reason": "length",
                      "logprobs": None}
            if request.get("logprobs"):
                choice["logprobs"] = {"content": [{**entry(*top[0]), "top_logprobs": [entry(*t) for t in top[:k]]}]}
            self._send(200, {"id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion",
                             "created": int(time.time()), "model": name, "choices": [choice]})

    server = RewardServer((host, port), Handler)
    server.label = "judge server"
    return server


@dataclass
class JudgeServerArgs:
    model_path: str
    """a Qwen2-VL or Qwen2.5-VL checkpoint folder or hub id (`tiny`: build a tiny random one, for tests)"""
    served_model_name: str | None = None
    """the name clients give as model= (unset: --model-path)"""
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "float32"
    """float32, bfloat16, float16"""
    max_logprobs: int = 20
    """the largest top_logprobs a request may ask (vLLM's default is 20 too)"""
    timeout: float = DEFAULT_TIMEOUT
    """seconds a connection may stay silent before it is dropped"""
    max_pixels: int = DEFAULT_MAX_PIXELS
    """most pixels one request's images may hold together: more is refused (400) from their headers, undecoded"""


if __name__ == "__main__":
    import tempfile

    import tyro

    from common.utils import UserError, install_user_error_hook, quiet_libraries, resolve_dtype

    install_user_error_hook()
    quiet_libraries()
    args = tyro.cli(JudgeServerArgs)
    if args.max_logprobs < 1 or args.max_pixels < 1 or not 0 < args.timeout < math.inf:
        raise UserError("--max-logprobs and --max-pixels must be at least 1 and --timeout a positive number")
    path = args.model_path
    if path == "tiny":
        tiny_folder = tempfile.TemporaryDirectory(prefix="tiny-judge-")  # removed when the server exits
        path = tiny_folder.name
        build_tiny_judge(path)
    device = torch.device(args.device)
    judge = Judge(path, args.device, resolve_dtype(args.dtype, device))
    name = args.served_model_name or args.model_path
    try:
        server = make_judge_server(judge, name, args.host, args.port, args.max_logprobs, args.timeout,
                                   max_pixels=args.max_pixels)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({error.strerror or error}); choose another "
                        f"--port") from None
    print(f"serving judge {name!r} on http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
