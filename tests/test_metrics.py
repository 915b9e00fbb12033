"""The metrics catalog: /metrics over real HTTP, undeclared names refused, naming scheme."""

from __future__ import annotations

import re
import urllib.request

import pytest

from worldloop.common.metrics import CATALOG, exported_names, metric, serve_metrics

NAME = re.compile(r"^worldloop_(process|stream|weights|actor|judge|learner|eval|server|up)_[a-z0-9_]+$")


def test_serve_metrics_over_http() -> None:
    metric("worldloop_stream_produced_messages").labels(stream="metrics-test").inc(3)
    port = serve_metrics("test", "127.0.0.1", 0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'worldloop_stream_produced_messages_total{stream="metrics-test"} 3.0' in body
    assert 'worldloop_process_up{role="test"} 1.0' in body


def test_metric_is_created_once_and_undeclared_names_are_refused() -> None:
    assert metric("worldloop_stream_reconnects") is metric("worldloop_stream_reconnects")
    with pytest.raises(KeyError, match="not declared"):
        metric("worldloop_stream_made_up")


def test_catalog_follows_the_naming_scheme() -> None:
    for name, spec in CATALOG.items():
        assert NAME.match(name), name
        assert spec.kind in ("counter", "gauge", "histogram"), name
        assert not name.endswith("_total"), name  # prometheus-client adds it
    assert "worldloop_stream_backpressure_seconds_total" in exported_names()
    assert "worldloop_weights_fetch_seconds_bucket" in exported_names()


def test_every_declared_metric_is_used_by_the_code() -> None:
    """A dashboard panel on a declared metric that no code updates would stay empty forever."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = ""
    for pkg in ("actor", "judge", "learner", "common", "envs", "worldloop"):
        for f in sorted((root / pkg).rglob("*.py")):
            text = f.read_text()
            if f.name == "metrics.py" and f.parent.name == "common":
                text = text.split("_lock = threading.Lock()", 1)[1]  # uses only, not the CATALOG itself
            source += text
    unused = [name for name in CATALOG if f'"{name}"' not in source]
    assert not unused, f"declared in CATALOG but never updated: {unused}"


# --------------------------------------------------------------------------- ports for other processes


def test_unassigned_ports_are_free_and_below_the_ephemeral_range() -> None:
    import socket

    from worldloop.common.metrics import ephemeral_range, free_port, unassigned_port

    low, high = ephemeral_range()
    assert 1024 <= low < high <= 65535
    ports = {unassigned_port() for _ in range(20)}
    assert all(10000 <= p < low for p in ports) and len(ports) > 1  # drawn, not one fixed port
    assert low <= free_port() <= high  # the OS's own pick lies in the range these avoid
    with socket.socket() as s:  # free: this process can bind each
        s.bind(("127.0.0.1", ports.pop()))


def test_an_unassigned_port_skips_one_in_use_and_falls_back_where_the_range_is_too_small(monkeypatch) -> None:
    import socket

    import worldloop.common.metrics as metrics

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        draws = iter([taken, taken, 23456])
        monkeypatch.setattr("random.SystemRandom.randrange", lambda self, a, b: next(draws))
        monkeypatch.setattr(metrics, "port_is_free", lambda port, host="127.0.0.1": port != taken)
        assert metrics.unassigned_port() == 23456
    low = metrics.ephemeral_range()[0]
    monkeypatch.setattr(metrics, "ephemeral_range", lambda: (10500, 60999))  # fewer than 1,000 ports below it
    assert metrics.unassigned_port() >= low  # the OS's pick (free_port), not a draw below 10,500
