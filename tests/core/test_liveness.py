"""One vocabulary of liveness (`core.liveness`): a sandbox node's states are its words, and an engine
worker's states and a sandbox's status map onto it, with the words the API and the metrics already use."""

from __future__ import annotations

import engine_pool.states as pool_states
from core.liveness import Liveness
from engine_pool.states import DEAD, DRAINING, LIVENESS, READY, SHADOW, STARTING, UNHEALTHY
from sandbox.backend import SandboxStatus
from sandbox.cluster.nodes import Node


def test_the_words_are_the_ones_the_api_and_the_metrics_use() -> None:
    assert [m.value for m in Liveness] == ["starting", "alive", "lost", "refused", "dead"]
    assert (STARTING, READY, SHADOW, UNHEALTHY, DRAINING, DEAD) == (
        "starting", "ready", "shadow", "unhealthy", "draining", "dead",
    )  # fmt: skip


def test_every_worker_state_has_its_liveness() -> None:
    states = {v for k, v in vars(pool_states).items() if k.isupper() and isinstance(v, str)}
    assert set(LIVENESS) == states
    assert LIVENESS == {
        "starting": Liveness.STARTING, "ready": Liveness.ALIVE, "shadow": Liveness.ALIVE,
        "draining": Liveness.ALIVE, "unhealthy": Liveness.LOST, "dead": Liveness.DEAD,
    }  # fmt: skip


def test_a_node_starts_refused_and_shows_its_state_as_its_word() -> None:
    node = Node("10.0.0.3", "ray-id", slots=4)
    assert node.state is Liveness.REFUSED
    node.state = Liveness.LOST
    view = node.view()
    assert view["state"] == "lost" and type(view["state"]) is str


def test_a_sandbox_status_says_its_liveness() -> None:
    assert SandboxStatus(running=True).liveness is Liveness.ALIVE
    assert SandboxStatus(running=False, node_lost=True).liveness is Liveness.LOST
    assert SandboxStatus(running=False, exit_code=137, oom_killed=True).liveness is Liveness.DEAD
