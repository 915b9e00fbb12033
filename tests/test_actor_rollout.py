"""The rollout engine without Redis: play_episodes, per-turn fields, context limit, env bugs, seeds."""

from __future__ import annotations

import gymnasium
import pytest
import torch
from msgspec.structs import asdict

from worldloop import envs  # noqa: F401  (registers the env ids)
from worldloop.actor.hf_backend import HFBackend
from worldloop.actor.episodes import play_episodes
from worldloop.actor.rollout import EpisodeSpec, RolloutEngine, Sampling, SeedSchedule, env_name, episode_sample_key
from worldloop.common.contracts.config import EnvSpec
from worldloop.common.contracts.schemas import Trajectory, decode_trajectory, encode_trajectory
from worldloop.envs.grid.frozenlake import FrozenLakeEnv

SIDE = 112
KW = {"size": 3, "is_slippery": False, "min_actions_to_succeed": 2, "render_mode": "vision", "image_size": 56, "add_example": False}
LAKE = "worldloop/FrozenLake-v0"
BUGGY = "worldloop-test/BuggyFrozenLake-v0"
SAMPLING = Sampling(temperature=0.7, top_p=0.95, max_new_tokens=12)


class BuggyFrozenLake(FrozenLakeEnv):
    """FrozenLake with a bug: on odd seeds its first step raises."""

    def reset(self, *, seed=None, options=None):
        self._odd = bool(seed is not None and seed % 2)
        return super().reset(seed=seed, options=options)

    def step(self, response):
        if self._odd:
            raise RuntimeError("env bug")
        return super().step(response)


if BUGGY not in gymnasium.registry:
    gymnasium.register(id=BUGGY, entry_point=BuggyFrozenLake, disable_env_checker=True)


@pytest.fixture(scope="module")
def backend(shared_tiny_model) -> HFBackend:
    path = shared_tiny_model(seed=0, max_image_side=SIDE)
    return HFBackend(path, max_image_side=SIDE)


def test_play_episodes_keeps_order_and_survives_env_bugs(backend) -> None:
    specs = [EpisodeSpec(BUGGY, 3, KW, max_turns=2), EpisodeSpec(LAKE, 1, KW, max_turns=2),
             EpisodeSpec(BUGGY, 2, KW, max_turns=2), EpisodeSpec(LAKE, 1, KW, env_name="lake", group_id="g", max_turns=1),
             EpisodeSpec(LAKE, 6, KW, max_turns=2)]
    trajs = play_episodes(backend, specs, concurrency=2, sampling=SAMPLING, max_model_len=2048, sample_seed=0)
    assert [(t.env_id, t.seed) for t in trajs] == [(s.env_id, s.seed) for s in specs]
    bug, lake, even, named, other = trajs
    assert bug.end_reason == "env_error" and bug.turns == []  # dropped, the others went on
    assert even.env_name == "buggyfrozenlake"
    assert named.env_name == "lake" and named.group_id == "g" and named.max_turns == 1
    assert lake.group_id != other.group_id  # no group given: each episode its own
    played = [t for t in (lake, even, named, other) if t.turns]
    assert played  # (a random tiny model may end an episode early by sampling an image token)
    for traj in (lake, even, named, other):
        assert traj.end_reason in ("done", "max_turns", "vision_token") and len(traj.turns) <= traj.max_turns
        assert traj.end_reason == "vision_token" or len(traj.turns) >= 1
    for traj in played:
        assert decode_trajectory(encode_trajectory(traj)).turns == traj.turns
        _check_turns_against_env(backend, traj)


def _check_turns_against_env(backend, traj: Trajectory) -> None:
    """Replay the episode with the recorded responses: every per-turn field is the env's."""
    env = gymnasium.make(traj.env_id, **traj.env_kwargs)
    _, info = env.reset(seed=traj.seed)
    state = info["state"]
    for turn in traj.turns:
        _, reward, terminated, truncated, info = env.step(turn.response_text)
        assert asdict(turn.state_before) == state and asdict(turn.state_after) == info["state"]
        assert turn.env_reward + turn.format_reward == reward
        assert turn.done == (terminated or truncated) and turn.success == info["success"]
        assert turn.actions == info["actions"] and turn.actions_total == len(info["actions"])
        assert turn.actions_effective == info["actions_effective"] and turn.format_ok == info["format_ok"]
        assert turn.prediction == info["prediction"] and turn.observation == info["observation"]
        assert turn.response_text == backend.codec.decode(turn.response_ids)
        assert turn.truncated_response == (turn.response_ids[-1] not in backend.codec.eos_token_ids)
        state = info["state"]
    assert traj.success == info["success"]
    env.close()


