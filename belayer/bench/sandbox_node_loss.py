"""``belayer bench sandbox-node-loss``: a cluster node lost under running episodes, and what it costs.

A Ray cluster of three nodes on this machine (``belayer.testing.ray_local``: a is the head, b and c offer
sandboxes) and one Docker engine per sandbox node (``belayer.testing.docker_local``); checkpoints go to a
shared directory. ``--sandboxes`` N sessions, spread over b and c by the cluster backend
(`sandbox.cluster`), each run an episode of ``--steps`` tool calls of ``--step-s`` seconds (what an
agent's turn takes: the model's answer and the tool), with a harness inside: a shell process whose step
count lives only in its memory (`sandbox.workloads.SHELL_COUNTER_SERVER`), bumped by each call, and a
checkpoint after each call, as the gateway's ``always`` policy takes them.

Then the node holding the most sandboxes is lost as a machine is (its Ray processes SIGKILLed, its Docker
engine killed with every container on it). Each lost session's next tool call finds it gone; the session
manager restores it on the other node from its newest checkpoint and replays the calls since (none
here), and the call answers. Printed:

- ``node_loss_restored_s_p50``, ``node_loss_restored_s_max``: from the kill until each lost sandbox
  answered again, with its in-memory count and its files as they were;
- ``restored_pct``: the lost sandboxes that came back whole (count and log right);
- ``rerun_s``: running the same episodes again from scratch on the surviving node, in this run;
- ``node_loss_speedup``: ``rerun_s / node_loss_restored_s_max``;
- ``leaked_containers``: Belayer containers on the lost node once it is back and swept (should be 0).

Figures go to stdout as ``name: value`` lines, progress to stderr. Needs root, ``dockerd`` and CRIU
(``deploy/host/setup_sandbox_host.sh install``) and Ray (in the project's venv).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from belayer.bench import emit as _emit
from belayer.testing.docker_local import LocalDockerEngine, ensure_busybox, local_docker_engines
from belayer.testing.ray_local import LocalRayCluster, local_ray_cluster
from belayer.testing.services import progress
from core.errors import BenchError, SandboxTimeout
from sandbox.backend import SandboxSpec
from sandbox.cluster import SLOTS, ClusterConfig, ClusterSandboxBackend
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.sessions.manager import SandboxManager
from sandbox.workloads import SHELL_COUNTER_SERVER
from store import SessionRecord, SqliteStore

IMAGE = "belayer-sandbox-busybox"


def emit(name: str, value: float | int | str) -> None:
    _emit(name, value, digits=3)


def step_command(i: int, step_s: float) -> str:
    """Tool call `i` (from 1): the turn's time, a line in the log, and one bump of the in-memory count."""
    return (
        f'sleep {step_s}; echo {i} >> /workspace/log; kill -USR1 "$(cat /workspace/server.pid)"; '
        f'while [ "$(cat /workspace/count 2>/dev/null)" != "{i}" ]; do sleep 0.02; done'
    )


async def episode(manager: SandboxManager, store: SqliteStore, sid: str, steps: int, step_s: float) -> float:
    """A session from nothing to `steps` tool calls, checkpointed after each; its seconds."""
    started = time.monotonic()
    store.create_session(SessionRecord(sid, time.time(), {}))
    await manager.create(sid, SandboxSpec(image=IMAGE))
    await manager.exec(sid, SHELL_COUNTER_SERVER)
    for i in range(1, steps + 1):
        try:  # the command waits (in the shell) for the in-memory count to reach i: its timeout bounds that
            result = await manager.exec(sid, step_command(i, step_s), timeout_s=step_s + 30)
        except SandboxTimeout:
            raise BenchError(
                f"{sid}: gave up waiting for the counter process to count step {i} after {step_s + 30:g} s"
            ) from None
        if result.exit_code != 0:
            raise BenchError(f"{sid}: step {i} failed: {result.stderr}")
        await manager.checkpoint(sid)
    return time.monotonic() - started


async def answered(manager: SandboxManager, sid: str, steps: int, lost_at: float) -> tuple[float, bool]:
    """The lost session's next tool call: seconds from the loss until it answered, and whether the
    sandbox came back whole: the in-memory count goes on from where it was, the log holds every step."""
    bump = (
        f'kill -USR1 "$(cat /workspace/server.pid)"; '
        f'while [ "$(cat /workspace/count)" != "{steps + 1}" ]; do sleep 0.02; done; wc -l < /workspace/log'
    )
    try:
        result = await manager.exec(sid, bump, timeout_s=15)
    except SandboxTimeout:  # the count did not go on: the process came back without its memory
        return time.monotonic() - lost_at, False
    return time.monotonic() - lost_at, result.stdout.strip() == str(steps)


