"""The per-episode loop (actor/episodes.py) with the real HF backend and real gymnasium envs:
same episodes as lockstep under keyed sampling, episodes that advance on their own, hung and
raising envs, stale responses, hold, paused generation and backend failures."""

from __future__ import annotations

import threading

import gymnasium
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worldloop import envs  # noqa: F401  (registers the env ids)
from worldloop.actor.episodes import EpisodeEngine
from worldloop.actor.hf_backend import HFBackend
from worldloop.actor.episodes import play_episodes
from worldloop.actor.rollout import EpisodeSpec, Sampling
from worldloop.actor.server.client import ServerError, token_versions
from worldloop.envs.grid.frozenlake import FrozenLakeEnv

SIDE = 112
KW = {"size": 3, "is_slippery": False, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56, "add_example": False}
LAKE = "worldloop/FrozenLake-v0"
GATED = "worldloop-test/GatedFrozenLake-v0"
SAMPLING = Sampling(temperature=0.7, top_p=0.95, max_new_tokens=12)

GATE = threading.Event()  # GatedFrozenLake's odd seeds block in step() until it is set
IN_GATE = threading.Event()  # set once an odd-seed env is blocked there


class GatedFrozenLake(FrozenLakeEnv):
    """FrozenLake whose odd seeds block in their first step until ``GATE`` is set (a slow or hung env)."""

    def reset(self, *, seed=None, options=None):
        self._gated = bool(seed is not None and seed % 2)
        return super().reset(seed=seed, options=options)

    def step(self, response):
        if self._gated:
            IN_GATE.set()
            GATE.wait(120)
        return super().step(response)


class RaisingFrozenLake(FrozenLakeEnv):
    """FrozenLake whose odd seeds raise in their first step (an env bug)."""

    def step(self, response):
        if self.np_random_seed % 2:
            raise RuntimeError("env bug")
        return super().step(response)


RAISING = "worldloop-test/RaisingFrozenLake-v0"
for env_id, cls in ((GATED, GatedFrozenLake), (RAISING, RaisingFrozenLake)):
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=cls, disable_env_checker=True)


class CountingBackend:
    """The real HF backend, with a count of its batched calls and an optional failure (instrumentation)."""

    def __init__(self, inner: HFBackend, fail: Exception | None = None):
        self.inner, self.fail = inner, fail
        self.codec = inner.codec
        self.calls = 0
        self.batch_sizes: list[int] = []

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, requests, **kw):
        self.calls += 1
        self.batch_sizes.append(len(requests))
        if self.fail is not None:
            raise self.fail
        return self.inner.generate(requests, **kw)


@pytest.fixture(scope="module")
def backend(shared_tiny_model) -> HFBackend:
    path = shared_tiny_model(seed=0, max_image_side=SIDE)
    return HFBackend(path, max_image_side=SIDE)


def _drive(engine: EpisodeEngine, n: int, steps: int = 400) -> list:
    """Step the engine until ``n`` trajectories were reported (at most ``steps`` waits)."""
    out = []
    for _ in range(steps):
        out += engine.step().finished
        if len(out) >= n:
            return out
    raise AssertionError(f"only {len(out)} of {n} episodes ended")


def test_keyed_episode_loop_plays_the_same_episodes_as_lockstep(backend) -> None:
    specs = [EpisodeSpec(LAKE, s, KW, max_turns=3) for s in (1, 2, 3, 4, 5)]
    kw = dict(sampling=SAMPLING, max_model_len=2048, sample_seed=7, keyed_sampling=True, concurrency=3)
    lockstep = play_episodes(backend, specs, **kw)
    episode = play_episodes(backend, specs, loop="episode", **kw)
    assert [t.seed for t in episode] == [s.seed for s in specs]  # in the specs' order
    for a, b in zip(lockstep, episode):
        assert a.end_reason == b.end_reason
        assert [t.response_ids for t in a.turns] == [t.response_ids for t in b.turns]
        assert [t.obs_ids for t in a.turns] == [t.obs_ids for t in b.turns]
        flat = [x for t in b.turns for x in t.logprobs]
        assert [x for t in a.turns for x in t.logprobs] == pytest.approx(flat, abs=1e-4)
    assert sum(len(t.turns) for t in episode) >= len(specs)


