"""Experiment trackers: the learner's per-step metrics and sampled episodes in TensorBoard / wandb.

``run.loggers`` lists where the learner's metrics go (``jsonl`` is the default):

``jsonl``
    ``<run_dir>/metrics.jsonl``, one line per step, and ``<run_dir>/samples.jsonl``; both are
    written whatever this list says (``worldloop up``, ``--resume`` and ``worldloop show`` read them;
    metrics.jsonl is written by ``learner/process.py``).
``tensorboard``
    event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``).
``wandb``
    a wandb run (project ``$WANDB_PROJECT`` or ``worldloop``, named ``run.name``, files under
    ``$WANDB_DIR`` or ``<run_dir>``); ``WANDB_MODE=offline`` keeps it off the network (``wandb sync``
    uploads it later). A resumed learner (``--resume``) continues the same wandb run (its id is
    kept in ``<run_dir>/wandb_run_id``). A wandb that cannot start (not logged in, a bad
    ``WANDB_*`` variable) is a :class:`ConfigError` at start-up.

What each tracker gets:

* every learner step, every number of the step's ``metrics.jsonl`` record on the **step axis**,
  nested keys joined by ``/`` (``losses/policy``, ``kl``, ``entropy``, ``clip_fraction``,
  ``advantage/mean``, ``importance_weight/max``, ``reward/total``, ``reward/env``,
  ``success_rate/sokoban``, ``staleness_mean``, ``step_seconds/forward``, ``tokens_per_s``, ...);
  ``None`` values and text are left out;
* the held-out evaluations (``{"eval": {...}}`` lines that ``worldloop evaluator`` appends to
  ``<run_dir>/eval.jsonl``), read at each step and at close, as ``eval/...`` on their own axis,
  the policy version evaluated (``eval/step``). After its last step the learner waits up to
  ``trainer.final_eval_wait_s`` for a live evaluator's evaluation of the final version
  (:meth:`Trackers.wait_for_eval`), so the trackers get that one too; one written later (no live
  evaluator, or past the wait) is only in ``eval.jsonl`` / ``metrics.jsonl``;
* the resolved config (``common/contracts/config.py`` ``to_dict``, secrets removed by ``common/secrets.py``
  ``redacted``) once at start: wandb's run config,
  TensorBoard's text ``config``;
* every ``trainer.sample_every`` steps (0 = never), :data:`SAMPLES_PER_STEP` episodes of the
  step's batch (the lowest, highest and evenly spaced total rewards between): a wandb table
  ``samples`` with one row per turn (image, the agent's text, parsed observation/prediction, the
  true states, actions, env/format/judge/total reward), in TensorBoard one text ``samples/<k>``
  (a markdown table of the turns) and the images ``samples/<k>/turn<i>``. The same episodes go to
  ``<run_dir>/samples.jsonl`` (one :class:`~worldloop.common.contracts.schemas.Trajectory` per line as JSON,
  images as base64 PNG, token ids left out, plus ``step`` and ``total_reward``), which
  ``worldloop show <run_dir>/samples.jsonl`` renders.

Public API::

    check_loggers(cfg)                     # ConfigError naming run.loggers when a package is missing
    trackers = open_trackers(run_dir, cfg) # all of run.loggers (rank 0 only)
    trackers.log_step(step, record, trajs) # after the step's metrics.jsonl line is written
    trackers.wait_for_eval(version, alive, timeout_s) -> bool   # the final evaluation, before close
    trackers.close()
    flatten(record) -> {"losses/policy": 0.12, ...}
    pick_samples(trajs, k) -> [Trajectory, ...]
    sample_record(traj, step) -> dict      # one samples.jsonl line

TensorBoard and wandb are optional extras (``pip install 'worldloop[tensorboard]'`` /
``'worldloop[wandb]'``), imported only when listed.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from worldloop.common.contracts.config import Config, ConfigError, to_dict
from worldloop.common.cores import usable_cores
from worldloop.common.secrets import redacted
from worldloop.common.files import append_lines
from worldloop.common.contracts.schemas import Trajectory, total_turn_reward

log = logging.getLogger("worldloop.learner.trackers")

LOGGERS = ("jsonl", "tensorboard", "wandb")
SAMPLES_PER_STEP = 4
SAMPLE_COLUMNS = ["step", "episode", "env", "seed", "trajectory_id", "turn", "image", "response", "observation",
                  "prediction", "state_before", "state_after", "actions", "env_reward", "format_reward",
                  "reasoning_reward", "total_reward", "done", "success"]
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
_SKIP = {"time", "repaired"}  # wall-clock time is not a metric; "repaired" marks restored lines
_TOKEN_FIELDS = ("obs_ids", "response_ids", "logprobs")


# --------------------------------------------------------------------------- pure helpers


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a nested record as ``{"a/b": float}``; None, text and non-finite values are
    left out, booleans become 0/1."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if not prefix and k in _SKIP:
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, (int, float)) and math.isfinite(v):
            out[key] = float(v)
    return out


def episode_reward(traj: Trajectory) -> float:
    return sum(total_turn_reward(t) for t in traj.turns)


def pick_samples(trajs: list[Trajectory], k: int = SAMPLES_PER_STEP) -> list[Trajectory]:
    """``k`` episodes spread over the batch's total rewards: the lowest, the highest and evenly
    spaced ones between (ties keep batch order)."""
    if k <= 0 or not trajs:
        return []
    order = sorted(range(len(trajs)), key=lambda i: episode_reward(trajs[i]))
    if len(order) <= k:
        return [trajs[i] for i in order]
    picks = sorted({round(j * (len(order) - 1) / (k - 1)) for j in range(k)}) if k > 1 else [0]
    return [trajs[order[p]] for p in picks]


def sample_record(traj: Trajectory, step: int) -> dict:
    """One ``samples.jsonl`` line: the trajectory as JSON (images base64) without token ids, plus
    ``step`` and ``total_reward`` (the shape ``worldloop show`` reads)."""
    rec = msgspec.to_builtins(traj)  # bytes -> base64 strings
    for t, turn in zip(rec["turns"], traj.turns):
        for f in _TOKEN_FIELDS:
            t.pop(f, None)
        t["reward"] = total_turn_reward(turn)  # the turn's total, as worldloop show shows it
    rec["step"] = step
    rec["total_reward"] = episode_reward(traj)
    return rec


def _state_text(state) -> str:
    parts = list(state.relations)
    if state.symbolic:
        parts.append(state.symbolic)
    return "\n".join(parts)


def sample_rows(samples: list[Trajectory], step: int) -> list[dict]:
    """One row per turn of each sampled episode (``image``: the turn's first image, PNG bytes)."""
    rows = []
    for e, traj in enumerate(samples):
        for turn in traj.turns:
            rows.append({
                "step": step, "episode": e, "env": traj.env_name, "seed": traj.seed,
                "trajectory_id": traj.trajectory_id, "turn": turn.index,
                "image": turn.images[0] if turn.images else None, "images": list(turn.images),
                "response": turn.response_text, "observation": turn.observation or "",
                "prediction": turn.prediction or "", "state_before": _state_text(turn.state_before),
                "state_after": _state_text(turn.state_after), "actions": ", ".join(turn.actions),
                "env_reward": float(turn.env_reward), "format_reward": float(turn.format_reward),
                "reasoning_reward": float(turn.reasoning_reward or 0.0), "total_reward": total_turn_reward(turn),
                "done": bool(turn.done), "success": bool(turn.success),
            })
    return rows


def _png_array(data: bytes):
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


# --------------------------------------------------------------------------- trackers


def check_loggers(cfg: Config) -> None:
    """Fail at start-up when a listed logger's package is not installed."""
    for name in cfg.run.loggers:
        pkg = _PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError("run.loggers", f"'{name}' is listed but the {pkg} package is not installed "
                                             f"(pip install 'worldloop[{name}]', or remove it from run.loggers)")


class Tracker:
    """One destination. ``metrics`` are flat ``{name: float}``."""

    def log_step(self, step: int, metrics: dict[str, float], samples: list[Trajectory]) -> None: ...

    def log_eval(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlTracker(Tracker):
    """metrics.jsonl is the learner's own file; this one writes the sampled episodes."""

    def __init__(self, run_dir: Path, cfg: Config):
        self.path = Path(run_dir) / "samples.jsonl"

    def log_step(self, step, metrics, samples):
        if samples:
            append_lines(self.path, [json.dumps(sample_record(traj, step)) + "\n" for traj in samples])


def _md_cell(x: Any) -> str:
    if isinstance(x, float):
        x = f"{x:.4g}"
    return str(x).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path, cfg: Config):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        text = json.dumps(redacted(to_dict(cfg)), indent=2, default=str)
        # TensorBoard renders text as markdown: indent by 4 spaces for a code block
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
        self.writer.flush()

    def log_step(self, step, metrics, samples):
        for k, v in metrics.items():
            if k != "step":  # the x axis itself
                self.writer.add_scalar(k, v, step)
        rows = sample_rows(samples, step)
        cols = ["turn", "actions", "response", "observation", "state_before", "prediction", "state_after",
                "env_reward", "format_reward", "reasoning_reward", "total_reward"]
        for e, traj in enumerate(samples):
            mine = [r for r in rows if r["episode"] == e]
            head = (f"**{traj.env_name}** seed {traj.seed} · `{traj.trajectory_id}` · "
                    f"{'success' if traj.success else 'failure'} · total reward {episode_reward(traj):.4g}\n\n")
            table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
            table += "".join("| " + " | ".join(_md_cell(r[c]) for c in cols) + " |\n" for r in mine)
            self.writer.add_text(f"samples/{e}", head + table, step)
            for r in mine:
                for m, img in enumerate(r["images"]):
                    tag = f"samples/{e}/turn{r['turn']}" + (f"_{m}" if m else "")
                    self.writer.add_image(tag, _png_array(img), step, dataformats="HWC")
        self.writer.flush()

    def log_eval(self, step, metrics):
        for k, v in metrics.items():
            if k != "eval/step":
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run_dir: Path, cfg: Config):
        import wandb

        self.wandb = wandb
        id_file = Path(run_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if cfg.trainer.resume and id_file.exists() else None
        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(run_dir)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "worldloop", name=cfg.run.name,
                                  config=redacted(to_dict(cfg)), id=run_id, resume="allow" if run_id else None,
                                  settings=wandb.Settings(console="off", silent=True), **kwargs)
        except Exception as e:  # no login, a bad WANDB_* variable: fail at start-up, not at step 1
            wandb.teardown()  # wandb keeps process-wide state (settings read at set-up): start clean next time
            raise ConfigError("run.loggers", f"'wandb' could not start a run: {type(e).__name__}: "
                                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''} "
                                             "(wandb login / WANDB_API_KEY, or WANDB_MODE=offline)") from e
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("eval/step")
        self._defined: set[str] = set()

    def _define(self, keys, step_metric: str) -> None:
        for k in keys:
            if k not in self._defined and k != step_metric:
                self.run.define_metric(k, step_metric=step_metric)
                self._defined.add(k)

    def log_step(self, step, metrics, samples):
        data = dict(metrics, step=step)
        if samples:
            table = self.wandb.Table(columns=SAMPLE_COLUMNS)
            for r in sample_rows(samples, step):
                img = self.wandb.Image(_png_array(r["image"])) if r["image"] is not None else None
                table.add_data(*[img if c == "image" else r[c] for c in SAMPLE_COLUMNS])
            data["samples"] = table
        self._define(data, "step")
        self.run.log(data)

    def log_eval(self, step, metrics):
        data = dict(metrics)
        data["eval/step"] = step
        self._define(data, "eval/step")
        self.run.log(data)

    def close(self):
        self.run.finish()
        # wait for wandb's service to write out the run: its files are complete when close returns
        self.wandb.teardown()