def test_seeded_sampling_replays_the_same_episodes(backend) -> None:
    specs = [EpisodeSpec(LAKE, s, KW, max_turns=2) for s in (4, 5)]
    run = lambda seed: [[t.response_ids for t in tr.turns]
                        for tr in play_episodes(backend, specs, concurrency=2, sampling=SAMPLING, sample_seed=seed)]
    first = run(11)
    assert any(first) and first == run(11)


def test_keyed_sampling_plays_each_episode_the_same_at_any_concurrency(backend) -> None:
    specs = [EpisodeSpec(LAKE, s, KW, max_turns=2) for s in (4, 5, 6, 7)]
    run = lambda concurrency, seed=11: [
        [t.response_ids for t in tr.turns]
        for tr in play_episodes(backend, specs, concurrency=concurrency, sampling=SAMPLING, sample_seed=seed,
                                keyed_sampling=True)]
    one_by_one = run(1)
    assert any(one_by_one)
    assert run(4) == one_by_one  # batched together: the same episodes, turn for turn
    assert run(3) == one_by_one
    assert run(4, seed=12) != one_by_one  # the sample seed is part of every key


def test_episode_sample_key_by_hand() -> None:
    spec = EpisodeSpec(LAKE, 1234, KW, max_turns=3)
    import hashlib
    digest = hashlib.sha256(b"7:frozenlake:1234:2").digest()
    assert episode_sample_key(7, spec, 2) == int.from_bytes(digest[:8], "big") >> 1
    keys = {episode_sample_key(7, spec, t) for t in range(3)} | {episode_sample_key(8, spec, 0),
                                                                  episode_sample_key(7, EpisodeSpec(LAKE, 1235, KW), 0)}
    assert len(keys) == 5 and all(0 <= k < 2**63 for k in keys)
    # the group id and the trajectory id are not part of it: a model pair compared on one seed shares keys
    assert episode_sample_key(7, EpisodeSpec(LAKE, 1234, KW, group_id="g", trajectory_id="t"), 2) == episode_sample_key(7, spec, 2)


def test_context_limit_ends_an_episode_before_generating(backend) -> None:
    env = gymnasium.make(LAKE, **KW)
    obs, _ = env.reset(seed=1)
    first = backend.codec.encode_obs(obs["text"], [obs["image"]], system=env.unwrapped.system_prompt(), first=True)
    env.close()
    need = len(first.ids) + SAMPLING.max_new_tokens
    spec = EpisodeSpec(LAKE, 1, KW, max_turns=5)
    # room for the first turn only: the second observation does not fit
    # seeded sampling: unseeded, the random model's first turn sometimes sampled an image token
    # (end reason "vision_token", ~1 run in 50) before the context limit could be reached
    [one] = play_episodes(backend, [spec], sampling=SAMPLING, max_model_len=need + 10, sample_seed=0)
    assert one.end_reason == "context" and len(one.turns) == 1
    # not even the first turn fits: no generation at all
    engine = RolloutEngine(backend, sampling=SAMPLING, max_model_len=need - 1)
    tid = engine.start(spec)
    assert engine.live == 0 and engine.pending_reports == 1
    report = engine.step()
    assert report.generated_tokens == 0
    assert [(t.trajectory_id, t.end_reason, t.turns) for t in report.finished] == [(tid, "context", [])]


