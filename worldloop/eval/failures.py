"""Where an agent fails, turn by turn: reading its board (the ``<observation>``) or acting on it.

Public API::

    failure_breakdown(records, judge=None) -> dict   # records: the lines of a `worldloop eval` episodes.jsonl
    format_breakdown(result) -> str      # a markdown table of it
    python -m worldloop.eval.failures OUT/episodes.jsonl [...]

Each episode is replayed from its seed in a fresh env (the record's env id and kwargs) with the
model's own responses, so the true state before every turn is known. Per turn, split into first
turns and later turns:

* ``well_formed``: the turn earned the format reward;
* ``observation_right``: its ``<observation>`` reads the board right by the judge's ``rule``
  scorer (every relation it states true of the true state before the turn, or the score 1.0;
  :func:`worldloop.eval.reading.reading_right`, the definition the run's evaluator reports as
  first-turn reading accuracy; ``--rule-mode`` as the run's ``judge.rule_mode``); strategies
  without an observation count as not right;
* ``on_shortest_path``: at least one action ran and every executed action brought the solver's
  distance to the goal down by one (the turn followed some shortest plan);
* the same, on turns whose observation was right and on turns whose observation was wrong: when
  acting is good only after a right reading, perception is what limits the agent;
* ``dead_end``: after the turn no plan reaches the goal any more (a box in a corner, a hole);
* where the env says what each move runs into (``move_outlook()``, FrozenLake), ``outlook_right``:
  the turn's ``<reasoning>`` is exactly that text of the true state before the turn (what
  ``sft.concise_reasoning: outlook`` teaches), and the dead ends after turns whose outlook was
  right and after those whose outlook was wrong: when only the latter fall, the agent acts on
  what it says (the table shows them when at least one turn's outlook was right); and
  ``against_own_outlook``: the turn's first action moves into a cell its own reasoning called a
  hole or the edge (:func:`worldloop.judge.rule.outlook.outlook_cells`), a move against its words.

Grid envs only (Sokoban, FrozenLake, Maze, Taxi: they have a shortest-plan solver); an episode of
another env, or one whose replay does not end as recorded, is counted in ``skipped`` /
``replay_mismatch`` and left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Iterable

from worldloop.common.contracts.config import JudgeConfig

KINDS = ("first", "later")
COUNTS = ("turns", "well_formed", "observation_right", "on_shortest_path", "right_reading_on_path",
          "wrong_reading_on_path", "dead_end", "outlooks", "outlook_right", "right_outlook_dead_end",
          "wrong_outlook_dead_end", "against_own_outlook")


def _replay(env: Any, record: dict, tally: dict[str, dict[str, int]], judge: JudgeConfig) -> bool:
    """Replay one episode into ``tally``; False when the replay does not end as recorded."""
    from worldloop.actor.rollout import env_name
    from worldloop.eval.reading import reading_right
    from worldloop.judge.rule.outlook import outlook_cells

    u = env.unwrapped
    env.reset(seed=int(record["seed"]))
    info: dict = {"success": False}
    for k, turn in enumerate(record.get("turns") or []):
        t = tally[KINDS[min(k, 1)]]
        state = u._current_state()
        outlook = state.get("outlook")  # the env's move_outlook(), which every state carries
        before = u._distance_to_goal()
        _, _, terminated, truncated, info = env.step(turn["response"])
        ran = int(info["actions_executed"])
        after = u._distance_to_goal()
        right = bool(reading_right(info.get("observation"), state, env_name(record["env_id"]),
                                   format_rewarded=float(info.get("format_reward") or 0.0) > 0, judge=judge))
        on_path = ran > 0 and before - after == ran
        t["turns"] += 1
        t["well_formed"] += bool(info["format_ok"])
        t["observation_right"] += right
        t["on_shortest_path"] += on_path
        t["right_reading_on_path"] += right and on_path
        t["wrong_reading_on_path"] += (not right) and on_path
        dead = u._remaining_plan() is None
        t["dead_end"] += dead
        if outlook is not None:
            said = (info.get("reasoning") or "").strip() == outlook
            t["outlooks"] += 1
            t["outlook_right"] += said
            t["right_outlook_dead_end"] += said and dead
            t["wrong_outlook_dead_end"] += (not said) and dead
            first = str((info.get("actions") or [""])[0]).lower()
            t["against_own_outlook"] += outlook_cells(info.get("reasoning")).get(first) in ("hole", "edge")
        if terminated or truncated:
            break
    return bool(info.get("success")) == bool(record.get("success"))


def failure_breakdown(records: Iterable[dict], judge: JudgeConfig | None = None) -> dict:
    """Per-turn counts and rates (see the module docstring) of finished, error-free episode records;
    ``judge``: the run's judge config (its ``rule_mode``), default the defaults."""
    import gymnasium

    from worldloop import envs  # noqa: F401  (registers worldloop/* ids)
    from worldloop.envs.grid.grid_env import GridEnv

    tally = {k: dict.fromkeys(COUNTS, 0) for k in KINDS}
    episodes = successes = skipped = mismatched = 0
    cache: dict[str, Any] = {}
    for rec in records:
        if rec.get("error"):
            continue
        key = json.dumps([rec["env_id"], rec.get("env_kwargs") or {}], sort_keys=True)
        env = cache.get(key)
        if env is None:
            env = cache[key] = gymnasium.make(rec["env_id"], **(rec.get("env_kwargs") or {}))
        if not isinstance(env.unwrapped, GridEnv):
            skipped += 1
            continue
        trial = {k: dict.fromkeys(COUNTS, 0) for k in KINDS}
        if not _replay(env, rec, trial, judge or JudgeConfig()):
            mismatched += 1
            continue
        for k in KINDS:
            for c in COUNTS:
                tally[k][c] += trial[k][c]
        episodes += 1
        successes += bool(rec.get("success"))
    for env in cache.values():
        env.close()

    def rate(a: int, b: int) -> float | None:
        return a / b if b else None

    rates = {}
    for k, t in tally.items():
        rates[k] = {
            "well_formed": rate(t["well_formed"], t["turns"]),
            "observation_right": rate(t["observation_right"], t["turns"]),
            "on_shortest_path": rate(t["on_shortest_path"], t["turns"]),
            "on_path_if_reading_right": rate(t["right_reading_on_path"], t["observation_right"]),
            "on_path_if_reading_wrong": rate(t["wrong_reading_on_path"], t["turns"] - t["observation_right"]),
            "dead_end": rate(t["dead_end"], t["turns"]),
            "outlook_right": rate(t["outlook_right"], t["outlooks"]),
            "dead_end_if_outlook_right": rate(t["right_outlook_dead_end"], t["outlook_right"]),
            "dead_end_if_outlook_wrong": rate(t["wrong_outlook_dead_end"], t["outlooks"] - t["outlook_right"]),
            "against_own_outlook": rate(t["against_own_outlook"], t["outlooks"]),
        }
    return {"episodes": episodes, "success_rate": rate(successes, episodes), "skipped": skipped,
            "replay_mismatch": mismatched, "counts": tally, "rates": rates}


