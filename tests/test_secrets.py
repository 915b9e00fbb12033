"""Secrets stay out of every file, tracker and printout (issue 31, item 9): the redaction rules,
`worldloop config show`, and (slow) a real `worldloop up` run on a Redis with a password, whose run
directory, logs, trackers and process command lines are searched for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.connection import parse_url

from procs import Child, wait_for
from test_cli import cli
from worldloop.common.contracts.config import load_config, to_dict
from worldloop.common.contracts.keys import Keys
from worldloop.common.transport.redis_link import REDIS_PASSWORD_ENV, connect
from worldloop.common.secrets import REDACTED, password_to_env, redacted, redacted_override, strip_password, url_password

PW = "s3cr3t-PW-9f1c"


def test_redaction_removes_url_passwords_and_secret_named_values_but_keeps_curve_key_paths() -> None:
    data = {"redis": {"url": f"redis://user:{PW}@10.0.0.5:6379/0", "namespace": "n"},
            "judge": {"base_url": f"https://bob:{PW}@llm.example/v1", "api_key_env": "OPENAI_API_KEY",
                      "auth_token": PW, "empty_token": None},
            "weights": {"curve_server_secret": "keys/server.key_secret"},
            "list": [f"rediss://:{PW}@[::1]:6380/2"]}
    out = redacted(data)
    assert PW not in repr(out)
    assert out["redis"]["url"] == "redis://user@10.0.0.5:6379/0"
    assert out["judge"]["base_url"] == "https://bob@llm.example/v1"
    assert out["judge"]["auth_token"] == REDACTED and out["judge"]["empty_token"] is None
    assert out["judge"]["api_key_env"] == "OPENAI_API_KEY"  # the name of the variable, not the key
    assert redacted({"max_new_tokens": 24, "api_key": "k", "ctx_token": "t"}) == {
        "max_new_tokens": 24, "api_key": REDACTED, "ctx_token": REDACTED}
    assert out["weights"]["curve_server_secret"] == "keys/server.key_secret"  # a path, not a secret
    assert out["list"] == ["rediss://[::1]:6380/2"]
    assert data["redis"]["url"].endswith("@10.0.0.5:6379/0") and PW in data["redis"]["url"]  # a copy
    assert strip_password("redis://10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"
    assert redacted_override(f"redis.url=redis://:{PW}@h:1/0") == "redis.url=redis://h:1/0"


def test_redaction_removes_every_credential_form_redis_py_reads() -> None:
    """Issue 38, finding 7: redis-py also reads ``?password=`` (and ``?ssl_password=`` for rediss);
    they go like the user info's password. The user name (user info or ``?username=``) and every
    other parameter stay, in their order; what is left still parses to the same connection."""
    url = f"redis://10.0.0.5:6379/0?socket_timeout=3&password={PW}&health_check_interval=5"
    assert redacted({"url": url}) == {"url": "redis://10.0.0.5:6379/0?socket_timeout=3&health_check_interval=5"}
    assert url_password(url) == PW
    both = f"rediss://bob:{PW}@h:6380/2?username=bob&password=other-{PW}&ssl_password={PW}x&ssl_cert_reqs=none"
    assert strip_password(both) == "rediss://bob@h:6380/2?username=bob&ssl_cert_reqs=none"
    assert url_password(both) == PW  # the user info wins, as in redis-py
    assert url_password("redis://h/0?password=a%26b%2B") == "a&b+"  # decoded as redis-py decodes it
    assert strip_password(f"unix://:{PW}@/run/redis.sock?db=1") == "unix:///run/redis.sock?db=1"
    assert strip_password(f"unix:///run/redis.sock?password={PW}") == "unix:///run/redis.sock"
    assert strip_password(f"https://llm.example/v1?api_key={PW}&x=1") == "https://llm.example/v1?x=1"
    # a URL urlsplit cannot read (an unbalanced IPv6 bracket) is still printed without a password
    broken = redacted(f"redis://u:{PW}@[::1:6379/0?password={PW}")
    assert PW not in broken and broken.startswith("redis://u@[::1")
    assert redacted_override(f"redis.url=redis://h:1/0?password={PW}") == "redis.url=redis://h:1/0"
    assert PW not in redacted_override(f"redis.url='redis://h:1/0?db=1&password={PW}'")


_QUERY_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(password=_QUERY_TEXT, user=st.sampled_from(["", "bob"]), in_userinfo=st.booleans(),
       extra=st.lists(st.sampled_from(["db=3", "socket_timeout=2", "health_check_interval=5", "username=bob"]),
                      max_size=3, unique=True), scheme=st.sampled_from(["redis", "rediss"]))
def test_redaction_property_no_password_survives_and_the_rest_parses_the_same(password, user, in_userinfo, extra,
                                                                               scheme) -> None:
    """Any password, in either place, with any other parameters: what redis-py reads from the
    stripped URL is what it read before, less the password; url_password finds what redis-py uses."""
    from urllib.parse import quote

    password = "Zq7" + password  # a prefix that nothing else in the URL holds
    enc = quote(password, safe="")
    query = "&".join([*extra, *([] if in_userinfo else [f"password={enc}"])])
    url = f"{scheme}://{user}{':' + enc if in_userinfo else ''}{'@' if user or in_userinfo else ''}h:6379/0" + (
        f"?{query}" if query else "")
    before = parse_url(url)
    assert url_password(url) == before["password"] == password
    stripped = strip_password(url)
    after = parse_url(stripped)
    assert "password" not in after and "Zq7" not in stripped
    before.pop("password")
    assert after == before


def test_redaction_leaves_every_shipped_preset_as_it_is() -> None:
    """config.yaml is what `worldloop up`'s children read: redaction may change no key but a
    URL's password (a count named max_new_tokens, a discount named gamma_token, a variable name)."""
    from worldloop.common.contracts.config import preset_names

    for name in [None, *preset_names()]:
        d = to_dict(load_config(name))
        assert redacted(d) == d, name


