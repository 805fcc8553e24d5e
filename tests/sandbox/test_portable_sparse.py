"""A sparse file in a sandbox costs a portable checkpoint its data, not its apparent size (issue 31, Low),
on the real engine: ``truncate -s 256M`` in the sandbox, and the store holds its 4 bytes of data; the restored
sandbox sees the same file, still sparse."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox.backend import SandboxSpec
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend

pytestmark = pytest.mark.docker
MB = 1 << 20


@pytest.fixture
def portable(docker_engine: None, busybox_image: str, tmp_path: Path) -> Iterator[DockerSandboxBackend]:
    config = DockerBackendConfig(
        checkpoint_dir=tmp_path / "stage", checkpoint_store=f"file://{tmp_path / 'store'}"
    )
    with DockerSandboxBackend(config) as backend:
        yield backend


def test_a_sparse_file_in_the_sandbox_stays_sparse_through_the_store(
    portable: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    box = portable.create(SandboxSpec(image=busybox_image))
    made = "truncate -s 256M /workspace/big && echo end >> /workspace/big && stat -c '%s %b' /workspace/big"
    assert portable.exec(box.id, made).stdout == f"{256 * MB + 4} 8\n"  # one block of data
    ckpt = portable.checkpoint(box.id)
    portable.destroy(box.id)
    layer = tmp_path / "store" / "ckpt" / ckpt.id / "fs.tar"
    with tarfile.open(layer) as tar:
        big = tar.getmember("workspace/big")
    pieces: object = big.sparse  # typeshed has it as bytes; tarfile makes it (offset, size) pairs
    assert (big.size, pieces) == (256 * MB + 4, [(256 * MB, 4)])  # its data only: today, 256 MB of zeros
    assert layer.stat().st_size < 8 * MB  # the supervisor's busybox (2 MB), no more
    restored = portable.restore(ckpt)
    out = portable.exec(restored.id, "stat -c '%s %b' /workspace/big; tail -c 4 /workspace/big")
    assert out.stdout == f"{256 * MB + 4} 8\nend\n"
    portable.destroy(restored.id)
    portable.delete_checkpoint(ckpt)
