"""The scripted engine keyed by session, behind a real gateway app (in process): the gateway names each
engine request's session and turn in ``X-Request-Id``, and the engine gives a fork's parent and each
child their own answer at the fork turn however often and in whatever order they ask."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_pool.engine.client import engine_request_id, session_of_request
from engine_pool.fake import FakeEngine
from gateway.policy.tokenization import ChatTokenizer
from harness_adapters.scripted_engine import Script, ScriptedEngine
from tests.support import GatewayHarness

FORK_TURN = 1
TURNS = ["first step", "parent's second step", "parent done"]
ANSWERS = ["child A's way", "child B's way"]


@pytest.fixture
def scripted(tiny_model_dir: Path) -> ScriptedEngine:
    script = Script(marker="TASK-9", turns=TURNS, fork_turn=FORK_TURN, fork_answers=ANSWERS)
    return ScriptedEngine.load(tiny_model_dir, [script])


@pytest.fixture
def fake_engine(scripted: ScriptedEngine) -> FakeEngine:  # the gateway fixture's engine
    return scripted.fake(max_model_len=4096)


async def ask(gateway: GatewayHarness, sid: str, messages: list[dict[str, Any]]) -> str:
    body = {"model": "policy", "messages": messages, "max_tokens": 32}
    r = await gateway.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_each_fork_child_keeps_its_own_answer_at_the_fork_turn(
    gateway: GatewayHarness, scripted: ScriptedEngine, tokenizer: ChatTokenizer
) -> None:
    sid, _ = await gateway.new_session()
    convo = [{"role": "user", "content": "TASK-9: fix it"}]
    assert await ask(gateway, sid, convo) == TURNS[0]
    convo += [{"role": "assistant", "content": TURNS[0]}, {"role": "user", "content": "go on"}]
    r = await gateway.client.post(f"/api/sessions/{sid}/fork", json={"at_turn": 0, "n": 2})
    assert r.status_code == 201, r.text
    a, b = (str(c["id"]) for c in r.json()["data"])
    # the parent asks first, then the children in the order B, A, and each asks twice (a retry)
    assert await ask(gateway, sid, convo) == TURNS[1]
    assert [await ask(gateway, b, convo), await ask(gateway, a, convo)] == ANSWERS
    assert [await ask(gateway, a, convo), await ask(gateway, b, convo)] == ANSWERS[::-1]
    assert await ask(gateway, sid, convo) == TURNS[1]
    # the engine saw each request's session, as the gateway named it
    assert [e.session for e in scripted.emitted] == [sid, sid, b, a, a, b, sid]
    assert [tokenizer.decode(e.output_ids, skip_special_tokens=True) for e in scripted.emitted[2:6]] == [
        ANSWERS[0],
        ANSWERS[1],
        ANSWERS[1],
        ANSWERS[0],
    ]


def test_engine_request_ids_are_unique_per_submission_and_name_their_session() -> None:
    ids = {engine_request_id("ses_1", 4) for _ in range(100)}
    assert len(ids) == 100 and {session_of_request(i) for i in ids} == {"ses_1"}
    assert all(i.startswith("ses_1.t4.") for i in ids)
    assert session_of_request(None) is None and session_of_request("cmpl-abc") is None
