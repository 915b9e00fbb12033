"""deploy/: the Grafana dashboard, the Prometheus config and supervisord with real processes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from worldloop.common.contracts.keys import Keys
from worldloop.common.metrics import CATALOG, exported_names, port_is_free

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
METRIC_RE = re.compile(r"\bworldloop_[a-z0-9_]+")
VLLM_RE = re.compile(r"\bvllm:[a-z0-9_:]+")  # vLLM's own metrics, on the inference servers' /metrics


def _vllm_declared() -> set[str] | None:
    """The metric names vLLM's metrics modules declare (read from its files, nothing imported:
    vLLM takes seconds to import); None when vLLM is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics"
    return {m for f in folder.glob("*.py") for m in re.findall(r'"(vllm:[a-z0-9_:]+)"', f.read_text())}


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "worldloop.json").read_text())


def _panels() -> list[dict]:
    """The dashboard's graph panels (rows hold none: they are flat in ``panels``)."""
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _variables() -> dict[str, dict]:
    return {v["name"]: v for v in _dashboard()["templating"]["list"]}


def _query_problems(panels: list[dict], variables: list[dict], exported: set[str]) -> tuple[list[str], set[str]]:
    """(what is wrong with the dashboard's queries, the worldloop and vLLM metrics they name)."""
    problems, seen = [], set()
    vllm = _vllm_declared()
    if not panels:
        problems.append("dashboard has no panels")
    for panel in panels:
        if not panel["targets"]:
            problems.append(f"panel {panel['title']!r} has no query")
        for t in panel["targets"]:
            names = METRIC_RE.findall(t["expr"])
            if not names and not VLLM_RE.findall(t["expr"]):
                problems.append(f"panel {panel['title']!r} query {t['expr']!r} names no worldloop or vLLM metric")
            for n in names:
                if n not in exported:
                    problems.append(f"panel {panel['title']!r} queries {n}, which no process exports")
                seen.add(n)
            for n in VLLM_RE.findall(t["expr"]):
                seen.add(n)
                base = re.sub(r"_(total|bucket|sum|count)$", "", n)
                if vllm is not None and n not in vllm and base not in vllm:
                    problems.append(f"panel {panel['title']!r} queries {n}, which vLLM does not declare")
    for var in variables:  # the variables' label_values() queries too
        for n in METRIC_RE.findall(var.get("definition", "")):
            if n not in exported:
                problems.append(f"variable {var['name']} queries {n}, which no process exports")
    return problems, seen


def test_every_dashboard_query_names_an_exported_metric():
    problems, seen = _query_problems(_panels(), list(_variables().values()), set(exported_names()))
    assert problems == []
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
        "worldloop_server_weights_version",
        "worldloop_actor_server_retries_total",
        "vllm:num_requests_running",
        "vllm:generation_tokens_total",
        "worldloop_eval_first_turn_reading_accuracy",
        "worldloop_eval_success_rate",
    ):
        assert needed in seen, f"no panel shows {needed}"


def test_dashboard_check_catches_a_misspelt_metric():
    # the check above must be able to fail: the real dashboard with one query's metric misspelt, one
    # query that names no worldloop metric and one variable querying an unknown metric
    panels, variables = _panels(), list(_variables().values())
    target = panels[0]["targets"][0]
    name = METRIC_RE.findall(target["expr"])[0]
    target["expr"] = target["expr"].replace(name, name + "_typo", 1)
    panels[1]["targets"][0]["expr"] = "up"
    panels[2]["targets"][0]["expr"] = "vllm:no_such_metric_total"
    variables.append({"name": "bogus", "definition": "label_values(worldloop_no_such_metric, instance)"})
    problems, _ = _query_problems(panels, variables, set(exported_names()))
    vllm_typo = ([f"panel {panels[2]['title']!r} queries vllm:no_such_metric_total, which vLLM does not declare"]
                 if _vllm_declared() is not None else [])
    assert problems == [f"panel {panels[0]['title']!r} queries {name}_typo, which no process exports",
                        f"panel {panels[1]['title']!r} query 'up' names no worldloop or vLLM metric",
                        *vllm_typo,
                        "variable bogus queries worldloop_no_such_metric, which no process exports"]
    assert _query_problems([], [], set())[0] == ["dashboard has no panels"]
    assert all(n.startswith("worldloop_") for n in CATALOG)


