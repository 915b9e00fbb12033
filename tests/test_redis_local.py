"""LocalRedis binds its port with retry: a port it picked that is taken by the time redis-server
binds it is given up for a new one; a port the caller chose is kept and its failure reported; and a
server already answering on the port is never mistaken for the one just started."""

from __future__ import annotations

import socket

import pytest
import redis

import worldloop.common.transport.redis_local as redis_local
from worldloop.common.metrics import free_port
from worldloop.common.transport.redis_local import LocalRedis, PortInUse


@pytest.fixture
def taken_port():
    """A loopback port held by a listening socket for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _pid_of(srv: LocalRedis) -> int:
    return redis.Redis.from_url(srv.url, socket_timeout=5).info("server")["process_id"]


def test_a_picked_port_taken_before_redis_binds_it_is_retried_on_a_new_one(taken_port, monkeypatch) -> None:
    # the race, made certain: the first port handed out is one somebody else listens on
    handed: list[int] = []

    def picker(host: str = "127.0.0.1") -> int:
        handed.append(taken_port if not handed else free_port(host))
        return handed[-1]

    monkeypatch.setattr(redis_local, "free_port", picker)
    srv = LocalRedis()
    assert srv.port == taken_port
    try:
        srv.start()
        assert handed[0] == taken_port and len(handed) == 2 and srv.port == handed[1] != taken_port
        assert _pid_of(srv) == srv.proc.pid
        port = srv.port
        srv.restart()  # a restart comes back on the port its clients know
        assert srv.port == port and _pid_of(srv) == srv.proc.pid
    finally:
        srv.close()


def test_a_port_the_caller_chose_is_kept_and_its_failure_named(taken_port) -> None:
    srv = LocalRedis(port=taken_port)
    try:
        with pytest.raises(PortInUse, match=rf"(?s)redis-server on 127\.0\.0\.1:{taken_port} exited .*Address already in use"):
            srv.start()
        assert srv.port == taken_port and srv.proc is None
    finally:
        srv.close()


def test_another_server_answering_on_the_port_is_not_taken_for_ours() -> None:
    """A second LocalRedis on the port of a running one: before the process-id check its PING was
    answered by the first server and start() returned a LocalRedis whose own process had failed."""
    first = LocalRedis().start()
    try:
        second = LocalRedis(port=first.port)
        try:
            with pytest.raises(PortInUse, match="Address already in use"):
                second.start()
        finally:
            second.close()
        assert _pid_of(first) == first.proc.pid  # the first one is untouched
    finally:
        first.close()
