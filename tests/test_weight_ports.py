"""The weight channel's ports and TCP self-connection.

A subscriber whose learner is down reconnects every 100 ms. When the learner's port lies in the
host's ephemeral range, the kernel can hand that very port to the reconnecting socket as its source
and connect it to itself; a ZeroMQ DEALER (the subscriber's fetch socket) even completes the
handshake with itself and stays. The restarted learner then cannot bind its port. The chaos soak,
which restarts its learner about ten times while two actors reconnect, picked its ports from that
range; ``worldloop up`` and the defaults (5555, 5556) lie below it.

The self-connection is made certain here: in a network namespace of its own whose ephemeral range is
one port, a DEALER reconnecting to that port must take it as its source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest
import zmq

from ci import unavailable
from worldloop.common.metrics import ephemeral_range, unassigned_port
from worldloop.common.transport.weights import WeightPublisher, WeightsError
from worldloop.common.transport.weights.publisher import SELF_CONNECT

HOST = "127.0.0.1"


def test_a_port_of_the_ephemeral_range_held_by_a_socket_is_refused_with_the_reason() -> None:
    low, high = ephemeral_range()
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.linger = 0
    try:
        port = holder.bind_to_random_port(f"tcp://{HOST}", min_port=low, max_port=high)
        with pytest.raises(WeightsError, match=rf"fetch_port socket on tcp://{HOST}:{port}: Address already in use .*"
                                               r"\(a subscriber reconnecting while the learner was down"):
            WeightPublisher(HOST, 0, port)
    finally:
        holder.close()
    below = unassigned_port()
    assert below < low
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.linger = 0
    try:
        holder.bind(f"tcp://{HOST}:{below}")
        with pytest.raises(WeightsError) as e:  # taken, but not by a self-connection: no such hint
            WeightPublisher(HOST, 0, below)
        assert "Address already in use" in str(e.value) and SELF_CONNECT not in str(e.value)
    finally:
        holder.close()


# In the namespace: a DEALER connects to PORT while nothing listens; once a connection from PORT to
# PORT is established (read from /proc/net/tcp), or after WAIT_S, a publisher tries to bind PORT.
_SELF_CONNECT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import zmq
    from worldloop.common.transport.weights import WeightPublisher, WeightsError

    port, wait_s = int(sys.argv[1]), float(sys.argv[2])
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://127.0.0.1:{port}")

    def self_connected():
        hexport = f"{port:04X}"
        for line in open("/proc/net/tcp").read().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            if local.endswith(":" + hexport) and remote.endswith(":" + hexport) and state == "01":
                return True
        return False

    deadline = time.monotonic() + wait_s
    while not self_connected() and time.monotonic() < deadline:
        time.sleep(0.05)
    out = {"self_connected": self_connected()}
    try:
        WeightPublisher("127.0.0.1", 20001, port).close()  # PUB below the range
        out["bound"] = True
    except WeightsError as e:
        out["bound"], out["error"] = False, str(e)
    dealer.close()
    print(json.dumps(out))
""")


def _in_namespace(ns: str, port_range: str, port: int, wait_s: float) -> dict:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.ip_local_port_range={port_range}"],
                   check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _SELF_CONNECT_SCRIPT, str(port), str(wait_s)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_reconnecting_subscriber_holds_a_port_of_the_ephemeral_range_and_none_below_it() -> None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("a network namespace of one's own needs Linux, root and `ip` (iproute2); .ci/run runs as root")
    ns = f"wlself{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        unavailable(f"ip netns add: {made.stderr.strip()}")
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        # the namespace's ephemeral range is the one port 40000: a reconnect to it has no other source
        inside = _in_namespace(ns, "40000 40000", 40000, 30.0)  # until it happens
        assert inside["self_connected"] and not inside["bound"], inside
        assert "Address already in use" in inside["error"] and SELF_CONNECT in inside["error"], inside
        # the learner's port below the range (as worldloop up and the chaos soak pick it): the reconnects
        # come from 40000 and never from it, and the publisher binds it
        below = _in_namespace(ns, "40000 40000", 20000, 2.0)  # ~20 reconnects
        assert not below["self_connected"] and below["bound"], below
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
