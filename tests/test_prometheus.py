"""Prometheus finds every process: `worldloop sd` targets from heartbeats, the shipped config and
alert rules (promtool), and a real Prometheus scraping real worldloop processes found that way."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from worldloop.common.transport.control import list_processes, register_process
from worldloop.common.contracts.keys import Keys
from worldloop.common.metrics import CATALOG, advertised_host, exported_names, free_port, metrics_url
from worldloop.sd import targets, write_atomic
from ci import require_tool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
METRIC_RE = re.compile(r"\bworldloop_[a-z0-9_]+")


def _tool(name: str) -> str:
    """The path of a Prometheus binary; skipped where it is not installed, a failure on CI."""
    return require_tool(name, install="apt-get install prometheus; .ci/run does")


# --------------------------------------------------------------------------- worldloop sd


def test_wildcard_bind_is_advertised_as_a_routable_address():
    assert advertised_host("10.1.2.3") == "10.1.2.3"
    assert advertised_host("127.0.0.1") == "127.0.0.1"
    import socket

    try:  # this machine's address on its default route, found independently of the code under test
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))
            routable = s.getsockname()[0]
    except OSError:
        routable = None  # a machine without a network: loopback is all there is
    for wildcard in ("0.0.0.0", "::", ""):
        host = advertised_host(wildcard)
        assert host not in ("0.0.0.0", "::", ""), host
        if routable:
            assert host == routable, (host, routable)
    assert metrics_url("fe80::1", 9100) == "http://[fe80::1]:9100/metrics"
    assert metrics_url("10.1.2.3", 9100) == "http://10.1.2.3:9100/metrics"


def test_targets_keep_live_processes_with_their_labels():
    now = 1000.0
    procs = [
        {"role": "actor", "id": "gpu7-actor-01", "host": "gpu7", "metrics_url": "http://10.0.0.7:9501/metrics", "seen_at": 995.0},
        {"role": "actor", "id": "gpu7-actor-00", "host": "gpu7", "metrics_url": "http://10.0.0.7:9500/metrics", "seen_at": 999.0},
        {"role": "learner", "id": "head-1", "host": "head", "metrics_url": "http://10.0.0.1:9400/metrics", "seen_at": 969.0},  # 31 s
        {"role": "judge", "id": "head-2", "host": "head", "metrics_url": None, "seen_at": 999.0},  # metrics off
        {"role": "judge", "id": "head-3", "host": "head", "metrics_url": "http://[fd00::3]:9600/metrics", "seen_at": 990.0},
    ]
    got = targets(procs, "run-a", now, timeout_s=30.0)
    assert got == [
        {"targets": ["10.0.0.7:9500"], "labels": {"role": "actor", "namespace": "run-a", "host": "gpu7", "process_id": "gpu7-actor-00"}},
        {"targets": ["10.0.0.7:9501"], "labels": {"role": "actor", "namespace": "run-a", "host": "gpu7", "process_id": "gpu7-actor-01"}},
        {"targets": ["[fd00::3]:9600"], "labels": {"role": "judge", "namespace": "run-a", "host": "head", "process_id": "head-3"}},
    ]
    # a longer timeout keeps the learner whose last heartbeat is 31 s old
    assert [g["labels"]["role"] for g in targets(procs, "run-a", now, timeout_s=60.0)] == ["actor", "actor", "judge", "learner"]


def test_write_atomic_replaces_the_file_in_one_rename(tmp_path):
    out = tmp_path / "sd" / "targets.json"
    write_atomic(out, "[1]\n")
    inode = out.stat().st_ino
    write_atomic(out, "[2]\n")
    assert out.read_text() == "[2]\n"
    assert out.stat().st_ino != inode  # a new file renamed over the old one, not rewritten in place
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in out.parent.iterdir()] == ["targets.json"]  # no temporary left behind


def test_sd_command_writes_targets_from_real_heartbeats(tmp_path, redis_url):
    ns = "sd-test"
    r = redis.Redis.from_url(redis_url)
    keys = Keys(ns)
    register_process(r, keys, "learner", "l-1", 9400, host="0.0.0.0")
    register_process(r, keys, "actor", "a-0", 9500, host="127.0.0.1")
    register_process(r, keys, "judge", "j-0", 9600, host="127.0.0.1")
    # a judge that died a minute ago: its heartbeat stays in the hash, but it is no target
    dead = json.loads(r.hget(keys.procs, "judge:j-0"))
    dead.update(id="j-dead", seen_at=time.time() - 60)
    r.hset(keys.procs, "judge:j-dead", json.dumps(dead))
    assert len(list_processes(r, keys)) == 4
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"redis": {"url": redis_url, "namespace": ns}}))
    out = tmp_path / "targets.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "worldloop", "sd", "--config", str(cfg), "--out", str(out)],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    by_id = {g["labels"]["process_id"]: g for g in got}
    assert set(by_id) == {"l-1", "a-0", "j-0"}
    assert by_id["a-0"] == {"targets": ["127.0.0.1:9500"],
                            "labels": {"role": "actor", "namespace": ns, "host": dead["host"], "process_id": "a-0"}}
    # bound to 0.0.0.0: advertised with this machine's address, never the wildcard
    learner_target = by_id["l-1"]["targets"][0]
    assert learner_target == f"{advertised_host('0.0.0.0')}:9400" and not learner_target.startswith("0.0.0.0")
    # bad flags and a missing redis.url fail before anything is written
    bad = subprocess.run([sys.executable, "-m", "worldloop", "sd", "--config", str(cfg), "--out", str(out), "--interval", "0"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "--interval" in bad.stderr
    cfg.write_text(yaml.safe_dump({"redis": {"namespace": ns}}))
    bad = subprocess.run([sys.executable, "-m", "worldloop", "sd", "--config", str(cfg), "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "redis.url" in bad.stderr and not (tmp_path / "x.json").exists()


# --------------------------------------------------------------------------- config and alert rules


def _rules() -> list[dict]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_alert_rules_cover_the_issue_and_use_only_catalog_metrics():
    rules = _rules()
    assert {r["alert"] for r in rules} == {
        "WorldloopLearnerStalled", "WorldloopActorPolicyLagHigh", "WorldloopDeadLettersRising",
        "WorldloopJudgeFallbacksRising", "WorldloopBackpressureGrowing",
    }
    exported = exported_names()
    for rule in rules:
        names = METRIC_RE.findall(rule["expr"])
        assert names, rule["alert"]
        assert all(n in exported for n in names), (rule["alert"], names)
    assert "worldloop_actor_policy_lag_versions" in CATALOG


def test_alert_rules_pass_their_promtool_unit_tests():
    promtool = _tool("promtool")
    res = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=DEPLOY / "prometheus",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr
    tested = set(re.findall(r"alertname:\s*(\w+)", (DEPLOY / "prometheus" / "rules_test.yml").read_text()))
    assert tested == {r["alert"] for r in _rules()}


def test_shipped_prometheus_config_discovers_targets_from_worldloop_sd():
    promtool = _tool("promtool")
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert "static_configs" not in job
    assert job["file_sd_configs"][0]["files"] == ["/var/lib/worldloop/prometheus-targets.json"]
    assert prom["rule_files"] == ["prometheus/rules.yml"]
    res = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 rules found" in res.stdout


# --------------------------------------------------------------------------- a real Prometheus


def _get(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


SERVER_ROW = "Inference servers"  # panels of actor.backend=server's vLLM servers


def _dashboard_queries(ns: str, rate_window: str, *, rows_out: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard query with its variables substituted as Grafana
    does: this run's namespace, "All" (``.*``) for role, instance and env; none of the rows titled
    in ``rows_out`` (a row's panels follow it)."""
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "worldloop.json").read_text())
    out = []
    row = None
    for panel in dash["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        if row in rows_out:
            continue
        for t in panel.get("targets", []):
            expr = (t["expr"].replace("$__rate_interval", rate_window).replace("$namespace", ns)
                    .replace("$role", ".*").replace("$instance", ".*").replace("$env", ".*"))
            assert "$" not in expr, expr
            out.append((panel["title"], expr))
    return out


def _has_finite_point(result: list[dict]) -> bool:
    return any(v not in ("NaN", "+Inf", "-Inf") for series in result for _, v in series.get("values", []))


def _start_prometheus(prometheus: str, config: Path, data: Path, log: Path,
                      pick_port=free_port) -> tuple[subprocess.Popen, int]:
    """A Prometheus on a free loopback port, once its API answers; another port when the one picked
    was bound by another process first ("address already in use" in its log: 3 tries). The answer
    must be this one's (its storage path), not another server's that holds the port."""
    from procs import wait_for

    attempt = 0
    while True:
        attempt += 1
        port = pick_port()
        api = f"http://127.0.0.1:{port}/api/v1"
        start = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            server = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={data}",
                                       f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                      stdout=out, stderr=subprocess.STDOUT)

        def state():
            if server.poll() is not None:
                return "exited"
            try:
                return _get(f"{api}/status/flags")["data"].get("storage.tsdb.path") == str(data)
            except (OSError, ValueError, KeyError):  # not up yet, or not a Prometheus
                return False

        tail = lambda: log.read_bytes()[start:].decode(errors="replace")[-3000:]  # noqa: E731
        try:
            got = wait_for(state, f"prometheus to serve its API on port {port}", 120, extra=tail)
        except BaseException:
            server.kill()
            server.wait(30)
            raise
        if got is True:
            return server, port
        if "address already in use" not in tail().lower() or attempt == 3:
            raise AssertionError(f"prometheus exited with {server.returncode} (port {port}):\n{tail()}")