_CLASSES = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker}


FINAL_EVAL_OVERHEAD_S = 15.0  # beside its episodes: the final checkpoint's load and the evaluator's exit


def final_eval_processes(cfg: Config, cores: int | None = None, cuda: bool = False) -> int:
    """How many processes play the final evaluation: ``trainer.final_eval_processes``, 0 = ``cores`` (default:
    the cores this process may use); 1 where the evaluator does not generate with HF on the CPU (``cuda``,
    or a vLLM engine), since a forked copy would share the engine or the device."""
    if cuda or cfg.actor.backend == "vllm":
        return 1
    n = cfg.trainer.final_eval_processes
    if n == 0:
        n = usable_cores() if cores is None else cores
    return max(1, int(n))


def final_eval_estimate_s(record: dict | None, eval_episodes: int, final_episodes: int,
                          processes: int = 1) -> float | None:
    """Wall seconds the final held-out evaluation should take, from an in-run evaluation's ``record``:
    its CPU seconds scaled from ``eval_episodes`` to ``final_episodes`` seeds per env, shared by
    ``processes`` (:func:`final_eval_processes`), plus :data:`FINAL_EVAL_OVERHEAD_S`. CPU seconds, not
    the in-run wall seconds: the in-run evaluations share the cores with the actors and the learner (and
    wait at low priority), the final one has them to itself, and each process's wall time is at most
    its CPU time. None without a usable record."""
    cpu = (record or {}).get("cpu_s")
    if cpu is None or eval_episodes <= 0 or float(cpu) <= 0:
        return None
    return float(cpu) * final_episodes / eval_episodes / max(1, processes) + FINAL_EVAL_OVERHEAD_S