def format_breakdown(result: dict) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    lines = [f"{result['episodes']} episodes, success {pct(result['success_rate'])} "
             f"(skipped {result['skipped']}, replay mismatches {result['replay_mismatch']})", "",
             "| turns | n | well-formed | observation right | actions on a shortest path | ... if the reading "
             "was right | ... if it was wrong | dead end after |",
             "|---|---|---|---|---|---|---|---|"]
    for k in KINDS:
        r = result["rates"][k]
        lines.append(f"| {k} | {result['counts'][k]['turns']} | {pct(r['well_formed'])} | {pct(r['observation_right'])} | "
                     f"{pct(r['on_shortest_path'])} | {pct(r['on_path_if_reading_right'])} | "
                     f"{pct(r['on_path_if_reading_wrong'])} | {pct(r['dead_end'])} |")
    if any(result["counts"][k]["outlook_right"] for k in KINDS):  # the agent writes the outlook at all
        lines += ["", "| turns | outlook right | dead end after a right outlook | ... after a wrong one | first move "
                  "into a cell its own outlook called a hole or the edge |", "|---|---|---|---|---|"]
        for k in KINDS:
            r = result["rates"][k]
            lines.append(f"| {k} | {pct(r['outlook_right'])} | {pct(r['dead_end_if_outlook_right'])} | "
                         f"{pct(r['dead_end_if_outlook_wrong'])} | {pct(r['against_own_outlook'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worldloop.eval.failures", description=__doc__.split("\n")[0])
    ap.add_argument("episodes", nargs="+", help="episodes.jsonl files written by `worldloop eval`")
    ap.add_argument("--rule-mode", choices=list(typing.get_args(JudgeConfig.model_fields["rule_mode"].annotation)), default="f1",
                    help="how the rule judge scores an observation (the run's judge.rule_mode; default f1)")
    args = ap.parse_args(argv)
    judge = JudgeConfig(rule_mode=args.rule_mode)
    for path in args.episodes:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        print(f"## {path}\n\n{format_breakdown(failure_breakdown(records, judge))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
