"""Checkpoints in inference bubbles without Docker: each policy mode's decisions, as events, and
the checkpoints they lead to (or not)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sandbox.config import PolicySettings
from sandbox.fake import Fault, Shell
from tests.sandbox.sessions.conftest import Env, EnvFactory, eventually

PRIORS: dict[str, Any] = {
    "margin": 1.0, "max_deferred_turns": 2, "prior_prefill_tps": 1000.0, "prior_decode_tps": 50.0,
    "prior_output_tokens": 100.0, "prior_fixed_cost_s": 3.0, "prior_dump_bps": 100e6,
}  # fmt: skip


def holding(env: Env) -> tuple[threading.Event, threading.Event]:
    """A sandbox command ``hold`` that sets the first event once it runs and returns when the second is
    set: a call that holds the sandbox for as long as the test wants."""
    entered, go = threading.Event(), threading.Event()

    def hold(shell: Shell, argv: list[str]) -> int:
        entered.set()
        shell.wait(go)
        return 0

    env.backend.commands["hold"] = hold
    return entered, go


def actions(env: Env) -> list[str]:
    return [data["action"] for kind, data in env.events() if kind == "sandbox_checkpoint_decision"]


async def test_always_checkpoints_in_the_bubble(make_env: EnvFactory) -> None:
    env = await make_env(policy=PolicySettings(mode="always"))
    sid = await env.session()
    await env.manager.write_file(sid, "a", b"12345")
    turn = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn)

    [(_, decision), (_, taken)] = env.events()[1:]
    assert decision == {
        "action": "checkpoint", "predicted_bubble_s": 1.2825, "predicted_cost_s": 0.3,
        "turns_since_checkpoint": 1, "reason": "mode always",
    }  # fmt: skip
    assert (taken["turn_index"], taken["in_bubble"], taken["keep_through"], taken["trigger"]) == (
        0,
        True,
        0,
        "checkpoint",
    )
    assert taken["dump_bytes"] == 5
    kinds_turns = [(e.kind, e.turn_id) for e in env.store.get_events(sid)][1:]
    assert kinds_turns == [
        ("sandbox_call", None),
        ("sandbox_checkpoint_decision", turn.id),
        ("sandbox_checkpoint", turn.id),
    ]


async def test_never_decides_off_and_takes_none(env: Env) -> None:
    sid = await env.session()
    for _ in range(3):
        env.finish_turn(env.start_turn(sid))
    await env.manager.idle()
    assert actions(env) == ["off"] * 3
    assert env.backend.ops("checkpoint") == []
    turns_since = [d["turns_since_checkpoint"] for k, d in env.events() if k == "sandbox_checkpoint_decision"]
    assert turns_since == [1, 2, 3]


async def test_adaptive_defers_forces_after_the_bound_and_checkpoints_a_long_bubble(
    make_env: EnvFactory,
) -> None:
    load = [1.0]
    env = await make_env(engine_load=lambda: load[0], policy=PolicySettings(mode="adaptive", **PRIORS))
    sid = await env.session()
    env.finish_turn(env.start_turn(sid))
    turn1 = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn1)
    load[0] = 2.0  # a busier engine: the next bubble is twice as long
    turn2 = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn2)

    assert actions(env) == ["defer", "forced", "checkpoint"]
    first = next(d for k, d in env.events() if k == "sandbox_checkpoint_decision")
    assert first == {
        "action": "defer", "predicted_bubble_s": 2.01, "predicted_cost_s": 3.0,
        "turns_since_checkpoint": 1, "reason": "bubble 2.01s < 1 x cost 3.00s",
    }  # fmt: skip
    taken = [(d["turn_index"], d["trigger"]) for k, d in env.events() if k == "sandbox_checkpoint"]
    assert taken == [(1, "forced"), (2, "checkpoint")]


async def test_a_bubble_over_before_its_checkpoint_could_start_is_skipped(make_env: EnvFactory) -> None:
    env = await make_env(policy=PolicySettings(mode="always"))
    sid = await env.session()
    turn = env.start_turn(sid)
    env.finish_turn(turn)  # before the background checkpoint got to run
    await env.manager.idle()

    assert env.kinds()[1:] == ["sandbox_checkpoint_decision", "sandbox_checkpoint_skipped"]
    assert env.events()[-1][1] == {"reason": "bubble over"}
    assert env.backend.ops("checkpoint") == []


async def test_a_bubble_while_a_call_holds_the_sandbox_is_busy(make_env: EnvFactory) -> None:
    env = await make_env(policy=PolicySettings(mode="adaptive", max_deferred_turns=0))  # forced each turn
    entered, go = holding(env)
    sid = await env.session()
    call = asyncio.create_task(env.manager.exec(sid, "hold"))
    await eventually(entered.is_set)
    env.finish_turn(env.start_turn(sid))
    go.set()
    await call
    await env.manager.idle()

    assert actions(env) == ["busy"]
    assert env.backend.ops("checkpoint") == []


async def test_a_failed_bubble_checkpoint_is_an_event_and_the_next_bubble_tries_again(
    make_env: EnvFactory,
) -> None:
    env = await make_env(policy=PolicySettings(mode="always"))
    sid = await env.session()
    box = env.manager.sandbox_id(sid)
    env.backend.inject(Fault("checkpoint"))
    turn = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn)
    turn = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn)

    assert env.kinds()[1:] == [
        "sandbox_checkpoint_decision", "sandbox_checkpoint_failed",
        "sandbox_checkpoint_decision", "sandbox_checkpoint",
    ]  # fmt: skip
    assert env.events()[2][1] == {"error": f"checkpoint on {box} failed (injected fault)"}
    assert actions(env) == ["checkpoint", "checkpoint"]


async def test_finished_turns_teach_the_policy_the_decode_speed(env: Env) -> None:
    sid = await env.session()
    before = env.manager.policy.predict_bubble(0, 1.0)
    env.finish_turn(env.start_turn(sid), output_tokens=100, total_ms=100.0)
    assert env.manager.policy.predict_bubble(0, 1.0) < before


async def test_always_takes_a_bubble_that_found_a_checkpoint_running_when_that_one_ends(
    make_env: EnvFactory,
) -> None:
    """Turn 1 starts while turn 0's checkpoint is still dumping: busy, and then taken in turn 1's
    bubble (still open); turn 2's bubble, over by the time turn 1's dump ends, is not."""
    env = await make_env(policy=PolicySettings(mode="always"))
    sid = await env.session()
    release = threading.Event()
    env.backend.inject(Fault("checkpoint", "block", release=release))
    turn0 = env.start_turn(sid)
    await eventually(lambda: bool(env.backend.ops("checkpoint")))  # turn 0's dump is under way
    env.finish_turn(turn0)
    turn1 = env.start_turn(sid)
    release.set()
    await eventually(lambda: len(env.backend.ops("checkpoint")) == 2)
    await env.manager.idle()
    env.finish_turn(turn1)
    turn2 = env.start_turn(sid)
    env.finish_turn(turn2)
    await env.manager.idle()

    assert actions(env) == ["checkpoint", "busy", "checkpoint"]
    taken = [(d["turn_index"], d["in_bubble"]) for k, d in env.events() if k == "sandbox_checkpoint"]
    assert taken == [(0, False), (1, True)]  # turn 0 ended mid-dump; turn 2: over before it could start
    assert env.kinds()[-1] == "sandbox_checkpoint_skipped"


async def test_always_waits_for_a_call_holding_the_sandbox_then_takes_the_bubble_if_still_open(
    make_env: EnvFactory,
) -> None:
    env = await make_env(policy=PolicySettings(mode="always"))
    entered, go = holding(env)
    sid = await env.session()
    for still_open in (False, True):
        entered.clear()
        go.clear()
        call = asyncio.create_task(env.manager.exec(sid, "hold"))
        await eventually(entered.is_set)
        turn = env.start_turn(sid)
        if not still_open:
            env.finish_turn(turn)
        go.set()
        await call
        await env.manager.idle()
        if still_open:
            env.finish_turn(turn)

    assert actions(env) == ["checkpoint", "checkpoint"]  # not "busy": each waited for the call
    outcomes = [k for k, _ in env.events() if k in ("sandbox_checkpoint", "sandbox_checkpoint_skipped")]
    assert outcomes == ["sandbox_checkpoint_skipped", "sandbox_checkpoint"]
    assert len(env.backend.ops("checkpoint")) == 1


async def test_always_holds_the_end_of_a_turn_until_its_checkpoint_is_taken(make_env: EnvFactory) -> None:
    """A call holds the sandbox for the whole turn (the harness's runner polling it): the turn's output
    is complete, but its end waits (`turn_ending`) until the call is over and the checkpoint taken, so
    the bubble is still open for it and the turn has a checkpoint to fork at."""
    env = await make_env(policy=PolicySettings(mode="always"))
    entered, go = holding(env)
    sid = await env.session()
    call = asyncio.create_task(env.manager.exec(sid, "hold"))
    await eventually(entered.is_set)
    turn = env.start_turn(sid)
    ending = asyncio.create_task(env.manager.turn_ending(turn))
    done, _ = await asyncio.wait({ending}, timeout=0.3)
    assert not done and env.backend.ops("checkpoint") == []  # held: the call still has the sandbox
    go.set()
    await call
    await asyncio.wait_for(ending, 30)
    assert len(env.backend.ops("checkpoint")) == 1  # taken before the end was let go
    env.finish_turn(turn)
    await env.manager.idle()

    taken = [(d["turn_index"], d["in_bubble"]) for k, d in env.events() if k == "sandbox_checkpoint"]
    assert taken == [(turn.index, True)]


async def test_adaptive_never_holds_the_end_of_a_turn(make_env: EnvFactory) -> None:
    env = await make_env(policy=PolicySettings(mode="adaptive", max_deferred_turns=0))  # forced each turn
    release = threading.Event()
    env.backend.inject(Fault("checkpoint", "block", release=release))
    sid = await env.session()
    turn = env.start_turn(sid)
    await eventually(lambda: bool(env.backend.ops("checkpoint")))  # its dump is under way
    await asyncio.wait_for(env.manager.turn_ending(turn), 5)  # not held for it
    release.set()
    env.finish_turn(turn)
    await env.manager.idle()
    assert actions(env) == ["checkpoint"]
