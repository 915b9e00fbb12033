"""Trajectory message codec: typed decode + validate against bare ``msgpack.unpackb``.

    python bench/schemas.py [--reps 2000]

The message is a 5-turn ``worldloop.trajectory/1`` of about 124 KB, shaped like a Sokoban
rollout of a vision model: every turn carries one rendered 6x6-room PNG (tiles drawn with
shading and sensor noise, so it compresses like a real render), ~290 observation tokens (system
prompt on the first turn, image placeholders), a 120-token response with its log-probs, the
parsed fields and the before/after ground-truth states. Rows, all measured in this run, median over
``--reps`` repetitions (after a warm-up):

* ``msgpack.unpackb``: bare untyped decode of the bytes (no validation): the baseline.
* ``decode_trajectory``: ours, decode + every check into ``Trajectory`` structs.
* ``encode_trajectory``: ours, pack + decode-back validation (what producers pay).
* ``msgspec encode only``: the pack part of the above.

ms per message and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import msgspec  # noqa: E402

from worldloop.common.contracts.schemas import (TRAJECTORY_SCHEMA, State, Trajectory, Turn, decode_trajectory,  # noqa: E402
                                      encode_trajectory)

TILE = {"#": (96, 64, 48), "_": (200, 190, 170), "O": (60, 160, 60), "X": (200, 150, 40), "P": (40, 80, 200)}


def room_png(step: int, side: int = 120, rng: np.random.Generator | None = None) -> bytes:
    """A rendered 6x6 room: shaded tiles plus sensor noise, PNG-encoded (~21 KB)."""
    rng = rng or np.random.default_rng(step)
    grid = ["######", "#__O_#", "#_X__#", "#__P_#", "#____#", "######"]
    px = side // 6
    img = np.zeros((side, side, 3), dtype=np.float32)
    yy, xx = np.mgrid[0:px, 0:px]
    shade = 0.85 + 0.15 * (1 - (yy + xx) / (2 * px))
    for r, row in enumerate(grid):
        for c, ch in enumerate(row):
            ch = "P" if (ch == "P" and step % 2 == 0) else ("_" if ch == "P" else ch)
            img[r * px:(r + 1) * px, c * px:(c + 1) * px] = np.array(TILE[ch]) * shade[..., None]
    img += rng.normal(0, 2.5, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def state(step: int) -> State:
    return State(relations=["box0 is above and on the left side of the player", "target0 is above the player"],
                 symbolic="######\n#__O_#\n#_X__#\n#__P_#\n#____#\n######",
                 structured={"player_position": [3, 3 - step % 2], "box_positions": [[2, 2]],
                             "target_positions": [[1, 3]], "step": step})


def trajectory(turns: int = 5) -> Trajectory:
    rng = np.random.default_rng(0)
    out = []
    for t in range(turns):
        obs = [int(x) for x in rng.integers(0, 151_000, 290 if t == 0 else 120)] + [151_655] * 170
        resp = [int(x) for x in rng.integers(0, 151_000, 120)]
        out.append(Turn(
            index=t, policy_version=7, obs_ids=obs, response_ids=resp,
            logprobs=[float(x) for x in -rng.exponential(0.7, len(resp))], images=[room_png(t, rng=rng)],
            response_text="<think><observation>The box is above and on the left side of the player.</observation>"
                          "<reasoning>Push it up.</reasoning><prediction>The box will be above the target."
                          "</prediction></think><answer>Up</answer>",
            observation="The box is above and on the left side of the player.", reasoning="Push it up.",
            prediction="The box will be above the target.", actions=["Up"], format_ok=True, env_reward=-0.1,
            format_reward=0.5, done=t == turns - 1, success=False, state_before=state(t), state_after=state(t + 1),
            actions_total=1, actions_effective=1, truncated_response=False))
    return Trajectory(schema=TRAJECTORY_SCHEMA, trajectory_id="0" * 32, group_id="1" * 32, env_id="worldloop/Sokoban-v0",
                      env_name="sokoban", env_kwargs={"dim_room": [6, 6], "num_boxes": 1}, seed=12345, actor_id="actor-0",
                      created_at=1.7e9, prompt_format="grounding_worldmodeling", max_turns=5, turns=out,
                      success=False, scored=False, end_reason="max_turns")


def median_ms(fn, reps: int) -> float:
    for _ in range(min(50, reps)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    traj = trajectory()
    data = encode_trajectory(traj)
    assert decode_trajectory(data) == traj
    n_img = sum(len(b) for t in traj.turns for b in t.images)
    print(f"message: {len(data) / 1024:.1f} KiB, {len(traj.turns)} turns, images {n_img / 1024:.1f} KiB, "
          f"{args.reps} repetitions")
    encoder = msgspec.msgpack.Encoder()
    rows = [
        ("msgpack.unpackb (bare, no validation)", lambda: msgpack.unpackb(data, raw=False, strict_map_key=True)),
        ("decode_trajectory (decode + validate)", lambda: decode_trajectory(data)),
        ("encode_trajectory (pack + validate)", lambda: encode_trajectory(traj)),
        ("msgspec encode only", lambda: encoder.encode(traj)),
    ]
    results = [(name, median_ms(fn, args.reps)) for name, fn in rows]
    base = results[0][1]
    print(f"{'operation':<40} {'ms/message':>11} {'vs unpackb':>11}")
    for name, ms in results:
        print(f"{name:<40} {ms:>11.3f} {ms / base:>10.2f}x")


if __name__ == "__main__":
    main()
