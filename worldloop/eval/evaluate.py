"""``worldloop eval``: success rates of a model on held-out seeds, in the layout of VAGEN Table 2.

    worldloop eval --model runs/x/checkpoints --envs sokoban,frozenlake --episodes 32
    OPENAI_API_KEY=... worldloop eval --model gpt-4o --base-url https://api.openai.com/v1 \\
        --envs sokoban,frozenlake,navigation --prompt-format free_think --max-tokens 400

Public API::

    run(cfg, args) -> int                 # the CLI entry point (common/cli.py)
    EnvPlan, Episode                      # what gets played
    plan_envs(cfg, names, *, single_turn, ...) -> list[EnvPlan]
    plan_episodes(plans, model, episodes, seed_start, settings) -> list[Episode]
    EpisodeStore(path)                    # episodes.jsonl: append-only, resumable
    ProgressBar(total, done=0)            # stderr progress bar (tqdm)

Models (``actor/eval_model.py``): an OpenAI-compatible endpoint (``--base-url``; key from
``$eval.api_key_env``, never logged; played message by message in ``actor/eval_remote.py``), a local
HF model directory, a learner checkpoint / checkpoints folder / run directory (played by the actors'
rollout engine ``actor/rollout.py`` with the ``hf`` or ``vllm`` backend).

Seeds: env ``e`` plays seeds ``eval.seed_start + i`` for ``i < episodes``, the same for every env and
every model (paired comparisons), and the range must not overlap the training seeds
``[actor.seed_start, actor.seed_end)``.

Settings: ``--prompt-format`` (reasoning strategy), ``--state-format`` (representation),
``--render-mode``, ``--max-tokens`` (Table 21: 150/400; default 400), ``--temperature`` (Table 21:
0.7), ``eval.top_p`` (1.0), ``--max-turns`` (default per env: VAGEN Tables 7/9/11/13/15, Sokoban 3,
FrozenLake 3, Navigation 4, PrimitiveSkill 3, SVG 2; ``actor.max_turns`` for other envs).

Single-turn mode (``--single-turn``, WMAct Sec. 4 / App. A.3: "all results are evaluated in a
single-turn manner"): one response per episode, and the action budget of that response is the
env's whole episode budget (``max_actions_per_step = max_steps``), since WMAct executes every action
of the answer in order; the episode succeeds only if that plan solves it. WMAct decodes with
temperature 1.0 and allows 12K tokens per turn (App. A.2/A.3): pass ``--temperature 1.0`` and a larger
``--max-tokens`` to match it exactly; the defaults stay Table 21's so that the two modes compare.

Suites: ``--envs vagen`` is Table 2's tasks (frozenlake, sokoban, navigation, navigation-common-sense,
primitive-place/-stack/-drawer/-align, svg), ``--envs wmact`` WMAct Table 1's (sokoban-7x7-2box, the two
hard Sokoban variants, maze, maze-hard-15x15, taxi). Without ``--envs``: the config's ``actor.envs``.

Output folder (``--output``, default ``runs/eval-<model>-<time>``):

* ``episodes.jsonl``: one line per finished episode: key, model, env name/id/kwargs, seed, task,
  success, metrics, error (None or the reason), settings, system prompt, and every turn (prompt text
  with ``<image>`` where the image was, response, parsed actions, rewards, done, success);
* ``results.md`` / ``results.csv``: the table (``actor/eval_stats.py``), also printed on stdout.

Resume: an episode is identified by a hash of (model, env id + kwargs, seed, settings); a rerun with
the same ``--output`` skips episodes already recorded without an error, and re-plays those recorded
with one (the newer line wins). The table holds only the episodes of the current plan.

Sampling (local models): ``eval.sampling: keyed`` (the default) draws each turn's noise from
(``run.seed``, env, seed, turn) alone (:func:`worldloop.actor.rollout.episode_sample_key`): an episode
plays the same at any ``--concurrency``, and two models evaluated on the same seeds share their
noise, so their paired comparison (a sign test on the seeds only one solved) sees the models'
difference rather than sampling luck. Each model's own success rate is an unbiased estimate either
way. ``batch`` seeds each batched call instead, as before the option existed.

Exit code: 0 when every episode ran, 1 when some ended with an error (the table is still written,
with a footnote), 2 for bad input (unknown env, missing model, overlapping seeds), 1 when the
endpoint cannot be reached at all.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from worldloop.eval.model import ModelNotFound, ModelRef, resolve_model
from worldloop.eval.plan import Episode, EnvPlan, make_checked
from worldloop.eval.stats import Table, build_table, family_of
from worldloop.common.contracts.config import Config, ConfigError, env_label
from worldloop.envs.family import families

log = logging.getLogger("worldloop.eval")


def paper_max_turns(task: str) -> int | None:
    """max_turns of a task (``Sokoban``) in its paper (VAGEN Tables 7, 9, 11, 13, 15), as its env
    family states it (``EnvFamily.paper_max_turns``); None where the family states none."""
    return next((f.paper_max_turns[task] for f in families() if task in f.paper_max_turns), None)


# --envs shorthands for the papers' suites (preset names of envs/presets.py)
SUITES = {
    "vagen": ["frozenlake", "sokoban", "navigation", "navigation-common-sense", "primitive-place", "primitive-stack",
              "primitive-drawer", "primitive-align", "svg"],  # VAGEN Table 2
    "wmact": ["sokoban-7x7-2box", "sokoban-hard-10x10", "sokoban-hard-7x7-3box", "maze", "maze-hard-15x15",
              "taxi"],  # WMAct Table 1 (standard and hard variants)
}


# --------------------------------------------------------------------------- planning


def _resolve_env_name(name: str) -> tuple[str, dict]:
    import gymnasium

    from worldloop import envs  # noqa: F401
    from worldloop.envs.presets import PRESETS, resolve

    try:
        return resolve(name)
    except ValueError:
        if name in gymnasium.registry:
            return name, {}
        raise ConfigError("--envs", f"unknown env {name!r}; known presets: {', '.join(sorted(PRESETS))}, "
                                    "or a registered gymnasium id such as worldloop/Sokoban-v0") from None


def plan_envs(cfg: Config, names: list[str] | None, *, single_turn: bool, max_turns: int | None = None,
              prompt_format: str | None = None, state_format: str | None = None,
              render_mode: str = "vision") -> list[EnvPlan]:
    """One EnvPlan per env name (``actor.envs`` of the config when ``names`` is None); each env is
    built once here, so a bad name or kwarg fails before anything runs."""
    specs: list[tuple[str, str, dict]] = []
    if names:
        for n in names:
            env_id, kwargs = _resolve_env_name(n)
            specs.append((n, env_id, kwargs))
    else:
        specs = [(env_label(s), s.id, dict(s.kwargs)) for s in cfg.actor.envs]
    seen: set[str] = set()
    plans = []
    for name, env_id, kwargs in specs:
        if name in seen:
            continue
        seen.add(name)
        kwargs = dict(kwargs, render_mode=render_mode)
        if prompt_format:
            kwargs["prompt_format"] = prompt_format
        if state_format:
            kwargs["state_format"] = state_format
        probe = make_checked(name, env_id, kwargs)
        try:
            if single_turn:
                kwargs["max_actions_per_step"] = int(getattr(probe.unwrapped, "max_steps", 0) or
                                                     getattr(probe.unwrapped, "max_actions_per_step", 1))
                turns = 1
            else:
                turns = max_turns or paper_max_turns(family_of(env_id)) or cfg.actor.max_turns
            pf = getattr(probe.unwrapped, "prompt_format", "") or ""
            sf = getattr(probe.unwrapped, "state_format", "") or ""
        finally:
            probe.close()
        plans.append(EnvPlan(name, env_id, kwargs, turns, pf, sf))
    return plans


def episode_key(model: str, plan: EnvPlan, seed: int, settings: dict) -> str:
    blob = json.dumps({"model": model, "env_id": plan.env_id, "kwargs": plan.kwargs, "max_turns": plan.max_turns,
                       "seed": seed, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def plan_episodes(plans: list[EnvPlan], model: str, episodes: int, seed_start: int, settings: dict) -> list[Episode]:
    return [Episode(p, seed_start + i, episode_key(model, p, seed_start + i, settings))
            for p in plans for i in range(episodes)]


def check_seeds(cfg: Config, seed_start: int, episodes: int) -> None:
    lo, hi = seed_start, seed_start + episodes
    if lo < cfg.actor.seed_end and cfg.actor.seed_start < hi:
        raise ConfigError("eval.seed_start", f"eval seeds [{lo}, {hi}) overlap the training seeds "
                                             f"[{cfg.actor.seed_start}, {cfg.actor.seed_end})")


# --------------------------------------------------------------------------- output


class EpisodeStore:
    """``episodes.jsonl``: one JSON line per finished episode; the last line of a key wins."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        self.bad_lines = 0
        if self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                        self.records[rec["key"]] = rec
                    except (ValueError, KeyError, TypeError):
                        self.bad_lines += 1  # e.g. the last line of a killed run
            if self.bad_lines:
                log.warning("%s: skipped %d unreadable line(s)", self.path, self.bad_lines)

    def done(self, key: str) -> bool:
        rec = self.records.get(key)
        return rec is not None and not rec.get("error")

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, ensure_ascii=False, default=_plain) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:  # never glue a record onto a partial line left by a killed run
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        self.records[record["key"]] = record


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


