"""Inference servers and their API key (issue 38, finding 14): ``serve.api_key_env`` /
``serve.api_key_file`` give the servers a key that vLLM requires (``$VLLM_API_KEY``, its
``--api-key`` off the command line) and that the actors' client sends; ``worldloop serve`` on a
non-loopback address without one warns, and so does a server's weight subscriber on a plaintext
channel. The client is checked against a real HTTP server on loopback that speaks the two
endpoints it uses and refuses any request without ``Authorization: Bearer <key>`` (the check vLLM
makes); vLLM itself is started only by the vllm-marked tests."""

from __future__ import annotations

import http.server
import json
import logging
import os
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from worldloop.actor.generation import GenRequest
from worldloop.actor.server.client import ServerBackend
from worldloop.actor.server.fingerprint import model_fingerprint
from worldloop.actor.server.launch import API_KEY_ENV, server_command
from worldloop.bootstrap.tiny_model import make_tiny_model
from worldloop.common.contracts.config import ConfigError, config_from_dict
from worldloop.common.secrets import bearer_ok, redacted, server_api_key
from worldloop.common.contracts.config import to_dict

ROOT = Path(__file__).resolve().parent.parent
KEY = "srv-KEY-3b9e77d1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", arch="qwen2", vocab_size=512)


class KeyedServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """``/worldloop/info`` and ``/inference/v1/generate`` as a worldloop server answers them, behind
    vLLM's check: 401 for a request without ``Authorization: Bearer <key>``. Records every
    request's path and Authorization header."""

    daemon_threads = True

    def __init__(self, model: Path, key: str):
        self.seen: list[tuple[str, str | None]] = []
        fingerprint = model_fingerprint(model)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self) -> bool:
                sent = self.headers.get("Authorization")
                server.seen.append((self.path, sent))
                if not bearer_ok(sent or "", key):
                    self._json(401, {"error": "Unauthorized"})
                    return False
                return True

            def do_GET(self):
                if self._allowed():
                    self._json(200, {"ready": True, "error": None, "version": 3, "fingerprint": fingerprint,
                                     "max_model_len": 4096, "vocab_size": 512})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._allowed():
                    content = [{"token_id": 40, "logprob": -0.5}, {"token_id": 41, "logprob": -0.25}]
                    self._json(200, {"prompt_token_ids": body["token_ids"], "choices": [
                        {"token_ids": [40, 41], "logprobs": {"content": content}, "weight_versions": [{"version": "3", "start": 0, "end": 2}]}]})

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _cfg(model: Path, url: str, **serve) -> object:
    return config_from_dict({"model": {"path": str(model)}, "serve": serve,
                             "actor": {"backend": "server", "servers": [url], "server_startup_timeout_s": 3,
                                       "max_new_tokens": 8}})


def test_the_actors_client_sends_the_servers_key(model_dir, monkeypatch) -> None:
    monkeypatch.setenv("WORLDLOOP_SERVE_API_KEY", KEY)
    srv = KeyedServer(model_dir, KEY)
    try:
        backend = ServerBackend.from_config(_cfg(model_dir, srv.url))
        try:
            (res,) = backend.generate([GenRequest(prompt_ids=[5, 6, 7], session="s")], temperature=1.0, top_p=1.0,
                                      max_new_tokens=8)
        finally:
            backend.close()
        assert res.error is None and res.response_ids == [40, 41] and res.logprobs == [-0.5, -0.25] and res.version == 3
        paths = {p for p, _ in srv.seen}
        assert {"/worldloop/info", "/inference/v1/generate"} <= paths
        assert {h for _, h in srv.seen} == {f"Bearer {KEY}"}  # every request, polls included
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_client_without_the_key_is_refused_by_a_keyed_server(model_dir, monkeypatch) -> None:
    monkeypatch.delenv("WORLDLOOP_SERVE_API_KEY", raising=False)
    srv = KeyedServer(model_dir, KEY)
    try:
        with pytest.raises(ConfigError, match=r"actor.servers.*no inference server was ready.*answered 401"):
            ServerBackend.from_config(_cfg(model_dir, srv.url))
        assert srv.seen and all(h is None for _, h in srv.seen)
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_key_comes_from_the_variable_or_a_file_and_reaches_vllm_off_the_command_line(model_dir, tmp_path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setenv("WORLDLOOP_SERVE_API_KEY", KEY)
    cfg = _cfg(model_dir, "http://127.0.0.1:1")
    assert server_api_key(cfg) == KEY
    argv, env = server_command(cfg, host="127.0.0.1", port=8123)
    assert env[API_KEY_ENV] == KEY and not any(KEY in a for a in argv)
    assert KEY not in env["WORLDLOOP_SERVE_CONFIG"]  # the config names the variable, not the key
    key_file = tmp_path / "serve.key"
    key_file.write_text("from-a-file-77\n")
    cfg = _cfg(model_dir, "http://127.0.0.1:1", api_key_file=str(key_file))
    assert server_api_key(cfg) == "from-a-file-77"
    assert server_command(cfg, host="127.0.0.1", port=8123)[1][API_KEY_ENV] == "from-a-file-77"
    assert redacted(to_dict(cfg))["serve"]["api_key_file"] == str(key_file)  # a path, not the key
    monkeypatch.delenv("WORLDLOOP_SERVE_API_KEY")
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert server_api_key(_cfg(model_dir, "http://127.0.0.1:1")) is None
    assert API_KEY_ENV not in server_command(_cfg(model_dir, "http://127.0.0.1:1"), host="127.0.0.1", port=1)[1]
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match=r"serve.api_key_file.*is empty"):
        server_api_key(cfg)
    with pytest.raises(ConfigError, match=r"serve.api_key_file.*cannot read the API key file"):
        server_api_key(_cfg(model_dir, "http://127.0.0.1:1", api_key_file=str(tmp_path / "missing")))


