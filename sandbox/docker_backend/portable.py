"""Portable checkpoints: a checkpoint that any node's Docker engine can restore, kept in a
`CheckpointStore` (a shared directory, or S3) instead of this engine's images.

A checkpoint is taken while the container is paused, so its two halves match:

- ``fs.tar``: the container's writable layer as overlayfs keeps it (its ``UpperDir``: added and changed
  files, deletions as 0/0 character devices), plus ``opaque.json``, the directories overlayfs marks
  opaque (a directory deleted and made again hides everything the image had there);
- ``criu.tar``: the CRIU dump of the processes (`Checkpoints._dump_processes`).

Both, with ``meta.json`` (the `Checkpoint` record), go under ``ckpt/<id>/`` in the store once the
container runs again. Restore, on this engine or any other with the sandbox's image, creates a
container from the *image* (never from a snapshot image, so a chain of restores never stacks layers),
unpacks ``fs.tar`` into its new writable layer, stages the dump and starts it from the dump.

So nothing of a checkpoint stays on the node that took it: a lost node loses no checkpoint. It needs
the overlay2 storage driver (the writable layer is read and written as a directory) and this host's
access to Docker's data-root, as the dump staging already does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from core.errors import CheckpointError, RestoreError, SandboxNotFound
from sandbox.backend import Checkpoint, Sandbox
from sandbox.checkpoint_store import CheckpointStore
from sandbox.docker_backend.checkpoints import (
    _CRIU_NAME,
    Checkpoints,
    checkpoint_from_json,
    checkpoint_to_json,
)
from sandbox.docker_backend.containers import Containers
from sandbox.docker_backend.engine import DockerEngine, docker_errors
from sandbox.docker_backend.images import Images

_OPAQUE = "trusted.overlay.opaque"
FILES = ("fs.tar", "opaque.json", "criu.tar", "meta.json")
"""What one checkpoint keeps in the store, under ``ckpt/<id>/`` (meta.json last: it marks it whole)."""


def checkpoint_key(checkpoint_id: str, name: str = "") -> str:
    return f"ckpt/{checkpoint_id}/{name}"


class PortableCheckpoints(Checkpoints):
    """Checkpoints in `store`, restorable by any engine that has the sandbox's image (see above)."""

    def __init__(
        self, engine: DockerEngine, containers: Containers, images: Images, store: CheckpointStore
    ) -> None:
        super().__init__(engine, containers, images)
        self.store = store

    def take(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        spec = self._engine.spec(sandbox_id)
        ckpt_id = uuid.uuid4().hex[:16]
        staging = self._config.checkpoint_dir / f"stage-{ckpt_id}"
        staging.mkdir(parents=True, exist_ok=False)
        try:
            with self._engine.lock(sandbox_id), docker_errors(CheckpointError):
                info = self._api.inspect_container(sandbox_id)
                with self._engine.paused(sandbox_id):
                    started = time.monotonic()
                    _pack_layer(_upper_dir(info), staging)
                    fs_done = time.monotonic()
                    self._dump_processes(info, staging)
                    dumped = time.monotonic()
            with tarfile.open(staging / "criu.tar", "w") as tar:
                tar.add(staging / _CRIU_NAME, arcname=".")
            ckpt = Checkpoint(
                id=ckpt_id, sandbox_id=sandbox_id, label=label, spec=spec, image=spec.image,
                location=f"{self.store.url.rstrip('/')}/{checkpoint_key(ckpt_id)}", created_at=time.time(),
                fs_seconds=fs_done - started, process_seconds=dumped - fs_done,
                env=tuple(info["Config"].get("Env") or ()),
                dump_bytes=(staging / "criu.tar").stat().st_size + (staging / "fs.tar").stat().st_size,
            )  # fmt: skip
            (staging / "meta.json").write_text(checkpoint_to_json(ckpt))
            for name in FILES:
                self.store.put_file(checkpoint_key(ckpt_id, name), staging / name)
        except BaseException:
            with contextlib.suppress(Exception):
                self.store.delete_prefix(checkpoint_key(ckpt_id))
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return ckpt

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        if not self._images.has(checkpoint.spec.image):
            raise RestoreError(
                f"checkpoint {checkpoint.id}: image {checkpoint.spec.image} is not on this node's engine; "
                "build it there first (sandbox images are built per node)"
            )
        with tempfile.TemporaryDirectory(dir=self._config.checkpoint_dir, prefix="restore-") as tmp:
            local = Path(tmp)
            for name_in_store in FILES[:3]:
                self.store.get_file(checkpoint_key(checkpoint.id, name_in_store), local / name_in_store)

            def stage(created: str, dest: Path) -> None:  # the layer into its writable layer, then the dump
                _unpack_layer(local, _upper_dir(self._api.inspect_container(created)))
                dest.mkdir(parents=True)
                with tarfile.open(local / "criu.tar") as tar:
                    tar.extractall(dest, filter="data")

            spec = checkpoint.spec
            return self.start_from_dump(spec, spec.image, list(checkpoint.env), stage)

    def delete(self, checkpoint: Checkpoint) -> None:
        self.store.delete_prefix(checkpoint_key(checkpoint.id))

    def exists(self, checkpoint: Checkpoint) -> bool:
        return self.store.exists(checkpoint_key(checkpoint.id, "meta.json"))

    def load(self, checkpoint_id: str) -> Checkpoint:
        key = checkpoint_key(checkpoint_id, "meta.json")
        if not self.store.exists(key):
            raise SandboxNotFound(f"no checkpoint {checkpoint_id} in {self.store.url}")
        return checkpoint_from_json(self.store.get_bytes(key).decode())

    def drop_orphan_snapshot(self, image: str) -> None:
        """Nothing to drop: a portable checkpoint makes no snapshot image."""


def _upper_dir(info: dict[str, Any]) -> Path:
    driver = info.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if driver.get("Name") != "overlay2" or not upper:
        raise CheckpointError(
            f"portable checkpoints need the overlay2 storage driver; this engine uses {driver.get('Name')!r}"
        )
    return Path(upper)


def _pack_layer(upper: Path, staging: Path) -> None:
    """``fs.tar`` (the writable layer, whiteouts as they are) and ``opaque.json`` into `staging`."""
    opaque = []
    with tarfile.open(staging / "fs.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(upper):
            for name in sorted(dirs):
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    if os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y":
                        opaque.append(os.path.relpath(path, upper))
            for name in [*sorted(dirs), *sorted(files)]:
                path = os.path.join(root, name)
                tar.add(path, arcname=os.path.relpath(path, upper), recursive=False)
    (staging / "opaque.json").write_text(json.dumps(opaque))


def _unpack_layer(local: Path, upper: Path) -> None:
    """Unpack ``fs.tar`` into a new container's empty writable layer, devices (whiteouts) and owners as
    they were; then mark the opaque directories. A member may not leave `upper`, nor go through a
    link (the tar could come from a store someone else writes)."""
    root = upper.resolve()
    with tarfile.open(local / "fs.tar") as tar:
        for member in tar:
            target = (
                (root / member.name).resolve()
                if not member.issym()
                else ((root / member.name).parent.resolve() / Path(member.name).name)
            )
            if root not in target.parents or (
                member.islnk() and root not in (root / member.linkname).resolve().parents
            ):
                raise RestoreError(f"checkpoint layer member {member.name!r} leaves the container's layer")
            tar.extract(member, root, numeric_owner=True, filter="fully_trusted")
    for path in json.loads((local / "opaque.json").read_text()):
        os.setxattr(root / path, _OPAQUE, b"y", follow_symlinks=False)
