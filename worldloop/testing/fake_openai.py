"""A real OpenAI-compatible HTTP server for tests and benchmarks (stdlib only, loopback, free port).

It speaks the wire protocol the ``openai`` client expects: ``POST /v1/chat/completions`` (JSON,
or server-sent events with ``"stream": true``) and ``GET /v1/models``, error bodies shaped like
OpenAI's (``{"error": {...}}``) with their status codes, and ``Retry-After`` on 429s.

    with FakeOpenAI(responder=lambda req: "<answer>YES</answer>", delay_s=0.2) as srv:
        client = AsyncOpenAI(base_url=srv.base_url, api_key="x")
        ...
        srv.requests  # every request: {"path", "headers", "json", "time"}

Behaviour, configurable per test (attributes may be changed while it runs):

* ``responder(request) -> str | Reply``: gets the full request JSON (model, messages with text and
  ``image_url`` data-URL parts, max_tokens, ...) and returns the assistant text, or a
  :class:`Reply` for a status code, a raw (garbage) body, extra headers or a per-request delay.
  Default: always ``"<think>ok</think><answer>YES</answer>"``. An exception in the responder
  becomes a 500. Helpers: :func:`text_of` (all text of the messages), :func:`images_of` (decoded
  data-URL images).
* ``delay_s``: seconds every request waits before it is answered (a slow endpoint).
* ``hang``: chat requests are read and recorded, then never answered (the connection stays open,
  as with an endpoint that accepted the request and stalled) until ``hang`` is cleared or the
  server closes.
* ``fail_first`` / ``fail_status`` / ``retry_after``: the first N chat requests get that status
  (500, 429, ...) before normal answers resume.
* ``requests``, ``max_concurrent``: what arrived, and the most requests handled at the same time.
"""
from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass
class Reply:
    content: str | None = None  # the assistant message text
    status: int = 200
    body: bytes | str | None = None  # raw body instead of a chat completion (garbage, HTML, ...)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    finish_reason: str = "stop"


