"""The HTTP client that the rewards served by other processes share (rewards/remote.py: this package's reward server;
rewards/vlm_judge.py: an OpenAI-compatible chat-completions server such as vLLM). Standard library only.

`PooledClient` keeps up to `connections` keep-alive connections and has at most that many requests in flight, so
that several threads (the training scripts' reward workers, a judge's concurrent questions) can send through one
client. Connection failures, timeouts and 502/503/504 are retried with exponential backoff (1 s, 2 s, 4 s, ...); a
server that stays unreachable is a UserError naming its URL, and one that accepted the connection but does not
answer in time is reported as stuck, not unreachable. A request still waiting after `notice_after` seconds prints
one line saying what it waits for.
"""

import http.client
import io
import json
import sys
import threading
import time
import urllib.error
import urllib.parse

from common.utils import UserError

RETRYABLE_STATUS = (502, 503, 504)


def shown(value) -> str:
    """A JSON value as the server sent it, cut short for an error line."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_url(url: str, needs: str) -> urllib.parse.SplitResult:
    """`url` split, or a UserError saying that `needs` (e.g. "the remote reward") needs url=http://HOST:PORT."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:  # such a port, or an unclosed "[" of an IPv6 address
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"{needs} needs url=http://HOST:PORT (got {url!r})")
    return parts


def _error_text(body: str) -> str:
    """The message of an error answer: this package's {"error": "..."}, OpenAI's {"error": {"message": ...}},
    vLLM's older {"message": ...}; anything else (an HTML page?) as one line."""
    try:
        answer = json.loads(body)
        error = answer.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(answer.get("message"), str):
            return answer["message"]
    except (ValueError, AttributeError):
        pass
    return " ".join(body.split())[:200]


class PooledClient:
    """JSON requests to one server (`request`), thread-safe. `server` names it in errors ("reward server"),
    `start_hint` says how to start it, `notice` prefixes the waiting line ("remote reward")."""

    def __init__(self, url: str, needs: str, server: str, start_hint: str, notice: str, timeout: str = "120",
                 retries: str = "3", backoff: str = "1.0", notice_after: str = "5", connections: str = "4"):
        self.parts = parse_url(url, needs)
        try:
            self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
            self.notice_after, self.connections = float(notice_after), int(connections)
        except ValueError:
            raise UserError(f"{needs}'s options timeout/backoff/notice_after must be numbers and retries/connections "
                            f"integers") from None
        if self.connections < 1:
            raise UserError(f"{needs}'s option connections= must be at least 1, got {self.connections}")
        self.server, self.start_hint, self.notice = server, start_hint, notice
        self.idle, self.slots = [], threading.BoundedSemaphore(self.connections)
        self.url, self.reached = url.rstrip("/"), False  # reached: set by the owner once the server has answered

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
        return kind(self.parts.hostname, self.parts.port, timeout=self.timeout)

    def _exchange(self, route: str, data: bytes | None) -> bytes:
        """One request on a pooled connection; an error status raises urllib's HTTPError, a failure to connect its
        URLError, as urlopen would. A kept-alive connection that the server closed meanwhile (its idle timeout)
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
                except (TimeoutError, ConnectionError, http.client.HTTPException):
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
            print(f"{self.notice}: waiting for {self.url} to answer {what} (gives up after {self.timeout:g} s)",
                  file=sys.stderr, flush=True)
            thread.join()
        if "error" in result:
            raise result["error"]
        try:
            return json.loads(result["body"])
        except ValueError:
            body = result["body"][:80].decode(errors="replace")
            raise RuntimeError(f"server {self.url} answered {what} with something that is not JSON: {body!r}") from None

    def request(self, route: str, data: bytes | None = None, what: str | None = None):
        """The parsed JSON answer to GET `route` (data None) or POST `route` with the JSON bytes `data`. An error
        status other than 502/503/504 is a RuntimeError with the server's message (a reward's caller turns it into
        one line naming the reward); an unreachable or stuck server a UserError, after the retries."""
        what = what or route
        reason, answered = "", False
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._open(route, data, what)
            except urllib.error.HTTPError as error:
                body = error.read().decode(errors="replace")
                if error.code not in RETRYABLE_STATUS:
                    raise RuntimeError(f"server {self.url} answered {error.code}: {_error_text(body)}") from None
                reason, answered = f"HTTP {error.code}", True
            except TimeoutError as error:  # socket.timeout is TimeoutError
                reason, answered = f"no answer within {self.timeout:g} s ({error})", True
            except (urllib.error.URLError, ConnectionError) as error:
                cause = getattr(error, "reason", error)
                if isinstance(cause, TimeoutError):
                    reason, answered = f"no answer within {self.timeout:g} s", True
                else:
                    reason = str(cause)
            except http.client.HTTPException as error:  # something listens there, but does not speak HTTP
                raise RuntimeError(f"server {self.url} did not answer {what} in HTTP ({type(error).__name__}: "
                                   f"{error})") from None
        if answered:  # it accepted the connection: running, but stuck or too slow
            raise UserError(f"{self.server} {self.url} did not answer {what} ({reason}) after {self.retries + 1} "
                            f"tries; it is running but stuck or too slow (raise timeout=)")
        hint = "it answered earlier in this run, so it has stopped; restart it" if self.reached else self.start_hint
        raise UserError(f"{self.server} {self.url} is not reachable ({reason}) after {self.retries + 1} tries; {hint}")
