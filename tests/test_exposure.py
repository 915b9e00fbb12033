"""What a run exposes (issue 31, items 10 and 11): a Redis reachable from other hosts without a
password is refused (worldloop's own redis-server, deploy/redis.sh) or warned about (a client);
a plaintext weight channel on a non-loopback address is warned about; a checkpoint is never
unpickled with code; `worldloop show` inlines only images inside the folder it shows; the
supervisor's folder is private."""

from __future__ import annotations

import html
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worldloop.common.exposure import is_loopback, warn_plain_weights
from worldloop.common.transport.redis_link import REDIS_PASSWORD_ENV, connect
from worldloop.common.transport.redis_local import LocalRedis

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def test_loopback_addresses() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.org", "", None))


def test_worldloops_own_redis_refuses_a_non_loopback_bind_without_a_password() -> None:
    with pytest.raises(ValueError, match="refusing to start redis-server on 0.0.0.0 without a password"):
        LocalRedis(host="0.0.0.0").start()
    with LocalRedis(host="0.0.0.0", password="pw") as srv:  # with one it starts
        assert connect(f"redis://:pw@127.0.0.1:{srv.port}/0").ping()


def _redis_sh(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """deploy/redis.sh with a stand-in redis-server that prints its arguments."""
    fake = tmp_path / "redis-server"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    base = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "WORLDLOOP_REDIS_PORT": "6390", "WORLDLOOP_RUN_DIR": str(tmp_path)}
    return subprocess.run(["bash", str(DEPLOY / "redis.sh")], env={**base, **env}, capture_output=True, text=True,
                          timeout=30)


def test_deploy_redis_refuses_a_non_loopback_bind_without_a_password(tmp_path) -> None:
    res = _redis_sh(tmp_path, WORLDLOOP_REDIS_BIND="127.0.0.1 10.0.0.5")
    assert res.returncode == 2 and "refusing to start redis-server on 10.0.0.5 without a password" in res.stderr
    res = _redis_sh(tmp_path, WORLDLOOP_REDIS_BIND="127.0.0.1")
    assert res.returncode == 0 and "127.0.0.1" in res.stdout.split()


def test_a_client_warns_once_about_a_network_redis_without_a_password(caplog, monkeypatch) -> None:
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="worldloop.common.exposure"):
        connect("redis://10.255.0.7:6379/0")  # no command is sent: connect() only builds the client
        connect("redis://10.255.0.7:6379/1")
        connect("redis://:pw@10.255.0.8:6379/0")
        connect("redis://10.255.0.11:6379/0?password=pw")  # redis-py's other form: no warning either
        connect("redis://bob@10.255.0.12:6379/0?username=bob&password=pw")
        connect("rediss://10.255.0.9:6379/0")
        connect("redis://127.0.0.1:6379/0")
        monkeypatch.setenv(REDIS_PASSWORD_ENV, "pw")
        connect("redis://10.255.0.10:6379/0")
    warned = [r.getMessage() for r in caplog.records if "SECURITY" in r.getMessage()]
    assert len(warned) == 1 and "10.255.0.7:6379" in warned[0] and "without a password" in warned[0]


def test_a_plaintext_weight_channel_off_loopback_is_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="worldloop.common.exposure"):
        assert warn_plain_weights("learner", "0.0.0.0", None)
        assert warn_plain_weights("actor", "10.0.0.5", None)
        assert not warn_plain_weights("learner", "0.0.0.0", "keys/server.key_secret")
        assert not warn_plain_weights("actor", "127.0.0.1", None)
    assert [r.getMessage().split(" in plaintext")[0] for r in caplog.records] == [
        "SECURITY: the learner binds the weight channel on 0.0.0.0", "SECURITY: the actor fetches weights from 10.0.0.5"]