def test_seed_schedule_groups_and_per_actor_streams() -> None:
    env_specs = [EnvSpec(id=LAKE, kwargs={"size": 3}, weight=1.0), EnvSpec(id="worldloop/Maze-v0", weight=0.0, name="never")]
    def take(actor: str, n: int) -> list[EpisodeSpec]:
        schedule = SeedSchedule(env_specs, 3, 100, 200, run_seed=5, actor_id=actor)
        return [schedule.next(2) for _ in range(n)]

    a, a_again, b = take("actor-0", 9), take("actor-0", 9), take("actor-1", 9)
    assert [s.seed for s in a] == [s.seed for s in a_again]  # deterministic per actor
    assert [s.seed for s in a] != [s.seed for s in b]  # another actor draws other seeds
    for chunk in (a[0:3], a[3:6], a[6:9]):  # groups of n_samples_per_seed = 3
        assert len({(s.seed, s.group_id, s.env_id) for s in chunk}) == 1
    assert len({s.group_id for s in a}) == 3
    assert all(100 <= s.seed < 200 and s.env_id == LAKE and s.name == "frozenlake" for s in a)
    assert all(s.max_turns == 2 and s.env_kwargs == {"size": 3} for s in a)
    assert env_name("worldloop/PrimitiveSkill-v0") == "primitiveskill"
    with pytest.raises(ValueError, match="seed_end"):
        SeedSchedule(env_specs, 1, 5, 5, run_seed=0, actor_id="x")


def test_seed_schedule_lays_train_kwargs_over_kwargs_and_start_up_checks_both() -> None:
    from worldloop.actor.process import check_env_specs
    from worldloop.common.contracts.config import ConfigError

    spec = EnvSpec(id="worldloop/Sokoban-v0", kwargs={"dim_room": [6, 6], "min_actions_to_succeed": 2},
                   train_kwargs={"max_actions_to_succeed": 4})
    drawn = [SeedSchedule([spec], 1, 0, 10**6, run_seed=s, actor_id="a").next(3) for s in range(12)]
    assert all(d.env_kwargs == {"dim_room": [6, 6], "min_actions_to_succeed": 2, "max_actions_to_succeed": 4} for d in drawn)
    # the capped training levels: every one the actors play is 2..4 optimal actions from solved
    lengths = []
    for d in drawn:
        env = gymnasium.make(d.env_id, **d.env_kwargs)
        _, info = env.reset(seed=d.seed)
        lengths.append(info["metrics"]["optimal_actions"])
        env.close()
    assert all(2 <= n <= 4 for n in lengths), lengths
    check_env_specs([spec])  # both spellings make an env
    bad = EnvSpec(id="worldloop/Sokoban-v0", kwargs={"min_actions_to_succeed": 3}, train_kwargs={"max_actions_to_succeed": 0})
    with pytest.raises(ConfigError, match=r"actor\.envs\[0\]\.train_kwargs"):
        check_env_specs([bad])


def test_engine_needs_a_codec() -> None:
    class NoCodec:
        version = 0

    with pytest.raises(ValueError, match="codec"):
        RolloutEngine(NoCodec(), sampling=SAMPLING, max_model_len=100)  # type: ignore[arg-type]


def test_a_response_ending_on_endoftext_is_closed_by_the_next_observation(backend) -> None:
    """Final norm 0 -> all logits 0 -> greedy picks id 0, <|endoftext|>: an EOS, but not the
    <|im_end|> that closes an assistant message, so the next obs_ids start with <|im_end|>\\n."""
    flat = HFBackend(backend.codec.model_dir, max_image_side=SIDE)
    state = dict(flat.model.state_dict())
    state["model.language_model.norm.weight"] = torch.zeros_like(state["model.language_model.norm.weight"])
    flat.update_weights(state, version=3)
    [traj] = play_episodes(flat, [EpisodeSpec(LAKE, 1, KW, max_turns=2)], sampling=Sampling(0.0, 1.0, 8))
    codec = flat.codec
    eot = codec.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    first, second = traj.turns
    assert first.response_ids == [eot] and not first.truncated_response and first.policy_version == 3
    assert second.obs_ids[:2] == [codec.im_end_id] + codec.tokenizer.encode("\n", add_special_tokens=False)
    # after a response that ended on <|im_end|> only "\n" follows (the codec's rule, checked here on ids)
    ended = codec.encode_obs("x", [], system=None, first=False, prev_response_ended=True).ids
    assert ended[0] != codec.im_end_id


