"""Reference reward server (protocol in rewards/remote.py): wraps any reward this package can load.

    python -m rewards.server --reward pickscore --host 127.0.0.1 --port 8000 [--device cuda] [--dtype bfloat16]
        [--timeout 60] [--max-request-mb 512] [--max-pixels 67108864] [--concurrency 1]

One server can serve several training jobs, and the concurrent micro-batches of each, at once: every connection
(kept alive between requests, HTTP/1.1) is read and answered in its own thread, with no limit on their number, so an
idle or stalled client holds no one up; each request is answered on the connection it came on, so answers cannot
mix. The scoring itself runs --concurrency requests at a time (default 1: reward models are not thread-safe; raise
it for a reward that is, e.g. one that waits on an API). A connection silent for --timeout seconds is dropped; a
request body over --max-request-mb is refused with 413 before it is read, and one whose images hold more than
--max-pixels pixels together with 400, read from their headers before any is decoded (a small PNG can unpack to
gigabytes). A request whose client hangs up while it waits for its turn is dropped unscored, so that the retries
of a client that gave up on a busy server do not pile up behind work nobody waits for.
"""

import base64
import io
import json
import select
import socket
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from rewards import call_reward, load_rewards

DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_REQUEST_MB = 512
# 64 Mi pixels a request, its images together: 64 images of 1024x1024 or 16 of 2048x2048 (768 MiB as float32 RGB)
DEFAULT_MAX_PIXELS = 2**26


class BadRequest(ValueError):
    """A request that the server refuses with 400 and this message."""


