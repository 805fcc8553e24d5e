"""Placement on a Ray cluster (``RayLauncher.choose``), decided from the cluster's nodes and the pool's
members alone: these run without Ray. And a gateway without ``--ray`` never imports Ray."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_pool.engine.client import EngineClient
from engine_pool.pool import READY, SHADOW, STARTING, PoolMember
from engine_pool.workers.ray_actor import RayWorker
from engine_pool.workers.ray_workers import HEAD_RESOURCE, NodeView, RayLauncher, RaySettings
from engine_pool.workers.worker import WorkerSpec


def node(name: str, cpus: float = 2.0, head: bool = False, alive: bool = True) -> NodeView:
    total = {"CPU": cpus, f"node_{name}": 1.0, **({HEAD_RESOURCE: 1.0} if head else {})}
    return NodeView(name, f"10.0.0.{ord(name) - 96}", alive, total)


class Pool:
    """A pool's members as placement sees them: each a `RayWorker` already on its node."""

    def __init__(self, launcher: RayLauncher, http: httpx.AsyncClient) -> None:
        self.launcher, self.http = launcher, http
        self.members: list[PoolMember] = []

    def add(self, state: str, on: str | None, shadow: bool = False) -> RayWorker:
        name = f"worker-{len(self.members)}"
        worker = self.launcher.worker(
            WorkerSpec(model="/m", port=1), Path("/tmp"), name, shadow, self.members
        )
        worker.node = on
        self.members.append(
            PoolMember(name, EngineClient("http://e", "m", self.http), process=worker, state=state)
        )
        return worker

    def new(self, shadow: bool) -> RayWorker:
        return self.add(STARTING, None, shadow)


@pytest.fixture
def pool() -> Iterator[Pool]:
    yield Pool(RayLauncher(RaySettings(cpus_per_worker=1.0)), httpx.AsyncClient())


NODES = [node("a", head=True), node("b"), node("c")]


def test_a_shadow_goes_where_no_active_worker_is(pool: Pool) -> None:
    pool.add(READY, "b")
    pool.add(READY, "c")
    assert pool.launcher.choose(NODES, pool.new(shadow=True)) == "a"


def test_an_active_worker_goes_where_no_shadow_is(pool: Pool) -> None:
    pool.add(SHADOW, "b", shadow=True)
    pool.add(READY, "c")
    assert (
        pool.launcher.choose(NODES, pool.new(shadow=False)) == "a"
    )  # the fewest workers: a, though the head


def test_starting_workers_count_by_what_they_are_launched_to_be(pool: Pool) -> None:
    pool.add(STARTING, "b", shadow=False)  # an active worker still starting holds node b
    assert pool.launcher.choose(NODES, pool.new(shadow=True)) == "c"  # not b; c before the head


def test_the_head_comes_after_nodes_with_as_much_room(pool: Pool) -> None:
    assert pool.launcher.choose(NODES, pool.new(shadow=False)) == "b"


def test_fewest_workers_first(pool: Pool) -> None:
    pool.add(READY, "b")
    assert pool.launcher.choose(NODES, pool.new(shadow=False)) == "c"


def test_with_no_room_apart_a_shadow_shares_an_active_workers_node(pool: Pool) -> None:
    nodes = [node("a", cpus=2), node("b", cpus=1)]
    pool.add(READY, "a")
    pool.add(SHADOW, "b", shadow=True)  # b is full
    assert pool.launcher.choose(nodes, pool.new(shadow=True)) == "a"


def test_a_node_whose_worker_could_not_be_stopped_comes_last(pool: Pool) -> None:
    pool.launcher.suspect("b")
    assert pool.launcher.choose(NODES, pool.new(shadow=False)) == "c"
    pool.add(READY, "c")
    pool.add(READY, "a")
    assert (
        pool.launcher.choose(NODES, pool.new(shadow=True)) == "c"
    )  # b last, though no active worker is on it


def test_dead_and_full_nodes_are_not_chosen_and_none_means_ray_queues_it(pool: Pool) -> None:
    nodes = [node("a", cpus=1), node("b", alive=False)]
    assert pool.launcher.choose(nodes, pool.new(shadow=False)) == "a"
    pool.add(READY, "a")
    assert pool.launcher.choose(nodes, pool.new(shadow=True)) is None


def test_custom_resources_and_gpus_count_toward_room(pool: Pool) -> None:
    launcher = RayLauncher(RaySettings(cpus_per_worker=1.0, gpus_per_worker=2.0, resources={"engine": 1.0}))
    gpu_pool = Pool(launcher, pool.http)
    nodes = [
        NodeView("a", "10.0.0.1", True, {"CPU": 8, "GPU": 4, "engine": 1}),
        NodeView("b", "10.0.0.2", True, {"CPU": 8, "GPU": 4}),
        NodeView("c", "10.0.0.3", True, {"CPU": 8, "GPU": 1, "engine": 1}),
    ]
    assert launcher.settings.needs() == {"CPU": 1.0, "engine": 1.0, "GPU": 2.0}
    assert launcher.choose(nodes, gpu_pool.new(shadow=False)) == "a"


def test_a_gateway_without_ray_never_imports_it() -> None:
    code = (
        "import sys, belayer.cli, gateway.app, engine_pool.pool, engine_pool.workers.ray_workers;"
        "from gateway.app import build_pool; from gateway.config import GatewayConfig; import httpx;"
        "build_pool(GatewayConfig(model='/m', worker_kind='fake'), httpx.AsyncClient());"
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ray_settings_from_the_command_line_and_gpus_left_to_ray(tiny_model_dir: Path) -> None:
    from core.errors import ConfigError
    from gateway.app import ray_launcher
    from gateway.config.loader import ConfigLoader
    from gateway.config.preflight import preflight

    flags = {"model": "--model", "ray.address": "--ray", "launch.gpus": "--gpus"}
    given = {"model": str(tiny_model_dir), "ray.address": "127.0.0.2:6379", "ray.resources": {"engine": "1"},
             "launch.profile": "gpu", "launch.tensor_parallel_size": 2, "port": 0}  # fmt: skip
    config = ConfigLoader(given, flags).load()
    launcher = ray_launcher(config)
    assert isinstance(launcher, RayLauncher)
    assert launcher.settings.needs() == {"CPU": 1.0, "engine": 1.0, "GPU": 2.0}
    with_gpus = ConfigLoader({**given, "launch.gpus": "0,1"}, flags)
    with pytest.raises(ConfigError, match="--gpus: with --ray, Ray assigns each worker its GPUs"):
        preflight(with_gpus.load(), with_gpus)