class ProgressBar:
    """A tqdm bar on stderr: ``[#####-----] 12/40 episodes, success 0.42 | errors 1 | 00:31<01:10``.

    ``done`` / ``successes`` count episodes already recorded (a resumed run starts there; the rate and
    the ETA count only this run's episodes). On a terminal it redraws in place at most 5 times a
    second; into a log file it writes a line at most every 10 s, and always the last one.
    """

    def __init__(self, total: int, done: int = 0, successes: int = 0, stream=None, width: int = 24):
        from tqdm import tqdm

        self.total, self.done, self.width = total, done, width
        self.successes, self.finished, self.errors = successes, done, 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = tqdm(total=total, initial=done, file=self.stream, ascii="-#", leave=True, dynamic_ncols=False,
                        bar_format="[{bar:%d}] {n_fmt}/{total_fmt} episodes{postfix} | {elapsed}<{remaining}" % width,
                        postfix=self._stats(), mininterval=0.2 if self.tty else 10.0, smoothing=0.0, disable=False)

    def _stats(self) -> str:
        rate = f"{self.successes / self.finished:.2f}" if self.finished else "-"
        return f"success {rate} | errors {self.errors}"

    def update(self, success: bool | None, error: bool = False) -> None:
        self.done += 1
        if error:
            self.errors += 1
        else:
            self.finished += 1
            self.successes += int(bool(success))
        self.bar.set_postfix_str(self._stats(), refresh=False)
        self.bar.update(1)
        if self.done >= self.total:
            self.close()

    def line(self) -> str:
        """The bar as one line of text (what it draws)."""
        return str(self.bar)

    def draw(self, force: bool = False) -> None:
        """Redraw now if the bar shows an older count (tqdm drew it when it was made)."""
        if self.bar.n != self.bar.last_print_n:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()  # draws the final state once (a second close does nothing)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/").split("/")[-1])[:60] or "model"


