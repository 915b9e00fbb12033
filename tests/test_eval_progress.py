"""The eval progress bar is a tqdm bar: counts, success rate over finished episodes, errors."""

from __future__ import annotations

import io

from tqdm import tqdm

from worldloop.eval.evaluate import ProgressBar


def test_bar_counts_a_resumed_run_and_closes_with_one_final_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(5, done=1, successes=1, stream=out, width=10)  # one episode already recorded, a success
    assert isinstance(bar.bar, tqdm)
    assert bar.line().startswith("[##--------] 1/5 episodes, success 1.00 | errors 0 | ")
    bar.update(True)
    bar.update(False)
    bar.update(True)
    assert bar.line().startswith("[########--] 4/5 episodes, success 0.75 | errors 0 | ")  # 3 of 4
    bar.update(None, error=True)  # an error is not a finished episode: the rate stays 3/4
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1  # the bar closed itself once, on its last episode
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("[##########] 5/5 episodes, success 0.75 | errors 1 | ")
    bar.close()  # idempotent
    assert out.getvalue() == text


def test_no_finished_episode_shows_a_dash() -> None:
    bar = ProgressBar(2, stream=io.StringIO(), width=4)
    bar.update(None, error=True)
    assert bar.line().startswith("[##--] 1/2 episodes, success - | errors 1 | ")
    bar.close()
