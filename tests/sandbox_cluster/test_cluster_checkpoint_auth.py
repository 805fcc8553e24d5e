"""On a cluster the gateway, not the nodes, holds the checkpoint key (issue 31, finding 5c): a node records
its checkpoint's digests, the gateway signs the record (and the store's ``meta.json``), and checks the MAC
before any node fetches anything; the node checks each part against its digest before it unpacks or
starts it. A part changed in the store is refused, and no container is made on either node."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from belayer.testing.docker_local import LocalDockerEngine
from belayer.testing.ray_local import LocalRayCluster
from core.errors import CheckpointTampered
from sandbox.backend import SandboxSpec
from sandbox.checkpoint_auth import CheckpointKey
from sandbox.checkpoint_store import LocalDirStore
from sandbox.cluster import ClusterConfig, ClusterSandboxBackend
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend.portable import checkpoint_key
from tests.sandbox_cluster.conftest import Cluster

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.docker, pytest.mark.ray]

IMAGE = "belayer-sandbox-busybox"


@pytest.fixture
def signing(
    whole_cluster: LocalRayCluster, whole_engines: dict[str, LocalDockerEngine], tmp_path: Path
) -> Iterator[Cluster]:
    """The cluster's backend with the gateway's key in the gateway's state."""
    urls = {whole_cluster.node(name).ip: engine.url for name, engine in whole_engines.items()}
    config = ClusterConfig(
        address=whole_cluster.address, node_ip=whole_cluster.head.ip, docker_urls=urls,
        probe_interval_s=0.3, node_timeout_s=2.0,
    )  # fmt: skip
    docker = DockerBackendConfig(
        checkpoint_dir=tmp_path / "stage", checkpoint_key_file=tmp_path / "state" / "checkpoint.key"
    )
    made = Cluster(
        whole_cluster, whole_engines, ClusterSandboxBackend(config, f"file://{tmp_path / 'store'}", docker)
    )
    try:
        for name in whole_engines:
            made.wait_state(name, "alive")
        yield made
    finally:
        made.backend.close()


def test_the_gateway_signs_a_nodes_checkpoint_and_a_changed_part_starts_nothing(
    signing: Cluster, tmp_path: Path
) -> None:
    backend, store = signing.backend, LocalDirStore(tmp_path / "store")
    box = backend.create(SandboxSpec(image=IMAGE))
    assert backend.exec(box.id, "echo kept > /workspace/a").exit_code == 0
    ckpt = backend.checkpoint(box.id)
    backend.destroy(box.id)
    CheckpointKey.load(tmp_path / "state" / "checkpoint.key").verify(ckpt)  # the gateway's own key
    assert json.loads(store.get_bytes(checkpoint_key(ckpt.id, "meta.json")))["mac"] == ckpt.mac
    before = signing.containers()
    original = store.get_bytes(checkpoint_key(ckpt.id, "criu.tar"))
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 1
    store.put_bytes(checkpoint_key(ckpt.id, "criu.tar"), bytes(flipped))
    with pytest.raises(CheckpointTampered, match=r"criu\.tar in the store is not the one the gateway wrote"):
        backend.restore(ckpt)  # checked on the node, before it unpacks or starts anything
    store.put_bytes(checkpoint_key(ckpt.id, "criu.tar"), original)
    with pytest.raises(CheckpointTampered, match="carries no MAC"):
        backend.restore(replace(ckpt, mac=""))  # checked by the gateway: no node asked
    with pytest.raises(CheckpointTampered, match="does not match the MAC"):
        backend.restore(replace(ckpt, env=(*ckpt.env, "LD_PRELOAD=/workspace/evil.so")))
    assert signing.containers() == before
    restored = backend.restore(ckpt)
    assert backend.exec(restored.id, "cat /workspace/a").stdout == "kept\n"
    backend.destroy(restored.id)
    backend.delete_checkpoint(ckpt)
