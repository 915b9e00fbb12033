"""Prometheus metrics: one catalog for every process, one ``/metrics`` endpoint each.

Naming scheme: ``worldloop_<role>_<what>_<unit>`` where role is one of
actor, judge, learner, eval (the held-out evaluator), server (an inference server's
weight loading, beside vLLM's own ``vllm:*`` metrics), stream (the Redis transport, in any
process), weights (the ZeroMQ channel) or up; counters end in ``_total`` (prometheus-client adds
it), durations are in ``_seconds``, sizes in ``_bytes``. Every metric a process
exports is declared in :data:`CATALOG`; ``metric(name)`` creates it on first
use. The Grafana dashboard in ``deploy/`` is checked against this catalog by
the tests, so a panel cannot query a metric that no process exports.

Each role owns its section of the catalog.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, REGISTRY, start_http_server

log = logging.getLogger(__name__)

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass(frozen=True)
class Spec:
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


CATALOG: dict[str, Spec] = {
    # ---- process (every role)
    "worldloop_process_up": Spec("gauge", "1 while the process runs", ("role",)),
    # ---- stream (Redis transport, any process)
    "worldloop_stream_produced_messages": Spec("counter", "Messages added to a stream", ("stream",)),
    "worldloop_stream_produced_bytes": Spec("counter", "Payload bytes added to a stream", ("stream",)),
    "worldloop_stream_consumed_messages": Spec("counter", "Messages delivered to this consumer", ("stream",)),
    "worldloop_stream_acked_messages": Spec("counter", "Messages acknowledged by this consumer", ("stream",)),
    "worldloop_stream_reclaimed_messages": Spec("counter", "Messages reclaimed from dead consumers", ("stream",)),
    "worldloop_stream_deadletter_messages": Spec("counter", "Messages sent to the dead-letter stream", ("stream", "reason")),
    "worldloop_stream_reconnects": Spec("counter", "Reconnections after Redis errors", ("stream",)),
    "worldloop_stream_refused_writes": Spec(
        "counter", "Calls Redis refused and that were retried (OOM, MISCONF, READONLY, NOPERM)", ("stream", "reason")),
    "worldloop_stream_backpressure_seconds": Spec("counter", "Seconds a producer waited on a full stream", ("stream",)),
    "worldloop_stream_backpressure_blocked": Spec("gauge", "1 while a producer waits on a full stream", ("stream",)),
    "worldloop_stream_backlog_messages": Spec("gauge", "Entries not yet delivered to a consumer, as last seen by a producer", ("stream",)),
    # ---- weights (ZeroMQ channel)
    "worldloop_weights_published_versions": Spec("counter", "Weight versions published"),
    "worldloop_weights_published_bytes": Spec("counter", "Bytes of published weight versions"),
    "worldloop_weights_served_chunks": Spec("counter", "Chunks served to subscribers"),
    "worldloop_weights_version": Spec("gauge", "Latest complete weight version held by this process"),
    "worldloop_weights_fetch_seconds": Spec("histogram", "Seconds to fetch and verify one version", buckets=_TIME_BUCKETS),
    "worldloop_weights_rejected_chunks": Spec("counter", "Chunks rejected (checksum, version change, bad frame)"),
    "worldloop_weights_publish_blocked_seconds": Spec(
        "histogram", "Seconds a publish call blocked its caller (validation, host copy, wait for a free buffer)",
        buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)),
    "worldloop_weights_prepare_seconds": Spec(
        "histogram", "Seconds from a publish hand-over until the version is served (checksums behind the caller)",
        buckets=_TIME_BUCKETS),
    "worldloop_weights_superseded_versions": Spec(
        "counter", "Handed-over weight versions replaced by a newer one before their preparation started"),
    "worldloop_weights_delta_bytes": Spec("counter", "Bytes of delta versions prepared (zstd of the XOR with the version before)"),
    "worldloop_weights_fetched_bytes": Spec("counter", "Bytes received for weight versions, by kind (full, delta)", ("kind",)),
    "worldloop_weights_delta_refused": Spec(
        "counter", "Delta versions refused (corrupt, truncated, wrong base): a full snapshot was fetched instead"),
    # ---- actor
    "worldloop_actor_episodes": Spec("counter", "Finished episodes", ("env",)),
    "worldloop_actor_successes": Spec("counter", "Finished episodes that succeeded", ("env",)),
    "worldloop_actor_turns": Spec("counter", "Turns played", ("env",)),
    "worldloop_actor_generated_tokens": Spec("counter", "Tokens generated"),
    "worldloop_actor_prompt_tokens": Spec("counter", "Prompt tokens fed to generation"),
    "worldloop_actor_episode_turns": Spec("histogram", "Turns per finished episode", ("env",), (1, 2, 3, 4, 5, 6, 8, 10, 15, 20)),
    "worldloop_actor_episode_reward": Spec(
        "histogram", "Env+format reward per finished episode", ("env",), (-5, -2, -1, 0, 0.5, 1, 2, 5, 10, 15, 20)
    ),
    "worldloop_actor_format_errors": Spec("counter", "Turns whose answer did not parse", ("env",)),
    "worldloop_actor_generate_seconds": Spec("histogram", "Seconds per batched generation", buckets=_TIME_BUCKETS),
    "worldloop_actor_policy_version": Spec("gauge", "Policy version the actor generates with"),
    "worldloop_actor_policy_lag_versions": Spec("gauge", "Learner version minus the actor's version"),
    "worldloop_actor_weight_updates": Spec("counter", "Weight versions applied"),
    "worldloop_actor_live_episodes": Spec("gauge", "Episodes in progress"),
    "worldloop_actor_episode_ends": Spec(
        "counter", "Ended episodes by reason (done, max_turns, context, vision_token, env_error, server_error)", ("env", "reason")
    ),
    "worldloop_actor_dropped_episodes": Spec("counter", "Ended episodes not pushed (no complete turn)", ("env", "reason")),
    "worldloop_actor_weight_update_failures": Spec("counter", "Weight versions that failed to fetch or apply", ("reason",)),
    "worldloop_actor_paused": Spec("gauge", "1 while the control record pauses this actor"),
    "worldloop_actor_stale_refusals": Spec("counter", "Responses refused because their oldest token is older than "
                                           "the staleness bound (the turn is generated again)"),
    "worldloop_actor_generation_busy_seconds": Spec("counter", "Seconds with at least one generation request in "
                                                    "flight (1 - rate = the share of time generation sat idle)"),
    "worldloop_actor_server_retries": Spec(
        "counter", "Generation requests sent again (server_failed: its inference server failed; mixed_versions: "
        "tokens from two weight versions)", ("reason",)),
    # ---- eval (worldloop evaluator: held-out success while training)
    "worldloop_eval_success_rate": Spec("gauge", "Held-out success rate of the newest evaluated policy version", ("env",)),
    "worldloop_eval_policy_version": Spec("gauge", "Policy version of the newest held-out evaluation"),
    "worldloop_eval_episodes": Spec("counter", "Held-out episodes played"),
    "worldloop_eval_first_turn_reading_accuracy": Spec(
        "gauge", "Share of the newest evaluation's first turns whose observation the rule judge scores 1.0", ("env",)),
    "worldloop_eval_cpu_share": Spec("gauge", "The in-run evaluations' share of the run's CPU seconds so far"),
    "worldloop_actor_admitted_episodes": Spec("counter", "Episodes admitted by the run's admission budget"),
    "worldloop_actor_admission_wait_seconds": Spec("counter", "Seconds the actor had room for episodes but no admission budget"),
    "worldloop_actor_idle_seconds": Spec("counter", "Seconds the actor generated nothing (no admitted episode running)"),
    # ---- server (worldloop serve: a vLLM inference server; vLLM's own metrics are named vllm:*)
    "worldloop_server_weights_version": Spec("gauge", "Weight version the server generates with"),
    "worldloop_server_weight_updates": Spec("counter", "Weight versions loaded into the running server"),
    "worldloop_server_weight_update_seconds": Spec(
        "histogram", "Seconds generation was paused to load one version (drain of the requests in flight included)",
        buckets=_TIME_BUCKETS),
    "worldloop_server_weight_update_failures": Spec("counter", "Weight versions the server failed to load", ("reason",)),
    "worldloop_server_cpu_seconds": Spec("gauge", "CPU seconds of the server with its engine-core and worker processes"),
    # ---- judge
    "worldloop_judge_scored_turns": Spec("counter", "Turns scored", ("scorer",)),
    "worldloop_judge_trajectories": Spec("counter", "Trajectories scored and forwarded"),
    "worldloop_judge_request_seconds": Spec("histogram", "Latency of one LLM judge request", ("scorer",), _TIME_BUCKETS),
    "worldloop_judge_failures": Spec("counter", "Failed LLM judge requests", ("reason",)),
    "worldloop_judge_retries": Spec("counter", "Retried LLM judge requests"),
    "worldloop_judge_cache_hits": Spec("counter", "Judge requests answered from the cache"),
    "worldloop_judge_fallbacks": Spec("counter", "Scores replaced by the flagged fallback"),
    "worldloop_judge_abandoned_entries": Spec("counter", "Entries whose handling failed, left pending for a retry"),
    "worldloop_judge_in_flight": Spec("gauge", "LLM judge requests in flight"),
    "worldloop_judge_score": Spec("histogram", "Judge scores", ("field",), (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)),
    # ---- learner
    "worldloop_learner_steps": Spec("counter", "Optimizer updates (policy versions) done"),
    "worldloop_learner_policy_version": Spec("gauge", "Current policy version"),
    "worldloop_learner_step_seconds": Spec("gauge", "Duration of the last step by phase", ("phase",)),
    "worldloop_learner_step_phase_seconds": Spec("histogram", "Step duration by phase", ("phase",), _TIME_BUCKETS),
    "worldloop_learner_tokens_per_second": Spec("gauge", "Trained tokens per second in the last step"),
    "worldloop_learner_trained_tokens": Spec("counter", "Tokens trained on"),
    "worldloop_learner_trained_trajectories": Spec("counter", "Trajectories trained on"),
    "worldloop_learner_dropped_trajectories": Spec("counter", "Trajectories dropped", ("reason",)),
    "worldloop_learner_admission_refunds": Spec("counter", "Admitted trajectories given back to the admission budget (never trainable)"),
    "worldloop_learner_staleness_versions": Spec(
        "histogram", "Policy lag of trained trajectories (oldest turn)", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
    ),
    "worldloop_learner_loss": Spec("gauge", "Loss terms of the last step", ("term",)),
    "worldloop_learner_kl": Spec("gauge", "Mean KL to the reference policy"),
    "worldloop_learner_entropy": Spec("gauge", "Mean token entropy"),
    "worldloop_learner_clip_fraction": Spec("gauge", "Fraction of tokens with a clipped ratio"),
    "worldloop_learner_advantage": Spec("gauge", "Advantage statistics of the last batch", ("stat",)),
    "worldloop_learner_importance_weight": Spec("gauge", "pi_prox/pi_behaviour statistics", ("stat",)),
    "worldloop_learner_mismatch_kl": Spec(
        "gauge", "KL(pi_behaviour || pi_prox) over the last batch's generated tokens (all, or those sampled with the weights "
                 "trained from), by estimator (k1, k3)", ("tokens", "estimator")),
    "worldloop_learner_mismatch_masked_fraction": Spec(
        "gauge", "Share of the last batch's generated tokens (or trajectories) the off-policy correction rejected", ("unit",)),
    "worldloop_learner_mismatch_ratio": Spec("gauge", "Quantiles of pi_prox/pi_behaviour over the last batch's generated tokens",
                                             ("quantile",)),
    "worldloop_learner_reward": Spec("gauge", "Mean per-trajectory reward of the last batch", ("component",)),
    "worldloop_learner_success_rate": Spec("gauge", "Success rate of the last batch", ("env",)),
    "worldloop_learner_max_turns": Spec("gauge", "max_turns published to actors"),
    "worldloop_learner_grad_norm": Spec("gauge", "Gradient norm of the last step", ("model",)),
    "worldloop_learner_pending_entries": Spec("gauge", "Stream entries held unacked until the next checkpoint"),
    "worldloop_learner_whole_group_fraction": Spec("gauge", "Share of the last batch's trajectories whose whole GRPO group was in the batch"),
    "worldloop_learner_checkpoints": Spec("counter", "Complete checkpoints written"),
}

_lock = threading.Lock()
_made: dict[tuple[int, str], Any] = {}


def metric(name: str, registry: CollectorRegistry | None = None) -> Any:
    """The process-wide metric called ``name`` (declared in CATALOG), created on first use."""
    spec = CATALOG.get(name)
    if spec is None:
        raise KeyError(f"metric {name!r} is not declared in worldloop.common.metrics.CATALOG")
    reg = registry or REGISTRY
    key = (id(reg), name)
    with _lock:
        m = _made.get(key)
        if m is None:
            if spec.kind == "counter":
                m = Counter(name, spec.doc, spec.labels, registry=reg)
            elif spec.kind == "gauge":
                m = Gauge(name, spec.doc, spec.labels, registry=reg)
            elif spec.kind == "histogram":
                m = Histogram(name, spec.doc, spec.labels, registry=reg, buckets=spec.buckets or _TIME_BUCKETS)
            else:  # pragma: no cover - catalog is static
                raise ValueError(spec.kind)
            _made[key] = m
        return m


def exported_names() -> set[str]:
    """Every sample name a process can export (counters get _total, histograms _bucket/_sum/_count)."""
    out = set()
    for name, spec in CATALOG.items():
        if spec.kind == "counter":
            out |= {name + "_total", name + "_created"}
        elif spec.kind == "histogram":
            out |= {name + "_bucket", name + "_sum", name + "_count", name + "_created"}
        else:
            out.add(name)
    return out


def process_tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (default: this one) and every process below it,
    those still running (a child that exited is not counted: an inference server's engine and
    workers live as long as it does)."""
    import psutil

    top = psutil.Process(pid)
    total = 0.0
    for p in [top, *top.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += t.user + t.system
    return total


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral ports (``ip_local_port_range``: bind to port 0, outgoing connections);
    Linux's default where that file cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def unassigned_port(host: str = "127.0.0.1", low: int = 10000, tries: int = 100) -> int:
    """A port free now for another process to bind later, drawn at random below the ephemeral range:
    no outgoing connection and no ``free_port()`` of any process lands there meanwhile, so only
    another explicit pick among ~20,000 ports could take it (an OS-given port can go to a client
    socket's local end within the same second). :func:`free_port` where that range is too small."""
    import random

    top = ephemeral_range()[0]
    if top - low >= 1000:
        draw = random.SystemRandom()
        for _ in range(tries):
            port = draw.randrange(low, top)
            if port_is_free(port, host):
                return port
    return free_port(host)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP socket can bind ``host``:``port`` right now (a hint: another process may take it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


@functools.lru_cache(maxsize=None)
def _primary_address() -> str:
    """This host's address on its default route (a UDP connect sends nothing), else the address of
    its name, else its name where that resolves, else loopback (a machine with no network)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
            ip = s.getsockname()[0]
        if ip and not ip.startswith("127.") and ip != "0.0.0.0":
            return ip
    except OSError:
        pass
    name = socket.getfqdn() or socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"
    return name if ip.startswith("127.") else ip


def advertised_host(bind: str | None) -> str:
    """Where other machines reach a server bound to ``bind`` (``metrics.host``): that address itself,
    or for a wildcard bind (0.0.0.0, ::) this host's primary IP address."""
    bind = (bind or "").strip()
    return _primary_address() if bind in _WILDCARDS else bind


def metrics_url(bind: str | None, port: int) -> str:
    """The /metrics URL a heartbeat advertises for a server bound to ``bind``:``port``."""
    host = advertised_host(bind)
    if ":" in host and not host.startswith("["):  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"


def serve_metrics(role: str, host: str = "127.0.0.1", port: int = 0) -> int:
    """Start the HTTP ``/metrics`` endpoint of this process; return the port it listens on."""
    server, _ = start_http_server(port, addr=host)
    port = server.server_port
    metric("worldloop_process_up").labels(role=role).set(1)
    log.info("metrics for %s on %s (bound to %s)", role, metrics_url(host, port), host)
    return port
