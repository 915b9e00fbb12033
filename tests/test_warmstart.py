"""The warm start a run starts from (worldloop/bootstrap/recipe.py, store.py): the recipe hash, the
models shipped in the package, the cache a config that changes the recipe builds into, and the
`worldloop model` command. Nothing here builds a preset's model: the builds use tiny recipes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worldloop.bootstrap import store
from worldloop.bootstrap.recipe import (BUILDER_VERSION, data_fingerprint, read_recipe, recipe_hash, recipe_keys,
                                        tokenizer_hash)
from worldloop.bootstrap.store import SHIPPED_DIR, cache_root, prepare_model, resolve_model, shipped_models
from worldloop.bootstrap.tiny_model import make_tiny_model
from worldloop.common.contracts.config import load_config
from procs import exit_code

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("tiny-frozenlake", "tiny-sokoban")
# a recipe that builds in seconds: SFT on 2 demonstrations of a 3x3 FrozenLake, no grounding
TINY = ["model.max_image_side=56", "model.tiny_grounding_steps=0", "actor.max_turns=2", "actor.max_new_tokens=8",
        "actor.envs=[{id: worldloop/FrozenLake-v0, kwargs: {size: 3, min_actions_to_succeed: 2, render_mode: vision, "
        "image_size: 56}}]", "sft.episodes=2", "sft.epochs=1"]


@pytest.fixture(scope="module")
def fresh_tokenizer(shared_tiny_model) -> Path:
    """A model directory with the tokenizer the code trains now (the weights are not used)."""
    return shared_tiny_model()


@pytest.mark.parametrize("preset", PRESETS)
def test_the_shipped_model_matches_the_code(preset: str, fresh_tokenizer: Path) -> None:
    shipped = SHIPPED_DIR / preset
    rebuild = f"rebuild it with `worldloop model build {preset} --out worldloop/warmstarts/{preset}`"
    recipe = read_recipe(shipped)
    assert recipe is not None and (shipped / "model.safetensors").exists(), f"no shipped model in {shipped}: {rebuild}"
    cfg = load_config(preset)
    assert recipe["builder_version"] == BUILDER_VERSION, (
        f"{preset}'s shipped model was built by builder {recipe['builder_version']}, the code is {BUILDER_VERSION}: {rebuild}")
    changed = {k: (recipe["keys"].get(k), v) for k, v in recipe_keys(cfg).items() if recipe["keys"].get(k) != v}
    changed.update({k: (v, None) for k, v in recipe["keys"].items() if k not in recipe_keys(cfg)})
    assert recipe["recipe_hash"] == recipe_hash(cfg), (
        f"the preset's recipe changed (key: (shipped, now) {changed}): {rebuild}")
    assert tokenizer_hash(shipped) == recipe["tokenizer_hash"], f"{shipped}'s tokenizer is not its recipe's: {rebuild}"
    assert tokenizer_hash(fresh_tokenizer) == recipe["tokenizer_hash"], (
        f"the code trains another tokenizer now (the envs' prompts or answers changed): bump BUILDER_VERSION and {rebuild}")
    assert data_fingerprint(cfg, fresh_tokenizer) == recipe["data_fingerprint"], (
        "the grounding examples or demonstrations the code makes changed (env prompts, demonstrator, answer style): "
        f"bump BUILDER_VERSION and {rebuild}")
    assert shipped_models()[recipe["recipe_hash"]] == shipped
    assert set(recipe["reports"]) == {"grounding", "sft"}
    size = sum(f.stat().st_size for f in shipped.iterdir())
    assert size < 8 * 2**20, f"{shipped} holds {size / 2**20:.1f} MiB"


def test_every_shipped_model_is_a_preset() -> None:
    assert sorted(p.name for p in SHIPPED_DIR.iterdir() if p.is_dir()) == sorted(PRESETS)


def test_the_recipe_hash_is_sha256_of_the_builder_version_and_the_keys() -> None:
    cfg = load_config(None, ["run.seed=7", "sft.enabled=false", "model.tiny_grounding_steps=0"])
    keys = {"run.seed": 7, "model.tiny_copy_pretrain_steps": 0, "model.tiny_grounding_steps": 0, "sft.enabled": False}
    assert recipe_keys(cfg) == keys  # nothing is trained: the envs, image size and SFT keys do not matter
    blob = json.dumps({"builder_version": BUILDER_VERSION, "keys": keys}, sort_keys=True, separators=(",", ":"))
    assert recipe_hash(cfg) == hashlib.sha256(blob.encode()).hexdigest()[:16]


@pytest.mark.parametrize("override", [
    "run.seed=1", "model.tiny_grounding_steps=999", "model.tiny_grounding_lr=0.01", "model.tiny_grounding_agent_every=2",
    "model.tiny_copy_pretrain_steps=5", "sft.epochs=3", "sft.observation_relations=2", "sft.turn_plan=prefix",
    "sft.level_pool=2",
    "actor.max_turns=4", "model.max_image_side=56", "model.freeze_vision=false", "judge.rule_mode=vagen",
    "actor.envs=[{id: worldloop/FrozenLake-v0, kwargs: {size: 5}}]",
])
def test_a_key_that_changes_the_model_changes_the_recipe(override: str) -> None:
    assert recipe_hash(load_config("tiny-frozenlake", [override])) != recipe_hash(load_config("tiny-frozenlake"))


@pytest.mark.parametrize("override", [
    "trainer.actor_lr=0.5", "trainer.eval_episodes=8", "actor.temperature=1.0", "actor.top_p=0.9",
    "actor.max_new_tokens=32", "actor.num_envs=3", "up.time_limit_s=null", "model.path=elsewhere",
    "judge.repetition_penalty=0.0", "eval.episodes=64",
])
def test_a_key_that_does_not_change_the_model_keeps_the_recipe(override: str) -> None:
    assert recipe_hash(load_config("tiny-frozenlake", [override])) == recipe_hash(load_config("tiny-frozenlake"))


def test_a_key_added_later_enters_the_recipe_only_when_set() -> None:
    """sft.level_pool came after the shipped warm starts: at its default it is not a recipe key, so their hashes stay."""
    assert "sft.level_pool" not in recipe_keys(load_config("tiny-frozenlake"))
    assert recipe_keys(load_config("tiny-frozenlake", ["sft.level_pool=3"]))["sft.level_pool"] == 3


def test_the_actors_own_env_kwargs_and_weights_keep_the_recipe() -> None:
    cfg = load_config("tiny-frozenlake")
    cfg.actor.envs[0].train_kwargs = {"max_actions_per_step": 1}  # training episodes alone: not grounding, not SFT
    cfg.actor.envs[0].weight = 3.0
    assert recipe_hash(cfg) == recipe_hash(load_config("tiny-frozenlake"))


def test_a_preset_resolves_to_its_shipped_model_without_building(tmp_path: Path, monkeypatch) -> None:
    def no(*_a, **_k):
        raise AssertionError("a shipped recipe must not be fingerprinted or built")

    monkeypatch.setattr(store, "code_fingerprint", no)
    monkeypatch.setattr(store, "make_model", no)
    cfg = load_config("tiny-frozenlake")
    model = prepare_model(cfg, tmp_path)
    assert model.source == "shipped" and model.path == SHIPPED_DIR / "tiny-frozenlake"
    assert cfg.model.path == str(model.path)  # what the children are given
    record = json.loads((tmp_path / "model.json").read_text())
    assert record["source"] == "shipped" and record["recipe_hash"] == recipe_hash(cfg)
    # the recipe's reports stand in the run directory as when the run made the model
    assert json.loads((tmp_path / "sft.json").read_text()) == read_recipe(model.path)["reports"]["sft"]


def test_an_explicit_model_path_wins_and_a_missing_one_is_an_error_only_when_it_may_not_be_made(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "mine", max_image_side=56)
    assert resolve_model(load_config("tiny-frozenlake", [f"model.path={path}"])).source == "path"
    with pytest.raises(FileNotFoundError, match="has no config.json and model.make_tiny_if_missing is false"):
        resolve_model(load_config("tiny-frozenlake", [f"model.path={tmp_path / 'none'}", "model.make_tiny_if_missing=false"]))
    with pytest.raises(FileNotFoundError, match="model.path is null and model.make_tiny_if_missing is false"):
        resolve_model(load_config("tiny-frozenlake", ["model.make_tiny_if_missing=false"]))
    # an old config naming a model.path that is not there: the recipe's model, nothing written there
    model = resolve_model(load_config("tiny-frozenlake", [f"model.path={tmp_path / 'old'}"]))
    assert model.source == "shipped" and not (tmp_path / "old").exists()


def test_a_changed_recipe_is_built_once_then_taken_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    builds = []
    real = store.make_model
    monkeypatch.setattr(store, "make_model", lambda *a, **k: builds.append(a[1]) or real(*a, **k))
    cfg = load_config(None, TINY)
    key = store.cache_key(recipe_hash(cfg), store.code_fingerprint(cfg))
    stale = cache_root() / f".{key}.build-killed"  # what a builder killed mid-way left
    stale.mkdir(parents=True)
    first = resolve_model(cfg)
    assert first.source == "built" and first.path == tmp_path / "cache" / "worldloop" / "models" / key
    assert builds == [first.path] and not stale.exists()
    assert read_recipe(first.path)["recipe_hash"] == recipe_hash(cfg)
    # the next run of the same recipe takes it from the cache; its recipe.json was not rewritten
    written = (first.path / "recipe.json").stat().st_mtime_ns
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    again = prepare_model(load_config(None, TINY), run_dir)
    assert (again.source, again.path, len(builds)) == ("cache", first.path, 1)
    assert (first.path / "recipe.json").stat().st_mtime_ns == written
    assert json.loads((run_dir / "model.json").read_text())["source"] == "cache"
    # another recipe is another build, in a folder of its own
    other = resolve_model(load_config(None, [*TINY, "run.seed=1"]))
    assert other.source == "built" and other.path != first.path and len(builds) == 2


def test_model_build_is_reproducible_on_one_machine(tmp_path: Path, monkeypatch, capsys) -> None:
    from worldloop.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["model", "build", *TINY, "--out", str(tmp_path / "a")]) == 0
    assert "recipe " + recipe_hash(load_config(None, TINY)) in capsys.readouterr().out
    assert main(["model", "build", *TINY, "--out", str(tmp_path / "b")]) == 0
    a, b = read_recipe(tmp_path / "a"), read_recipe(tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a["reports"]["sft"]["loss_after"] == b["reports"]["sft"]["loss_after"]
    assert a["build"]["torch_threads"] == 1 and a["versions"]["torch"]
    # --out replaces what is there, whole
    assert main(["model", "build", *TINY, "run.seed=3", "--out", str(tmp_path / "a")]) == 0
    assert read_recipe(tmp_path / "a")["keys"]["run.seed"] == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no build or old folder left


def test_a_role_with_no_model_path_takes_the_cached_model_and_never_builds(tmp_path: Path, monkeypatch, capsys) -> None:
    from worldloop.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # a config the evaluator accepts (it checks these before any model is looked for); nothing listens
    # on the Redis URL, and nothing connects before the model is resolved
    assert main(["evaluator", *TINY, "trainer.eval_every=1", "redis.url=redis://127.0.0.1:9/0"]) == 2
    err = capsys.readouterr().err
    assert "no shipped or cached model has this config's recipe" in err and "worldloop model build" in err
    assert not cache_root().exists() or not any(cache_root().iterdir())


def test_two_processes_resolving_one_recipe_build_it_once(tmp_path: Path) -> None:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "worldloop", "model", "resolve", *TINY]
    procs = []
    for i in range(2):
        with open(tmp_path / f"resolve{i}.out", "wb") as out, open(tmp_path / f"resolve{i}.err", "wb") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=tmp_path))
    # both run at once: one builds (about a minute on 2 cores), the other waits for it; 480 s in all
    # for the two, within the test's 600 s, so that this message comes before pytest's timeout
    deadline = time.monotonic() + 480
    try:
        codes = [exit_code(p, max(1.0, deadline - time.monotonic()), f"`worldloop model resolve` #{i}",
                           log=tmp_path / f"resolve{i}.err") for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [((tmp_path / f"resolve{i}.out").read_text(), (tmp_path / f"resolve{i}.err").read_text()) for i in range(2)]
    assert codes == [0, 0], outs
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1, outs
    assert sum("model: built in" in err for _, err in outs) == 1, outs  # the other waited and took it
    models = tmp_path / "cache" / "worldloop" / "models"
    (built,) = [p for p in models.iterdir() if p.is_dir()]
    assert str(built) in paths and (built / "config.json").exists()
    assert [p.name for p in models.iterdir() if p.name.startswith(".")] == []


def test_the_code_fingerprint_is_computed_once_per_recipe_and_code_version(tmp_path: Path, monkeypatch) -> None:
    """store.fingerprint_of keeps code_fingerprint (a fresh tiny model and the recipe's first
    examples) per recipe hash and code version: the second run of a recipe reads it; another recipe,
    other package versions or an unreadable memo compute it again, and the memo holds what the code
    computes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    computed = []
    real = store.code_fingerprint
    monkeypatch.setattr(store, "code_fingerprint", lambda cfg: computed.append(recipe_hash(cfg)) or real(cfg))
    cfg = load_config(None, TINY)
    version = store.code_version()
    assert version == store.code_version() and len(version) == 64
    first = store.fingerprint_of(cfg)
    assert first == real(cfg) and computed == [recipe_hash(cfg)]
    assert store.fingerprint_of(cfg) == first and len(computed) == 1  # read back, not computed
    memo = cache_root().parent / "fingerprints" / f"{recipe_hash(cfg)}-{version[:16]}.json"
    assert json.loads(memo.read_text()) == first
    other = load_config(None, TINY + ["sft.epochs=2"])
    assert recipe_hash(other) != recipe_hash(cfg)
    store.fingerprint_of(other)
    assert computed == [recipe_hash(cfg), recipe_hash(other)]
    memo.write_text('{"tokenizer": 1}')  # damaged: computed again and rewritten
    assert store.fingerprint_of(cfg) == first and len(computed) == 3 and json.loads(memo.read_text()) == first
    versions = store.package_versions()
    monkeypatch.setattr(store, "package_versions", lambda: {**versions, "tokenizers": "0.0.0"})
    assert store.code_version() != version
    assert store.fingerprint_of(cfg) == first and len(computed) == 4  # another install: not trusted