def test_an_episode_does_not_wait_for_a_slow_env(backend) -> None:
    """Seed 1 blocks in its env step; seeds 2 and 4 play to their end meanwhile (in lockstep they could not)."""
    GATE.clear(), IN_GATE.clear()
    engine = EpisodeEngine(backend, sampling=SAMPLING, max_model_len=2048, env_workers=3, step_wait_s=0.05)
    try:
        ids = {engine.start(EpisodeSpec(GATED, s, KW, max_turns=2)): s for s in (1, 2, 4)}
        done = _drive(engine, 2)
        # seed 1 cannot end before the gate opens; its env thread may not have reached the gate yet
        # when 2 and 4 end (a loaded machine schedules it late), so wait for that state, not a time
        assert IN_GATE.wait(60), "seed 1's env step never reached the gate"
        assert sorted(ids[t.trajectory_id] for t in done) == [2, 4] and engine.live == 1
        GATE.set()
        last = _drive(engine, 1)
        assert ids[last[0].trajectory_id] == 1 and last[0].end_reason in ("done", "max_turns", "vision_token")
    finally:
        GATE.set()
        engine.close()


def test_a_hung_env_ends_its_episode_flagged_and_the_others_go_on(backend) -> None:
    GATE.clear(), IN_GATE.clear()
    engine = EpisodeEngine(backend, sampling=SAMPLING, max_model_len=2048, env_workers=3, env_timeout_s=0.3,
                           step_wait_s=0.05)
    try:
        ids = {engine.start(EpisodeSpec(GATED, s, KW, max_turns=2)): s for s in (3, 6, 8)}
        done = {ids[t.trajectory_id]: t for t in _drive(engine, 3)}
        assert done[3].end_reason == "env_timeout" and done[3].turns == []
        assert all(done[s].end_reason in ("done", "max_turns", "vision_token") for s in (6, 8))
        assert engine.live == 0
    finally:
        GATE.set()
        engine.close()


def test_a_raising_env_ends_as_env_error_in_the_episode_loop(backend) -> None:
    specs = [EpisodeSpec(RAISING, 3, KW, max_turns=2), EpisodeSpec(LAKE, 2, KW, max_turns=2)]
    bug, lake = play_episodes(backend, specs, concurrency=2, sampling=SAMPLING, max_model_len=2048, loop="episode")
    assert bug.end_reason == "env_error" and bug.turns == []
    assert lake.end_reason in ("done", "max_turns", "vision_token")


def test_a_stale_response_is_refused_and_its_turn_generated_again(backend) -> None:
    floors = iter([1, 1])  # the first two responses (v0) are below the bound, then the bound is 0

    def min_version() -> int:
        return next(floors, 0)

    engine = EpisodeEngine(backend, sampling=SAMPLING, max_model_len=2048, min_version=min_version, step_wait_s=0.05)
    try:
        engine.start(EpisodeSpec(LAKE, 2, KW, max_turns=1))
        refused, finished = 0, []
        for _ in range(400):
            report = engine.step()
            refused += report.stale_refusals
            finished += report.finished
            if finished:
                break
        assert refused == 2 and len(finished) == 1
        assert finished[0].end_reason in ("done", "max_turns", "vision_token")
    finally:
        engine.close()


def test_an_episode_refused_as_stale_too_often_is_dropped(backend) -> None:
    engine = EpisodeEngine(backend, sampling=SAMPLING, max_model_len=2048, min_version=lambda: 5, step_wait_s=0.05)
    try:
        engine.start(EpisodeSpec(LAKE, 2, KW, max_turns=2))
        (traj,) = _drive(engine, 1)
        assert traj.end_reason == "stale" and traj.turns == []
    finally:
        engine.close()


def test_hold_and_paused_generation_keep_requests_back(backend) -> None:
    counting = CountingBackend(backend)
    engine = EpisodeEngine(counting, sampling=SAMPLING, max_model_len=2048, step_wait_s=0.05, batch_wait_s=0.05)
    try:
        engine.hold(True)
        for s in (1, 2):
            engine.start(EpisodeSpec(LAKE, s, KW, max_turns=1))
        for _ in range(10):
            assert engine.step().finished == []
        assert counting.calls == 0 and engine.awaiting_generation() == 2  # both ready, both held
        with engine.paused_generation():
            engine.hold(False)
            for _ in range(5):
                engine.step()
            assert counting.calls == 0  # the batcher waits for the lock (a weight update would run here)
        done = _drive(engine, 2)
        assert len(done) == 2 and counting.calls >= 1
        assert counting.batch_sizes[0] == 2  # both ready requests went in one batched call
        assert engine.busy_seconds() > 0
    finally:
        engine.close()


def test_a_backend_failure_is_raised_by_step(backend) -> None:
    engine = EpisodeEngine(CountingBackend(backend, fail=RuntimeError("model on fire")), sampling=SAMPLING,
                           max_model_len=2048, step_wait_s=0.05)
    try:
        engine.start(EpisodeSpec(LAKE, 1, KW, max_turns=1))
        with pytest.raises(RuntimeError, match="model on fire"):
            for _ in range(400):
                engine.step()
    finally:
        engine.close()


