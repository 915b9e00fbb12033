"""The multi-env, multi-turn rollout engine: play episodes with a generation backend, token-in/token-out.

Public API::

    Sampling(temperature=0.7, top_p=0.95, max_new_tokens=200)
    EpisodeSpec(env_id, seed, env_kwargs={}, env_name=None, group_id=None, max_turns=3)
        .name                                   # env_name or the id without prefix/version
    RolloutEngine(backend, *, sampling, max_model_len, actor_id="local", codec=None,
                  sample_seed=None, make_env=gymnasium.make, keyed_sampling=False)
        .start(spec) -> str                     # reset a new episode; its trajectory id
        .step() -> StepReport                   # one batched generation for all live episodes
        .live -> int, .pending_reports -> int, .close()
    StepReport(finished, generated_tokens, prompt_tokens, generate_seconds, turns, format_errors)
    episode_sample_key(sample_seed, spec, turn) -> int  # the key of one turn's generation (keyed sampling)
    SeedSchedule(envs, n_samples_per_seed, seed_start, seed_end, run_seed, actor_id)
        .next(max_turns) -> EpisodeSpec         # groups of n_samples_per_seed specs share a group_id
        .next_group(max_turns) -> [EpisodeSpec] # the rest of a group, each with its trajectory id
    env_name(env_id) -> str

``keyed_sampling=True`` (evaluations: ``worldloop eval`` and the run's evaluator) gives every turn's
request its own random stream, keyed by ``(sample_seed, env name, episode seed, turn)``
(:func:`episode_sample_key`; "Keyed sampling" in :mod:`worldloop.actor.generation`): an episode's
samples no longer depend on which episodes share its batch (``--concurrency``), and two models
evaluated on the same seeds use the same noise, so their paired comparison is not diluted by
sampling luck. The actors' training rollouts keep one stream per call: the members of a GRPO group
share env and seed and must sample independently.

This is the lockstep engine (``actor.loop: lockstep``, the default): every live episode in one
batched call per turn. The per-episode loop (:mod:`worldloop.actor.episodes`) subclasses it and keeps every
rule below; ``worldloop.actor.episodes.play_episodes`` plays a given list of episodes with either
(what ``worldloop eval`` builds on). The actor process (:mod:`worldloop.actor.process`) drives an
engine itself so that it can apply weights and control between generations.

One turn of an episode
----------------------
1. The env's observation (``obs["text"]`` with its ``<image>`` placeholder and ``obs["image"]``)
   becomes the turn's ``obs_ids``/``images`` with :meth:`worldloop.common.contracts.modeling.ChatCodec.encode_obs`
   (system prompt from ``env.unwrapped.system_prompt()`` on turn 0; later turns continue after the
   previous response, closing it with ``<|im_end|>`` unless the response ended with that token:
   truncated at ``max_new_tokens``, or stopped on the other EOS ``<|endoftext|>``).
2. All live episodes are generated in ONE ``backend.generate`` call; each request is the whole
   episode so far (every turn's ``obs_ids`` + ``response_ids``) plus all its images, and names
   its episode (``session``: the trajectory id).
3. ``env.step(response_text)``; the turn records exactly the fields of ``worldloop.trajectory/1``
   (``common/contracts/schemas.py``): the ids, the behaviour log-probs, the PNG images, the parsed fields and
   rewards from ``info``, ``state_before`` (the state of the previous reset/step ``info``) and
   ``state_after``, ``actions_total = info["actions_executed"]``, ``actions_effective``,
   ``truncated_response`` and ``policy_version`` (the version that produced the response: the
   result's own ``version`` when the backend gives one, as the server backend does per response,
   else the backend's version when the call began; for a response whose tokens came from two
   versions, the oldest, with ``token_versions`` naming each token's).

History: the whole episode stays in the model context. Every turn's ``obs_ids`` continue the
previous turns, so the learner's concatenation of obs_ids and response_ids over turns IS the
context the model saw (token-in/token-out is exact). A sliding window of recent turns would break
that layout: the learner would train on a context the model never saw. So an episode whose next
turn would not fit (context so far + the next ``obs_ids`` + ``max_new_tokens`` >
``max_model_len``) ends before generating, with ``end_reason = "context"``.

An episode ends when the env terminates or truncates (``"done"``), after its ``max_turns`` turns
(``"max_turns"``), when the context is full (``"context"``), when a response contains a
prompt-only token (``ChatCodec.prompt_only_ids``: ``<|image_pad|>``, ``<|vision_start|>``, ...:
``"vision_token"``; that turn is discarded, since the learner locates images by those tokens and
would reject the whole sequence, and the env is not stepped with it; every backend forbids
sampling them, so this is a guard against a backend that does not), or when the env raises
during ``reset``/``step`` or returns an observation the codec refuses (``"env_error"``: an env bug;
the error is logged with its traceback and the episode is dropped, the engine goes on), or when
its generation failed for good (``"server_error"``: the server backend found no usable server
within ``actor.server_retry_s``; dropped too). Each trajectory carries ``end_reason``. Episodes
with ``end_reason`` env_error or server_error, or that ended before their first generation, have
no turns: the actor drops them (``encode_trajectory`` refuses an empty ``turns``);
``play_episodes`` returns them with ``turns == []`` so that a caller can count them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from worldloop.actor.generation import GenerationBackend, GenRequest
from worldloop.common.contracts.config import EnvSpec
from worldloop.common.contracts.modeling import ChatCodec
from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn, empty_state, state_from_info
from worldloop.envs.base import observation_parts

log = logging.getLogger(__name__)

END_REASONS = ("done", "max_turns", "context", "vision_token", "env_error", "server_error", "env_timeout", "stale")


def env_name(env_id: str) -> str:
    """Metric label of an env id: ``worldloop/FrozenLake-v0`` -> ``frozenlake``."""
    base = env_id.rsplit("/", 1)[-1]
    base = base.rsplit("-v", 1)[0] if "-v" in base else base
    return base.lower()


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 200


@dataclass
class EpisodeSpec:
    env_id: str
    seed: int
    env_kwargs: dict = field(default_factory=dict)
    env_name: str | None = None
    group_id: str | None = None  # None: a fresh id (a group of one)
    max_turns: int = 3
    trajectory_id: str | None = None  # None: a fresh id (admission names it before the episode starts)

    @property
    def name(self) -> str:
        return self.env_name or env_name(self.env_id)


@dataclass
class StepReport:
    """What one :meth:`RolloutEngine.step` did (the actor turns it into metrics)."""

    finished: list[Trajectory] = field(default_factory=list)  # turns possibly empty
    generated_tokens: int = 0
    prompt_tokens: int = 0
    generate_seconds: float = 0.0
    turns: dict[str, int] = field(default_factory=dict)  # env name -> turns played
    format_errors: dict[str, int] = field(default_factory=dict)
    stale_refusals: int = 0  # responses older than the staleness bound, generated again (actor/episodes.py)


class _Episode:
    """One live episode: its env, the context so far and the turns recorded."""

    def __init__(self, spec: EpisodeSpec, actor_id: str):
        self.spec = spec
        self.env: Any = None
        self.system = ""
        self.prompt_format = str(spec.env_kwargs.get("prompt_format", "grounding_worldmodeling"))
        self.context: list[int] = []
        self.images: list[bytes] = []
        self.turns: list[Turn] = []
        self.state: State = empty_state()  # ground truth after the last reset/step
        self.pending: Any = None  # the next turn's Segment (obs_ids + images), None when ended
        self.prev_ended = True
        self.success = False
        self.end_reason: str | None = None
        self.trajectory_id = spec.trajectory_id or uuid.uuid4().hex
        self.group_id = spec.group_id or uuid.uuid4().hex
        self.actor_id = actor_id
        # the per-episode loop's bookkeeping (actor/episodes.py): env | gen | ended, since when
        self.phase = "env"
        self.since = 0.0
        self.stale_tries = 0

    def message(self) -> Trajectory:
        spec = self.spec
        return Trajectory(schema=TRAJECTORY_SCHEMA, trajectory_id=self.trajectory_id, group_id=self.group_id,
                          env_id=spec.env_id, env_name=spec.name, env_kwargs=dict(spec.env_kwargs), seed=int(spec.seed),
                          actor_id=self.actor_id, created_at=time.time(), prompt_format=self.prompt_format,
                          max_turns=int(spec.max_turns), turns=list(self.turns), success=bool(self.success), scored=False,
                          end_reason=self.end_reason)


def _str_or_none(x: Any) -> str | None:
    return None if x is None else str(x)


class RolloutEngine:
    """Plays any number of live episodes of any registered envs, one batched generation per step."""

    def __init__(
        self,
        backend: GenerationBackend,
        *,
        sampling: Sampling,
        max_model_len: int,
        actor_id: str = "local",
        codec: ChatCodec | None = None,
        sample_seed: int | None = None,
        make_env: Callable[..., Any] | None = None,
        keyed_sampling: bool = False,
    ):
        codec = codec or getattr(backend, "codec", None)
        if codec is None:
            raise ValueError("the backend has no .codec; pass codec=ChatCodec(model_dir)")
        if make_env is None:
            import gymnasium

            from worldloop import envs  # noqa: F401  (registers worldloop/* ids)

            make_env = gymnasium.make
        self.backend = backend
        self.codec: ChatCodec = codec
        self.sampling = sampling
        self.max_model_len = int(max_model_len)
        self.actor_id = actor_id
        self.sample_seed = sample_seed
        self.keyed_sampling = bool(keyed_sampling)
        self.make_env = make_env
        # image-placeholder tokens a response must not contain (see the module docstring)
        self._vision_ids = set(codec.prompt_only_ids)  # never sampled by a backend: a guard
        self._episodes: list[_Episode] = []
        self._done: list[Trajectory] = []  # ended outside step() (at start): reported by the next step()
        self._calls = 0
        self._busy_s = 0.0  # seconds inside generate calls

    @property
    def live(self) -> int:
        """Episodes in progress."""
        return len(self._episodes)

    @property
    def pending_reports(self) -> int:
        """Episodes that ended in :meth:`start`, reported by the next :meth:`step`."""
        return len(self._done)

    # ------------------------------------------------------------------ episodes

    def start(self, spec: EpisodeSpec) -> str:
        """Make and reset the env of a new episode; return its trajectory id.

        An episode that ends at once (env error at reset, first observation too long) is not
        live; its trajectory (no turns) is reported by the next :meth:`step`.
        """
        ep = _Episode(spec, self.actor_id)
        self._open(ep)
        if ep.end_reason is not None:
            self._end(ep)
            self._done.append(ep.message())
        else:
            self._episodes.append(ep)
        return ep.trajectory_id

    def _open(self, ep: _Episode) -> None:
        """Make and reset the episode's env and encode its first observation (or end it: env
        error, no turn allowed, first observation too long)."""
        spec = ep.spec
        try:
            ep.env = self.make_env(spec.env_id, **spec.env_kwargs)
            obs, info = ep.env.reset(seed=int(spec.seed))
            ep.system = str(ep.env.unwrapped.system_prompt())
            ep.prompt_format = str(getattr(ep.env.unwrapped, "prompt_format", ep.prompt_format))
            ep.state = state_from_info(info)
            ep.success = bool(info.get("success", False)) if isinstance(info, dict) else False
            if spec.max_turns < 1:
                ep.end_reason = "max_turns"
            else:
                self._encode_next(ep, obs)
        except Exception:
            self._env_error(ep, "reset")

    def _encode_next(self, ep: _Episode, obs: Any) -> None:
        """Encode the next turn's observation; end the episode when it would overflow the context."""
        text, images = observation_parts(obs)
        seg = self.codec.encode_obs(text, images, system=ep.system, first=not ep.turns, prev_response_ended=ep.prev_ended)
        if len(ep.context) + len(seg.ids) + self.sampling.max_new_tokens > self.max_model_len:
            ep.end_reason = "context"
            log.info("episode %s (%s seed %d) ends: %d context + %d observation + %d new tokens exceed max_model_len %d",
                     ep.trajectory_id, ep.spec.name, ep.spec.seed, len(ep.context), len(seg.ids),
                     self.sampling.max_new_tokens, self.max_model_len)
            return
        ep.pending = seg

    def _env_error(self, ep: _Episode, where: str) -> None:
        ep.end_reason = "env_error"
        ep.turns = []  # an episode interrupted by an env bug is not training data
        log.error("env %s (seed %d) raised during %s; episode %s dropped:\n%s", ep.spec.env_id, ep.spec.seed, where,
                  ep.trajectory_id, traceback.format_exc())

    def _end(self, ep: _Episode) -> None:
        ep.pending = None
        if ep.env is not None:
            try:
                ep.env.close()
            except Exception:  # closing a broken env must not take the engine down
                log.warning("env %s close failed", ep.spec.env_id, exc_info=True)
            ep.env = None

    # ------------------------------------------------------------------ one step

    def step(self) -> StepReport:
        """Generate one turn for every live episode (one batched call), step their envs."""
        report = StepReport(finished=self._done)
        self._done = []
        batch = [ep for ep in self._episodes if ep.pending is not None]
        if batch:
            self._generate(batch, report)
        still = []
        for ep in self._episodes:
            if ep.end_reason is None:
                still.append(ep)
            else:
                self._end(ep)
                report.finished.append(ep.message())
        self._episodes = still
        return report

    def _generate(self, batch: list[_Episode], report: StepReport) -> None:
        keys = [episode_sample_key(self.sample_seed, ep.spec, len(ep.turns)) if self.keyed_sampling else None for ep in batch]
        requests = [GenRequest(ep.context + ep.pending.ids, ep.images + ep.pending.images, sample_key=k,
                               session=ep.trajectory_id) for ep, k in zip(batch, keys)]
        version = int(self.backend.version)
        seed = None if self.sample_seed is None else self.sample_seed + self._calls
        self._calls += 1
        t0 = time.perf_counter()
        results = self.backend.generate(requests, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                        max_new_tokens=self.sampling.max_new_tokens, seed=seed)
        report.generate_seconds += time.perf_counter() - t0
        self._busy_s += time.perf_counter() - t0
        report.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        for ep, res in zip(batch, results):
            report.generated_tokens += len(res.response_ids)
            # the weights that produced the response: its own version when the backend gives one (servers)
            self._play(ep, res, version if res.version is None else int(res.version), report)

    def _play(self, ep: _Episode, res: Any, version: int, report: StepReport) -> None:
        seg, ep.pending = ep.pending, None
        name = ep.spec.name
        if self._failed(ep, res):
            return
        if self._vision_ids.intersection(res.response_ids):
            ep.end_reason = "vision_token"
            log.info("episode %s (%s seed %d) ends: the response holds image placeholder tokens; turn %d discarded",
                     ep.trajectory_id, name, ep.spec.seed, len(ep.turns))
            return
        try:
            obs, _, terminated, truncated, info = ep.env.step(res.text)
            if not isinstance(info, dict):
                raise TypeError(f"step info must be a dict, got {type(info).__name__}")
            after = state_from_info(info)
            actions = [str(a) for a in info.get("actions") or []]
            turn = Turn(
                index=len(ep.turns),
                policy_version=version,
                obs_ids=list(seg.ids),
                response_ids=list(res.response_ids),
                logprobs=[float(x) for x in res.logprobs],
                images=list(seg.images),
                response_text=res.text,
                observation=_str_or_none(info.get("observation")),
                reasoning=_str_or_none(info.get("reasoning")),
                prediction=_str_or_none(info.get("prediction")),
                actions=actions,
                format_ok=bool(info.get("format_ok", False)),
                env_reward=float(info.get("env_reward", 0.0)),
                format_reward=float(info.get("format_reward", 0.0)),
                done=bool(terminated or truncated),
                success=bool(info.get("success", False)),
                state_before=ep.state,
                state_after=after,
                # WMAct's N counts the actions the episode ran: parsed actions left over when the
                # task ended mid-turn were never executed
                actions_total=int(info.get("actions_executed", len(actions))),
                actions_effective=int(info.get("actions_effective", 0)),
                truncated_response=bool(res.truncated),
                # a response that spans versions (a server that loaded one mid-request): each token's
                token_versions=None if res.token_versions is None else [int(v) for v in res.token_versions],
            )
            ep.turns.append(turn)
            ep.context += list(seg.ids) + list(res.response_ids)
            ep.images += list(seg.images)
            # the next observation closes this message with <|im_end|> unless the model did (a
            # response that stopped on <|endoftext|> or at max_new_tokens is closed by the codec)
            ep.prev_ended = bool(res.response_ids) and res.response_ids[-1] == self.codec.im_end_id
            ep.state = after
            ep.success = turn.success
            report.turns[name] = report.turns.get(name, 0) + 1
            if not turn.format_ok:
                report.format_errors[name] = report.format_errors.get(name, 0) + 1
            if turn.done:
                ep.end_reason = "done"
            elif len(ep.turns) >= ep.spec.max_turns:
                ep.end_reason = "max_turns"
            else:
                self._encode_next(ep, obs)
        except Exception:
            self._env_error(ep, "step")

    @staticmethod
    def _failed(ep: _Episode, res: Any) -> bool:
        """A generation that failed for good (server backend) drops its episode: no turns, so the
        actor refunds its admission."""
        if res.error is None:
            return False
        ep.end_reason, ep.turns = "server_error", []
        log.warning("episode %s (%s seed %d) dropped: its generation failed (%s)", ep.trajectory_id, ep.spec.name,
                    ep.spec.seed, res.error)
        return True

    def busy_seconds(self) -> float:
        """Seconds with a generation in flight (lockstep: inside the batched calls)."""
        return self._busy_s

    def hold(self, on: bool) -> None:
        """Lockstep: nothing to hold (no generation runs unless :meth:`step` is called)."""

    def paused_generation(self) -> contextlib.AbstractContextManager:
        """Lockstep: generation runs only inside :meth:`step`, so weights may change at any other time."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Abandon every live episode (their envs are closed; nothing is returned)."""
        for ep in self._episodes:
            self._end(ep)
        self._episodes = []


