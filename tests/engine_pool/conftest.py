"""The one Ray cluster the ``ray`` tests share: three nodes on 127.0.0.2-4 (``belayer.testing.ray_local``), started
once per test session on first use and stopped by the pids it recorded. A test that kills a node brings
it back before it ends, so the next test finds the cluster whole."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer.testing.ray_local import LocalRayCluster, local_ray_cluster

NODES = ("a", "b", "c")  # a is the head


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    with (
        tempfile.TemporaryDirectory(prefix="belayer-ray-", dir="/tmp") as tmp,
        local_ray_cluster(NODES, Path(tmp), cpus=2) as cluster,
    ):
        yield cluster


@pytest.fixture
def whole_cluster(ray_cluster: LocalRayCluster) -> Iterator[LocalRayCluster]:
    """The shared cluster, with every node it lost during the test started again afterwards."""
    yield ray_cluster
    lost = [n for n in ray_cluster.nodes if n.proc is None]
    for node in lost:
        ray_cluster.start_node(node)
