"""Replicated gateways: two ``belayer serve`` processes on one PostgreSQL and one engine.

A session started on gateway A continues on gateway B with exact prefix reuse: B has never seen the
session and finds turn 1 in the store. Behind HAProxy, a ``kill -9`` of A mid-stream leaves the
harness's retry, through the balancer, to B, which continues the session. Real parts: a PostgreSQL
server, a fake engine process (``tests.gateway.held_engine``, autoregressive: the test knows every
token it produces), gateway processes, Debian's ``haproxy``, and the official ``openai`` SDK as the
harness.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest

from belayer.testing.services import haproxy_service, running
from engine_pool.fake import FakeEngine, autoregressive
from gateway.policy.tokenization import ChatTokenizer
from tests.postgres_server import PostgresServer
from tests.support import belayer_server, held_engine, poll

pytestmark = pytest.mark.postgres

REPLY_TOKENS = 300


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    with held_engine(tmp_path, 0.001) as (url, _):
        yield url


def _trajectory(url: str, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/sessions/{sid}/trajectory", timeout=10)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _chat(base_url: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
    sdk = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    r = sdk.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens, temperature=0)  # type: ignore[arg-type]
    content = r.choices[0].message.content
    assert content is not None
    return content


def _close_seen_by_follower(follower_url: str, close: Callable[[], object]) -> float:
    """Follow ``/api/finished`` on one gateway, `close` a session (on another); seconds until the
    follower had it."""
    with httpx.stream("GET", f"{follower_url}/api/finished?follow=true", timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == ": belayer finished feed"  # subscribed: a close from now on wakes it
        t0 = time.monotonic()
        close()
        for line in lines:
            if line == "event: finished":
                return time.monotonic() - t0
    raise AssertionError("the feed ended without the session")


def _episode(first: str, second: str, sid: str) -> list[dict[str, Any]]:
    """Turn 1 through gateway `first`, turn 2 through gateway `second`; the trajectory."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    answer = _chat(f"{first}/s/{sid}/v1", messages, 12)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "now the tests"}]
    _chat(f"{second}/s/{sid}/v1", messages, 8)
    turns: list[dict[str, Any]] = _trajectory(first, sid)["turns"]
    return turns


def test_a_session_started_on_a_continues_on_b_with_exact_prefix_reuse(
    postgres: PostgresServer, engine: str, tmp_path: Path, tiny_model_dir: Path, tokenizer: ChatTokenizer
) -> None:
    store = postgres.new_database()
    args = ["serve", "--model", str(tiny_model_dir), "--engine-url", engine, "--store", store]
    with (
        belayer_server(args, tmp_path / "a.log") as a,
        belayer_server(args, tmp_path / "b.log") as b,
    ):
        sid = httpx.post(f"{a.url}/api/sessions", json={"metadata": {"task": "t"}}).json()["id"]
        turns = _episode(a.url, b.url, sid)
        # the same conversation on gateway A alone: what one gateway builds is the reference
        alone = httpx.post(f"{a.url}/api/sessions", json={}).json()["id"]
        reference = _episode(a.url, a.url, alone)
        via_b = _trajectory(b.url, sid)["turns"]  # B reads the whole session too
        # a trainer follows the finished feed on B; the session closes on A: B's feed has it at once
        waited = _close_seen_by_follower(b.url, lambda: httpx.post(f"{a.url}/api/sessions/{sid}/close"))
        # Not at the feed's next 15 s heartbeat: A's close woke B (NOTIFY). 10 s leaves a loaded machine
        # seconds of scheduling delay and still tells the two apart.
        assert waited < 10.0

    t1, t2 = turns
    first = [{"role": "user", "content": "list the files"}]
    assert t1["prompt_ids"] == tokenizer.encode(tokenizer.render(first, None, add_generation_prompt=True))
    assert t1["output_ids"] == FakeEngine(step=autoregressive).greedy(t1["prompt_ids"], 12)
    reused = len(t1["prompt_ids"]) + len(t1["output_ids"])
    assert t2["prompt_ids"][:reused] == t1["prompt_ids"] + t1["output_ids"]  # turn 1's exact tokens
    assert t2["events"][0]["data"]["reused_tokens"] == reused
    assert [t["prompt_ids"] for t in turns] == [t["prompt_ids"] for t in reference]
    assert [t["output_ids"] for t in turns] == [t["output_ids"] for t in reference]
    assert (t2["index"], t2["branch"], t2["parent_index"]) == (1, 0, 0)
    assert t2["output_ids"] == FakeEngine(step=autoregressive).greedy(t2["prompt_ids"], 8)
    assert [(t["prompt_ids"], t["output_ids"]) for t in via_b] == [
        (t["prompt_ids"], t["output_ids"]) for t in turns
    ]


