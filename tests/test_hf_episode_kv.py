"""``actor.hf_decode: cached`` (``actor/hf_episode_kv.py``): each episode's keys and values kept between
its turns, so that a turn prefills only its new tokens and images.

It gives ``generate``'s distribution, not its bits, so it is checked against what is exact: the
learner's one-pass log-probs over the whole multi-turn sequence (which a wrong rotary offset, a
wrong mask or a stale key would move far more than float rounding), and the bit-exact ``loop``
on the same real FrozenLake episodes of the shipped warm start."""

from __future__ import annotations

import numpy as np
import torch

from worldloop.actor.episodes import play_episodes
from worldloop.actor.generation import GenRequest
from worldloop.actor.hf_backend import HFBackend
from worldloop.actor.rollout import EpisodeSpec, Sampling
from worldloop.bootstrap.store import SHIPPED_DIR
from worldloop.common.contracts.config import load_config
from worldloop.common.contracts.modeling import build_sequence, collate, token_logprobs

CFG = load_config("tiny-frozenlake")
MODEL = SHIPPED_DIR / "tiny-frozenlake"


def _backend(decode: str) -> HFBackend:
    return HFBackend(MODEL, max_image_side=CFG.model.max_image_side, decode=decode)


def _play(backend: HFBackend, n: int, temperature: float, keyed: bool, seed0: int = 20_000_000):
    env = CFG.actor.envs[0]
    specs = [EpisodeSpec(env.id, seed0 + i, dict(env.kwargs), max_turns=3) for i in range(n)]
    return play_episodes(backend, specs, concurrency=n, sampling=Sampling(temperature, 1.0, CFG.actor.max_new_tokens),
                         max_model_len=CFG.model.max_model_len, sample_seed=3, keyed_sampling=keyed)


def _gap(model, codec, traj) -> float:
    layout = build_sequence(traj)
    with torch.no_grad():
        lp, _ = token_logprobs(model, collate([layout], codec), temperature=0.7, masked_ids=codec.prompt_only_ids)
    return max((lp[0, s:e] - layout.behaviour_logprobs[s:e]).abs().max().item() for s, e in layout.turn_spans)


def test_cached_turns_have_the_learners_logprobs_over_the_whole_sequence() -> None:
    backend = _backend("cached")
    trajs = _play(backend, 8, temperature=0.7, keyed=False)
    store = backend.episode_kv
    multi = [t for t in trajs if len(t.turns) > 1]
    assert len(multi) >= 2, [len(t.turns) for t in trajs]
    assert store.hits >= sum(len(t.turns) - 1 for t in trajs)  # every later turn found its episode
    assert store.reused_tokens > store.prefilled_tokens  # most of a later turn's context was not prefilled
    for t in multi:
        assert _gap(backend.model, backend.codec, t) < 1e-4


def test_cached_plays_the_loops_episodes() -> None:
    """Greedy, the same episodes turn by turn as the bit-exact loop (log-probs within float rounding)."""
    cached, loop = _backend("cached"), _backend("loop")
    a, b = _play(cached, 8, temperature=0.0, keyed=False), _play(loop, 8, temperature=0.0, keyed=False)
    turns_a = [(list(t.response_ids), list(t.logprobs)) for tr in a for t in tr.turns]
    turns_b = [(list(t.response_ids), list(t.logprobs)) for tr in b for t in tr.turns]
    assert len(turns_a) == len(turns_b) > 8
    same = [(x, y) for x, y in zip(turns_a, turns_b) if x[0] == y[0]]
    assert len(same) >= 0.9 * len(turns_b)  # a near-tie may flip a greedy token; none did here when written
    assert max(abs(p - q) for x, y in same for p, q in zip(x[1], y[1])) < 1e-4
    assert cached.episode_kv.hits > 0


