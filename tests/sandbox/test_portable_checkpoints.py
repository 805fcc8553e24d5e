"""Portable checkpoints (`sandbox.docker_backend.portable`) on the real engine: everything a checkpoint
holds is in the checkpoint store, and a restore needs nothing else of the engine that took it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from core.errors import CheckpointMissing, RestoreError
from sandbox.backend import SandboxSpec
from sandbox.checkpoint_store import store_for
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend

pytestmark = pytest.mark.docker


@pytest.fixture(params=["local", "s3"])
def portable(
    request: pytest.FixtureRequest, docker_engine: None, busybox_image: str, tmp_path: Path
) -> Iterator[DockerSandboxBackend]:
    """The backend with its checkpoints in a directory, or in S3 (a real moto_server on 127.0.0.1)."""
    url = f"file://{tmp_path / 'store'}"
    if request.param == "s3":
        endpoint = request.getfixturevalue("moto_endpoint")
        request.getfixturevalue("aws_env")
        url = f"s3://ckpt-{uuid.uuid4().hex[:12]}/node-a?endpoint={endpoint}&region=us-east-1"
        store_for(url, create_bucket=True).close()
    config = DockerBackendConfig(checkpoint_dir=tmp_path / "stage", checkpoint_store=url)
    with DockerSandboxBackend(config) as backend:
        yield backend


def stored(backend: DockerSandboxBackend, checkpoint_id: str) -> list[str]:
    return store_for(str(backend.config.checkpoint_store)).list(f"ckpt/{checkpoint_id}")


def test_a_restore_brings_back_files_deletions_opaque_dirs_and_processes(
    portable: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    box = portable.create(SandboxSpec(image=busybox_image))
    setup = (
        "cd /tmp && export N=7 && echo hi > /workspace/a && rm /bin/vi && "
        "rm -rf /usr && mkdir /usr && echo only > /usr/only && (sleep 600 &)"
    )
    assert portable.exec(box.id, setup).exit_code == 0
    ckpt = portable.checkpoint(box.id, label="t")
    portable.destroy(box.id)
    assert stored(portable, ckpt.id) == [
        f"ckpt/{ckpt.id}/{n}" for n in ("criu.tar", "fs.tar", "meta.json", "opaque.json")
    ]
    assert list((tmp_path / "stage").iterdir()) == []  # nothing of it stays on the node
    assert ckpt.image == busybox_image  # restored from the image, never from a snapshot image
    box2 = portable.restore(ckpt)
    out = portable.exec(
        box2.id, "echo $N $(pwd) $(cat /workspace/a); ls /usr; ls /bin/vi; ps | grep -c '[s]leep 600'"
    )
    # the shell's state, the file, the deletion, the opaque /usr (the image's files hidden), the process
    assert out.stdout == "7 /tmp hi\nonly\n1\n"
    assert "No such file" in out.stderr
    again = portable.checkpoint(box2.id)  # a restored sandbox checkpoints like any other
    portable.destroy(box2.id)
    box3 = portable.restore(again)
    assert portable.exec(box3.id, "echo $N $(cat /workspace/a)").stdout == "7 hi\n"
    portable.destroy(box3.id)
    assert portable.load_checkpoint(again.id) == again
    portable.delete_checkpoint(again)
    portable.delete_checkpoint(ckpt)
    assert not portable.has_checkpoint(ckpt) and stored(portable, ckpt.id) == []


def test_an_unreadable_checkpoint_fails_its_restore_with_a_reason(
    portable: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    box = portable.create(SandboxSpec(image=busybox_image))
    ckpt = portable.checkpoint(box.id)
    portable.destroy(box.id)
    store_for(str(portable.config.checkpoint_store)).delete_prefix(f"ckpt/{ckpt.id}")  # the store lost it
    with pytest.raises(CheckpointMissing, match=f"ckpt/{ckpt.id}/fs.tar"):
        portable.restore(ckpt)
    missing_image = SandboxSpec(image="belayer-sandbox-not-on-this-node")
    with pytest.raises(RestoreError, match="is not on this node's engine"):
        portable.restore(replace(ckpt, spec=missing_image))
    assert [c for c in portable.list_sandboxes({}) if c.spec.image == missing_image.image] == []
    portable.delete_checkpoint(ckpt)