class _Unmasked:
    """A backend that does not forbid prompt-only tokens (every real one does): the HF backend's
    responses with their first token replaced by ``<|image_pad|>``."""

    def __init__(self, inner: HFBackend):
        self.inner, self.codec, self.version = inner, inner.codec, inner.version

    def generate(self, requests, **kw):
        import dataclasses

        return [dataclasses.replace(r, response_ids=[self.codec.image_token_id, *r.response_ids[1:]])
                for r in self.inner.generate(requests, **kw)]


def test_a_response_with_image_tokens_ends_the_episode_without_that_turn(backend) -> None:
    """Weights under which greedy decoding would emit an image placeholder token: final norm = C * e_0
    makes every logit C' * x_0 * E[j, 0] for the normalised hidden x; E[<|image_pad|>, 0] = +1000
    and E[<|vision_start|>, 0] = -1000 put a vision token on top whatever the sign of x_0. The HF
    backend masks them (prompt-only tokens are never sampled), so the episode plays on; a backend
    that let one through would have the episode end without that turn."""
    bad = HFBackend(backend.codec.model_dir, max_image_side=SIDE)
    codec = bad.codec
    state = {k: v.clone() for k, v in bad.model.state_dict().items()}
    norm = torch.zeros_like(state["model.language_model.norm.weight"])
    norm[0] = 100.0
    state["model.language_model.norm.weight"] = norm
    emb = state["model.language_model.embed_tokens.weight"]
    emb[codec.image_token_id, 0], emb[codec.vision_start_id, 0] = 1000.0, -1000.0
    state.pop("lm_head.weight")
    bad.update_weights(state, version=1)
    [traj] = play_episodes(bad, [EpisodeSpec(LAKE, 1, KW, max_turns=2)], sampling=Sampling(0.0, 1.0, 4))
    assert traj.end_reason != "vision_token" and traj.turns
    assert not {i for t in traj.turns for i in t.response_ids} & set(codec.prompt_only_ids)
    [traj] = play_episodes(_Unmasked(backend), [EpisodeSpec(LAKE, 1, KW, max_turns=2)], sampling=Sampling(0.0, 1.0, 4))
    assert traj.end_reason == "vision_token" and traj.turns == []


class _ServerLike:
    """The HF backend answering as the server backend does: each result names the version that
    produced it (here 7 + the request's image count, so each turn differs from the backend's
    ``version``), and every request of the session ``fail`` after its first turn fails for good."""

    def __init__(self, inner: HFBackend, fail: str | None = None):
        self.inner, self.fail, self.version, self.sessions = inner, fail, 0, []
        self.codec = inner.codec

    def generate(self, requests, **kw):
        import dataclasses

        from worldloop.actor.generation import GenResult

        out = []
        for req, res in zip(requests, self.inner.generate(requests, **kw)):
            self.sessions.append(req.session)
            if req.session == self.fail and len(req.images) > 1:
                out.append(GenResult([], [], "", False, error="no usable inference server within 3 s"))
            else:
                out.append(dataclasses.replace(res, version=7 + len(req.images)))
        return out


def test_per_result_versions_sessions_and_failed_generations(backend) -> None:
    specs = [EpisodeSpec(LAKE, s, KW, max_turns=2, trajectory_id=f"ep{s}") for s in (3, 4)]
    probe = _ServerLike(backend)
    played = play_episodes(probe, specs, sampling=Sampling(0.0, 1.0, 12))
    two_turns = [t for t in played if len(t.turns) == 2]
    assert two_turns, [t.end_reason for t in played]
    for traj in played:  # each turn records the version of its own response, not the backend's
        assert [t.policy_version for t in traj.turns] == [8, 9][: len(traj.turns)]
    assert set(probe.sessions) == {"ep3", "ep4"}  # every request names its episode
    # a generation that failed for good drops its episode whole (no turns: the actor refunds it)
    tid = two_turns[0].trajectory_id
    failing = _ServerLike(backend, fail=tid)
    again = {t.trajectory_id: t for t in play_episodes(failing, specs, sampling=Sampling(0.0, 1.0, 12))}
    assert again[tid].end_reason == "server_error" and again[tid].turns == []
    other = next(t for k, t in again.items() if k != tid)
    assert other.end_reason != "server_error" and other.turns