def test_every_query_filters_by_the_variables_and_uses_rate_interval():
    with_env = {"worldloop_actor_episodes", "worldloop_actor_successes", "worldloop_learner_success_rate",
                "worldloop_eval_success_rate", "worldloop_eval_first_turn_reading_accuracy"}
    for panel in _panels():
        for t in panel["targets"]:
            expr = t["expr"]
            # every selector of a worldloop (or vLLM) metric carries the namespace, role and instance filters
            for m in re.finditer(r"(worldloop_[a-z0-9_]+|vllm:[a-z0-9_:]+)\{([^}]*)\}", expr):
                name, matchers = m.groups()
                for var in ("namespace", "role", "instance"):
                    assert f'{var}=~"${var}"' in matchers, f"{panel['title']!r}: {name} lacks the {var} filter"
                if re.sub(r"_(total|bucket)$", "", name) in with_env:
                    assert 'env=~"$env"' in matchers, f"{panel['title']!r}: {name} lacks the env filter"
            assert len(METRIC_RE.findall(expr)) == len(re.findall(r"worldloop_[a-z0-9_]+\{", expr)), expr
            assert len(VLLM_RE.findall(expr)) == len(re.findall(r"vllm:[a-z0-9_:]+\{", expr)), expr
            # rate windows follow the scrape interval instead of a fixed window
            windows = re.findall(r"\[([^\]]+)\]", expr)
            assert all(w == "$__rate_interval" for w in windows), f"{panel['title']!r}: fixed window in {expr}"


def test_dashboard_is_importable_and_has_a_training_row():
    d = _dashboard()
    assert d["id"] is None and d["uid"] == "worldloop"
    assert d["schemaVersion"] >= 39
    (inp,) = d["__inputs"]
    assert inp["name"] == "DS_PROMETHEUS" and inp["type"] == "datasource" and inp["pluginId"] == "prometheus"
    for panel in _panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"]), panel["title"]
    variables = _variables()
    assert set(variables) >= {"DS_PROMETHEUS", "namespace", "role", "instance", "env"}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for name in ("namespace", "role", "instance", "env"):
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert v["includeAll"] and v["allValue"] == ".*"
        assert f"{name})" in v["definition"].replace(" ", ""), v["definition"]  # label_values(..., name)
    # rows: operations first, then the per-step training panels
    rows = [p for p in d["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Operations", "Training (per step)", "Inference servers"]
    training_y = rows[1]["gridPos"]["y"]
    training = " ".join(t["expr"] for p in _panels() if p["gridPos"]["y"] > training_y for t in p["targets"])
    for name in ("worldloop_learner_loss", "worldloop_learner_kl", "worldloop_learner_entropy",
                 "worldloop_learner_clip_fraction", "worldloop_learner_success_rate", "worldloop_learner_reward",
                 "worldloop_learner_staleness_versions_bucket"):
        assert name + "{" in training, f"the training row has no {name} panel"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_provisioning_points_at_the_dashboard_datasource():
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    # provisioned, the data source variable starts on this uid (the default Prometheus otherwise)
    assert _variables()["DS_PROMETHEUS"]["current"]["value"] == source["uid"]
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "worldloop.yml").read_text())
    assert prov["providers"][0]["type"] == "file"


def test_prometheus_finds_targets_with_worldloop_sd():
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert [sd["files"] for sd in job["file_sd_configs"]] == [["/var/lib/worldloop/prometheus-targets.json"]]
    assert (DEPLOY / prom["rule_files"][0]).exists()


# --------------------------------------------------------------------------- supervisord


def _scrape_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return b"worldloop_process_up" in r.read()
    except OSError:
        return False


