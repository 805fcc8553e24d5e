"""A portable checkpoint changed in the store is never restored (issue 31, finding 5c), on the real
engine: the backend signs each checkpoint with the gateway's key, and a restore checks the record's MAC
and every part's digest before it unpacks or starts anything, so a writer of the store cannot run code
on a node through a CRIU image or a layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from core.errors import CheckpointTampered
from sandbox.backend import SandboxSpec
from sandbox.checkpoint_store import LocalDirStore
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.docker_backend.portable import PARTS, checkpoint_key

pytestmark = pytest.mark.docker


@pytest.fixture
def signed(docker_engine: None, busybox_image: str, tmp_path: Path) -> Iterator[DockerSandboxBackend]:
    """The backend with its checkpoints in a directory, signed with a key in the gateway's state."""
    config = DockerBackendConfig(
        checkpoint_dir=tmp_path / "stage", checkpoint_store=f"file://{tmp_path / 'store'}",
        checkpoint_key_file=tmp_path / "state" / "checkpoint.key",
    )  # fmt: skip
    with DockerSandboxBackend(config) as backend:
        yield backend


def _containers(backend: DockerSandboxBackend) -> set[str]:
    return {c["Id"] for c in backend._api.containers(all=True)}


def test_a_part_changed_in_the_store_is_refused_before_anything_is_unpacked_or_started(
    signed: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    box = signed.create(SandboxSpec(image=busybox_image))
    assert signed.exec(box.id, "echo kept > /workspace/a").exit_code == 0
    ckpt = signed.checkpoint(box.id)
    signed.destroy(box.id)
    assert ckpt.mac.startswith("hmac-sha256:") and [name for name, _ in ckpt.digests] == list(PARTS)
    store = LocalDirStore(tmp_path / "store")
    before = _containers(signed)
    for part in PARTS:
        original = store.get_bytes(checkpoint_key(ckpt.id, part))
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 1  # one bit, by someone who can write the store
        store.put_bytes(checkpoint_key(ckpt.id, part), bytes(flipped))
        with pytest.raises(CheckpointTampered, match=f"{part} in the store is not the one the gateway wrote"):
            signed.restore(ckpt)
        assert _containers(signed) == before  # no container made, none started
        store.put_bytes(checkpoint_key(ckpt.id, part), original)
    record = store.get_bytes(checkpoint_key(ckpt.id, "meta.json"))  # the store's copy of the record
    assert b'"cap_add": []' in record
    store.put_bytes(
        checkpoint_key(ckpt.id, "meta.json"), record.replace(b'"cap_add": []', b'"cap_add": ["SYS_ADMIN"]')
    )
    with pytest.raises(CheckpointTampered, match="does not match the MAC"):
        signed.load_checkpoint(ckpt.id)
    with pytest.raises(CheckpointTampered, match="does not match the MAC"):  # a record changed on its way
        signed.restore(replace(ckpt, env=(*ckpt.env, "LD_PRELOAD=/workspace/evil.so")))
    with pytest.raises(CheckpointTampered, match="carries no MAC"):
        signed.restore(replace(ckpt, mac=""))
    assert _containers(signed) == before
    restored = signed.restore(ckpt)  # untouched, it restores as before
    assert signed.exec(restored.id, "cat /workspace/a").stdout == "kept\n"
    signed.destroy(restored.id)
    signed.delete_checkpoint(ckpt)