# --------------------------------------------------------------------------- keyed sampling


def episode_sample_key(sample_seed: int | None, spec: EpisodeSpec, turn: int) -> int:
    """The sample key of ``turn`` of the episode ``spec`` (keyed sampling): a 63-bit hash of the
    run's sample seed, the env's name, the episode's seed and the turn."""
    text = f"{0 if sample_seed is None else int(sample_seed)}:{spec.name}:{int(spec.seed)}:{int(turn)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


# --------------------------------------------------------------------------- training seeds


class SeedSchedule:
    """The actor's stream of episodes: env by weight, seed in [seed_start, seed_end), in groups.

    The random stream is seeded from ``sha256(run_seed, actor_id)``: deterministic per actor, and
    two actors of one run draw different seeds. Each draw yields ``n_samples_per_seed`` specs with
    the same env, kwargs (the spec's ``kwargs`` with its ``train_kwargs`` over them) and seed and one
    shared ``group_id`` (for GRPO); ``max_turns`` is the value passed to :meth:`next` when the spec
    is handed out (the control record's, for new episodes).
    """

    def __init__(self, envs: Sequence[EnvSpec], n_samples_per_seed: int, seed_start: int, seed_end: int,
                 run_seed: int, actor_id: str):
        if not envs:
            raise ValueError("SeedSchedule needs at least one env spec")
        if seed_end <= seed_start:
            raise ValueError(f"seed_end ({seed_end}) must be greater than seed_start ({seed_start})")
        self.envs = [(e.id, e.training_kwargs(), e.name or env_name(e.id), float(e.weight)) for e in envs]
        if any(w < 0 for *_, w in self.envs) or sum(w for *_, w in self.envs) <= 0:
            raise ValueError("env weights must be >= 0 with a positive sum")
        self.n = int(n_samples_per_seed)
        self.seed_start, self.seed_end = int(seed_start), int(seed_end)
        digest = hashlib.sha256(f"{run_seed}:{actor_id}".encode()).digest()
        self.rng = random.Random(int.from_bytes(digest[:8], "big"))
        self._group: tuple[str, dict, str, int, str] | None = None
        self._left = 0

    def next_group(self, max_turns: int) -> list[EpisodeSpec]:
        """The rest of the current group (a whole new one when none is open), each spec with its
        own trajectory id: what rollout admission admits at once."""
        first = self.next(max_turns)
        group = [first] + [self.next(max_turns) for _ in range(self._left)]
        for spec in group:
            spec.trajectory_id = uuid.uuid4().hex
        return group

    def next(self, max_turns: int) -> EpisodeSpec:
        if self._left == 0:
            env_id, kwargs, name, _ = self.rng.choices(self.envs, weights=[w for *_, w in self.envs])[0]
            seed = self.rng.randrange(self.seed_start, self.seed_end)
            self._group = (env_id, kwargs, name, seed, uuid.uuid4().hex)
            self._left = self.n
        env_id, kwargs, name, seed, group = self._group  # type: ignore[misc]
        self._left -= 1
        return EpisodeSpec(env_id=env_id, seed=seed, env_kwargs=dict(kwargs), env_name=name, group_id=group,
                           max_turns=int(max_turns))
