"""Sandboxes across a Ray cluster (`sandbox.cluster`): nodes b and c of the shared local cluster, each
with a Docker engine of its own (`belayer.testing.docker_local`), checkpoints in a shared directory.

A node is lost the way a machine is: its raylet tree SIGKILLed and its Docker engine with every
container on it. The episodes on it go on, on the other node, from their newest checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.testing.docker_local import LocalDockerEngine
from belayer.testing.ray_local import LocalRayCluster
from core.errors import NoSandboxSlot, SandboxArgumentError
from engine_pool.fake import FakeEngine, LatentEngine
from engine_pool.pool import EnginePool
from gateway.api.sandbox import open_sandboxes
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig
from sandbox.backend import SandboxSpec
from sandbox.cluster import ClusterConfig, ClusterSandboxBackend
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.workloads import SHELL_COUNTER_SERVER
from store import SessionRecord, SqliteStore
from tests.sandbox.test_recovery import Env, Harness, check_consistent, start, step_command
from tests.sandbox_cluster.conftest import Cluster, sandboxes_on

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.docker, pytest.mark.ray]

IMAGE = "belayer-sandbox-busybox"


def test_sandboxes_spread_over_both_nodes_and_restore_on_each(cluster: Cluster) -> None:
    backend = cluster.backend
    b, c = cluster.ray.node("b").ip, cluster.ray.node("c").ip
    assert {n["node"]: n["state"] for n in backend.nodes()} == {b: "alive", c: "alive"}
    boxes = [backend.create(SandboxSpec(image=IMAGE)) for _ in range(4)]
    names = [cluster.name_of(b.id) for b in boxes]
    assert sorted(names) == ["b", "b", "c", "c"]
    for box, name in zip(boxes, names, strict=True):  # each container is on its node's engine, and only there
        assert box.id in cluster.engines[name].container_states()
        assert box.id not in cluster.engines["c" if name == "b" else "b"].container_states()
    try:
        for i, box in enumerate(boxes):
            out = backend.exec(box.id, f"cd /tmp && export N={i} && echo {i} > /workspace/n && (sleep 600 &)")
            assert out.exit_code == 0, out
        checkpoints = [backend.checkpoint(b.id, label="t") for b in boxes]
        for box in boxes:
            backend.destroy(box.id)
        restored = [backend.restore(c) for c in checkpoints]
        assert sorted(cluster.name_of(b.id) for b in restored) == ["b", "b", "c", "c"]
        for i, box in enumerate(restored):
            out = backend.exec(box.id, "echo $N $(pwd) $(cat /workspace/n); ps | grep -c '[s]leep 600'")
            assert out.stdout == f"{i} /tmp {i}\n1\n"  # shell, files and the process, as checkpointed
        for box in restored:
            backend.destroy(box.id)
        for c in checkpoints:
            backend.delete_checkpoint(c)
            assert not backend.has_checkpoint(c)
    finally:
        for box in boxes:
            backend.destroy(box.id)


def test_a_node_without_docker_is_refused_with_one_clear_line(
    whole_cluster: LocalRayCluster, node_engines: dict[str, LocalDockerEngine], tmp_path: Path
) -> None:
    b, c = whole_cluster.node("b").ip, whole_cluster.node("c").ip
    config = ClusterConfig(
        address=whole_cluster.address, node_ip=whole_cluster.head.ip,
        docker_urls={b: node_engines["b"].url, c: "unix:///run/belayer-no-such-engine.sock"},
    )  # fmt: skip
    backend = ClusterSandboxBackend(config, f"file://{tmp_path / 'store'}")
    try:
        Cluster(whole_cluster, node_engines, backend).wait_state("b", "alive")  # b: its check may be slow
        nodes = {n["node"]: n for n in backend.nodes()}
        assert (nodes[b]["state"], nodes[c]["state"]) == ("alive", "refused")
        assert "no Docker engine answers at unix:///run/belayer-no-such-engine.sock" in nodes[c]["reason"]
        assert "\n" not in nodes[c]["reason"]
        boxes = [backend.create(SandboxSpec(image=IMAGE)) for _ in range(2)]
        assert [backend.node_of(x.id) for x in boxes] == [b, b]  # never on the refused node
        for box in boxes:
            backend.destroy(box.id)
    finally:
        backend.close()


def test_no_free_slot_is_a_clear_error(cluster: Cluster) -> None:
    backend = cluster.backend
    boxes = []
    try:
        with pytest.raises(NoSandboxSlot, match="no node of the Ray cluster has a free sandbox slot"):
            for _ in range(17):  # 8 slots on each node
                boxes.append(backend.create(SandboxSpec(image=IMAGE)))
        assert len(boxes) == 16
    finally:
        for box in boxes:
            backend.destroy(box.id)


# ------------------------------------------------------------------ through the gateway: node loss


@pytest.fixture
async def env(cluster: Cluster, tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[tuple[Env, Cluster]]:
    engine = FakeEngine(max_model_len=8192)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
        sandbox=SandboxConfig(
            enabled=True, policy=PolicySettings(mode="always"), exec_grace_s=5.0, sandbox_port=None
        ),
    )
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(LatentEngine(engine.app(), 0.2)))
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool, sandbox_backend=cluster.backend)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=180
        )
        yield Env(client, app.state.gateway, engine), cluster
        await client.aclose()
    await engine_http.aclose()


def _losing_after(harness: Harness, env: Env, cluster: Cluster, sid: str, step: int, lost: list[str]) -> None:
    """Lose the node that holds the session's sandbox right after tool call `step` returned."""
    original = harness.run_tools

    async def run_tools(calls: list[dict[str, Any]]) -> None:
        now = sum(m["role"] == "tool" for m in harness.messages)
        await original(calls)
        if now == step and not lost:
            name = cluster.name_of(env.gw.sandboxes.sandbox_id(sid))  # type: ignore[union-attr]
            lost.append(name)
            await asyncio.to_thread(cluster.lose, name)

    harness.run_tools = run_tools  # type: ignore[method-assign]


