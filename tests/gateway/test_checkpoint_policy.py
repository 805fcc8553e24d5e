"""The adaptive checkpoint policy, without Docker: exact predictions and decisions."""

from __future__ import annotations

import pytest

from sandbox.config import PolicySettings
from sandbox.sessions.policy import AdaptivePolicy

PRIORS = PolicySettings(
    margin=1.0, max_deferred_turns=2, alpha=0.5, prior_prefill_tps=1000.0, prior_decode_tps=50.0,
    prior_output_tokens=100.0, prior_fixed_cost_s=0.5, prior_dump_bps=100e6,
)  # fmt: skip


def decide(policy: AdaptivePolicy, prompt: int, load: float = 1.0, since: int = 1, dump: float = 0.0) -> str:
    d = policy.decide(
        prompt_tokens=prompt, engine_load=load, turns_since_checkpoint=since,
        last_dump_bytes=dump, bytes_written_since=0, session_cost_s=None,
    )  # fmt: skip
    return d.action


def test_predictions_from_priors() -> None:
    policy = AdaptivePolicy(PRIORS)
    assert policy.predict_bubble(1000, 1.0) == pytest.approx(1.0 + 2.0)
    assert policy.predict_bubble(1000, 3.0) == pytest.approx(9.0)  # shared with two other requests
    assert policy.predict_cost(50e6) == pytest.approx(0.5 + 0.5)
    assert policy.predict_cost(50e6, session_cost_s=2.0) == 2.0


def test_checkpoints_when_the_bubble_outlasts_the_cost_else_defers_with_a_bound() -> None:
    policy = AdaptivePolicy(PRIORS)
    assert decide(policy, 0, dump=100e6) == "checkpoint"  # bubble 2.0 >= cost 1.5
    assert decide(policy, 0, dump=200e6) == "defer"  # bubble 2.0 < cost 2.5
    assert decide(policy, 0, dump=200e6, since=2) == "forced"  # the upper bound on deferral
    assert decide(policy, 0, dump=200e6, load=2.0) == "checkpoint"  # a loaded engine: a longer bubble


def test_learns_decode_speed_and_checkpoint_cost() -> None:
    policy = AdaptivePolicy(PRIORS)
    # replies of 20 tokens at 100 tok/s after a 0.1 s prefill of 1000 tokens: bubbles get short
    for _ in range(20):
        policy.observe_turn(prompt_tokens=1000, output_tokens=20, seconds=0.3, ttft_s=0.1)
    assert policy.predict_bubble(1000, 1.0) == pytest.approx(0.1 + 0.2, rel=1e-3)
    assert decide(policy, 1000) == "defer"  # 0.3 s bubble < 0.5 s fixed cost
    for _ in range(20):
        policy.observe_checkpoint(seconds=0.2, dump_bytes=0)
    assert policy.predict_cost(0) == pytest.approx(0.2, rel=1e-3)
    assert decide(policy, 1000) == "checkpoint"


@pytest.mark.parametrize(("mode", "action"), [("always", "checkpoint"), ("never", "off")])
def test_fixed_modes(mode: str, action: str) -> None:
    policy = AdaptivePolicy(PRIORS.model_copy(update={"mode": mode}))
    assert decide(policy, 0, dump=1e12, since=0) == action


def test_a_standby_fits_what_is_left_of_the_shorter_of_the_predicted_and_the_recent_bubbles() -> None:
    policy = AdaptivePolicy(PRIORS)
    assert policy.predict_standby(50e6) == pytest.approx(1.0)  # before any: what the checkpoint costs
    assert policy.standby_bubble(3.0) == 3.0  # no bubble seen yet
    assert policy.standby_fits(1.0, 50e6) and not policy.standby_fits(0.99, 50e6)  # margin 1
    policy.observe_standby(0.4)
    policy.observe_standby(0.8)
    assert policy.predict_standby(50e6) == pytest.approx(0.6)  # alpha 0.5
    policy.observe_turn(prompt_tokens=10, output_tokens=10, seconds=2.0, ttft_s=None)
    policy.observe_turn(prompt_tokens=10, output_tokens=10, seconds=1.0, ttft_s=None)
    assert policy.standby_bubble(3.0) == pytest.approx(1.5) and policy.standby_bubble(1.2) == 1.2