# --------------------------------------------------------------------------- playing


def _record(ep: Episode, model: ModelRef, settings: dict, backend: str, fields: dict) -> dict:
    return {
        "key": ep.key, "model": model.name, "backend": backend, "policy_version": model.policy_version,
        "env": ep.plan.name, "env_id": ep.plan.env_id, "env_kwargs": ep.plan.kwargs, "seed": ep.seed,
        "task": fields.get("task"), "success": bool(fields.get("success")) and not fields.get("error"),
        "metrics": fields.get("metrics") or {}, "error": fields.get("error"),
        "end_reason": fields.get("end_reason") or ("error" if fields.get("error") else None),
        "num_turns": len(fields.get("turns") or []),
        "total_reward": round(sum(t["reward"] for t in fields.get("turns") or []), 6),
        "settings": dict(settings, max_turns=ep.plan.max_turns, prompt_format=ep.plan.prompt_format,
                         state_format=ep.plan.state_format),
        "system_prompt": fields.get("system_prompt"), "turns": fields.get("turns") or [],
        "requests": fields.get("requests"), "time_s": fields.get("time_s"), "finished_at": time.time(),
    }


class _EnvPool:
    """Reusable env instances per plan (envs reset by seed, so reuse changes nothing)."""

    def __init__(self):
        self._free: dict[str, list] = {}
        self._all: list = []

    def get(self, plan: EnvPlan):
        free = self._free.setdefault(plan.name, [])
        if free:
            return free.pop()
        env = plan.make()
        self._all.append(env)
        return env

    def put(self, plan: EnvPlan, env) -> None:
        self._free.setdefault(plan.name, []).append(env)

    def close(self) -> None:
        for env in self._all:
            try:
                env.close()
            except Exception:  # closing must not hide the run's result
                pass