async def measure(
    backend: ClusterSandboxBackend,
    lose: dict[str, Callable[[], None]],
    store: SqliteStore,
    opts: argparse.Namespace,
) -> None:
    """Run the episodes, lose the fuller node, measure the restores and a rerun (module docstring).
    `lose` maps a node address to what loses that node."""
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=0.2)
    manager = SandboxManager(backend, store, settings)
    try:
        sids = [f"ses_node{i}" for i in range(opts.sandboxes)]
        progress(
            f"{len(sids)} episodes of {opts.steps} tool calls of {opts.step_s}s, checkpointed after each"
        )
        await asyncio.gather(*(episode(manager, store, sid, opts.steps, opts.step_s) for sid in sids))
        where = {sid: str(backend.node_of(str(manager.sandbox_id(sid)))) for sid in sids}
        node = max(set(where.values()), key=lambda ip: sum(v == ip for v in where.values()))
        lost = [sid for sid in sids if where[sid] == node]
        progress(f"losing node {node} with {len(lost)} sandboxes")
        lost_at = time.monotonic()
        await asyncio.to_thread(lose[node])
        results = await asyncio.gather(*(answered(manager, sid, opts.steps, lost_at) for sid in lost))
        moved = {backend.node_of(str(manager.sandbox_id(sid))) for sid in lost}
        if node in moved:
            raise BenchError(f"a lost sandbox still reports node {node}")
        seconds = [s for s, _ in results]
        progress(f"rerunning the {len(lost)} lost episodes from scratch on the surviving node")
        rerun_started = time.monotonic()
        await asyncio.gather(
            *(episode(manager, store, f"{sid}_rerun", opts.steps, opts.step_s) for sid in lost)
        )
        rerun = time.monotonic() - rerun_started
        emit("lost_sandboxes", len(lost))
        emit("node_loss_restored_s_p50", statistics.median(seconds))
        emit("node_loss_restored_s_max", max(seconds))
        emit("restored_pct", 100.0 * sum(ok for _, ok in results) / len(results))
        emit("rerun_s", rerun)
        emit("node_loss_speedup", rerun / max(seconds))
        emit("node_losses", backend.node_losses)
    finally:
        await manager.close()


def _lose(ray: LocalRayCluster, engine: LocalDockerEngine, name: str) -> Callable[[], None]:
    def lose() -> None:
        ray.kill_node(name)
        engine.kill()

    return lose


async def run(opts: argparse.Namespace, tmp: Path) -> None:
    ips = f"127.0.0.{opts.first_ip}-{opts.first_ip + 2}"
    progress(f"a Ray cluster of 3 nodes on {ips} and a Docker engine for each of b and c")
    slots = {SLOTS: 2 * opts.sandboxes}  # room for every episode, restored and rerun, on either node
    resources = {"b": slots, "c": slots}
    with (
        local_docker_engines(["b", "c"], tmp / "docker") as engines,
        local_ray_cluster(
            ["a", "b", "c"], tmp / "ray", cpus=2, resources=resources, first_ip=opts.first_ip
        ) as ray,
    ):
        for engine in engines:
            ensure_busybox(engine)
        await run_on(ray, {e.name: e for e in engines}, opts, tmp)


async def run_on(
    ray: LocalRayCluster, by_name: dict[str, LocalDockerEngine], opts: argparse.Namespace, tmp: Path
) -> None:
    """The bench on `ray`, whose sandbox nodes (b and c, with room for ``2 * --sandboxes`` sandboxes each)
    run the engines `by_name` (by node name, each with the busybox image): a test passes its session's
    own. The lost node and its engine are started again before it returns."""
    urls = {ray.node(n).ip: e.url for n, e in by_name.items()}
    config = ClusterConfig(
        address=ray.address, node_ip=ray.head.ip, docker_urls=urls, probe_interval_s=0.3,
        node_timeout_s=opts.node_timeout,
    )  # fmt: skip
    backend = await asyncio.to_thread(ClusterSandboxBackend, config, f"file://{tmp / 'store'}")
    try:
        lose = {ray.node(n).ip: _lose(ray, e, n) for n, e in by_name.items()}
        await measure(backend, lose, SqliteStore(tmp / "traj.db"), opts)
        for name, engine in by_name.items():  # bring the lost node back: it is swept before it serves
            if not engine.running():
                engine.restart()
                ray.restart_node(name)
                deadline = time.monotonic() + 60
                ip = ray.node(name).ip
                while not any(n["node"] == ip and n["state"] == "alive" for n in backend.nodes()):
                    if time.monotonic() > deadline:
                        raise BenchError(f"node {name} never came back: {backend.nodes()}")
                    await asyncio.sleep(0.2)
                leaked = [c for c in engine.container_states() if c.startswith("belayer-sbx")]
                emit("leaked_containers", len(leaked))
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="belayer bench sandbox-node-loss", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sandboxes", type=int, default=16, help="episodes, over the two sandbox nodes")
    parser.add_argument("--steps", type=int, default=10, help="tool calls per episode")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds each tool call takes")
    parser.add_argument("--node-timeout", type=float, default=2.0, help="a node silent this long is lost")
    parser.add_argument(
        "--first-ip", type=int, default=2, help="the nodes' loopback addresses: 127.0.0.N, N+1, N+2"
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    opts = parser.parse_args(argv)
    if opts.dir is not None:
        opts.dir.mkdir(parents=True, exist_ok=True)
        asyncio.run(run(opts, opts.dir))
        return 0
    with tempfile.TemporaryDirectory(prefix="belayer-node-loss-", dir="/tmp") as tmp:
        asyncio.run(run(opts, Path(tmp)))
    return 0