class _Evil:
    """Unpickling it with code allowed would create the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_is_read_without_running_its_code(tmp_path) -> None:
    from worldloop.eval.model import _deepspeed_state_dict

    tag = tmp_path / "ckpt" / "ds"
    tag.mkdir(parents=True)
    marker = tmp_path / "ran"
    torch.save({"module": {"w": torch.zeros(2)}, "x": _Evil(str(marker))}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        _deepspeed_state_dict(tmp_path / "ckpt")
    assert not marker.exists()
    torch.save({"module": {"w": torch.ones(2)}}, tag / "mp_rank_00_model_states.pt")  # a plain one loads
    assert _deepspeed_state_dict(tmp_path / "ckpt")["w"].tolist() == [1.0, 1.0]


def test_show_inlines_only_images_inside_the_folder_it_shows(tmp_path) -> None:
    import base64

    from worldloop.show import image_url

    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
    shown, outside = tmp_path / "run", tmp_path / "private"
    (shown / "img").mkdir(parents=True)
    outside.mkdir()
    (shown / "img" / "a.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    (shown / "img" / "link.png").symlink_to(outside / "secret.png")
    assert image_url("img/a.png", shown).startswith("data:image/png;base64,")
    assert image_url(str(shown / "img" / "a.png"), shown).startswith("data:image/png")  # absolute, inside
    for item in (str(outside / "secret.png"), "../private/secret.png", "img/link.png"):
        assert image_url(item, shown) is None, item


def test_the_supervisor_folder_must_be_private(tmp_path) -> None:
    def check(path: Path, create: bool = False) -> subprocess.CompletedProcess:
        script = (f'set -euo pipefail; here={DEPLOY}; WORLDLOOP_ENV_FILE={DEPLOY}/worldloop.env; . {DEPLOY}/env.sh; '
                  f'private_dir "$0" {"create" if create else ""}')
        return subprocess.run(["bash", "-c", script, str(path)], capture_output=True, text=True, timeout=30)

    fresh = tmp_path / "a" / "sup"
    assert check(fresh, create=True).returncode == 0
    assert oct(fresh.stat().st_mode & 0o777) == "0o700"
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    res = check(open_dir)
    assert res.returncode == 2 and "writable by others" in res.stderr
    if os.geteuid() == 0:  # only root can make a folder another user's
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)  # another user made it first
        res = check(theirs, create=True)
        assert res.returncode == 2 and "belongs to uid 12345" in res.stderr
    link = tmp_path / "link"
    link.symlink_to(fresh)
    assert check(link).returncode == 2


def _show(folder: Path) -> subprocess.CompletedProcess:
    """``python -m worldloop show episodes.jsonl`` run in ``folder``: its modules are importable there
    (``-m`` puts the working directory first on sys.path)."""
    return subprocess.run([sys.executable, "-m", "worldloop", "show", "episodes.jsonl"], cwd=folder, capture_output=True,
                          text=True, timeout=300)


def test_show_never_imports_a_module_that_a_record_names(tmp_path) -> None:
    """Issue 38, finding 8: gymnasium.make("evilenv:Env-v0") imports ``evilenv``; the viewer re-plays
    only ids that worldloop registers, so a module beside the JSONL never runs, and the record is
    still shown, its env id marked unknown."""
    marker = tmp_path / "IMPORTED"
    run = tmp_path / "run"
    run.mkdir()
    (run / "evilenv.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                    "import gymnasium\nclass Env(gymnasium.Env):\n    pass\n")
    rec = {"env": "evil", "env_id": "evilenv:Env-v0", "seed": 3, "success": False,
           "turns": [{"response": "<answer>Left</answer>", "reward": 0.0}]}
    (run / "episodes.jsonl").write_text(json.dumps(rec) + "\n")
    res = _show(run)
    assert res.returncode == 0, res.stderr
    assert not marker.exists()
    page = html.unescape((run / "episodes.html").read_text())
    assert "unknown env id 'evilenv:Env-v0': not one that worldloop registers" in page
    assert "<answer>Left</answer>" in page  # the record itself is shown


def test_show_replays_an_svg_record_without_loading_the_weights_it_names(tmp_path) -> None:
    """A record's env_kwargs naming model weights (``metric="dino"`` with a ``dino_model`` folder
    beside the file) are not loaded: the viewer re-plays with the pixel metric."""
    run = tmp_path / "run"
    (run / "dino").mkdir(parents=True)
    rec = {"env": "svg", "env_id": "worldloop/SVG-v0", "seed": 1, "success": False,
           "env_kwargs": {"metric": "dino", "dino_model": str(run / "dino")},
           "turns": [{"response": "<answer><svg xmlns='http://www.w3.org/2000/svg'></svg></answer>", "reward": 0.0}]}
    (run / "episodes.jsonl").write_text(json.dumps(rec) + "\n")
    res = _show(run)
    assert res.returncode == 0, res.stderr
    page = html.unescape((run / "episodes.html").read_text())
    assert "could not re-play" not in page and "DINO" not in page
    assert "data:image/png;base64," in page  # the re-play's image of the turn