def run_remote(todo: list[Episode], model: ModelRef, settings: dict, cfg: Config, base_url: str, concurrency: int,
               on_record: Callable[[dict], None]) -> None:
    from worldloop.eval.remote import ChatEndpoint, play_episode

    key = os.environ.get(cfg.eval.api_key_env) or ""
    if not key:
        log.info("$%s is not set; sending a dummy API key (fine for local endpoints)", cfg.eval.api_key_env)
    e = cfg.eval

    async def main() -> None:
        endpoint = ChatEndpoint(base_url, model.name, api_key=key or "sk-no-key-set", concurrency=concurrency,
                                timeout_s=e.timeout_s, max_retries=e.max_retries, backoff_s=e.backoff_s)
        pool = _EnvPool()
        sem = asyncio.Semaphore(concurrency)

        async def one(ep: Episode) -> None:
            async with sem:
                env = pool.get(ep.plan)
                try:
                    fields = await play_episode(endpoint, env, ep.seed, max_turns=ep.plan.max_turns,
                                                max_tokens=settings["max_tokens"], temperature=settings["temperature"],
                                                top_p=settings["top_p"])
                except Exception as exc:  # an env that raises: recorded, the others go on
                    log.warning("episode %s seed %d: env error %s: %s", ep.plan.name, ep.seed, type(exc).__name__, exc)
                    fields = {"error": f"env_error: {type(exc).__name__}: {exc}"}
                finally:
                    pool.put(ep.plan, env)
                on_record(_record(ep, model, settings, "openai", fields))

        try:
            await endpoint.check()
            await asyncio.gather(*(one(ep) for ep in todo))
        finally:
            await endpoint.close()
            pool.close()

    asyncio.run(main())


def run_local(todo: list[Episode], model: ModelRef, settings: dict, cfg: Config, backend_name: str,
              concurrency: int, on_record: Callable[[dict], None]) -> None:
    from worldloop.eval.local import play_local

    play_local(todo, model, settings, cfg, backend_name, concurrency,
               lambda ep, fields: on_record(_record(ep, model, settings, backend_name, fields)))


# --------------------------------------------------------------------------- entry point


def _title(model: ModelRef, plans: list[EnvPlan], settings: dict, seeds: tuple[int, int]) -> str:
    pf = ",".join(sorted({p.prompt_format for p in plans}))
    sf = ",".join(sorted({p.state_format for p in plans}))
    mode = "single-turn (WMAct)" if settings["single_turn"] else "multi-turn"
    return (f"{model.source} | {mode}, prompt {pf}, state {sf}, {settings['render_mode']}, max tokens "
            f"{settings['max_tokens']}, temperature {settings['temperature']}, top_p {settings['top_p']}, "
            f"seeds {seeds[0]}..{seeds[1] - 1}")


def write_results(out: Path, table: Table, title: str, model: str) -> None:
    (out / "results.md").write_text(table.render_markdown(title, model), encoding="utf-8")
    (out / "results.csv").write_text(table.render_csv(model), encoding="utf-8")


@dataclass
class _Options:
    """What the command line asks for, resolved against ``cfg.eval`` and checked."""

    episodes: int
    max_turns: int | None
    concurrency: int
    prompt_format: str | None
    state_format: str | None
    settings: dict  # part of every episode's key: max_tokens, temperature, top_p, single_turn, render_mode
    names: list[str] | None  # env names (suites expanded); None: the config's actor.envs
    out: Path


def _options(cfg: Config, args: argparse.Namespace) -> _Options:
    """The command line's flags over ``cfg.eval``; a bad value raises ConfigError naming the flag."""
    e = cfg.eval
    pick = lambda name, default: default if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    episodes = pick("episodes", e.episodes)
    single_turn = bool(getattr(args, "single_turn", False) or e.single_turn)
    max_turns = pick("max_turns", e.max_turns)
    concurrency = pick("concurrency", e.concurrency)
    for flag, value in (("--episodes", episodes), ("--max-tokens", pick("max_tokens", e.max_tokens)),
                        ("--concurrency", concurrency), ("--max-turns", max_turns or 1)):
        if value < 1:
            raise ConfigError(flag, f"must be >= 1, got {value}")
    if pick("temperature", e.temperature) < 0:
        raise ConfigError("--temperature", "must be >= 0")
    if single_turn and max_turns not in (None, 1):
        log.warning("--single-turn plays one turn per episode; ignoring --max-turns %s", max_turns)
    settings = {"max_tokens": pick("max_tokens", e.max_tokens), "temperature": float(pick("temperature", e.temperature)),
                "top_p": float(e.top_p), "single_turn": single_turn, "render_mode": pick("render_mode", e.render_mode)}
    check_seeds(cfg, e.seed_start, episodes)
    names = None
    if getattr(args, "envs", None):
        names = [m for n in args.envs.split(",") if n.strip() for m in SUITES.get(n.strip(), [n.strip()])]
    if names is not None and not names:
        raise ConfigError("--envs", "names no env")
    out = Path(pick("output", e.output) or Path("runs") / f"eval-{_slug(args.model or cfg.model.path or 'warmstart')}-{time.strftime('%Y%m%d-%H%M%S')}")
    return _Options(episodes, max_turns, concurrency, pick("prompt_format", e.prompt_format),
                    pick("state_format", e.state_format), settings, names, out)


