"""Reference reward server (protocol in rewards/remote.py): wraps any reward this package can load.

    python -m rewards.server --reward pickscore --host 127.0.0.1 --port 8000 [--device cuda] [--dtype bfloat16]
"""

import json
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

from rewards import call_reward, load_rewards
from rewards.remote import decode_images


def make_server(reward, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
    """An HTTP server (one request at a time: reward models are not thread-safe) around a loaded Reward."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path != "/info":
                return self._send(404, {"error": f"unknown route {self.path}; use GET /info or POST /score"})
            self._send(200, {"name": reward.name, "groupwise": reward.groupwise,
                             "wants_conditions": reward.wants_conditions})

        def do_POST(self):
            if self.path != "/score":
                return self._send(404, {"error": f"unknown route {self.path}; use GET /info or POST /score"})
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                images, prompts = decode_images(request["images"]), list(request["prompts"])
                conditions = None
                if "conditions" in request:  # each sample's condition images, as (3, h, w) tensors
                    conditions = [list(decode_images(c)) if c else [] for c in request["conditions"]]
            except Exception as error:
                return self._send(400, {"error": f"malformed request: {error}"})
            try:
                scores = call_reward(reward, images, prompts, conditions)
            except Exception as error:  # reported to the client, which stops its run with this message
                return self._send(500, {"error": str(error)})
            self.server.requests_served += 1
            self._send(200, {"scores": scores.tolist()})

        def log_message(self, format, *args):  # keep the console for errors
            pass

    server = HTTPServer((host, port), Handler)
    server.requests_served = 0
    return server


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


if __name__ == "__main__":
    import tyro

    from common.utils import install_user_error_hook, quiet_libraries, resolve_dtype

    install_user_error_hook()
    try:  # a server environment may hold only what its reward needs
        quiet_libraries()
    except ImportError:
        pass
    args = tyro.cli(ServerArgs)
    device = torch.device(args.device)
    (reward,) = load_rewards([args.reward], device, resolve_dtype(args.dtype, device))
    server = make_server(reward, args.host, args.port)
    print(f"serving reward {reward.name!r} (groupwise={reward.groupwise}) on "
          f"http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
