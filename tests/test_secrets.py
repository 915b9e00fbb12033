"""Secrets stay out of every file, tracker and printout (issue 31, item 9): the redaction rules,
`worldloop config show`, and (slow) a real `worldloop up` run on a Redis with a password, whose run
directory, logs, trackers and process command lines are searched for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
import yaml

from procs import Child, wait_for
from test_cli import cli
from worldloop.common.keys import Keys
from worldloop.common.config import load_config, to_dict
from worldloop.common.redis_link import REDIS_PASSWORD_ENV, connect
from worldloop.common.secrets import REDACTED, password_to_env, redacted, redacted_override, strip_password

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


def test_redaction_leaves_every_shipped_preset_as_it_is() -> None:
    """config.yaml is what `worldloop up`'s children read: redaction may change no key but a
    URL's password (a count named max_new_tokens, a discount named gamma_token, a variable name)."""
    from worldloop.common.config import preset_names

    for name in [None, *preset_names()]:
        d = to_dict(load_config(name))
        assert redacted(d) == d, name


def test_the_password_moves_to_the_environment_and_still_connects() -> None:
    from worldloop.common.redis_local import LocalRedis

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


def test_config_show_prints_no_password() -> None:
    out = cli("config", "show", "tiny-frozenlake", f"redis.url=redis://:{PW}@host:6399/0")
    assert out.returncode == 0, out.stderr
    assert PW not in out.stdout and PW not in out.stderr
    assert yaml.safe_load(out.stdout)["redis"]["url"] == "redis://host:6399/0"
    assert f"${REDIS_PASSWORD_ENV}" in out.stdout  # says where the password goes instead


@pytest.mark.slow
def test_a_run_on_a_redis_with_a_password_writes_it_nowhere(tmp_path: Path) -> None:
    """`worldloop up` with `redis.url=redis://:PW@...` (TensorBoard and wandb offline on): the run
    works (its children get the password from the environment) and no file under the run
    directory, no line of up's output and no child's command line holds the password."""
    from worldloop.common.redis_local import LocalRedis

    with LocalRedis(password=PW) as srv:
        run_dir = tmp_path / "run"
        cfg_path = tmp_path / "tiny.yaml"
        cfg_path.write_text(yaml.safe_dump({
            "run": {"name": "secret", "run_dir": str(run_dir), "loggers": ["jsonl", "tensorboard", "wandb"]},
            "redis": {"url": srv.url, "namespace": "secret", "max_backlog": 32, "claim_idle_ms": 3000},
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
        assert PW in srv.url
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
            up.kill()
        out = up.output(None)
        assert rc == 0, out[-4000:]
        assert (run_dir / "learner_ledger.jsonl").exists() and (run_dir / "tensorboard").exists()
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"] == f"redis://127.0.0.1:{srv.port}/0"
        leaks = [str(p) for p in run_dir.rglob("*") if p.is_file() and PW.encode() in p.read_bytes()]
        assert leaks == []
        assert PW not in out
        assert cmdlines and not [c for c in cmdlines if PW.encode() in c]