def _supervisor(sup_dir: Path):
    """supervisord's XML-RPC interface over its unix socket."""
    import xmlrpc.client

    from supervisor.xmlrpc import SupervisorTransport

    return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=SupervisorTransport(None, None, f"unix://{sup_dir}/supervisor.sock"))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _free_prefixes(counts: dict[str, int]) -> dict[str, str]:
    """A distinct two-digit port prefix P for each program, with P00 .. P(n-1) free now. supervisord
    numbers a program's processes P00, P01, ..., so no OS-given port fits them; prefixes 11..32 give
    ports 1100..3299, below Linux's ephemeral range (32768 and up), where no outgoing connection and
    no free_port() of another test (xdist's other worker) lands meanwhile."""
    out: dict[str, str] = {}
    candidates = iter(range(11, 33))
    for name, n in counts.items():
        out[name] = next((str(p) for p in candidates if all(port_is_free(p * 100 + i) for i in range(n))), "")
        assert out[name], f"no two-digit port prefix with {n} free ports for {name}"
    return out


def test_free_prefixes_skip_a_range_where_something_listens() -> None:
    first = _free_prefixes({"a": 2})["a"]  # what "a" would get with nothing held
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", int(first) * 100 + 1))  # its second port taken
        held.listen(1)
        got = _free_prefixes({"a": 2, "b": 1})
    assert got["a"] != first and got["a"] != got["b"]
    assert all(port_is_free(int(p) * 100 + i) for p, n in ((got["a"], 2), (got["b"], 1)) for i in range(n))


