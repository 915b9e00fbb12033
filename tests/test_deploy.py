"""deploy/: the Grafana dashboard, the Prometheus config and supervisord with real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from common.metrics import CATALOG, exported_names, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
METRIC_RE = re.compile(r"\bworldloop_[a-z0-9_]+")


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "worldloop.json").read_text())


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_names()
    panels = _dashboard()["panels"]
    assert panels, "dashboard has no panels"
    seen = set()
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for t in panel["targets"]:
            names = METRIC_RE.findall(t["expr"])
            assert names, f"panel {panel['title']!r} query {t['expr']!r} names no worldloop metric"
            for n in names:
                assert n in exported, f"panel {panel['title']!r} queries {n}, which no process exports"
                seen.add(n)
    # the dashboard covers every area the operators watch
    for needed in (
        "worldloop_actor_episodes_total",
        "worldloop_actor_generated_tokens_total",
        "worldloop_learner_step_seconds",
        "worldloop_learner_staleness_versions_bucket",
        "worldloop_learner_dropped_trajectories_total",
        "worldloop_learner_reward",
        "worldloop_actor_successes_total",
        "worldloop_judge_request_seconds_bucket",
        "worldloop_judge_failures_total",
        "worldloop_stream_backlog_messages",
    ):
        assert needed in seen, f"no panel shows {needed}"


def test_dashboard_check_catches_a_misspelt_metric():
    # the check above must be able to fail: a name not in the catalog is not exported
    assert "worldloop_actor_episode_total" not in exported_names()
    assert all(n.startswith("worldloop_") for n in CATALOG)


def test_grafana_provisioning_points_at_the_dashboard_datasource():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    for panel in _dashboard()["panels"]:
        assert panel["datasource"]["uid"] == uid
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "worldloop.yml").read_text())
    assert prov["providers"][0]["type"] == "file"


def test_prometheus_scrapes_every_role():
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    roles = set()
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            roles.add(sc["labels"]["role"])
            assert all(re.fullmatch(r"[\w.\-]+:\d+", t) for t in sc["targets"])
    assert roles == {"learner", "actor", "judge"}


# --------------------------------------------------------------------------- supervisord


def _scrape_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return b"worldloop_process_up" in r.read()
    except OSError:
        return False


@pytest.mark.slow
def test_supervisord_runs_every_program_and_each_serves_metrics(tmp_path):
    from common.tiny_model import make_tiny_model

    model_dir = tmp_path / "model"
    make_tiny_model(model_dir, seed=0)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": "deploy-test"},
        "redis": {"namespace": "deploy-test", "max_backlog": 16},
        "model": {"path": str(model_dir), "make_tiny_if_missing": False, "max_image_side": 56},
        "actor": {"num_envs": 1, "max_turns": 1, "max_new_tokens": 8,
                  "envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 3, "min_actions_to_succeed": 2, "render_mode": "text"}}]},
        "trainer": {"total_steps": 1000, "train_batch_size": 2, "ppo_mini_batch_size": 2, "micro_batch_size": 1},
        "sft": {"enabled": False},
    }))
    ports = {
        "WORLDLOOP_REDIS_PORT": free_port(),
        "WORLDLOOP_WEIGHTS_PUB_PORT": free_port(),
        "WORLDLOOP_WEIGHTS_FETCH_PORT": free_port(),
        "WORLDLOOP_LEARNER_METRICS_PORT": free_port(),
    }
    # two-digit prefixes with %(process_num)02d: pick ranges where nothing listens
    actor_prefix, judge_prefix = "47", "48"
    env_file = tmp_path / "worldloop.env"
    sup_dir = tmp_path / "sup"
    values = {
        "WORLDLOOP_HOME": str(ROOT),
        "WORLDLOOP_PYTHON": sys.executable,
        "WORLDLOOP_CONFIG": str(cfg_path),
        "WORLDLOOP_RUN_DIR": str(tmp_path / "run"),
        "WORLDLOOP_LOG_DIR": str(tmp_path / "logs"),
        "WORLDLOOP_SUPERVISOR_DIR": str(sup_dir),
        "WORLDLOOP_REDIS_BIND": "127.0.0.1",
        "WORLDLOOP_REDIS_URL": f"redis://127.0.0.1:{ports['WORLDLOOP_REDIS_PORT']}/0",
        "WORLDLOOP_WEIGHTS_BIND": "127.0.0.1",
        "WORLDLOOP_WEIGHTS_HOST": "127.0.0.1",
        "WORLDLOOP_NUM_ACTORS": "2",
        "WORLDLOOP_NUM_JUDGES": "1",
        "WORLDLOOP_METRICS_HOST": "127.0.0.1",
        "WORLDLOOP_ACTOR_METRICS_PREFIX": actor_prefix,
        "WORLDLOOP_JUDGE_METRICS_PREFIX": judge_prefix,
        **{k: str(v) for k, v in ports.items()},
    }
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    env = dict(os.environ)
    env["WORLDLOOP_ENV_FILE"] = str(env_file)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run([str(DEPLOY / "supervisord.sh")], env=env, check=True, timeout=30)
    ctl = [str(DEPLOY / "ctl.sh")]
    try:
        expected = {"redis", "learner", "actor:actor-00", "actor:actor-01", "judge:judge-00"}
        metric_ports = {
            "learner": ports["WORLDLOOP_LEARNER_METRICS_PORT"],
            "actor:actor-00": int(actor_prefix + "00"),
            "actor:actor-01": int(actor_prefix + "01"),
            "judge:judge-00": int(judge_prefix + "00"),
        }
        deadline = time.monotonic() + 240
        status: dict[str, str] = {}
        served: set[str] = set()
        while time.monotonic() < deadline:
            out = subprocess.run(ctl + ["status"], env=env, capture_output=True, text=True, timeout=30).stdout
            status = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
            served |= {name for name, port in metric_ports.items() if name not in served and _scrape_ok(port)}
            if all(status.get(n) == "RUNNING" for n in expected) and served == set(metric_ports):
                break
            time.sleep(2)
        logs = "".join(
            f"\n--- {p.name}\n" + p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log"))
        )
        assert set(status) >= expected, f"supervisorctl status: {status}{logs}"
        assert all(status[n] == "RUNNING" for n in expected), f"not all RUNNING: {status}{logs}"
        assert served == set(metric_ports), f"/metrics not served by {set(metric_ports) - served}{logs}"
    finally:
        subprocess.run(ctl + ["shutdown"], env=env, capture_output=True, timeout=120)