@pytest.mark.parametrize("recovery", ["truncate", "replay"])
async def test_an_episode_goes_on_on_another_node_when_its_node_is_lost(
    env: tuple[Env, Cluster], recovery: str
) -> None:
    gateway, cluster = env
    commands = [step_command(i) for i in range(6)]  # a counter server whose count lives in its memory
    before = cluster.containers()
    sid, harness = await start(gateway, commands, recovery=recovery)
    lost: list[str] = []
    _losing_after(harness, gateway, cluster, sid, 3, lost)
    await harness.run()

    [name] = lost
    box = gateway.gw.sandboxes.sandbox_id(sid)  # type: ignore[union-attr]
    assert cluster.name_of(box) != name  # it runs on the other node now
    traj = await check_consistent(gateway, sid, len(commands))  # every step once, the counter's memory back
    failures = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_failure"]
    assert [f["kind"] for f in failures] == ["node_lost"]
    assert f"sandbox node {cluster.ray.node(name).ip}" in failures[0]["detail"]
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    if recovery == "replay":  # the harness never noticed
        assert harness.restores == [] and {t["branch"] for t in traj["turns"]} == {0}
        assert (restored["mode"], restored["turn_index"], restored["diverged"]) == ("replay", 3, 0)
    else:  # the harness resumed after the checkpoint's turn, told by a 409
        [restore] = harness.restores
        assert (restore["turn_index"], restore["keep_through"]) == (3, 3)

    # the lost node comes back: it is swept before it takes sandboxes; nothing of ours runs there again
    await asyncio.to_thread(cluster.bring_back, name)
    await asyncio.to_thread(cluster.wait_state, name, "alive")
    assert sandboxes_on(cluster.engines[name]) <= before[name]
    await gateway.client.delete(f"/api/sessions/{sid}/sandbox")
    assert cluster.containers() == before


async def test_a_forks_siblings_land_on_both_nodes_with_the_parents_processes(
    env: tuple[Env, Cluster],
) -> None:
    gateway, cluster = env
    tok = gateway.gw.tokenizer
    sandboxes = gateway.gw.sandboxes
    assert sandboxes is not None
    before = cluster.containers()

    async def turn(sid: str, messages: list[dict[str, Any]], reply: str) -> list[dict[str, Any]]:
        gateway.engine.outputs.append([*tok.encode(reply), tok.encode(tok.eos_token)[0]])
        r = await gateway.client.post(
            f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": messages, "max_tokens": 16}
        )
        assert r.status_code == 200, r.text
        return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]

    async def sh(sid: str, command: str) -> str:
        r = await gateway.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": command})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        return str(r.json()["stdout"])

    bump = 'kill -USR1 "$(cat /workspace/server.pid)"; while [ "$(cat /workspace/count)" != "{n}" ]; do sleep 0.02; done; echo {n}'
    r = await gateway.client.post("/api/sessions", json={"sandbox": {"image": IMAGE}})
    assert r.status_code == 201, r.text
    parent = str(r.json()["id"])
    convo = await turn(parent, [{"role": "user", "content": "start"}], "step 0")
    await sh(parent, SHELL_COUNTER_SERVER + "; echo from-the-parent > /workspace/data.txt")
    assert await sh(parent, bump.replace("{n}", "1")) == "1\n"
    await turn(parent, convo, "step 1")
    await sandboxes.idle()  # turn 1's bubble checkpoint (policy always)
    r = await gateway.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 3})
    assert r.status_code == 201, r.text
    children = [str(c["id"]) for c in r.json()["data"]]
    nodes = {cluster.name_of(str(sandboxes.sandbox_id(s))) for s in [parent, *children]}
    assert nodes == {"b", "c"}  # four sandboxes over two nodes: siblings on each
    for i, child in enumerate(children):  # the parent's file and its counter's memory, on either node
        assert await sh(child, "cat /workspace/data.txt") == "from-the-parent\n"
        assert await sh(child, bump.replace("{n}", "2")) == "2\n"
        await sh(child, f"echo {i} > /workspace/mine")
    assert [await sh(c, "cat /workspace/mine") for c in children] == ["0\n", "1\n", "2\n"]
    assert await sh(parent, "cat /workspace/count") == "1\n"  # the parent untouched
    for sid in (parent, *children):
        assert (await gateway.client.post(f"/api/sessions/{sid}/close")).status_code == 200
    assert cluster.containers() == before  # every sibling's container removed, on either node