@pytest.mark.slow
@pytest.mark.timeout(900)  # its waits add up to about 760 s
def test_supervisord_runs_every_program_and_each_serves_metrics(tmp_path):
    """deploy/supervisord.sh with an env file: the group worldloop with redis (password from the env
    file), learner, 2 actors (each on its own CUDA_VISIBLE_DEVICES), a judge and worldloop sd, all
    stopped as process groups, the learner's stopwaitsecs from the env file."""
    import redis

    from worldloop.bootstrap.tiny_model import make_tiny_model

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
    # two-digit prefixes with %(process_num)02d: ranges where nothing listens now (were 47/48, fixed);
    # the four single ports from a range of their own there too (supervisord starts the programs that
    # bind them: no retry on another port is possible)
    prefixes = _free_prefixes({"actor": 2, "judge": 1, "single": 4})
    actor_prefix, judge_prefix = prefixes["actor"], prefixes["judge"]
    ports = {name: int(prefixes["single"]) * 100 + i for i, name in enumerate(
        ["WORLDLOOP_REDIS_PORT", "WORLDLOOP_WEIGHTS_PUB_PORT", "WORLDLOOP_WEIGHTS_FETCH_PORT",
         "WORLDLOOP_LEARNER_METRICS_PORT"])}
    password = 's3cret p@ss/"x'  # space, @, / and a quote: quoted for the URL and for redis.conf
    env_file = tmp_path / "worldloop.env"
    sup_dir = tmp_path / "sup"
    sd_file = tmp_path / "prom" / "targets.json"
    values = {
        "WORLDLOOP_HOME": str(ROOT),
        "WORLDLOOP_PYTHON": sys.executable,
        "WORLDLOOP_CONFIG": str(cfg_path),
        "WORLDLOOP_RUN_DIR": str(tmp_path / "run"),
        "WORLDLOOP_LOG_DIR": str(tmp_path / "logs"),
        "WORLDLOOP_SUPERVISOR_DIR": str(sup_dir),
        "WORLDLOOP_REDIS_BIND": "127.0.0.1",
        "WORLDLOOP_REDIS_URL": f"redis://127.0.0.1:{ports['WORLDLOOP_REDIS_PORT']}/0",
        "WORLDLOOP_REDIS_PASSWORD": password,
        "WORLDLOOP_WEIGHTS_BIND": "127.0.0.1",
        "WORLDLOOP_WEIGHTS_HOST": "127.0.0.1",
        "WORLDLOOP_NUM_ACTORS": "2",
        "WORLDLOOP_NUM_JUDGES": "1",
        "WORLDLOOP_ACTOR_GPUS": "3 5,6",
        "WORLDLOOP_LEARNER_STOPWAITSECS": "123",
        "WORLDLOOP_METRICS_HOST": "127.0.0.1",
        "WORLDLOOP_ACTOR_METRICS_PREFIX": actor_prefix,
        "WORLDLOOP_JUDGE_METRICS_PREFIX": judge_prefix,
        "WORLDLOOP_SD_FILE": str(sd_file),
        "WORLDLOOP_SD_INTERVAL": "1",
        **{k: str(v) for k, v in ports.items()},
    }
    env_file.write_text("".join(f"{k}='{v}'\n" for k, v in values.items()))  # as bash reads it
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["WORLDLOOP_ENV_FILE"] = str(env_file)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    subprocess.run([str(DEPLOY / "supervisord.sh")], env=env, check=True, timeout=30)
    ctl = [str(DEPLOY / "ctl.sh")]
    expected = {"worldloop:redis", "worldloop:learner", "worldloop:actor-00", "worldloop:actor-01",
                "worldloop:judge-00", "worldloop:sd"}
    pgids: dict[str, int] = {}
    try:
        metric_ports = {
            "worldloop:learner": ports["WORLDLOOP_LEARNER_METRICS_PORT"],
            "worldloop:actor-00": int(actor_prefix + "00"),
            "worldloop:actor-01": int(actor_prefix + "01"),
            "worldloop:judge-00": int(judge_prefix + "00"),
        }
        deadline = time.monotonic() + 240
        status: dict[str, str] = {}
        served: set[str] = set()
        listed: set[str] = set()
        while time.monotonic() < deadline:
            out = subprocess.run(ctl + ["status"], env=env, capture_output=True, text=True, timeout=30).stdout
            status = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
            served |= {name for name, port in metric_ports.items() if name not in served and _scrape_ok(port)}
            if sd_file.exists():  # worldloop sd found every process from its heartbeat
                listed = {t for g in json.loads(sd_file.read_text()) for t in g["targets"]}
            if (all(status.get(n) == "RUNNING" for n in expected) and served == set(metric_ports)
                    and listed == {f"127.0.0.1:{p}" for p in metric_ports.values()}):
                break
            time.sleep(2)
        logs = "".join(
            f"\n--- {p.name}\n" + p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log"))
        )
        assert set(status) == expected, f"supervisorctl status: {status}{logs}"
        assert all(status[n] == "RUNNING" for n in expected), f"not all RUNNING: {status}{logs}"
        assert served == set(metric_ports), f"/metrics not served by {set(metric_ports) - served}{logs}"
        assert listed == {f"127.0.0.1:{p}" for p in metric_ports.values()}, f"worldloop sd listed {listed}{logs}"

        # idioms, as supervisord itself reports them
        server = _supervisor(sup_dir)
        infos = {f"{i['group']}:{i['name']}": i for i in server.supervisor.getAllConfigInfo()}
        assert set(infos) == expected
        assert all(info["killasgroup"] for info in infos.values()), infos
        assert infos["worldloop:learner"]["stopwaitsecs"] == 123
        # stopasgroup is not in getAllConfigInfo: read it with supervisord's own config parser
        parsed = subprocess.run(["bash", "-c", f'here={DEPLOY}; . {DEPLOY}/env.sh; exec "$WORLDLOOP_PYTHON" -c "$0"', """
from supervisor.options import ServerOptions
o = ServerOptions()
o.realize(args=["-c", "%s"])
for g in o.process_group_configs:
    for pc in g.process_configs:
        print(g.name, pc.name, pc.stopasgroup, pc.killasgroup)
""" % (DEPLOY / "supervisord.conf")], env=env, capture_output=True, text=True, timeout=60)
        rows = {f"{g}:{n}": (a, k) for g, n, a, k in (line.split() for line in parsed.stdout.splitlines())}
        assert rows == {name: ("True", "True") for name in expected}, parsed.stdout + parsed.stderr
        procs = {f"{p['group']}:{p['name']}": p for p in server.supervisor.getAllProcessInfo()}
        pgids = {name: os.getpgid(p["pid"]) for name, p in procs.items()}
        assert all(pgids[name] == procs[name]["pid"] for name in expected)  # each leads its own group

        # per-actor GPUs from WORLDLOOP_ACTOR_GPUS; the learner's list is empty: left unset
        assert _environ(procs["worldloop:actor-00"]["pid"]).get("CUDA_VISIBLE_DEVICES") == "3"
        assert _environ(procs["worldloop:actor-01"]["pid"]).get("CUDA_VISIBLE_DEVICES") == "5,6"
        assert "CUDA_VISIBLE_DEVICES" not in _environ(procs["worldloop:learner"]["pid"])

        # Redis demands the password, and every process authenticated with it (their heartbeats)
        url = values["WORLDLOOP_REDIS_URL"]
        with pytest.raises(redis.AuthenticationError, match="(?i)auth"):
            redis.Redis.from_url(url, socket_timeout=5).ping()
        r = redis.Redis.from_url(url, password=password, socket_timeout=5)
        roles = sorted(json.loads(v)["role"] for v in r.hvals(Keys("deploy-test").procs))
        assert roles == ["actor", "actor", "judge", "learner"]
        # on no command line: redis-server gets it through stdin, the worldloop processes from the environment
        for name, p in procs.items():
            if p["pid"] <= 0:
                continue  # not running (a program this env file does not start)
            assert b"s3cret" not in Path(f"/proc/{p['pid']}/cmdline").read_bytes(), name

        # stopping the group leaves no process of any program's group behind
        out = subprocess.run(ctl + ["stop", "worldloop:*"], env=env, capture_output=True, text=True, timeout=200)
        assert out.returncode == 0, out.stdout + out.stderr
        assert not [name for name, g in pgids.items() if _group_alive(g)], out.stdout
    finally:
        subprocess.run(ctl + ["shutdown"], env=env, capture_output=True, timeout=200)
        for g in pgids.values():
            if _group_alive(g):
                os.killpg(g, 9)