def test_the_password_moves_to_the_environment_and_still_connects() -> None:
    from worldloop.common.transport.redis_local import LocalRedis

    with LocalRedis(password="p@ss:w/rd%") as srv:
        assert "p%40ss%3Aw%2Frd%25@" in srv.url  # percent-encoded in the URL, as redis-py reads it
        cfg = load_config(None, [f"redis.url={srv.url}"])
        env: dict[str, str] = {}
        assert password_to_env(cfg, env)
        assert cfg.redis.url == f"redis://127.0.0.1:{srv.port}/0" and env[REDIS_PASSWORD_ENV] == "p@ss:w/rd%"
        os.environ[REDIS_PASSWORD_ENV] = env[REDIS_PASSWORD_ENV]
        try:
            assert connect(cfg.redis.url).ping()
        finally:
            del os.environ[REDIS_PASSWORD_ENV]


def test_a_query_string_password_moves_to_the_environment_and_still_connects() -> None:
    """`worldloop up`'s config.yaml (password_to_env, then redacted): no ``?password=`` in it, and
    a child that reads it with the environment up gives it reaches the Redis with a password."""
    from worldloop.common.transport.redis_local import LocalRedis

    with LocalRedis(password=PW) as srv:
        url = f"redis://127.0.0.1:{srv.port}/0?password={PW}&socket_timeout=7"
        assert redis.Redis.from_url(url).ping()  # redis-py reads this form
        cfg = load_config(None, [f"redis.url={url}"])
        env: dict[str, str] = {}
        assert password_to_env(cfg, env) and env[REDIS_PASSWORD_ENV] == PW
        written = yaml.safe_dump(redacted(to_dict(cfg)), sort_keys=False)
        assert PW not in written
        child_url = yaml.safe_load(written)["redis"]["url"]
        assert child_url == f"redis://127.0.0.1:{srv.port}/0?socket_timeout=7"
        with pytest.raises(redis.AuthenticationError, match="authenticat"):
            redis.Redis.from_url(child_url).ping()
        os.environ[REDIS_PASSWORD_ENV] = env[REDIS_PASSWORD_ENV]
        try:
            assert connect(child_url).ping()
        finally:
            del os.environ[REDIS_PASSWORD_ENV]


@pytest.mark.parametrize("url", [f"redis://:{PW}@host:6399/0", f"redis://host:6399/0?password={PW}"])
def test_config_show_prints_no_password_in_either_form(url: str) -> None:
    out = cli("config", "show", "tiny-frozenlake", f"redis.url={url}")
    assert out.returncode == 0, out.stderr
    assert PW not in out.stdout and PW not in out.stderr  # neither the YAML nor the echoed overrides
    assert "overrides: redis.url=redis://host:6399/0" in out.stdout
    assert yaml.safe_load(out.stdout)["redis"]["url"] == "redis://host:6399/0"
    assert f"${REDIS_PASSWORD_ENV}" in out.stdout  # says where the password goes instead