@contextlib.contextmanager
def _haproxy(tmp_path: Path, a: str, b: str) -> Iterator[str]:
    """HAProxy in front of gateways `a` and `b` (the bench's: ``belayer.testing.services.HAPROXY_CFG``):
    everything to A while it is up, a request whose connection A refuses redispatched to B."""
    lb = haproxy_service(tmp_path, [("a", a), ("b", b)])
    with running([lb]):
        lb.start()
        lb.wait_ready(30)
        yield lb.health_url.removesuffix("/health")


def _tokens(chunk: Any) -> int:
    choice = chunk.choices[0] if chunk.choices else None
    return len(choice.logprobs.content or []) if choice is not None and choice.logprobs else 0


def _connections(store: str, name: str) -> int:
    with psycopg.connect(store) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_kill_9_of_a_mid_stream_behind_haproxy_the_retry_continues_on_b(
    postgres: PostgresServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    store = postgres.new_database()
    config = tmp_path / "belayer.toml"
    config.write_text("[inflight]\nflush_interval_s = 0.05\nflush_tokens = 8\n")
    with held_engine(tmp_path, 0.01) as (engine, _):

        def serve(name: str) -> list[str]:
            return ["serve", "--model", str(tiny_model_dir), "--engine-url", engine, "--config", str(config),
                    "--store", f"{store}?application_name={name}"]  # fmt: skip

        with (
            belayer_server(serve("gw-a"), tmp_path / "a.log") as a,
            belayer_server(serve("gw-b"), tmp_path / "b.log") as b,
            _haproxy(tmp_path, a.url, b.url) as lb,
        ):
            sid = httpx.post(f"{lb}/api/sessions", json={}).json()["id"]
            sdk = openai.OpenAI(base_url=f"{lb}/s/{sid}/v1", api_key="none", max_retries=3, timeout=60)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
            answer = _chat(f"{lb}/s/{sid}/v1", messages, 12)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
            request = {"model": "policy", "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0,
                       "logprobs": True, "stream": True}  # fmt: skip
            stream = sdk.chat.completions.create(**request)
            received = 0
            for chunk in stream:
                received += _tokens(chunk)
                if received >= 40:
                    break

            def on_disk() -> list[int] | None:  # read from B: it shares the store
                turns = _trajectory(b.url, sid)["turns"]
                out: list[int] = turns[1]["output_ids"] if len(turns) == 2 else []
                return out if turns[1]["status"] == "running" and len(out) >= received else None

            seen = poll(on_disk, f"the running turn's first {received} tokens in the store")
            os.kill(a.proc.pid, signal.SIGKILL)  # gateway A itself, by its PID, mid-stream
            a.proc.wait(timeout=30)
            with pytest.raises((openai.APIError, httpx.HTTPError)):
                for _ in stream:
                    pass
            poll(lambda: _connections(store, "gw-a") == 0 or None, "A's database connections closed")

            retry = sdk.chat.completions.create(**request)  # the harness retries, through the balancer
            assert sum(_tokens(chunk) for chunk in retry) == REPLY_TOKENS
            traj = _trajectory(lb, sid)
            assert b.proc.poll() is None

    t1, t2, t3 = traj["turns"]
    assert [t["status"] for t in traj["turns"]] == ["complete", "interrupted", "complete"]
    expected = FakeEngine(step=autoregressive).greedy(t2["prompt_ids"], REPLY_TOKENS)
    assert len(t2["output_ids"]) >= len(seen) >= received >= 40
    assert t2["output_ids"] == expected[: len(t2["output_ids"])]  # what A streamed, kept
    assert t3["prompt_ids"] == t2["prompt_ids"] and t3["output_ids"] == expected
    reused = len(t1["prompt_ids"]) + len(t1["output_ids"])
    assert t3["prompt_ids"][:reused] == t1["prompt_ids"] + t1["output_ids"]
    assert t3["events"][0]["data"]["reused_tokens"] == reused
    assert t3["parent_index"] == t2["parent_index"] == 0 and t3["branch"] != t2["branch"]


SWEEP_S = 1.0


def _stored(store: str, sid: str) -> list[tuple[int, str, int]]:
    """The session's turns as the database holds them: (index, status, output tokens)."""
    with psycopg.connect(store) as conn:
        rows = conn.execute(
            "SELECT idx, status, length(output_ids) / 4 FROM turns WHERE session_id = %s ORDER BY idx", (sid,)
        ).fetchall()
    return [(int(i), str(s), int(n)) for i, s, n in rows]


def test_kill_9_of_a_mid_stream_b_sweeps_its_turn_interrupted_with_no_request_to_the_session(
    postgres: PostgresServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    store = postgres.new_database()
    config = tmp_path / "belayer.toml"
    config.write_text(
        f"[inflight]\nflush_interval_s = 0.05\nflush_tokens = 8\nsweep_interval_s = {SWEEP_S}\n"
    )
    with held_engine(tmp_path, 0.01) as (engine, _):

        def serve(name: str) -> list[str]:
            return ["serve", "--model", str(tiny_model_dir), "--engine-url", engine, "--config", str(config),
                    "--store", f"{store}?application_name={name}"]  # fmt: skip

        with (
            belayer_server(serve("gw-a"), tmp_path / "a.log") as a,
            belayer_server(serve("gw-b"), tmp_path / "b.log") as b,
        ):
            sid = httpx.post(f"{a.url}/api/sessions", json={}).json()["id"]
            messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
            answer = _chat(f"{a.url}/s/{sid}/v1", messages, 12)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go on"}]
            sdk = openai.OpenAI(base_url=f"{a.url}/s/{sid}/v1", api_key="none", max_retries=0, timeout=60)
            stream = sdk.chat.completions.create(
                model="policy", messages=messages, max_tokens=REPLY_TOKENS, temperature=0,  # type: ignore[arg-type]
                logprobs=True, stream=True,
            )  # fmt: skip
            received = 0
            for chunk in stream:
                received += _tokens(chunk)
                if received >= 40:
                    break

            def on_disk() -> int | None:  # read from the database: no request touches the session
                turns = _stored(store, sid)
                running = len(turns) == 2 and turns[1][1] == "running" and turns[1][2] >= received
                return turns[1][2] if running else None

            poll(on_disk, f"the running turn's first {received} tokens in the store")
            os.kill(a.proc.pid, signal.SIGKILL)  # gateway A itself, by its PID, mid-stream
            a.proc.wait(timeout=30)
            poll(lambda: _connections(store, "gw-a") == 0 or None, "A's database connections closed")

            def interrupted() -> list[tuple[int, str, int]] | None:
                turns = _stored(store, sid)
                return turns if turns[1][1] != "running" else None

            # B's next sweep, at most SWEEP_S away; 30 s is many sweeps, for a loaded machine: the test
            # shows that B marks it, not how soon (a bound of SWEEP_S + 5 s did not tell the configured
            # period from the 5 s default either).
            after = poll(interrupted, "B's sweep marking A's turn interrupted", timeout=30.0)
            traj = _trajectory(b.url, sid)
            metrics = httpx.get(f"{b.url}/metrics").text
            assert b.proc.poll() is None

    (_, s1, _), (_, s2, kept) = after
    assert (s1, s2) == ("complete", "interrupted") and kept >= received >= 40
    t2 = traj["turns"][1]
    expected = FakeEngine(step=autoregressive).greedy(t2["prompt_ids"], REPLY_TOKENS)
    assert t2["status"] == "interrupted" and t2["output_ids"] == expected[:kept]  # what A streamed, kept
    assert len(t2["output_logprobs"]) == kept
    events = [e["data"] for e in traj["events"] if e["kind"] == "turns_interrupted"]
    assert events == [{"turn_indices": [1], "output_tokens": [kept], "reason": "gateway_gone"}]
    assert "belayer_turns_interrupted_total 1.0" in metrics  # counted by B, whose sweep did it


def test_bench_gateway_crash_behind_haproxy_next_to_the_restart(
    postgres: PostgresServer,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from belayer.bench.gateway_crash import main

    monkeypatch.setenv("BELAYER_INFLIGHT__FLUSH_INTERVAL_S", "0.05")  # the bench's gateways inherit it
    args = ["--model", str(tiny_model_dir), "--sessions", "3", "--kill-after", "30", "--reply-tokens", "400"]
    args += [
        "--token-delay",
        "0.01",
        "--skip-overhead",
        "--replicas",
        "2",
        "--store",
        postgres.new_database(),
    ]
    assert main(args) == 0
    figures = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert figures["replicas"] == "2" and figures["replicas_sessions"] == figures["sessions"] == "3"
    for pre in ("", "replicas_"):  # the restart, and the kill of replica A behind the balancer
        assert figures[f"{pre}sessions_continued_pct"] == "100.000"
        assert figures[f"{pre}turns_lost"] == "0"
        assert float(figures[f"{pre}tokens_kept_pct"]) > 0
        assert float(figures[f"{pre}first_token_after_crash_s"]) > 0
