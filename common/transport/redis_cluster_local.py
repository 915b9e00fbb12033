"""Start a private Redis Cluster on loopback: ``primaries`` redis-server nodes (each with
``replicas`` replicas) made into one cluster with ``redis-cli --cluster create``.

For the tests of worldloop on a cluster (tests/test_redis_cluster.py) and for trying a
``redis+cluster://`` URL by hand; never for production (a real cluster spans machines).
Each node listens on a free port P and its cluster bus on P + 10000, both below the ephemeral range
(a node whose port was taken before it bound starts again on another pair); everything lives in a
temporary folder that :meth:`LocalRedisCluster.close` removes. ``kill_primary_of(key)`` kills
-9 the primary that serves a key's slot and :meth:`wait_failover` waits until one of its
replicas took over and the cluster says ``cluster_state:ok`` again.
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

from worldloop.common.metrics import ephemeral_range, free_port, port_is_free
from worldloop.common.transport.redis_local import find_redis_server

_BUS_OFFSET = 10000


def _node_ports(n: int, taken: tuple[int, ...] = ()) -> list[int]:
    """``n`` free ports whose cluster-bus ports (+10000) are free too, both drawn below the ephemeral
    range where no client socket or OS-given port of another process lands meanwhile (in the suite,
    another test's outgoing connection once took a node's port between the draw and the node's bind);
    OS-given ports where that range is too small. ``taken``: ports not to return (the other nodes')."""
    top = ephemeral_range()[0] - _BUS_OFFSET
    draw = random.SystemRandom()
    ports: list[int] = []
    for _ in range(1000 * n):
        if len(ports) == n:
            break
        p = draw.randrange(10000, top) if top - 10000 >= 1000 else free_port()
        if (p + _BUS_OFFSET < 65536 and p not in ports and p not in taken and port_is_free(p)
                and port_is_free(p + _BUS_OFFSET)):
            ports.append(p)
    if len(ports) < n:
        raise RuntimeError(f"local redis cluster: found {len(ports)} of {n} free node/bus port pairs")
    return ports


class LocalRedisCluster:
    """A Redis Cluster of ``primaries`` x (1 + ``replicas``) local redis-server processes.

    ``persist``: AOF with ``appendfsync`` on every node. ``password``: every node requires it (and its
    replicas use it); :attr:`url` leaves it out: pass it as ``$WORLDLOOP_REDIS_PASSWORD`` or in the URL. ``node_timeout_ms``: how long a node may
    be unreachable before the others take it for failed (and a replica of a failed primary starts
    its election about a second later)."""

    def __init__(self, primaries: int = 3, replicas: int = 1, *, persist: bool = False,
                 appendfsync: str = "everysec", node_timeout_ms: int = 1000, data_dir: str | None = None,
                 password: str | None = None):
        if primaries < 3:
            raise ValueError(f"redis-cli --cluster create needs at least 3 primaries, got {primaries}")
        self.primaries, self.replicas = primaries, replicas
        self.persist, self.appendfsync, self.node_timeout_ms = persist, appendfsync, node_timeout_ms
        self.password = password  # every node's requirepass and masterauth (the URL does not carry it)
        self._tmp = None
        if data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="worldloop-cluster-")
            data_dir = self._tmp.name
        self.data_dir = Path(data_dir).resolve()
        self.ports = _node_ports(primaries * (1 + replicas))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """The worldloop URL of the cluster: any node seeds the client, which discovers the rest."""
        alive = [p for p in self.ports if p in self.procs and self.procs[p].poll() is None]
        return f"redis+cluster://127.0.0.1:{(alive or self.ports)[0]}"

    def _start_node(self, port: int) -> None:
        d = self.data_dir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--appendonly", "yes" if self.persist else "no", "--appendfsync", self.appendfsync,
                "--repl-diskless-sync-delay", "0", "--save", "", "--daemonize", "no", "--logfile", str(d / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _client(self, port: int):
        """A client of one node that tries a command twice, without back-off: the callers poll
        (:meth:`_wait`), and redis-py 8's default retries (10, back-off up to 1 s, each after its
        socket timeout) made a PING to a port another process held take 27 s before the node's exit
        was looked at."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2, retry=Retry(NoBackoff(), 1))

    def _wait(self, what: str, ok, timeout: float, stop=None) -> bool:
        """Poll ``ok`` until it is true (True) or ``stop`` is (False); RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if stop is not None and stop():
                return False
            try:
                if ok():
                    return True
            except Exception:  # a node still starting or just killed: ask again
                pass
            time.sleep(0.1)
        raise RuntimeError(f"local redis cluster: {what} within {timeout:g}s (logs in {self.data_dir})")

    def start(self, timeout: float = 30.0) -> "LocalRedisCluster":
        for p in self.ports:
            self._start_node(p)
        try:
            for i in range(len(self.ports)):
                self._node_answers(i, timeout)
            create = subprocess.run(
                ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout,
                env={**os.environ, "REDISCLI_AUTH": self.password} if self.password else None)
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]} {create.stderr[-2000:]}")
            self._wait("the cluster did not become ready", self._ready, timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _node_answers(self, i: int, timeout: float, attempts: int = 3) -> None:
        """Wait until node ``i`` answers a PING; a node that exited first (its port taken between the
        draw and its bind) starts again on a new port pair, up to ``attempts`` times in all."""
        for attempt in range(attempts):
            p = self.ports[i]
            proc = self.procs[p]
            if self._wait(f"node {p} did not answer", lambda: self._client(p).ping(), timeout,
                          stop=lambda: proc.poll() is not None):
                return
            log = self.data_dir / str(p) / "redis.log"
            tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
            if attempt == attempts - 1 or "in use" not in tail:
                raise RuntimeError(f"local redis cluster: node {p} exited with {proc.returncode}: {tail}")
            del self.procs[p]
            self.ports[i] = _node_ports(1, taken=tuple(self.ports))[0]
            self._start_node(self.ports[i])

    def _ready(self) -> bool:
        """Every live node says cluster_state:ok and every primary that should have replicas has them."""
        live = [p for p in self.ports if self.procs[p].poll() is None]
        for p in live:
            info = self._client(p).cluster("info")
            if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) < len(self.ports):
                return False
        if len(self.primary_ports()) != self.primaries:
            return False
        # a replica that never synced with its primary cannot take over from it
        replicas = [n["port"] for n in self.nodes() if "slave" in n["flags"] and n["port"] in live]
        return len(replicas) == self.primaries * self.replicas and all(
            self._client(p).info("replication").get("master_link_status") == "up" for p in replicas)

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: port, role (master/slave), its primary's id, flags."""
        for p in self.ports:
            if self.procs.get(p) is None or self.procs[p].poll() is not None:
                continue
            try:
                text = self._client(p).execute_command("CLUSTER", "NODES")
            except Exception:  # that node is going down: ask another
                continue
            text = text.decode() if isinstance(text, bytes) else text
            out = []
            for line in text.strip().splitlines():
                f = line.split()
                out.append({"id": f[0], "port": int(f[1].split("@")[0].rsplit(":", 1)[1]), "flags": f[2].split(","),
                            "primary_id": f[3], "slots": f[8:]})
            return out
        raise RuntimeError("no node of the local cluster answers")

    def primary_ports(self) -> list[int]:
        return [n["port"] for n in self.nodes() if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"]]

    def primary_of(self, key: str) -> int:
        """The port of the primary that serves ``key``'s slot now."""
        live = next(p for p in self.ports if self.procs[p].poll() is None)
        slot = int(self._client(live).execute_command("CLUSTER", "KEYSLOT", key))
        for n in self.nodes():
            if "master" not in n["flags"] or "fail" in n["flags"]:
                continue
            for rng in n["slots"]:
                if rng.startswith("["):  # a slot being migrated
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return n["port"]
        raise RuntimeError(f"no primary serves slot {slot} of {key!r}")

    def kill(self, port: int) -> None:
        """kill -9 one node (no shutdown, no final fsync)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start a killed node again on its port: it rejoins with its nodes-PORT.conf (its slots, or
        as the replica of whoever took them over); waits until the cluster is ok again."""
        if self.procs[port].poll() is None:
            raise RuntimeError(f"node {port} is still running")
        self._start_node(port)
        self._wait(f"node {port} did not rejoin", self._ready, timeout)

    def kill_primary_of(self, key: str) -> int:
        """kill -9 the primary serving ``key``; returns its port."""
        port = self.primary_of(key)
        self.kill(port)
        return port

    def wait_failover(self, dead_port: int, key: str, timeout: float = 30.0) -> int:
        """Wait until a replica took over ``key``'s slot from the dead primary ``dead_port`` and every
        live node says ``cluster_state:ok``; returns the port of the new primary."""
        def replaced() -> bool:
            if self.primary_of(key) == dead_port:
                return False
            live = [p for p in self.ports if self.procs[p].poll() is None]
            return all(self._client(p).cluster("info").get("cluster_state") == "ok" for p in live)

        self._wait(f"no replica took over from {dead_port}", replaced, timeout)
        return self.primary_of(key)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
