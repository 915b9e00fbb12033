"""tests/procs.py ``wait_for``: a Redis read that gets no answer in time is "not yet", never a pass.

The silent server is a real listening socket that accepts and never answers, read by a real
redis-py client with a short socket timeout (the failure once seen in test_up.py: HGETALL got no
answer within redis-py's default 5 s on a loaded 2-core VM)."""

from __future__ import annotations

import socket

import pytest
import redis

from procs import wait_for


@pytest.fixture()
def silent_redis():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    url = f"redis://127.0.0.1:{srv.getsockname()[1]}/0"
    yield url
    srv.close()


def test_reads_that_time_out_are_asked_again_until_the_state_holds(silent_redis, redis_url):
    silent = redis.Redis.from_url(silent_redis, socket_timeout=0.05, socket_connect_timeout=1, retry_on_timeout=False,
                                  protocol=2)
    live = redis.Redis.from_url(redis_url)
    live.set("k", "v")
    calls = []

    def pred():
        calls.append(1)
        client = silent if len(calls) <= 2 else live  # two reads with no answer, then an answer
        return client.get("k")

    assert wait_for(pred, "k", 30) == b"v"
    assert len(calls) == 3


def test_a_state_never_read_fails_at_the_deadline_and_says_why(silent_redis):
    silent = redis.Redis.from_url(silent_redis, socket_timeout=0.05, socket_connect_timeout=1, retry_on_timeout=False,
                                  protocol=2)
    with pytest.raises(AssertionError, match=r"timed out after 1 s waiting for k \(\d+ Redis reads got no answer in time\)"):
        wait_for(lambda: silent.get("k"), "k", 1)


def test_other_errors_still_fail_at_once(redis_url):
    live = redis.Redis.from_url(redis_url)
    live.set("k", "v")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        wait_for(lambda: live.hgetall("k"), "k", 30)