def test_a_weight_update_empties_the_store_and_an_unrelated_prompt_is_prefilled_whole() -> None:
    backend = _backend("cached")
    codec = backend.codec
    first = codec.encode_obs("go", [], system="Play.", first=True).ids
    r = backend.generate([GenRequest(first, session="e1")], temperature=0.0, top_p=1.0, max_new_tokens=8)[0]
    store = backend.episode_kv
    assert len(store) == 1 and store.hits == 0
    follow = first + r.response_ids + codec.encode_obs("again", [], system=None, first=False).ids
    backend.generate([GenRequest(follow, session="e1")], temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert store.hits == 1 and store.reused_tokens == len(first) + len(r.response_ids) - 1
    # the same episode name with a prompt that does not continue the stored one: a miss, prefilled whole
    other = codec.encode_obs("something else", [], system="Play.", first=True).ids
    backend.generate([GenRequest(other, session="e1")], temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert store.hits == 1 and store.misses == 2
    # the same ids with another image where the stored one was: a miss too
    img = lambda seed: np.random.RandomState(seed).randint(0, 256, (60, 60, 3), dtype=np.uint8)
    obs = codec.encode_obs("look <image>", [img(0)], system="Play.", first=True)
    r = backend.generate([GenRequest(obs.ids, obs.images, session="e2")], temperature=0.0, top_p=1.0, max_new_tokens=8)[0]
    more = obs.ids + r.response_ids + codec.encode_obs("again", [], system=None, first=False).ids
    other_image = codec.encode_obs("look <image>", [img(1)], system="Play.", first=True).images
    backend.generate([GenRequest(more, other_image, session="e2")], temperature=0.0, top_p=1.0, max_new_tokens=8)
    assert store.hits == 1 and store.misses == 4
    own = backend.model.state_dict()
    backend.update_weights({k: v.clone() for k, v in own.items()}, 2)
    assert len(store) == 0 and backend.version == 2


def test_identical_first_turns_share_one_prefill_and_keep_their_bits(monkeypatch) -> None:
    """A GRPO group's episodes start on one level: the actor's lockstep batch holds the same first prompt
    several times. They are prefilled once, and every row gets exactly what its own prefill gives (the
    same call with the prefill run per row, compared with ``torch.equal``)."""
    import gymnasium as gym

    from worldloop.actor import hf_episode_kv
    from worldloop.envs.base import observation_parts

    env = CFG.actor.envs[0]
    backend = _backend("cached")
    codec = backend.codec

    def first_turn(seed: int):
        e = gym.make(env.id, **dict(env.kwargs))
        obs, _ = e.reset(seed=seed)
        text, images = observation_parts(obs)
        return codec.encode_obs(text, images, system=str(e.unwrapped.system_prompt()), first=True)

    a, b = first_turn(20_000_000), first_turn(20_000_001)
    # the preset's egocentric first observation says the same words on every level: only the image tells
    # two levels apart, so a prefill shared by token ids alone would give level b level a's keys
    assert a.ids == b.ids and a.images != b.images
    requests = [GenRequest(a.ids, a.images, session=f"s{i}") for i in range(3)] + [GenRequest(b.ids, b.images, session="s3")]
    calls = []
    real = hf_episode_kv._prefill_row

    def counted(model, codec, request, entry):
        calls.append(request.session)
        return real(model, codec, request, entry)

    monkeypatch.setattr(hf_episode_kv, "_prefill_row", counted)
    shared = backend.generate(requests, temperature=1.5, top_p=1.0, max_new_tokens=24, seed=11)
    assert calls == ["s0", "s3"] and backend.episode_kv.shared_prefills == 2
    stored = {s: backend.episode_kv._entries[s] for s in ("s0", "s1", "s2", "s3")}
    calls.clear()
    backend.episode_kv.clear()
    backend.episode_kv.shared_prefills = 0
    backend.episode_kv.share_prefill = False  # as before sharing: one prefill per row
    alone = backend.generate(requests, temperature=1.5, top_p=1.0, max_new_tokens=24, seed=11)
    assert calls == ["s0", "s1", "s2", "s3"] and backend.episode_kv.shared_prefills == 0
    assert [(r.response_ids, r.logprobs) for r in shared] == [(r.response_ids, r.logprobs) for r in alone]
    assert len({tuple(r.response_ids) for r in shared[:3]}) > 1  # the three rows sampled on their own
    for s, e in stored.items():  # and each episode keeps its own keys for its next turn
        o = backend.episode_kv._entries[s]
        assert e.ids == o.ids and all(torch.equal(x, y) for x, y in zip(e.keys + e.values, o.keys + o.values))