def run(cfg: Config, args: argparse.Namespace) -> int:
    e = cfg.eval
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per request otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    o = _options(cfg, args)
    settings, out = o.settings, o.out
    base_url = getattr(args, "base_url", None)
    try:
        model = resolve_model(getattr(args, "model", None), base_url=base_url, cfg=cfg, scratch=out)
    except ModelNotFound as err:
        print(f"worldloop eval: {err}", file=sys.stderr)
        return 2
    plans = plan_envs(cfg, o.names, single_turn=settings["single_turn"], max_turns=o.max_turns,
                      prompt_format=o.prompt_format, state_format=o.state_format, render_mode=settings["render_mode"])
    backend = "openai" if model.kind == "remote" else (getattr(args, "backend", None) or cfg.actor.backend)
    if backend != "openai" and e.sampling == "keyed":
        # part of every episode's key, so a rerun in the other mode does not resume these episodes
        # (batch-mode keys are those of the evaluations made before the mode existed)
        settings["sampling"] = "keyed"
    all_eps = plan_episodes(plans, model.name, o.episodes, e.seed_start, settings)
    out.mkdir(parents=True, exist_ok=True)
    store = EpisodeStore(out / "episodes.jsonl")
    todo = [ep for ep in all_eps if not store.done(ep.key)]
    print(f"worldloop eval: {model.source}; {len(plans)} env(s) x {o.episodes} episode(s), {len(all_eps) - len(todo)} "
          f"already recorded; output {out} (rerun with --output {out} to resume)", file=sys.stderr, flush=True)
    bar = ProgressBar(len(all_eps), done=len(all_eps) - len(todo),
                      successes=sum(1 for ep in all_eps if store.done(ep.key) and store.records[ep.key]["success"]))

    def on_record(rec: dict) -> None:
        store.append(rec)
        bar.update(rec["success"], error=bool(rec["error"]))

    if todo and not _play(todo, model, settings, cfg, backend, base_url, o.concurrency, on_record, bar):
        return 1
    bar.close()
    records = [store.records[ep.key] for ep in all_eps if ep.key in store.records]
    return _report(records, out, _title(model, plans, settings, (e.seed_start, e.seed_start + o.episodes)), model.name)


def _play(todo: list[Episode], model: ModelRef, settings: dict, cfg: Config, backend: str, base_url: str | None,
          concurrency: int, on_record: Callable[[dict], None], bar: ProgressBar) -> bool:
    """Play ``todo`` on the endpoint or locally; False (after saying why) when the endpoint cannot
    be reached at all."""
    bar.draw(force=True)
    try:
        if model.kind == "remote":
            run_remote(todo, model, settings, cfg, base_url, concurrency, on_record)
        else:
            run_local(todo, model, settings, cfg, backend, concurrency, on_record)
    except Exception as err:
        from worldloop.eval.remote import EndpointError

        if isinstance(err, EndpointError):
            bar.close()
            print(f"\nworldloop eval: {err}", file=sys.stderr)
            return False
        raise
    return True


def _report(records: list[dict], out: Path, title: str, model_name: str) -> int:
    """The table of ``records``: written to ``out`` and printed; 1 when some episode ended with an error."""
    table = build_table(records)
    write_results(out, table, title, model_name)
    print(table.render_text(title), flush=True)
    failed = sum(1 for r in records if r.get("error"))
    if failed:
        print(f"worldloop eval: {failed} episode(s) ended with an error (see the footnote and {out / 'episodes.jsonl'}); "
              f"rerun with --output {out} to retry them", file=sys.stderr)
        return 1
    return 0