def decode_capped(encoded: list, max_pixels: int) -> list:
    """The base64 images of one request as RGB PIL images, decoded only once their headers show that together they
    hold at most `max_pixels` pixels; a BadRequest naming the first image that cannot be read, or the total."""
    from PIL import Image

    opened = []
    for number, text in enumerate(encoded, start=1):
        try:  # reads the header only: the size, without the pixels
            opened.append(Image.open(io.BytesIO(base64.b64decode(text))))
        except Exception as error:  # not base64, not an image, or over PIL's own decompression-bomb limit
            raise BadRequest(f"image {number} of the request is not a readable image ({type(error).__name__}: "
                             f"{error})") from None
    pixels = sum(image.width * image.height for image in opened)
    if pixels > max_pixels:
        raise BadRequest(f"the request's {len(opened)} images hold {pixels} pixels, over this server's limit of "
                         f"{max_pixels} (--max-pixels): send fewer or smaller images per request")
    decoded = []
    for number, image in enumerate(opened, start=1):
        try:
            decoded.append(image.convert("RGB"))
        except Exception as error:  # a valid header over a corrupt or truncated data stream
            raise BadRequest(f"image {number} of the request cannot be decoded ({type(error).__name__}: {error})") \
                from None
    return decoded


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server that tracks its kept-alive connections (closed with it) and reports a dropped
    connection in one line prefixed by `label`. rewards/vlm_server.py serves through it too."""

    requests_served = 0
    label = "reward server"

    def __init__(self, *args, **kwargs):
        self.open_connections, self.connections_lock = set(), threading.Lock()
        super().__init__(*args, **kwargs)

    def server_close(self):
        # Kept-alive connections outlive `shutdown`: close them too, so that a stopped server answers no one.
        super().server_close()
        with self.connections_lock:
            for connection in self.open_connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address):
        # A client that stops reading or writing mid-request (socket timeout, reset): one line, not a traceback.
        print(f"{self.label}: dropped the connection from {client_address[0]}:{client_address[1]} "
              f"({sys.exc_info()[1]!r})", file=sys.stderr, flush=True)


class JsonHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive JSON requests and answers: `_send` an object, `_read_json` a POST body within
    `max_request_bytes` (set by the subclass, as is `timeout`, the socket's silence limit)."""

    protocol_version = "HTTP/1.1"  # keep-alive: a client's pooled connections carry one request after another
    max_request_bytes = DEFAULT_MAX_REQUEST_MB * 2**20

    def setup(self):
        super().setup()
        with self.server.connections_lock:
            self.server.open_connections.add(self.connection)

    def finish(self):
        with self.server.connections_lock:
            self.server.open_connections.discard(self.connection)
        super().finish()

    def _send(self, status: int, payload: dict):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _client_gone(self) -> bool:
        """Whether the client has closed (or reset) its connection: nobody would read an answer. A client waiting
        for its answer sends nothing, so a readable socket means end of file, unless it holds a next request."""
        poller = select.poll()  # not select.select, which fails for descriptors past 1024
        try:
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):  # reset, or closed by server_close
            return True

    def _take_turn(self, slots: threading.Semaphore) -> bool:
        """Acquire one of `slots` once the requests before this one are done; False, holding none, when the client
        hung up meanwhile: its request is dropped unscored (its retries would otherwise queue behind it)."""
        while not slots.acquire(timeout=0.1):
            if self._client_gone():
                break
        else:
            if not self._client_gone():
                return True
            slots.release()
        self.close_connection = True
        self.log_error("the client hung up while its request waited; dropped it unscored")
        return False

    def _read_json(self):
        """The POST body as parsed JSON, or None when it has been answered already (no or too large a length, a
        client that hung up, malformed JSON)."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0 or length > self.max_request_bytes:
            self.close_connection = True  # the body is left unread: the connection cannot carry another request
        if length < 0:
            return self._send(411, {"error": f"POST {self.path} needs a Content-Length header (the body's bytes)"})
        if length > self.max_request_bytes:  # answered without reading the body; the connection then closes
            return self._send(413, {"error": f"request body of {length} bytes exceeds this server's limit of "
                                             f"{self.max_request_bytes} (--max-request-mb); send fewer images per "
                                             f"request"})
        data = self.rfile.read(length)  # a client silent for `timeout` seconds raises TimeoutError: dropped
        if len(data) < length:  # the client hung up mid-body: nobody to answer
            self.close_connection = True
            return None
        try:
            return json.loads(data)
        except ValueError as error:
            return self._send(400, {"error": f"malformed request: {error}"})

    def log_message(self, format, *args):  # keep the console for errors
        pass

    def log_error(self, format, *args):  # a timed-out or malformed request: one line on the console
        print(f"{self.server.label}: {self.client_address[0]}:{self.client_address[1]}: {format % args}",
              file=sys.stderr, flush=True)


def make_server(reward, host: str = "127.0.0.1", port: int = 0, timeout: float = DEFAULT_TIMEOUT,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_MB * 2**20, concurrency: int = 1,
                max_pixels: int = DEFAULT_MAX_PIXELS) -> RewardServer:
    """An HTTP server around a loaded Reward: requests are read concurrently and scored `concurrency` at a time; a
    connection silent for `timeout` seconds is dropped, a body over `max_request_bytes` refused (413) unread, images
    over `max_pixels` together refused (400) undecoded, a request whose client hung up before its turn dropped."""
    score_slots, socket_timeout, limit = threading.BoundedSemaphore(concurrency), timeout, max_request_bytes

    class Handler(JsonHandler):
        timeout = socket_timeout  # set on the socket by StreamRequestHandler: bounds each read and write, not scoring
        max_request_bytes = limit

        def do_GET(self):
            if self.path != "/info":
                return self._send(404, {"error": f"unknown route {self.path}; use GET /info or POST /score"})
            self._send(200, {"name": reward.name, "groupwise": reward.groupwise,
                             "wants_conditions": reward.wants_conditions, "max_request_bytes": max_request_bytes})

        def do_POST(self):
            if self.path != "/score":
                return self._send(404, {"error": f"unknown route {self.path}; use GET /info or POST /score"})
            if (request := self._read_json()) is None:
                return
            try:
                prompts, counts = list(request["prompts"]), [len(request["images"])]
                if "conditions" in request:  # each sample's condition images
                    counts += [len(c) for c in request["conditions"]]
                everything = decode_capped([*request["images"], *(c for cs in request.get("conditions", ())
                                                                    for c in cs)], max_pixels)
                tensors = [torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 for image in everything]
                images, conditions = torch.stack(tensors[:counts[0]]), None
                if "conditions" in request:  # as lists of (3, h, w) tensors
                    ends = np.cumsum(counts).tolist()
                    conditions = [tensors[start:end] for start, end in zip(ends, ends[1:])]
            except BadRequest as error:
                return self._send(400, {"error": str(error)})
            except Exception as error:
                return self._send(400, {"error": f"malformed request: {error}"})
            if not self._take_turn(score_slots):
                return
            try:
                scores = call_reward(reward, images, prompts, conditions)
                with self.server.connections_lock:
                    self.server.requests_served += 1
            except Exception as error:  # reported to the client, which stops its run with this message
                return self._send(500, {"error": str(error)})
            finally:
                score_slots.release()
            self._send(200, {"scores": scores.tolist()})

    return RewardServer((host, port), Handler)


@dataclass
class ServerArgs:
    reward: str
    """the reward to serve, a SPEC as for training (NAME[:WEIGHT][,KEY=VALUE...] or MODULE:ATTR); weight unused"""
    host: str = "127.0.0.1"
    """address to listen on (0.0.0.0 to accept other machines)"""
    port: int = 8000
    """port to listen on (0: any free port, printed at start)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """device of the reward model"""
    dtype: str = "float32"
    """dtype of the reward model: float32, bfloat16, float16"""
    timeout: float = DEFAULT_TIMEOUT
    """seconds a connection may stay silent (while its request is read or its answer sent) before it is dropped, so
    that a stalled client holds nothing; the time spent scoring does not count"""
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB
    """largest request body, in MiB: a larger one is refused (413) before it is read; clients learn the limit from
    /info and refuse a larger request themselves, naming batch_size="""
    max_pixels: int = DEFAULT_MAX_PIXELS
    """most pixels one request's images (and condition images) may hold together: more is refused (400) from their
    headers, before anything is decoded"""
    concurrency: int = 1
    """requests scored at once (connections are read and answered concurrently whatever this is); above 1 only for
    a reward that is thread-safe"""


if __name__ == "__main__":
    import math

    import tyro

    from common.utils import UserError, install_user_error_hook, quiet_libraries, resolve_dtype

    install_user_error_hook()
    try:  # a server environment may hold only what its reward needs
        quiet_libraries()
    except ImportError:
        pass
    args = tyro.cli(ServerArgs)
    for flag, value in (("--timeout", args.timeout), ("--max-request-mb", args.max_request_mb)):
        if not 0 < value < math.inf:
            raise UserError(f"{flag} must be a positive number, got {value}")
    for flag, value in (("--concurrency", args.concurrency), ("--max-pixels", args.max_pixels)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    device = torch.device(args.device)
    (reward,) = load_rewards([args.reward], device, resolve_dtype(args.dtype, device))
    try:
        server = make_server(reward, args.host, args.port, args.timeout, int(args.max_request_mb * 2**20),
                             args.concurrency, args.max_pixels)
    except OSError as error:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({error.strerror or error}): another server may "
                        f"be running there (jobs can share one: give them all its url=), or choose another --port") \
            from None
    print(f"serving reward {reward.name!r} (groupwise={reward.groupwise}) on "
          f"http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