@pytest.mark.parametrize("url", [f"redis://:{PW}@10.0.0.5:6399/0", f"redis://10.0.0.5:6399/0?password={PW}"])
def test_an_inference_servers_config_holds_no_password(url: str) -> None:
    """`worldloop serve` hands its processes the config as JSON in their environment: the password
    travels in $WORLDLOOP_REDIS_PASSWORD instead, as with `worldloop up`'s children."""
    from worldloop.actor.server.launch import CONFIG_ENV, server_env

    cfg = load_config(None, [f"redis.url={url}"])
    env = server_env(cfg, base={}, on_gpu=False)
    assert PW not in env[CONFIG_ENV] and env[REDIS_PASSWORD_ENV] == PW
    assert json.loads(env[CONFIG_ENV])["redis"]["url"] == "redis://10.0.0.5:6399/0"
    assert cfg.redis.url == url  # the caller's config is left as it was


def test_status_and_a_bad_url_print_no_query_string_password() -> None:
    from worldloop.common.metrics import free_port

    out = cli("status", f"redis.url=redis://127.0.0.1:{free_port()}/0?password={PW}", "redis.socket_timeout_s=1")
    assert out.returncode == 1 and "cannot read Redis at redis://127.0.0.1:" in out.stderr
    assert PW not in out.stderr + out.stdout
    with pytest.raises(ValueError, match="must start with redis://") as e:
        connect(f"http://h/0?password={PW}")
    assert PW not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_a_run_on_a_redis_with_a_password_writes_it_nowhere(tmp_path: Path, form: str) -> None:
    """`worldloop up` with `redis.url=redis://:PW@...` or `redis://...?password=PW` (TensorBoard and
    wandb offline on): the run works (its children get the password from the environment) and no
    file under the run directory, no line of up's output and no child's command line holds it."""
    from worldloop.common.transport.redis_local import LocalRedis

    with LocalRedis(password=PW) as srv:
        url = srv.url if form == "userinfo" else f"redis://127.0.0.1:{srv.port}/0?password={PW}"
        run_dir = tmp_path / "run"
        cfg_path = tmp_path / "tiny.yaml"
        cfg_path.write_text(yaml.safe_dump({
            "run": {"name": "secret", "run_dir": str(run_dir), "loggers": ["jsonl", "tensorboard", "wandb"]},
            "redis": {"url": url, "namespace": "secret", "max_backlog": 32, "claim_idle_ms": 3000},
            "weights": {"pub_port": 0, "fetch_port": 0},
            "model": {"path": str(tmp_path / "model"), "make_tiny_if_missing": True, "max_image_side": 56},
            "actor": {"num_envs": 2, "max_turns": 2, "max_new_tokens": 24, "n_samples_per_seed": 2,
                      "envs": [{"id": "worldloop/FrozenLake-v0", "kwargs": {"size": 3, "min_actions_to_succeed": 2}}]},
            "judge": {"enabled": True, "scorers": {"default": ["rule"]}},
            "trainer": {"total_steps": 2, "train_batch_size": 4, "ppo_mini_batch_size": 2, "micro_batch_size": 1,
                        "checkpoint_every": 2, "eval_every": 0},
            "sft": {"enabled": False},
            "up": {"num_actors": 1, "num_judges": 1, "progress_interval_s": 1.0},
        }))
        assert PW in url
        up = Child(["up", str(cfg_path)], tmp_path / "up.log", env={"WANDB_MODE": "offline", "WANDB_DIR": str(run_dir),
                                                                     REDIS_PASSWORD_ENV: ""})
        r = redis.Redis.from_url(srv.url)
        cmdlines: list[bytes] = []

        def children_seen() -> bool:
            for pid in os.listdir("/proc"):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"worldloop" in cmd and str(run_dir).encode() in cmd:  # up's children: --config <run_dir>/...
                    cmdlines.append(cmd)
            return r.hlen(Keys("secret").procs) >= 3

        try:
            wait_for(children_seen, "the learner, actor and judge heartbeats", 600, [up])
            rc = up.wait(timeout=900)
        finally:
            up.stop()
        out = up.output(None)
        assert rc == 0, out[-4000:]
        assert (run_dir / "learner_ledger.jsonl").exists() and (run_dir / "tensorboard").exists()
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"] == f"redis://127.0.0.1:{srv.port}/0"
        leaks = [str(p) for p in run_dir.rglob("*") if p.is_file() and PW.encode() in p.read_bytes()]
        assert leaks == []
        assert PW not in out
        assert cmdlines and not [c for c in cmdlines if PW.encode() in c]