def test_bearer_check() -> None:
    assert bearer_ok(f"Bearer {KEY}", KEY) and bearer_ok(f"bearer {KEY}", KEY)
    assert not any(bearer_ok(h, KEY) for h in ("", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer ", f"Bearer  {KEY}"))


def _serve(tmp_path: Path, host: str, env: dict) -> subprocess.CompletedProcess:
    """``worldloop serve --host HOST`` on a config whose model directory does not exist: it stops
    with that error before anything starts, after its start-up checks."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no-model")}}))
    return subprocess.run([sys.executable, "-m", "worldloop", "serve", "--config", str(cfg), "--host", host],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_serve_on_a_network_address_without_a_key_warns(tmp_path) -> None:
    res = _serve(tmp_path, "0.0.0.0", {"WORLDLOOP_SERVE_API_KEY": ""})
    assert res.returncode != 0 and "no model directory" in res.stderr
    assert "SECURITY: the inference server listens on 0.0.0.0 without an API key" in res.stderr
    res = _serve(tmp_path, "0.0.0.0", {"WORLDLOOP_SERVE_API_KEY": KEY})
    assert "no model directory" in res.stderr and "SECURITY" not in res.stderr and KEY not in res.stderr + res.stdout
    res = _serve(tmp_path, "127.0.0.1", {"WORLDLOOP_SERVE_API_KEY": ""})
    assert "no model directory" in res.stderr and "SECURITY" not in res.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_a_servers_weight_subscriber_warns_about_plain_weights(model_dir, tmp_path) -> None:
    """The server's WeightSync (its worker's weight thread) warns as the actors do; with CURVE it
    does not. (Importing the extension imports vLLM.)"""
    pytest.importorskip("vllm")
    import zmq.auth

    from worldloop.actor.server.extension import WeightSync

    public, _ = zmq.auth.create_certificates(str(tmp_path), "server")
    weights = {"host": "10.255.0.9", "pub_port": 5555, "fetch_port": 5556}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the extension sends worldloop's loggers to stderr, not to the root logger
    logger = logging.getLogger("worldloop.common.exposure")
    logger.addHandler(handler)
    try:
        WeightSync(config_from_dict({"model": {"path": str(model_dir)}, "weights": weights}), str(model_dir)).close()
        keyed = config_from_dict({"model": {"path": str(model_dir)},
                                  "weights": {**weights, "curve_server_public": public}})
        WeightSync(keyed, str(model_dir)).close()
    finally:
        logger.removeHandler(handler)
    warned = [r.getMessage() for r in records if "SECURITY" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "SECURITY: the inference server fetches weights from 10.255.0.9 in plaintext")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_servers_info_path_needs_the_key_too(monkeypatch) -> None:
    """vLLM guards /v1, /inference with $VLLM_API_KEY; worldloop's middleware guards /worldloop/info
    the same way (the real middleware, called as vLLM's ASGI app calls it)."""
    import asyncio

    pytest.importorskip("vllm")
    from worldloop.actor.server.app import WorldloopMiddleware

    inner: list[str] = []

    async def app(scope, receive, send):
        inner.append(scope["path"])

    def status(path: str, headers: list) -> int | None:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request"}

        asyncio.run(WorldloopMiddleware(app)({"type": "http", "path": path, "headers": headers}, receive, send))
        return sent[0]["status"] if sent else None

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert status("/worldloop/info", []) == 200  # no key: open, as before
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert status("/worldloop/info", []) == 401
    assert status("/worldloop/info", [(b"authorization", b"Bearer wrong")]) == 401
    assert status("/worldloop/info", [(b"authorization", f"Bearer {KEY}".encode())]) == 200
    assert status("/metrics", []) is None and inner == ["/metrics"]  # passed on to vLLM's app
