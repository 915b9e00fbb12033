"""Small valid messages for tests and benchmarks (``worldloop.trajectory/1``)."""

from __future__ import annotations

from worldloop.common.contracts.schemas import TRAJECTORY_SCHEMA, State, Trajectory, Turn, empty_state


def make_turn(index: int, n_resp: int = 3) -> Turn:
    return Turn(
        index=index,
        policy_version=2,
        obs_ids=[1, 2, 3, 4],
        response_ids=list(range(10, 10 + n_resp)),
        logprobs=[-0.5] * n_resp,
        images=[b"\x89PNG fake"],
        response_text="<think>...</think><answer>Up</answer>",
        observation="the box is left of the player",
        reasoning=None,
        prediction="the player moves up",
        actions=["Up"],
        format_ok=True,
        env_reward=-0.1,
        format_reward=0.5,
        done=False,
        success=False,
        state_before=empty_state(),
        state_after=State(relations=["box left of player"], symbolic="#P#", structured={"player": [1, 2]}),
        actions_total=1,
        actions_effective=1,
    )


def make_trajectory(tid: str = "t-1", turns: int = 2) -> Trajectory:
    """A valid worldloop.trajectory/1 message (used by the stream tests too)."""
    return Trajectory(
        schema=TRAJECTORY_SCHEMA,
        trajectory_id=tid,
        group_id="g-1",
        env_id="worldloop/Sokoban-v0",
        env_name="sokoban",
        env_kwargs={"dim_room": [6, 6]},
        seed=7,
        actor_id="a-1",
        created_at=1.5,
        prompt_format="grounding_worldmodeling",
        max_turns=3,
        turns=[make_turn(i) for i in range(turns)],
        success=False,
        scored=False,
    )


def one_turn_trajectory(obs_ids: list[int], response_ids: list[int], images: list[bytes] | None = None,
                        logprobs: list[float] | None = None) -> Trajectory:
    """A valid one-turn trajectory holding exactly these token ids (and images): what a test that
    scores or trains on given ids needs."""
    import msgspec

    turn = msgspec.structs.replace(make_turn(0, n_resp=len(response_ids)), policy_version=0, obs_ids=list(obs_ids),
                                   response_ids=list(response_ids), images=list(images or []),
                                   logprobs=list(logprobs) if logprobs is not None else [0.0] * len(response_ids))
    return msgspec.structs.replace(make_trajectory(turns=0), turns=[turn])
