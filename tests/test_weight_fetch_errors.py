"""Issue 38, finding 6: a weight-fetching thread survives passing errors and stops its process on a
fatal one. Both threads (the actor's ``WeightFetcher``, the server's ``WeightSync``) caught
``WeightsError`` only: one ``ZMQError(EMFILE)`` ended the thread silently, and the actor generated
on old weights until admission blocked it for ever. The errors here are real: EMFILE from libzmq
under a lowered RLIMIT_NOFILE, ENOTSOCK from a closed ZeroMQ socket."""

from __future__ import annotations

import errno
import os
import resource
import threading
from pathlib import Path

import pytest
import torch
import zmq
from prometheus_client import REGISTRY

from worldloop.common.transport.weights.fetcher import WeightFetcher
from worldloop.common.transport.weights import WeightPublisher, WeightSubscriber
from worldloop.common.transport.weights.retry import FetchErrors, WeightFetchFailed
from procs import wait_for

HOST = "127.0.0.1"


def real_emfile() -> zmq.ZMQError:
    """A ZMQError(EMFILE) raised by libzmq itself: sockets made under a soft RLIMIT_NOFILE lowered to
    the number of files open now (the limit is restored at once)."""
    ctx = zmq.Context()
    ctx.socket(zmq.PAIR).close()  # the context's own threads and files first
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    made = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1, hard))
        for _ in range(64):
            made.append(ctx.socket(zmq.DEALER))
    except zmq.ZMQError as e:
        assert e.errno == errno.EMFILE, e
        return e
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for s in made:
            s.close(linger=0)
        ctx.term()
    raise AssertionError("no EMFILE from 64 sockets")


def real_enotsock() -> zmq.ZMQError:
    """ENOTSOCK: a ZeroMQ call on a socket that was closed under it, raised by pyzmq/libzmq."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.close()
    try:
        s.recv(zmq.NOBLOCK)
    except zmq.ZMQError as e:
        return e
    finally:
        ctx.term()
    raise AssertionError("recv on a closed socket did not raise")


class Faulty:
    """A real subscriber whose ``latest_announced`` raises ``errors()`` for its first ``n`` calls."""

    def __init__(self, sub: WeightSubscriber, n: int, errors=real_emfile):
        self.sub, self.n, self.errors, self.raised = sub, n, errors, []

    def latest_announced(self):
        if len(self.raised) < self.n:
            self.raised.append(self.errors())
            raise self.raised[-1]
        return self.sub.latest_announced()

    def fetch(self, min_version: int = 0):
        return self.sub.fetch(min_version=min_version)

    def close(self) -> None:
        self.sub.close()


def _weights(v: int) -> dict[str, torch.Tensor]:
    return {"model.w": torch.full((64, 4), float(v)), "model.b": torch.arange(8, dtype=torch.int64) * v}


def _failures(name: str, reason: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_total", {"reason": reason}) or 0.0


def test_the_actor_fetcher_survives_a_real_emfile_and_still_fetches() -> None:
    pub = WeightPublisher(HOST, announce_interval_s=0.1)
    sub = Faulty(WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=20), n=2)
    stop = threading.Event()
    before = _failures("worldloop_actor_weight_update_failures", "fetch_error")
    fetcher = WeightFetcher(sub, stop)  # the actor's own policy: retries after 1 s, then 2 s
    try:
        fetcher.start()
        pub.publish(_weights(1), 1)
        got = wait_for(lambda: fetcher.take(), "the fetcher to hand over v1 after two EMFILEs", 60)
        assert got[0] == 1 and torch.equal(got[1]["model.w"], _weights(1)["model.w"])
        assert [e.errno for e in sub.raised] == [errno.EMFILE, errno.EMFILE]
        assert fetcher.is_alive() and not stop.is_set()
        fetcher.check()  # nothing fatal
        assert _failures("worldloop_actor_weight_update_failures", "fetch_error") == before + 2
        pub.publish(_weights(2), 2)
        got = wait_for(lambda: fetcher.take(), "v2 as well", 60)
        assert got[0] == 2
    finally:
        stop.set()
        fetcher.join(10)
        sub.close()
        pub.close()


def test_the_actor_fetcher_stops_the_process_on_errors_that_do_not_pass() -> None:
    """ENOTSOCK every time: after max_errors in a row the thread ends, sets the actor's stop event
    and check() raises the error (the actor's run() then exits non-zero); a bug (TypeError) is
    fatal at once."""
    for errors, n, want in ((real_enotsock, 3, r"ZMQError: .*(not a socket|Socket operation on non-socket)"),
                            (lambda: TypeError("a bug"), 1, "TypeError: a bug")):
        stop = threading.Event()
        sub = Faulty(None, n=10**9, errors=errors)  # never reaches a real subscriber
        fetcher = WeightFetcher(sub, stop, errors=FetchErrors("actor weights", lambda reason: None, retry_s=0.01,
                                                              max_errors=3))
        fetcher.start()
        fetcher.join(30)
        assert not fetcher.is_alive() and stop.is_set()
        assert len(sub.raised) == n
        with pytest.raises(WeightFetchFailed, match=f"actor weights: weight fetching stopped on {want}"):
            fetcher.check()


def test_the_server_weight_thread_survives_a_real_emfile_and_ends_the_process_on_a_bug(tmp_path: Path) -> None:
    from worldloop.actor.server.extension import WeightSync
    from worldloop.bootstrap.tiny_model import make_tiny_model
    from worldloop.common.contracts.config import config_from_dict
    from worldloop.actor.vllm_backend import reference_params

    model = make_tiny_model(tmp_path / "model", arch="qwen2")
    shapes, _ = reference_params(str(model))
    pub = WeightPublisher(HOST, announce_interval_s=0.1)
    cfg = config_from_dict({"model": {"path": str(model)}, "weights": {"host": HOST, "pub_port": pub.pub_port,
                                                                       "fetch_port": pub.fetch_port}})
    made: list[Faulty] = []
    fatal: list[BaseException] = []

    def make(c) -> Faulty:
        made.append(Faulty(WeightSubscriber(HOST, pub.pub_port, pub.fetch_port, fetch_timeout_s=20), n=1))
        return made[-1]

    before = _failures("worldloop_server_weight_update_failures", "fetch_error")
    sync = WeightSync(cfg, str(model), on_fatal=fatal.append, make_subscriber=make)
    try:
        weights = {name: torch.zeros(shape) for name, shape in list(shapes.items())[:1]}
        pub.publish(weights, 3)
        wait_for(lambda: sync.staged() == 3, "the server thread to fetch v3 after an EMFILE", 60)
        assert [e.errno for e in made[0].raised] == [errno.EMFILE] and not fatal
        assert _failures("worldloop_server_weight_update_failures", "fetch_error") == before + 1
        made[0].n, made[0].errors = 10**9, lambda: TypeError("a bug")  # from now on every poll hits a bug
        wait_for(lambda: fatal, "the bug to end the server's weight thread", 30)
        sync._thread.join(10)  # on_fatal runs on the thread itself, just before it returns and closes its socket
        assert isinstance(fatal[0], TypeError) and not sync._thread.is_alive()
    finally:
        sync.close()
        pub.close()
