"""A gateway killed with SIGKILL mid-stream, then restarted on the same store and port: the running
turn keeps the tokens it had written while it streamed (as ``interrupted``), a logprob recomputation
it had pending is redone, and the harness's retry of the same request continues the session.

Real parts: a fake engine process (``tests.gateway.held_engine``), ``belayer serve`` processes, and
the official ``openai`` SDK as the harness.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from core.net import free_port
from engine_pool.fake import FakeEngine, autoregressive, fake_logprob
from store import SqliteStore
from tests.support import belayer_server, poll, spawn, stop, wait_healthy

pytestmark = pytest.mark.chaos

REPLY_TOKENS = 400


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The engine's URL, and the file whose existence holds its prompt-logprobs answers."""
    hold = tmp_path / "hold"
    hold.touch()
    port = free_port()
    argv = [sys.executable, "-m", "tests.gateway.held_engine", "--port", str(port), "--hold", str(hold)]
    proc = spawn(argv, tmp_path / "engine.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc], 60, tmp_path / "engine.log")
        yield f"http://127.0.0.1:{port}", hold
    finally:
        stop(proc)


def _body(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {"model": "policy", "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def _tokens(chunk: Any) -> int:
    """Tokens in a streamed chunk (one logprob each)."""
    choice = chunk.choices[0] if chunk.choices else None
    return len(choice.logprobs.content or []) if choice is not None and choice.logprobs else 0


def _trajectory(url: str, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/sessions/{sid}/trajectory", timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_kill_9_mid_stream_keeps_the_tokens_resumes_recomputation_and_the_retry_continues(
    engine: tuple[str, Path], tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine_url, hold = engine
    db, port = tmp_path / "t.db", free_port()
    config = tmp_path / "belayer.toml"
    config.write_text("[inflight]\nflush_interval_s = 0.05\nflush_tokens = 8\n")
    args = ["serve", "--model", str(tiny_model_dir), "--engine-url", engine_url, "--store", str(db)]
    args += ["--config", str(config)]
    with belayer_server(args, tmp_path / "gw1.log", port=port) as gw:
        url = gw.url
        sid = httpx.post(f"{url}/api/sessions", json={}).json()["id"]
        sdk = openai.OpenAI(base_url=f"{url}/s/{sid}/v1", api_key="none", max_retries=0, timeout=60)
        first = [{"role": "user", "content": "a"}]
        r0 = sdk.chat.completions.create(**_body(first, 12))
        # History rewritten (the answer replaced by a summary): turn 1's logprobs for it are
        # recomputed in the background, and the engine holds that request (the hold file).
        rewritten: list[dict[str, Any]] = [*first, {"role": "assistant", "content": "(summary)"}]
        rewritten.append({"role": "user", "content": "b"})
        r1 = sdk.chat.completions.create(**_body(rewritten, 6))
        assert r0.choices[0].message.content is not None and r1.choices[0].message.content is not None
        with contextlib.closing(SqliteStore(db, recover=False)) as peek:  # the gateway is running
            assert len(peek.pending_recomputations()) == 1

        # Turn 2 extends turn 1 (prefix reuse) and streams a long reply; the gateway dies in it.
        messages = [*rewritten, {"role": "assistant", "content": r1.choices[0].message.content}]
        messages.append({"role": "user", "content": "go on"})
        request = {"model": "policy", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0,
                   "logprobs": True, "stream": True}  # fmt: skip
        stream = sdk.chat.completions.create(**request)
        received = 0
        for chunk in stream:
            received += _tokens(chunk)
            if received >= 40:
                break

        def on_disk() -> list[int] | None:
            turns = _trajectory(url, sid)["turns"]
            out: list[int] = turns[2]["output_ids"] if len(turns) == 3 else []
            return out if turns[2]["status"] == "running" and len(out) >= received else None

        seen = poll(on_disk, f"the running turn's first {received} tokens in the store")
        events = [e["kind"] for e in _trajectory(url, sid)["events"]]
        assert "recomputed_logprobs" not in events  # still pending, held by the engine
        os.kill(gw.proc.pid, signal.SIGKILL)  # the gateway process itself, by its PID
        gw.proc.wait(timeout=30)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:
                pass
    hold.unlink()  # the engine answers recomputations again

    with belayer_server(args, tmp_path / "gw2.log", port=port):  # the same port and store
        traj = _trajectory(url, sid)
        t2 = traj["turns"][2]
        expected = FakeEngine(step=autoregressive).greedy(t2["prompt_ids"], REPLY_TOKENS)
        stored = t2["output_ids"]
        assert t2["status"] == "interrupted"
        assert len(stored) >= len(seen) >= received >= 40
        assert stored == expected[: len(stored)]  # a prefix of what the engine would have produced
        assert t2["output_logprobs"] == [fake_logprob(i, t) for i, t in enumerate(stored)]

        # The harness retries the same request: a new turn with exactly turn 2's prompt ids, built by
        # prefix reuse of turn 1, on a new branch; turn 2 stays readable on its own.
        retry = sdk.chat.completions.create(**request)
        assert sum(_tokens(chunk) for chunk in retry) == REPLY_TOKENS

        def recomputed() -> dict[str, Any] | None:
            t = _trajectory(url, sid)
            kinds = [e["kind"] for e in t["events"]]
            return t if "recomputed_logprobs" in kinds else None

        traj = poll(recomputed, "the pending recomputation redone after the restart")
    turns = traj["turns"]
    assert [t["status"] for t in turns] == ["complete", "complete", "interrupted", "complete"]
    t1, t2, t3 = turns[1], turns[2], turns[3]
    assert t3["prompt_ids"] == t2["prompt_ids"] and t3["output_ids"] == expected
    assert t3["parent_index"] == t2["parent_index"] == 1 and t3["branch"] != t2["branch"]
    reuse = t3["events"][0]
    assert reuse["data"]["reused_tokens"] == len(t1["prompt_ids"]) + len(t1["output_ids"])
    assert t2["output_ids"] == stored and t2["branch"] == t1["branch"]
    kinds = [e["kind"] for e in traj["events"]]
    assert kinds.count("recomputed_logprobs") == 1 and "recompute_resumed" in kinds
    assert sum(t1["recomputed_mask"]) > 0
    with contextlib.closing(SqliteStore(db, recover=False)) as store:
        assert store.pending_recomputations() == []