def test_prometheus_is_started_again_on_another_port_when_its_port_is_taken(tmp_path) -> None:
    """_start_prometheus with its first port held by a listening socket: Prometheus exits with
    "address already in use", and the second port serves."""
    import socket

    prometheus = _tool("prometheus")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, "scrape_configs": []}))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        picks = [held.getsockname()[1]]
        server, port = _start_prometheus(prometheus, cfg, tmp_path / "data", tmp_path / "prometheus.log",
                                         pick_port=lambda: picks.pop(0) if picks else free_port())
        try:
            assert port != held.getsockname()[1] and not picks
            assert "address already in use" in (tmp_path / "prometheus.log").read_text().lower()
        finally:
            server.terminate()
            server.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(1600)  # its waits add up to about 1,480 s (each with the children's logs)
def test_real_prometheus_scrapes_a_run_found_by_worldloop_sd(tmp_path, redis_url):
    """`worldloop up` (learner, actor, judge with an LLM scorer on a fake endpoint) binds /metrics on
    0.0.0.0; `worldloop sd --interval` turns the heartbeats into targets; a real Prometheus with the
    shipped config and rules scrapes them. Every dashboard query answers with data, every alert
    rule evaluates, and the dead-letter alert fires on dead letters made here."""
    prometheus = _tool("prometheus")
    import msgspec

    from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory
    from worldloop.testing.fake_openai import FakeOpenAI, Reply
    from procs import Child, wait_for

    ns = "prom-e2e"
    keys = Keys(ns)
    r = redis.Redis.from_url(redis_url)
    calls = {"n": 0}

    def judge_endpoint(request: dict):  # every other request fails: failures and fallbacks (max_retries 0)
        calls["n"] += 1
        return Reply(status=500, body='{"error": {"message": "overloaded"}}') if calls["n"] % 2 == 0 \
            else "<think>matches</think><answer>YES</answer>"

    fake = FakeOpenAI(judge_endpoint).__enter__()
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "prom-e2e", "run_dir": str(tmp_path / "run")},
        "redis": {"url": redis_url, "namespace": ns, "max_backlog": 8},
        "weights": {"pub_port": 0, "fetch_port": 0},
        "metrics": {"host": "0.0.0.0", "port": 0},
        "model": {"path": str(tmp_path / "model"), "make_tiny_if_missing": True, "max_image_side": 56},
        # groups of 2 episodes per seed: the learner exports the share of whole GRPO groups (a panel)
        "actor": {"num_envs": 2, "max_turns": 1, "max_new_tokens": 8, "n_samples_per_seed": 2,
                  "envs": [{"id": "worldloop/FrozenLake-v0",
                            "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "text",
                                       "prompt_format": "grounding_worldmodeling"}}]},
        "judge": {"enabled": True, "scorers": {"default": ["llm"]}, "base_url": fake.base_url,
                  "max_retries": 0, "timeout_s": 10.0},
        "trainer": {"total_steps": 1000, "train_batch_size": 2, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                    "max_staleness": 1, "checkpoint_every": 1000,
                    # the evaluator: its v0 evaluation sets the held-out panels' gauges
                    "eval_every": 1000, "eval_episodes": 2},
        "sft": {"enabled": False},
        "up": {"num_actors": 1, "num_judges": 1, "progress_interval_s": 5.0},
    }))
    targets_file = tmp_path / "targets.json"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    prom["global"].update(scrape_interval="1s", evaluation_interval="1s")
    prom["rule_files"] = [str(DEPLOY / p) for p in prom["rule_files"]]
    prom["scrape_configs"][0]["file_sd_configs"][0].update(files=[str(targets_file)], refresh_interval="1s")
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump(prom))
    try:
        server, port = _start_prometheus(prometheus, prom_cfg, tmp_path / "data", tmp_path / "prometheus.log")
    except BaseException:
        fake.__exit__(None, None, None)
        raise
    api = f"http://127.0.0.1:{port}/api/v1"
    env = {"OPENAI_API_KEY": "test-key"}
    up = Child(["up", str(cfg_path)], tmp_path / "up.log", env=env, new_session=True)
    sd = Child(["sd", "--config", str(cfg_path), "--out", str(targets_file), "--interval", "1"], tmp_path / "sd.log")
    children = [up, sd]
    run_dir = tmp_path / "run"

    def logs() -> str:
        text = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        return text + f"\n--- prometheus\n{(tmp_path / 'prometheus.log').read_text(errors='replace')[-2000:]}"

    def query(expr: str) -> list[dict]:
        return _get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))["data"]["result"]

    started = time.time()
    try:
        # every role is discovered through worldloop sd and scraped: up == 1 for learner, actor, judge, evaluator
        def roles_up():
            try:
                got = query(f'up{{namespace="{ns}"}} == 1')
            except OSError:
                return None
            roles = {s["metric"]["role"] for s in got}
            return got if roles == {"learner", "actor", "judge", "evaluator"} else None

        scraped = wait_for(roles_up, "Prometheus to scrape learner, actor, judge and evaluator", 300, children, extra=logs)
        advertised = advertised_host("0.0.0.0")
        assert all(s["metric"]["instance"].startswith(advertised + ":") for s in scraped), scraped
        assert all({"host", "process_id", "namespace"} <= set(s["metric"]) for s in scraped), scraped

        # two learner steps, then events the dashboard shows: dead letters, LLM judge requests and
        # stale trajectories (copies of a version-0 one, more than max_staleness=1 behind)
        # a real trajectory to copy is caught while it passes through the streams: the learner acks
        # (XACK + XDEL) what it drops as stale at once and what it trained at its next checkpoint, so
        # both streams can be empty at any one moment
        seen: list = []

        def catch_trajectory():
            if not seen:
                entries = r.xrange(keys.scored, count=1) or r.xrange(keys.rollouts, count=1)
                if entries:
                    seen.append(decode_trajectory(entries[0][1][b"data"]))
            return seen

        def two_steps():
            catch_trajectory()
            return query(f'worldloop_learner_steps_total{{namespace="{ns}"}} >= 2') or None

        wait_for(two_steps, "two learner steps", 400, children, extra=logs)
        traj = wait_for(catch_trajectory, "a trajectory in the streams to copy", 120, children, extra=logs)[0]
        # as if the agent had answered in format (the judge scores only turns that earned the format reward)
        turns = [msgspec.structs.replace(t, observation="The player is at the top left, the goal at the bottom right.",
                                         prediction="The player moves one cell down.", policy_version=0,
                                         format_ok=True, format_reward=max(t.format_reward, 0.5))
                 for t in traj.turns]
        # judged by the LLM scorer (then dropped as stale by the learner): one copy first, so that the
        # latency histogram's series exists before the next copies move it (rate() sees a change)
        for i in range(3):
            copy = msgspec.structs.replace(traj, trajectory_id=f"{traj.trajectory_id}-copy{i}", turns=turns, scored=False)
            r.xadd(keys.rollouts, {b"data": encode_trajectory(copy)})
            if i == 0:
                wait_for(lambda: query(f'worldloop_judge_request_seconds_count{{namespace="{ns}"}}'),
                         "the first LLM judge request to be scraped", 120, children, extra=logs)
        for i in range(5):  # undecodable: dead-lettered by the judge
            r.xadd(keys.rollouts, {b"data": b"not msgpack %d" % i})
            time.sleep(1.5)

        # this run has no inference server (actor.backend hf): the server row's queries must parse
        # and evaluate, but have no data to show
        queries = _dashboard_queries(ns, "30s", rows_out=(SERVER_ROW,))
        missing: list[str] = []
        params = {"start": started, "end": time.time(), "step": 2}
        for title, expr in set(_dashboard_queries(ns, "30s")) - set(queries):
            res = _get(f"{api}/query_range?" + urllib.parse.urlencode({**params, "query": expr}))
            assert res["status"] == "success", (title, expr, res)

        def all_answer():
            missing.clear()
            params = {"start": started, "end": time.time(), "step": 2}
            for title, expr in queries:
                res = _get(f"{api}/query_range?" + urllib.parse.urlencode({**params, "query": expr}))
                assert res["status"] == "success", (title, expr, res)
                if not _has_finite_point(res["data"]["result"]):
                    missing.append(f"{title}: {expr}")
            return not missing

        wait_for(all_answer, "every dashboard query to answer", 180, children,
                 extra=lambda: "no data for:\n" + "\n".join(missing) + logs())
        for title, expr in queries:  # what a user sees (pytest -s): each query's series and latest value
            result = _get(f"{api}/query_range?" + urllib.parse.urlencode(
                {"start": started, "end": time.time(), "step": 2, "query": expr}))["data"]["result"]
            finite = [v for series in result for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
            print(f"answered: {title} | {len(result)} series, last {float(finite[-1]):.4g} | {expr}")

        # the variables' label_values() answer too
        def label_values(label: str, match: str) -> list[str]:
            return _get(f"{api}/label/{label}/values?" + urllib.parse.urlencode({"match[]": match}))["data"]
        assert ns in label_values("namespace", "worldloop_process_up")
        assert set(label_values("role", f'worldloop_process_up{{namespace="{ns}"}}')) == {"learner", "actor", "judge",
                                                                                          "evaluator"}
        assert len(label_values("instance", f'worldloop_process_up{{namespace="{ns}"}}')) == 4
        assert label_values("env", f'worldloop_actor_episodes_total{{namespace="{ns}"}}') == ["frozenlake"]

        # every alert rule was evaluated without error, and the dead letters made above fire theirs
        def rules_evaluated():
            groups = _get(f"{api}/rules")["data"]["groups"]
            rules = [rule for g in groups for rule in g["rules"]]
            return rules if rules and all(rule["lastEvaluation"] > "2000" for rule in rules) else None

        rules = wait_for(rules_evaluated, "the alert rules to be evaluated", 60, children, extra=logs)
        assert {rule["name"] for rule in rules} == {rule["alert"] for rule in _rules()}
        for rule in rules:
            assert rule["health"] == "ok" and not rule.get("lastError"), rule
            print(f"rule: {rule['name']} health={rule['health']} state={rule.get('state')}")

        def deadletter_alert():
            alerts = _get(f"{api}/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "WorldloopDeadLettersRising"
                    and a["labels"].get("namespace") == ns and a["state"] == "firing"]

        fired = wait_for(deadletter_alert, "WorldloopDeadLettersRising to fire", 60, children, extra=logs)
        assert fired[0]["labels"]["reason"] == "decode_error", fired
    finally:
        if up.returncode is None:
            os.killpg(up.pid, signal.SIGINT)  # up stops its children
            try:
                up.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
        sd.kill()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        fake.__exit__(None, None, None)
