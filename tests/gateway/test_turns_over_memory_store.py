"""The turn logic over the store's fake (`store.memory`): prefix reuse and the turn runner, with no database.

Each test runs the gateway's own objects (`SessionManager`, `TurnRunner`) on a `MemoryStore` and the
scripted fake engine, and reads the trajectory back from the fake.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine_pool.engine.client import SamplingParams
from engine_pool.fake import FakeEngine, fake_logprob
from engine_pool.pool import EnginePool
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.protocol import Done, GenerationRequest
from gateway.turns.runner import TurnRunner
from gateway.turns.sessions import SessionManager
from store.memory import MemoryStore


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.fixture
async def runner(tokenizer: ChatTokenizer) -> AsyncIterator[tuple[TurnRunner, SessionManager, FakeEngine]]:
    engine = FakeEngine()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(engine.app()))
    pool = EnginePool(http)
    pool.add_remote("http://fake-engine")
    await pool.start()
    store = MemoryStore()
    turns = TurnRunner(store, pool, tokenizer)
    yield turns, SessionManager(store, tokenizer), engine
    await turns.close()
    await pool.stop()
    await http.aclose()
    store.close()


async def _turn(
    turns: TurnRunner, sessions: SessionManager, sid: str, messages: list[dict[str, Any]]
) -> Done:
    plan, keys, session = sessions.plan(sid, messages, None)
    req = GenerationRequest(
        session, plan, SamplingParams(), {"messages": messages}, time.time(),
        max_tokens=4, messages=messages, message_keys=keys, stream=False,
    )  # fmt: skip
    done = [event async for event in turns.run(req) if isinstance(event, Done)]
    assert len(done) == 1
    return done[0]


async def test_a_turn_runs_on_the_fake_engine_and_is_recorded_in_the_fake_store(
    runner: tuple[TurnRunner, SessionManager, FakeEngine],
) -> None:
    turns, sessions, engine = runner
    engine.outputs = [[11, 12, 13]]
    sid = sessions.create({"task": "t"}).id
    done = await _turn(turns, sessions, sid, [_user("hi")])
    [stored] = turns.ledger.store.get_turns(sid)
    assert stored == done.turn and stored.status == "complete" and stored.output_ids == [11, 12, 13]
    prompt = stored.prompt_ids
    assert stored.output_logprobs == [fake_logprob(i, t) for i, t in enumerate([11, 12, 13])]  # as sent
    assert stored.loss_mask() == [0] * len(prompt) + [1, 1, 1]
    assert [e.kind for e in turns.ledger.store.get_events(sid)][:1] == ["fresh_prompt"]


async def test_the_next_turn_reuses_the_previous_turns_tokens_and_a_rewrite_opens_a_branch(
    runner: tuple[TurnRunner, SessionManager, FakeEngine], tokenizer: ChatTokenizer
) -> None:
    turns, sessions, engine = runner
    answer = tokenizer.encode("sure")
    engine.outputs = [answer, tokenizer.encode("ok"), tokenizer.encode("no")]
    sid = sessions.create().id
    first = (await _turn(turns, sessions, sid, [_user("a")])).turn
    said = {"role": "assistant", "content": tokenizer.decode(answer)}
    second = (await _turn(turns, sessions, sid, [_user("a"), said, _user("b")])).turn
    base = first.prompt_ids + first.output_ids
    assert second.parent_id == first.id and second.prompt_ids[: len(base)] == base
    assert (
        len(first.prompt_ids),
        len(base),
        first.id,
    ) in second.prompt_gen_spans  # generated, not re-tokenized
    rewritten = {"role": "assistant", "content": "something else"}
    third = (await _turn(turns, sessions, sid, [_user("a"), rewritten, _user("b")])).turn
    assert third.parent_id is None and third.branch != second.branch
    assert [(t.index, t.branch) for t in turns.ledger.store.get_turns(sid)] == [(0, 0), (1, 0), (2, 1)]
    assert [e.kind for e in turns.ledger.store.get_events(sid) if e.turn_id == second.id][:1] == [
        "prefix_reuse"
    ]
