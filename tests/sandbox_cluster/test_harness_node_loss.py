"""A real harness (mini-swe-agent, unchanged) through ``belayer serve --sandboxes --sandbox-ray``: its
sandbox is placed on a node of the shared Ray cluster, and that node is lost mid-episode (its Ray processes
and its Docker engine with the container, killed). The episode still solves its task: the gateway restores
the newest checkpoint on the other node and replays the commands since, unseen by mini; the task's image,
built on the gateway's own engine, is copied to each node that needs it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.testing.docker_local import LocalDockerEngine
from belayer.testing.ray_local import LocalRayCluster
from harness_adapters.mini_swe_agent import MiniSweAgent
from tests.harness.test_episodes import (
    API_TOKEN,
    CACHE,
    MINI_TURNS,
    Stack,
    check_trajectory,
    make_task,
    start_stack,
)
from tests.sandbox_cluster.conftest import sandboxes_on

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.harness, pytest.mark.docker, pytest.mark.ray]


@pytest.fixture
def cluster_stack(
    tmp_path: Path,
    tiny_model_dir: Path,
    docker_engine: None,
    whole_cluster: LocalRayCluster,
    whole_engines: dict[str, LocalDockerEngine],
) -> Iterator[Stack]:
    args = ["--sandbox-ray", whole_cluster.address, "--sandbox-ray-node-ip", whole_cluster.head.ip,
            "--checkpoint-store", f"file://{tmp_path / 'store'}", "--sandbox-node-timeout", "2"]  # fmt: skip
    for name, engine in whole_engines.items():
        args += ["--sandbox-docker-url", f"{whole_cluster.node(name).ip}={engine.url}"]
    yield from start_stack(
        tmp_path, tiny_model_dir, "MINI-TASK", MINI_TURNS, crash=None, policy="always", api_token=API_TOKEN,
        serve_args=args,
    )  # fmt: skip


def lose_node_after_checkpoint(
    stack: Stack,
    turn: int,
    done: threading.Event,
    cluster: LocalRayCluster,
    engines: dict[str, LocalDockerEngine],
) -> tuple[str, str, str]:
    """Once the session's sandbox has a checkpoint from `turn`'s bubble, lose the node that holds it; the
    sandbox, the node's name, and the node that holds the sandbox restored in its place."""
    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline and not done.is_set():
        for s in stack.api("sessions")["data"]:
            state = stack.api(f"sessions/{s['id']}/sandbox", check=False)
            seen = [c["turn_index"] for c in state.get("checkpoints", [])]
            if any(t >= turn for t in seen):
                box = state["sandbox_id"]
                [name] = [n for n, e in engines.items() if box in e.container_states()]
                cluster.kill_node(name)
                engines[name].kill()
                return box, name, restored_on(stack, s["id"], box, engines)
        time.sleep(0.1)  # the episode runs in another thread: poll the gateway's view of it
    raise AssertionError(f"no checkpoint of turn {turn} before the episode ended (checkpoints at {seen})")


def restored_on(stack: Stack, sid: str, lost: str, engines: dict[str, LocalDockerEngine]) -> str:
    """The node whose engine holds the session's sandbox once it is no longer `lost`."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        box = stack.api(f"sessions/{sid}/sandbox", check=False).get("sandbox_id")
        holders = [
            n
            for n, e in engines.items()
            if e.running() and box and box != lost and box in e.container_states()
        ]
        if holders:
            return holders[0]
        time.sleep(0.1)
    raise AssertionError(f"session {sid}'s sandbox was never restored")


def test_mini_swe_agent_episode_survives_the_loss_of_its_node(
    cluster_stack: Stack,
    tmp_path: Path,
    whole_cluster: LocalRayCluster,
    whole_engines: dict[str, LocalDockerEngine],
) -> None:
    before = {name: sandboxes_on(engine) for name, engine in whole_engines.items()}
    runner = cluster_stack.runner(MiniSweAgent(CACHE))
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        episode = pool.submit(runner.run, make_task(tmp_path, "MINI-TASK"))
        episode.add_done_callback(lambda _f: done.set())
        lost_box, lost_node, restored_node = lose_node_after_checkpoint(
            cluster_stack, 2, done, whole_cluster, whole_engines
        )
        report: dict[str, Any] = episode.result(timeout=600)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, report["harness_stderr_tail"]
    assert report["harness_report"]["exit_status"] == "Submitted"
    check_trajectory(cluster_stack, report["session_id"], 4)  # every turn complete, the ids the engine sent
    traj = cluster_stack.api(f"sessions/{report['session_id']}/trajectory")
    [failure] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_failure"]
    assert failure["kind"] == "node_lost" and failure["sandbox_id"] == lost_box
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert (restored["mode"], restored["discarded_turns"], restored["diverged"]) == ("replay", [], 0)
    assert restored_node != lost_node  # on the node alive
    assert (report["prefix_reuse"], report["branches"], report["fresh_prompts"]) == (3, 0, 1)
    metrics = httpx.get(f"{cluster_stack.url}/metrics", headers={"authorization": f"Bearer {API_TOKEN}"}).text
    assert "belayer_node_loss_restores_total 1.0" in metrics

    # the lost node comes back while the gateway runs: it is swept; nothing of the episode is left on it
    whole_engines[lost_node].restart()
    whole_cluster.restart_node(lost_node)
    ip = whole_cluster.node(lost_node).ip
    deadline = time.monotonic() + 120
    while not any(
        n["node"] == ip and n["state"] == "alive"
        for n in cluster_stack.api("dashboard/state")["sandbox_nodes"]
    ):
        assert time.monotonic() < deadline, cluster_stack.api("dashboard/state")["sandbox_nodes"]
        time.sleep(0.2)  # the gateway probes its nodes every second
    assert sandboxes_on(whole_engines[lost_node]) <= before[lost_node]