def _cuda_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # no torch here: no CUDA either
        return False


FINAL_EXIT_S = 10.0  # after the final evaluation: worldloop up stops the children and draws the plot


def final_eval_deadline(cfg: Config, learner_started: float) -> float | None:
    """Under ``worldloop up`` with ``up.time_limit_s``: the wall-clock time (``time.time()``) by which the
    final evaluation should end so that the run ends within its budget: the learner's start, plus its
    ``trainer.time_limit_s`` and ``up.final_reserve_s`` (what up split the budget into), less
    :data:`FINAL_EXIT_S`. The learner writes it into the control record as ``final_eval_by`` when it
    stops the run; the evaluator stops its final evaluation at a chunk boundary before it and says so.
    None without that budget."""
    if cfg.up.time_limit_s is None or cfg.trainer.time_limit_s is None:
        return None
    return learner_started + cfg.trainer.time_limit_s + cfg.up.final_reserve_s - FINAL_EXIT_S


class Trackers:
    """Every tracker of ``run.loggers``; feeds them each step and the new held-out evaluations."""

    def __init__(self, run_dir: Path, cfg: Config):
        check_loggers(cfg)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sample_every = cfg.trainer.sample_every
        self.items: list[Tracker] = []
        self._eval_path = self.run_dir / "eval.jsonl"
        self.eval_versions: set[int] = set()  # the policy versions of the evaluations logged
        self.last_in_run_eval: dict | None = None  # the newest in-run (not final) evaluation record
        self._extra_logged = 0.0  # final_eval_extra_s as last logged
        # evaluations already in the file belong to an earlier (resumed) learner: logged there
        self._eval_offset = self._eval_path.stat().st_size if cfg.trainer.resume and self._eval_path.exists() else 0
        try:
            for name in dict.fromkeys(["jsonl", *cfg.run.loggers]):  # the JSONL files always
                self.items.append(_CLASSES[name](self.run_dir, cfg))
        except Exception:
            self.close()
            raise

    def log_step(self, step: int, record: dict, trajs: list[Trajectory]) -> None:
        metrics = flatten(record)
        due = self.sample_every > 0 and step % self.sample_every == 0
        samples = pick_samples(list(trajs)) if due else []
        for t in self.items:
            self._guard(t, "log_step", step, metrics, samples)
        self.poll_evals()

    def log_eval(self, record: dict) -> None:
        """One evaluator record (the value of an ``{"eval": ...}`` line)."""
        step = int(record.get("step", record.get("policy_version", 0)))
        self.eval_versions.add(int(record.get("policy_version", step)))
        if not record.get("final"):
            self.last_in_run_eval = record
        metrics = flatten(record, "eval/")
        for t in self.items:
            self._guard(t, "log_eval", step, metrics)

    def poll_evals(self) -> None:
        """Log the evaluations appended to ``<run_dir>/eval.jsonl`` since the last call."""
        if not self._eval_path.exists():
            return
        with open(self._eval_path, "rb") as f:
            f.seek(self._eval_offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self._eval_offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("eval"), dict):
                self.log_eval(rec["eval"])

    def final_eval_extra_s(self, cfg: Config) -> float:
        """Under ``worldloop up`` with ``up.time_limit_s`` (which kept ``up.final_reserve_s`` back from
        the learner's ``trainer.time_limit_s``): the seconds the final evaluation needs beyond that
        reserve, by :func:`final_eval_estimate_s` of the newest in-run evaluation, at most
        ``up.final_eval_max_share`` of ``up.time_limit_s`` less the reserve; 0 before one, or without
        ``up.time_limit_s`` or an evaluator. The learner stops this much earlier, so that the whole run,
        the final evaluation included, ends within the budget on a slow or loaded machine; beyond the
        cap the final evaluation is cut at its deadline rather than the training."""
        t = cfg.trainer
        if cfg.up.time_limit_s is None or t.eval_every <= 0:
            return 0.0
        processes = final_eval_processes(cfg, cuda=cfg.actor.device == "cuda" or (
            cfg.actor.device == "auto" and _cuda_visible()))
        est = final_eval_estimate_s(self.last_in_run_eval, t.eval_episodes, t.final_eval_episodes or t.eval_episodes,
                                    processes)
        wanted = max(0.0, (est or 0.0) - cfg.up.final_reserve_s)
        # at most up.final_eval_max_share of the budget, the reserve included: on a loaded machine the
        # estimate grows with the load (a 2-core VM under the test suite: 804 s for 512 episodes, and the
        # learner stopped after 1 of 60 updates), and the final evaluation is cut at its deadline anyway
        cap = max(0.0, cfg.up.final_eval_max_share * cfg.up.time_limit_s - cfg.up.final_reserve_s)
        extra = min(wanted, cap)
        if abs(extra - self._extra_logged) >= 5.0:
            self._extra_logged = extra
            log.info("the final evaluation should take %.0fs (the in-run evaluation of v%s: %.1f CPU s for %d "
                     "episodes; %d processes): the learner stops %.0fs before trainer.time_limit_s, beyond "
                     "up.final_reserve_s=%.0f%s",
                     est or 0.0, self.last_in_run_eval.get("policy_version"), self.last_in_run_eval.get("cpu_s"),
                     (self.last_in_run_eval.get("episodes") or {}).get("all", 0), processes, extra,
                     cfg.up.final_reserve_s,
                     f" (up.final_eval_max_share={cfg.up.final_eval_max_share:g} caps it: the final evaluation will be "
                     "cut at its deadline)" if wanted > cap else "")
        return extra

    def wait_for_eval(self, version: int, alive: Callable[[], bool], timeout_s: float, *,
                      should_stop: Callable[[], bool] = lambda: False, poll_s: float = 0.5) -> bool:
        """Log new evaluations until one of policy ``version`` is among them (True), or until the
        evaluator is no longer ``alive()``, ``should_stop()`` or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll_evals()
            if version in self.eval_versions:
                return True
            if not alive() or should_stop() or time.monotonic() >= deadline:
                self.poll_evals()  # it may have written the record just before it exited
                return version in self.eval_versions
            time.sleep(poll_s)

    @staticmethod
    def _guard(t: Tracker, method: str, *args) -> None:
        # a tracker's failure (disk full, a wandb hiccup) is logged, never ends the training run
        try:
            getattr(t, method)(*args)
        except Exception as e:
            log.warning("tracker %s.%s failed: %s: %s", type(t).__name__, method, type(e).__name__, e)

    def close(self) -> None:
        try:
            self.poll_evals()
        except OSError as e:
            log.warning("reading %s: %s", self._eval_path, e)
        for t in self.items:
            self._guard(t, "close")
        self.items = []


def open_trackers(run_dir: Path, cfg: Config) -> Trackers:
    return Trackers(run_dir, cfg)
