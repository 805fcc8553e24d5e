"""The RL trainer's parts without a gateway: the task's verifier, the GRPO loss and its staleness
rule, the warm-up's token sequences, and what the loop counts from a row (`belayer.train`)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from belayer.client import Finished
from belayer.train import grpo, task
from belayer.train.deterministic import Run, compare
from belayer.train.loop import batches
from belayer.train.report import Report, account
from belayer.train.settings import Settings
from belayer.train.trainer import Trainer

ROW = {
    "prompt_ids": [1, 2, 3],
    "response_ids": [10, 11, 12, 13, 14, 15],
    "response_mask": [1, 1, 1, 0, 1, 1],
    "response_logprobs": [-0.5, -1.0, -0.25, 0.0, -2.0, -0.75],
    "turn_spans": [{"start": 0, "end": 3}, {"start": 4, "end": 6}],
    "weight_segments": [
        {"start": 0, "end": 1, "version": "v0"},
        {"start": 1, "end": 3, "version": "v1"},
        {"start": 4, "end": 6, "version": "v2"},
    ],
}
INDEX = {"v0": 0, "v1": 1, "v2": 2}


def test_the_verifier_pays_for_the_right_call_and_for_a_faithful_answer():
    assert task.reward("cyan", [("lookup", '{"key": "cyan"}')], "six", "six") == 1.0
    assert task.reward("cyan", [("lookup", '{"key": "red"}')], "seven", " seven\n") == 0.75
    assert task.reward("cyan", [("lookup", '{"key": "cyan"}')], "six", "seven") == 0.25
    assert task.reward("cyan", [("search", '{"key": "cyan"}')], "unknown", "six") == 0.0
    assert task.reward("cyan", [], None, None) == 0.0
    assert task.tool_answer("nope") == task.UNKNOWN and task.tool_answer(None) == task.UNKNOWN


def test_warm_up_episodes_are_right_about_as_often_as_asked():
    eps = task.warm_up_episodes(random.Random(3), 4000, correct=0.2)
    right_call = sum(e.called == e.key for e in eps) / len(eps)
    right_answer = sum(e.answer == task.TABLE[e.called] for e in eps) / len(eps)
    expected = 0.2 + 0.8 / len(task.KEYS)
    assert abs(right_call - expected) < 0.03 and abs(right_answer - expected) < 0.03


def test_tokens_beyond_max_staleness_are_masked_and_the_others_count():
    assert grpo.token_versions(ROW) == ["v0", "v1", "v1", None, "v2", "v2"]
    assert grpo.token_weights(ROW, INDEX, current=2, max_staleness=0) == [0, 0, 0, 0, 1, 1]
    assert grpo.token_weights(ROW, INDEX, current=2, max_staleness=1) == [0, 1, 1, 0, 1, 1]
    assert grpo.token_weights(ROW, INDEX, current=2, max_staleness=2) == [1, 1, 1, 0, 1, 1]
    # a version the trainer does not know (not its own) never counts
    assert grpo.token_weights(ROW, {"v2": 0}, current=0, max_staleness=9) == [0, 0, 0, 0, 1, 1]


def test_a_stale_token_within_the_bound_counts_through_its_importance_ratio():
    old = torch.tensor([[-1.0, -1.0]])
    new = torch.tensor([[-1.0 + math.log(1.1), -1.0]], requires_grad=True)  # token 0: ratio 1.1
    adv = torch.tensor([1.0])
    loss = grpo.clipped_loss(new, old, adv, torch.tensor([[1.0, 1.0]]))
    assert loss.item() == pytest.approx(-(1.1 + 1.0) / 2)
    loss.backward()
    assert new.grad is not None and new.grad[0, 0].item() == pytest.approx(
        -1.1 / 2
    )  # d(ratio)/d(logp) = ratio
    # beyond the clip range the token pushes no further
    far = torch.tensor([[-1.0 + math.log(2.0), -1.0]], requires_grad=True)
    grpo.clipped_loss(far, old, adv, torch.tensor([[1.0, 1.0]])).backward()
    assert far.grad is not None and far.grad[0, 0].item() == 0.0


def test_a_masked_token_does_not_move_the_loss():
    old = torch.tensor([[-1.0, -1.0]])
    weights = torch.tensor([[0.0, 1.0]])
    a = grpo.clipped_loss(torch.tensor([[-5.0, -1.0]]), old, torch.tensor([1.0]), weights)
    b = grpo.clipped_loss(torch.tensor([[-0.1, -1.0]]), old, torch.tensor([1.0]), weights)
    assert a.item() == b.item() == -1.0


def test_group_advantages_are_zero_for_a_group_that_teaches_nothing():
    assert grpo.group_advantages([0.25, 0.25, 0.25]) == [0.0, 0.0, 0.0]
    adv = grpo.group_advantages([1.0, 0.0])
    assert adv == pytest.approx([1.0, -1.0])


def test_the_loop_counts_cut_turns_lag_and_tokens_without_a_version():
    report = Report()
    account(report, ROW, INDEX, current=2)
    assert report.turns_cut == 1 and report.tokens_kept_across_cuts == 1  # turn 0: 1 token of v0, then v1
    assert report.max_version_lag == 2 and report.tokens_without_version == 0 and report.tokens_discarded == 0
    gap = {**ROW, "weight_segments": ROW["weight_segments"][1:]}  # token 0 generated, with no version
    account(report, gap, INDEX, current=2)
    assert report.tokens_without_version == 1 and report.tokens_discarded == 1


async def test_the_group_batcher_trains_on_complete_groups_in_the_order_they_completed():
    order = ["g0", "g1", "g2", "g1", "g2", "g0", "g3", "g3", "g4"]

    async def feed():
        for i, group in enumerate(order):
            yield Finished(str(i), {"id": f"s{i}", "metadata": {"group": group}})

    got = [[[item.cursor for item in g] for g in batch] async for batch in batches(feed(), 2, 2)]
    assert got == [[["1", "3"], ["2", "4"]], [["0", "5"], ["6", "7"]]]  # g4 is still one short


def test_response_slice_aligns_the_sequence_logprobs_with_the_response():
    lp = torch.arange(8.0)[None, :]  # sequence of 9 tokens: position j scores token j + 1
    row = {"prompt_ids": [0, 0, 0], "response_ids": [0] * 6}
    assert grpo.response_slice(lp, row, 0).tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def _finished(reward: float, logprobs: list[float], version: str = "v0") -> Finished:
    row = {**ROW, "response_logprobs": logprobs, "branch": 0,
           "weight_segments": [{"start": 0, "end": 3, "version": version}, {"start": 4, "end": 6, "version": version}]}  # fmt: skip
    return Finished("c", {"id": "s", "reward": reward}, [row])


def test_the_deterministic_trainer_ignores_the_recorded_logprobs_and_takes_an_alias_for_its_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Its ratio's "old" logprobs are its own: rows that differ only in their recorded logprobs give the
    same loss and the same weights; tokens of an alias of the served version have lag 0 and count."""
    states, losses = [], []
    shifted = [x - 0.001 for x in ROW["response_logprobs"]]
    for deterministic, logprobs in [(True, ROW["response_logprobs"]), (True, shifted), (False, shifted)]:
        settings = Settings(model_dir=str(tiny_model_dir), workdir=tmp_path, deterministic=deterministic)
        trainer = Trainer(settings, tiny_model_dir, "v0")
        trainer.alias("v0.recut")
        report = Report()
        trainer.step([[_finished(1.0, logprobs), _finished(0.0, logprobs, "v0.recut")]], report)
        states.append(trainer.model.state_dict())
        losses.append(trainer.losses)
        assert report.max_version_lag == 0 and report.tokens_without_version == 0
    assert losses[0] == losses[1] and len(losses[0]) == 1
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[1][k], states[2][k]) for k in states[0])  # the recorded ones move it


