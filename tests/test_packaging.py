"""The built wheel, installed into a fresh virtual environment and used from outside the repository:
one import root (``worldloop``), no top-level ``common``/``envs``/..., presets and deployment files
shipped as package data, and the console script."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "worldloop"
    # build from a copy of the tracked tree, so the checkout gets no build/ or egg-info of its own
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True)
    (whl,) = out.glob("worldloop-*.whl")
    return whl


def test_the_wheel_holds_one_import_root_and_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("worldloop-")}
    assert tops == {"worldloop"}, tops
    for must in ("worldloop/configs/tiny-sokoban.yaml", "worldloop/configs/tiny-frozenlake.yaml",
                 "worldloop/deploy/supervisord.conf", "worldloop/deploy/prometheus.yml",
                 "worldloop/deploy/grafana/dashboards/worldloop.json", "worldloop/common/config.py",
                 "worldloop/actor/process.py", "worldloop/judge/process.py", "worldloop/learner/process.py",
                 "worldloop/envs/grid/sokoban.py", "worldloop/eval/evaluate.py"):
        assert must in names, must
    # the presets' warm starts ship whole: every tracked file of worldloop/warmstarts
    shipped = subprocess.run(["git", "ls-files", "worldloop/warmstarts"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for preset in ("tiny-frozenlake", "tiny-sokoban"):
        for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "recipe.json"):
            assert f"worldloop/warmstarts/{preset}/{f}" in shipped, f"{preset}/{f} is not tracked"
    assert [f for f in shipped if f not in names] == []
    # every tracked preset and deployment file ships (dashboards, provisioning, alert rules, scripts)
    tracked = subprocess.run(["git", "ls-files", "configs", "deploy"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = [f for f in tracked if f"worldloop/{f}" not in names]
    assert not missing, missing
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "worldloop = worldloop.cli:run" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.timeout(900)  # five commands of at most 120 s each, the venv and the install
def test_a_fresh_venv_imports_worldloop_and_nothing_else(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # the dependencies come from this environment's site-packages, added as a plain path (its .pth
    # files, such as the editable install's finder, are not run from there)
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip())
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=180)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=outside, env=env, capture_output=True, text=True, timeout=120)

    probe = run(str(py), "-c", (
        "import importlib, json, worldloop.common.contracts.config as c\n"
        "out = {'config': c.__file__}\n"
        "for name in ('common', 'envs', 'actor', 'judge', 'learner'):\n"
        "    try:\n"
        "        importlib.import_module(name); out[name] = 'importable'\n"
        "    except ImportError:\n"
        "        out[name] = 'absent'\n"
        "print(json.dumps(out))"))
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert str(env_dir) in got.pop("config")  # the installed copy, not the checkout
    assert got == {name: "absent" for name in ("common", "envs", "actor", "judge", "learner")}

    script = env_dir / "bin" / "worldloop"
    for cmd in ("up", "eval"):
        h = run(str(script), cmd, "--help")
        assert h.returncode == 0 and "usage: worldloop " + cmd in h.stdout, h.stdout + h.stderr
    # a preset by name, from the package data of the wheel
    shown = run(str(py), "-c", "from worldloop.common.contracts.config import load_config; "
                               "c = load_config('tiny-sokoban'); print(c.run.name, c.source)")
    assert shown.returncode == 0, shown.stderr
    name, source = shown.stdout.split()
    assert name == "tiny-sokoban" and str(env_dir) in source
    bad = run(str(py), "-c", "from worldloop.common.contracts.config import load_config; load_config('no-such-preset')")
    assert bad.returncode != 0 and "tiny-sokoban" in bad.stderr  # the error lists the presets
    # a fresh install starts a preset from its shipped warm start, inside the installed package
    where = run(str(script), "model", "resolve", "tiny-frozenlake")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(env_dir)) and where.stdout.strip().endswith("warmstarts/tiny-frozenlake")
    assert "shipped" in where.stderr