def test_env_file_errors_name_the_variable(tmp_path):
    values = (DEPLOY / "worldloop.env").read_text().replace("WORLDLOOP_CONFIG=", "# WORLDLOOP_CONFIG=")
    (tmp_path / "a.env").write_text(values)
    env = {**os.environ, "WORLDLOOP_ENV_FILE": str(tmp_path / "a.env")}
    env.pop("WORLDLOOP_CONFIG", None)
    res = subprocess.run([str(DEPLOY / "ctl.sh"), "status"], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "WORLDLOOP_CONFIG is not set" in res.stderr, res.stderr
    (tmp_path / "b.env").write_text((DEPLOY / "worldloop.env").read_text() + "WORLDLOOP_LEARNER_STOPWAITSECS=10m\n")
    env["WORLDLOOP_ENV_FILE"] = str(tmp_path / "b.env")
    res = subprocess.run([str(DEPLOY / "ctl.sh"), "status"], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "WORLDLOOP_LEARNER_STOPWAITSECS must be whole seconds" in res.stderr, res.stderr


@pytest.mark.parametrize("url", ["redis://:pw@10.0.0.1:6390/0", "redis://10.0.0.1:6390/0?password=pw",
                                 "rediss://10.0.0.1:6390/0?db=1&ssl_password=pw"])
def test_env_file_refuses_a_redis_url_with_a_password_in_any_form(tmp_path, url):
    """Issue 38, finding 7: redis-py also reads ``?password=``; run.sh puts WORLDLOOP_REDIS_URL on
    every command line, so a password in it is refused in either place."""
    values = (DEPLOY / "worldloop.env").read_text() + f"WORLDLOOP_REDIS_URL='{url}'\n"
    (tmp_path / "a.env").write_text(values)
    env = {**os.environ, "WORLDLOOP_ENV_FILE": str(tmp_path / "a.env")}
    res = subprocess.run([str(DEPLOY / "ctl.sh"), "status"], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "WORLDLOOP_REDIS_URL holds a password" in res.stderr, res.stderr


def test_run_sh_maps_gpus_and_keeps_the_password_off_the_command_line(tmp_path):
    """deploy/run.sh with a stand-in for python that prints what it was given."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec ' + sys.executable + ' "$@"; fi\n'
                    'echo "CUDA=${CUDA_VISIBLE_DEVICES-unset}"; printf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    base = {"PATH": os.environ["PATH"], "WORLDLOOP_PYTHON": str(fake), "WORLDLOOP_REDIS_URL": "redis://10.0.0.1:6390/0"}

    def run(role: str, index: str, **extra) -> list[str]:
        out = subprocess.run([str(DEPLOY / "run.sh"), role, index, "--config", "c.yaml"], env={**base, **extra},
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.splitlines()

    assert run("actor", "0", WORLDLOOP_ACTOR_GPUS="0 1 2") == [
        "CUDA=0", "-m", "worldloop", "actor", "--config", "c.yaml", "redis.url=redis://10.0.0.1:6390/0"]
    assert run("actor", "04", WORLDLOOP_ACTOR_GPUS="0 1 2")[0] == "CUDA=1"  # 4 mod 3, a zero-padded index
    assert run("actor", "1", WORLDLOOP_ACTOR_GPUS="0,1 2,3")[0] == "CUDA=2,3"
    assert run("learner", "0", WORLDLOOP_ACTOR_GPUS="0 1")[0] == "CUDA=unset"
    out = run("judge", "0", WORLDLOOP_REDIS_PASSWORD="p@ss word")
    assert out[-1] == "redis.url=redis://10.0.0.1:6390/0" and not any("p@ss" in a for a in out)
    assert run("serve", "01", WORLDLOOP_SERVE_GPUS="0,1 2,3")[:5] == ["CUDA=2,3", "-m", "worldloop", "serve", "--config"]


def test_supervisord_runs_the_inference_servers_asked_for(tmp_path):
    """WORLDLOOP_NUM_SERVERS=2: server-00 and server-01 in the group, each `run.sh serve NN` on port
    <prefix>NN with the weight channel of the env file, stopped and killed as a group; the default
    (0) adds no process. Read with supervisord's own config parser (starting vLLM is for the
    vllm tests)."""
    script = """
from supervisor.options import ServerOptions
o = ServerOptions()
o.realize(args=["-c", "%s"])
for g in o.process_group_configs:
    for pc in g.process_configs:
        print(g.name + ":" + pc.name, pc.stopasgroup, pc.killasgroup, pc.command.replace(chr(10), " "), sep=chr(9))
""" % (DEPLOY / "supervisord.conf")

    def programs(**values) -> dict[str, str]:
        env_file = tmp_path / "w.env"
        env_file.write_text((DEPLOY / "worldloop.env").read_text() + "".join(f"{k}='{v}'\n" for k, v in {
            "WORLDLOOP_PYTHON": sys.executable, "WORLDLOOP_LOG_DIR": tmp_path, "WORLDLOOP_SUPERVISOR_DIR": tmp_path,
            **values}.items()))
        res = subprocess.run(["bash", "-c", f'here={DEPLOY}; . {DEPLOY}/env.sh; exec "$WORLDLOOP_PYTHON" -c "$0"', script],
                             env={"PATH": os.environ["PATH"], "WORLDLOOP_ENV_FILE": str(env_file)},
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return {name: rest for name, *rest in (line.split("\t") for line in res.stdout.splitlines())}

    assert not [name for name in programs() if ":server" in name]
    two = programs(WORLDLOOP_NUM_SERVERS=2, WORLDLOOP_SERVE_PORT_PREFIX=71, WORLDLOOP_SERVE_HOST="0.0.0.0")
    servers = {name: line for name, line in two.items() if ":server" in name}
    assert sorted(servers) == ["worldloop:server-00", "worldloop:server-01"]
    for i, (name, (stopasgroup, killasgroup, command)) in enumerate(sorted(servers.items())):
        assert stopasgroup == killasgroup == "True"  # vLLM's engine and workers stop with the server
        assert f"run.sh serve {i} --config" in command and f"--host 0.0.0.0 --port 710{i}" in command, command
        assert "weights.pub_port=5555 weights.fetch_port=5556" in command