def _run(name: str, response_ids: list[int], logprob: float, reward: float) -> Run:
    row = {**ROW, "response_ids": response_ids, "response_logprobs": [logprob] * 6, "branch": 0}
    run = Run(name, losses=[0.5], state={"w": torch.ones(2)})
    run.episodes[(1, 0, 0)] = Finished("c", {"id": name, "reward": reward}, [row])
    return run


def test_the_comparison_of_two_runs_names_what_differs() -> None:
    settings = Settings(model_dir="m", workdir=Path("w"), kill_after_step=None)
    same = compare(
        _run("a", [10, 11, 12, 13, 14, 15], -1.0, 1.0),
        _run("b", [10, 11, 12, 13, 14, 15], -1.0 + 2**-20, 1.0),
        settings,
    )
    assert same.trajectories_identical and same.rewards_identical and same.weights_identical
    assert same.tokens_compared == 5 and same.recorded_logprob_max_abs_diff == 2**-20
    assert same.loss_max_abs_diff == 0.0 and same.problems() == []
    other = compare(
        _run("a", [10, 11, 12, 13, 14, 15], -1.0, 1.0),
        _run("b", [10, 11, 99, 13, 14, 15], -1.0, 0.5),
        settings,
    )
    assert not other.trajectories_identical and not other.rewards_identical
    assert other.problems() == ["the trajectories differ: [\"(1, 0, 0): branch 0's token ids differ\"]",
                                "the rewards differ"]  # fmt: skip
    assert dict(other.lines())["trajectories_identical"] == "false"