async def test_a_checkpoint_the_store_cannot_give_back_fails_the_recovery_with_its_reason(
    env: tuple[Env, Cluster], tmp_path: Path
) -> None:
    gateway, cluster = env
    r = await gateway.client.post("/api/sessions", json={"sandbox": {"image": IMAGE}})
    sid = str(r.json()["id"])
    base = f"/api/sessions/{sid}/sandbox"
    assert (
        await gateway.client.post(f"{base}/exec", json={"command": "echo 1 > /workspace/a"})
    ).status_code == 200
    r = await gateway.client.post(f"{base}/checkpoints")
    assert r.status_code == 201, r.text
    ckpt = r.json()["id"]
    (tmp_path / "store" / "ckpt" / ckpt / "criu.tar").unlink()  # the store lost half of it
    box = gateway.gw.sandboxes.sandbox_id(sid)  # type: ignore[union-attr]
    await asyncio.to_thread(cluster.lose, cluster.name_of(box))
    r = await gateway.client.post(f"{base}/exec", json={"command": "cat /workspace/a"})
    assert (r.status_code, r.json()["error"]["code"]) == (503, "checkpoint_unreadable"), r.text
    assert f"ckpt/{ckpt}/criu.tar" in r.json()["error"]["message"]
    events = {e.kind: e.data for e in gateway.gw.store.get_events(sid)}
    assert events["sandbox_failure"]["kind"] == "node_lost"
    failed = events["sandbox_restore_failed"]
    assert failed["checkpoint_id"] == ckpt and f"ckpt/{ckpt}/criu.tar" in failed["error"]
    assert failed["error"].startswith("CheckpointMissing")


async def test_a_restarted_gateway_takes_back_its_sandboxes_on_every_node(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A gateway that leaves its sandboxes (keep_on_shutdown) to the next one on the same store: the next
    gateway's backend finds them on both nodes, with their processes still running."""
    store = SqliteStore(tmp_path / "traj.db")
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), keep_on_shutdown=True)
    sids = [f"s{i}" for i in range(4)]
    before = cluster.containers()
    async with httpx.AsyncClient() as http:
        pool = EnginePool(http)
        async with open_sandboxes(settings, store, pool, cluster.backend) as manager:
            assert manager is not None
            for sid in sids:
                store.create_session(SessionRecord(sid, time.time(), {}))
                await manager.create(sid, SandboxSpec(image=IMAGE))
                await manager.exec(sid, SHELL_COUNTER_SERVER + f"; echo {sid} > /workspace/f")
            boxes = {sid: manager.sandbox_id(sid) for sid in sids}
        assert {cluster.name_of(str(b)) for b in boxes.values()} == {"b", "c"}, cluster.backend.nodes()
        config = cluster.backend.config
        cluster.backend.close()  # the gateway is gone; its sandboxes are not
        cluster.backend = ClusterSandboxBackend(config, f"file://{tmp_path / 'store'}")
        async with open_sandboxes(
            settings.model_copy(update={"keep_on_shutdown": False}), store, pool, cluster.backend
        ) as manager:
            assert manager is not None and manager.adoption is not None
            assert sorted(manager.adoption.adopted) == sids
            for sid in sids:
                assert manager.sandbox_id(sid) == boxes[sid]
                out = await manager.exec(
                    sid, 'cat /workspace/f; kill -0 "$(cat /workspace/server.pid)" && echo alive'
                )
                assert out.stdout == f"{sid}\nalive\n"
    assert cluster.containers() == before  # keep_on_shutdown off the second time: removed from both nodes
    store.close()


def test_a_process_joins_one_ray_cluster(cluster: Cluster, tmp_path: Path) -> None:
    other = ClusterConfig(address="127.0.0.99:6379", node_ip=cluster.ray.head.ip)
    with pytest.raises(SandboxArgumentError, match=r"already joined the Ray cluster at 127\.0\.0\.\d+:\d+"):
        ClusterSandboxBackend(other, f"file://{tmp_path / 'store'}")