# --------------------------------------------------------------------------- vLLM's version spans


def test_token_versions_from_spans_by_hand() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5) == [3, 3, 4, 4, 4]
    with pytest.raises(ServerError, match="cover 5 of 6"):
        token_versions(spans, 6)
    with pytest.raises(ServerError, match="do not tile"):
        token_versions([{"version": "3", "start": 1, "end": 2}], 1)
    with pytest.raises(ServerError, match="not \\{version, start, end\\}"):
        token_versions([{"version": "x", "start": 0, "end": 1}], 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=6),
       st.lists(st.fixed_dictionaries({"version": st.one_of(st.integers(), st.text(max_size=3), st.none()),
                                       "start": st.integers(-2, 9), "end": st.integers(-2, 9)}), max_size=4),
       st.integers(0, 12))
def test_token_versions_tiles_or_raises_server_error(runs, junk, n) -> None:
    """Well-formed spans give one version per token, in order; anything else raises only ServerError."""
    spans, start = [], 0
    for version, length in runs:
        spans.append({"version": str(version), "start": start, "end": start + length})
        start += length
    assert token_versions(spans, start) == [v for v, length in runs for _ in range(length)]
    try:
        out = token_versions(junk, n)
    except ServerError:
        return
    assert len(out) == n


def _answer(req, ids: list[int], logprobs: list[float], spans: list[tuple[int, int, int]]) -> dict:
    """A ``/inference/v1/generate`` answer as vLLM's token-in/token-out server writes it."""
    return {"prompt_token_ids": list(req.prompt_ids),
            "choices": [{"token_ids": ids, "weight_versions": [{"version": str(v), "start": a, "end": b} for v, a, b in spans],
                         "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs)]}}]}


def test_parse_answer_keeps_or_refuses_a_response_that_spans_two_versions(backend) -> None:
    from worldloop.actor.generation import GenRequest
    from worldloop.actor.server.client import parse_answer

    codec = backend.codec
    req = GenRequest(codec.encode_obs("Go.", [], system="Play.", first=True).ids)
    words = codec.tokenizer.encode(" left right up", add_special_tokens=False)
    ids = words + [codec.im_end_id, words[0]]  # vLLM stops at the EOS; a token after it is cut
    lps = [-0.5, -1.0, -1.5, -0.1, -2.0][: len(ids)]
    mixed = _answer(req, ids, lps, [(3, 0, 2), (4, 2, len(ids))])
    res = parse_answer(mixed, req, codec, mixed_versions=True)
    n = len(words) + 1
    assert res.response_ids == ids[:n] and res.logprobs == lps[:n] and not res.truncated
    assert res.token_versions == [3, 3] + [4] * (n - 2) and res.version == 3  # the oldest token's
    assert parse_answer(mixed, req, codec, mixed_versions=False) is None  # wait mode: generated again
    one = parse_answer(_answer(req, ids, lps, [(4, 0, len(ids))]), req, codec, mixed_versions=False)
    assert one.version == 4 and one.token_versions is None
    with pytest.raises(ServerError, match="no weight version"):
        parse_answer(_answer(req, ids, lps, []), req, codec, mixed_versions=True)
    with pytest.raises(ServerError, match="cover 2 of"):
        parse_answer(_answer(req, ids, lps, [(4, 0, 2)]), req, codec, mixed_versions=True)


class RelabelledBackend(CountingBackend):
    """The real HF backend whose results say their first token came from v3 and the rest from v4,
    as a server's do when a version lands mid-response (actor.weight_update=interrupt)."""

    def generate(self, requests, **kw):
        out = super().generate(requests, **kw)
        for res in out:
            res.token_versions = [3] + [4] * (len(res.response_ids) - 1)
            res.version = 3
        return out


def test_turns_keep_the_version_of_each_token(backend) -> None:
    from worldloop.common.contracts.schemas import decode_trajectory, encode_trajectory

    sampling = Sampling(0.7, 0.95, 6)
    [traj] = play_episodes(RelabelledBackend(backend), [EpisodeSpec(LAKE, 2, KW, max_turns=2)], sampling=sampling,
                           max_model_len=2048, loop="episode")
    assert traj.turns
    for turn in traj.turns:
        assert turn.policy_version == 3 and turn.token_versions == [3] + [4] * (len(turn.response_ids) - 1)
    assert decode_trajectory(encode_trajectory(traj)).turns == traj.turns
