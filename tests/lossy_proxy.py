"""A TCP relay between a Redis client and a real redis-server that can lose one reply: the request
reaches Redis and runs, and the client sees its connection drop instead of the answer (what a
network fault after the server answered does). Only the tests use it."""

from __future__ import annotations

import socket
import threading

from worldloop.common.metrics import free_port


class LossyProxy:
    """``127.0.0.1:<port>`` relays to ``upstream``; :meth:`lose_reply_to` arms one loss."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self._pattern: bytes | None = None
        self._lock = threading.Lock()
        self.lost = 0
        self._srv = socket.create_server(("127.0.0.1", self.port))
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def lose_reply_to(self, pattern: bytes) -> None:
        """The next request that contains ``pattern`` runs on Redis; its reply is dropped with the
        client's connection."""
        with self._lock:
            self._pattern = pattern

    def close(self) -> None:
        self._closing = True
        self._srv.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            armed = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, armed), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, armed), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, armed: threading.Event) -> None:
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                _close(client, upstream)
                return
            with self._lock:
                if self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    armed.set()
            upstream.sendall(data)

    def _down(self, upstream: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        while True:
            try:
                data = upstream.recv(65536)
            except OSError:
                data = b""
            if not data or armed.is_set():
                if data:
                    self.lost += 1
                _close(client, upstream)
                return
            try:
                client.sendall(data)
            except OSError:
                _close(client, upstream)
                return


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