def text_of(request: dict) -> str:
    """All text of a chat request's messages (string contents and ``text`` parts), joined by newlines."""
    out = []
    for m in request.get("messages") or []:
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out += [p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(out)


def images_of(request: dict) -> list[bytes]:
    """The decoded bytes of every ``image_url`` part given as a ``data:`` URL."""
    out = []
    for m in request.get("messages") or []:
        c = m.get("content")
        if not isinstance(c, list):
            continue
        for p in c:
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = (p.get("image_url") or {}).get("url", "")
                if url.startswith("data:") and "," in url:
                    out.append(base64.b64decode(url.split(",", 1)[1]))
    return out


def _default_responder(request: dict) -> str:
    return "<think>ok</think><answer>YES</answer>"


class FakeOpenAI:
    def __init__(self, responder: Callable[[dict], str | Reply] | None = None, *, delay_s: float = 0.0,
                 fail_first: int = 0, fail_status: int = 500, retry_after: float | None = None,
                 model: str = "fake-judge", host: str = "127.0.0.1", port: int = 0):
        self.responder = responder or _default_responder
        self.delay_s = delay_s
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.retry_after = retry_after
        self.model = model
        self.hang = False
        self._closed = threading.Event()
        self.requests: list[dict] = []
        self.max_concurrent = 0
        self._active = 0
        self._chat_count = 0
        self._lock = threading.Lock()
        self._server = _Server((host, port), self._handler_class())
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-openai", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()  # releases hung requests
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "FakeOpenAI":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def chat_requests(self) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["path"].endswith("/chat/completions")]

    # ------------------------------------------------------------------ request handling

    def _answer_chat(self, request: dict) -> tuple[int, dict[str, str], bytes, float]:
        with self._lock:
            self._chat_count += 1
            n = self._chat_count
        if n <= self.fail_first:
            headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
            kind = "rate_limit_exceeded" if self.fail_status == 429 else "server_error"
            return self.fail_status, headers, _error_body(f"injected failure {n}", kind), self.delay_s
        try:
            reply = self.responder(request)
        except Exception as e:  # a broken responder is a server error, as a real server would give
            return 500, {}, _error_body(f"responder failed: {type(e).__name__}: {e}", "server_error"), self.delay_s
        if not isinstance(reply, Reply):
            reply = Reply(content=str(reply))
        delay = self.delay_s + reply.delay_s
        if reply.body is not None:
            body = reply.body.encode() if isinstance(reply.body, str) else reply.body
            return reply.status, reply.headers, body, delay
        if reply.status != 200:
            return reply.status, reply.headers, _error_body(reply.content or "error", "server_error"), delay
        if request.get("stream"):
            return 200, {"Content-Type": "text/event-stream", **reply.headers}, \
                self._sse(request, reply.content or "", reply.finish_reason, n), delay
        return 200, reply.headers, json.dumps(self._completion(request, reply.content or "", reply.finish_reason, n)).encode(), delay

    def _completion(self, request: dict, content: str, finish: str, n: int) -> dict:
        prompt_tokens = max(1, len(text_of(request)) // 4)
        completion_tokens = max(1, len(content) // 4)
        return {
            "id": f"chatcmpl-fake-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": request.get("model") or self.model, "system_fingerprint": "fake",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": None},
                         "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    def _sse(self, request: dict, content: str, finish: str, n: int) -> bytes:
        base = {"id": f"chatcmpl-fake-{n}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": request.get("model") or self.model}
        chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        for i in range(0, len(content), 16):
            chunks.append({**base, "choices": [{"index": 0, "delta": {"content": content[i:i + 16]}, "finish_reason": None}]})
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"fake": self})


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request to ``fake`` (a class attribute: FakeOpenAI makes a subclass per server)."""

    fake: FakeOpenAI
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body leave at once (no 40 ms delayed-ACK stall)

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            for k, v in hdrs.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            self.close_connection = True

    def _record(self, body: Any) -> None:
        fake = self.fake
        with fake._lock:
            fake.requests.append({"path": self.path, "headers": dict(self.headers), "json": body,
                                  "time": time.time()})

    def do_GET(self) -> None:
        fake = self.fake
        self._record(None)
        if self.path.rstrip("/").endswith("/models"):
            body = {"object": "list", "data": [{"id": fake.model, "object": "model", "created": 0,
                                                "owned_by": "fake"}]}
            self._send(200, json.dumps(body).encode())
        else:
            self._send(404, _error_body(f"no route {self.path}", "not_found"))

    def do_POST(self) -> None:
        fake = self.fake
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        self._record(body)
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, _error_body(f"no route {self.path}", "not_found"))
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self._send(400, _error_body("body must be a JSON object with 'messages'", "invalid_request_error"))
            return
        with fake._lock:
            fake._active += 1
            fake.max_concurrent = max(fake.max_concurrent, fake._active)
        try:
            while fake.hang and not fake._closed.wait(0.05):
                pass  # no answer, no close: the client's own timeout must end it
            if fake.hang:  # closed while hanging: drop the connection unanswered
                return
            status, headers, payload, delay = fake._answer_chat(body)
            if delay > 0:
                time.sleep(delay)
            self._send(status, payload, headers)
        finally:
            with fake._lock:
                fake._active -= 1


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # listen backlog: many clients connect at once (the default 5 resets them)
    daemon_threads = True


def _error_body(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": kind}}).encode()


def main(argv: list[str] | None = None) -> int:
    """Serve until killed: ``python -m worldloop.testing.fake_openai --delay 0.2 [--answer TEXT] [--port N] [--hang]``.

    Prints the base URL on the first line of stdout (benchmarks run it in its own process so that
    its request threads do not share a GIL with the client being measured).
    """
    import argparse

    ap = argparse.ArgumentParser(description="OpenAI-compatible fake endpoint")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--answer", default=_default_responder({}))
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--hang", action="store_true", help="accept chat requests and never answer them")
    args = ap.parse_args(argv)
    srv = FakeOpenAI(lambda req: args.answer, delay_s=args.delay, port=args.port)
    srv.hang = args.hang
    srv.start()
    print(srv.base_url, flush=True)
    try:
        srv._thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
