"""The Docker backend's checkpoints: a snapshot image and a CRIU dump, taken together; restore from them.

A checkpoint is two things taken while the container is paused, so they match:

- the filesystem: `docker commit` into `<checkpoint_repository>:<checkpoint id>`; when the image's layer
  chain nears Docker's limit (125) it is flattened instead (export + import);
- the processes: a CRIU dump (`POST /containers/{id}/checkpoints`, leave running) written straight
  into `<checkpoint_dir>/<checkpoint id>/criu`, next to `meta.json`.

Restore creates a *new* container from the snapshot image, copies the dump into
`<data-root>/containers/<new id>/checkpoints/criu/` (Docker cannot start from a custom checkpoint
directory), adds a unique nonce file (identical dumps otherwise fail with "content already exists",
moby#42900), and starts it with `POST /containers/{id}/start?checkpoint=criu`. The process dump refers
to files by path, so it needs this host's filesystem access to Docker's data-root.

A restored sandbox carries where its restore's time went (`Sandbox.restore_phases`): ``container_create``
(the new container from the snapshot image), ``dump_stage`` (the dump into its checkpoint directory),
then the start, split, where CRIU's restore log is found, into ``engine_start`` (dockerd hands the dump to
containerd as an archive, containerd unpacks it, runc sets up) and ``criu_restore`` (CRIU's own time, the
runtime's network hook it waits on included); where the log is not found, ``engine_start`` is the whole
start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker.errors

from core.errors import CheckpointError, RestoreError, SandboxNotFound
from sandbox.backend import Checkpoint, Sandbox, SandboxSpec, checkpoint_from_record, checkpoint_record
from sandbox.docker_backend import containerd
from sandbox.docker_backend.containers import Containers
from sandbox.docker_backend.engine import DockerEngine, docker_errors
from sandbox.docker_backend.images import Images

_CRIU_NAME = "criu"
log = logging.getLogger("belayer.sandbox")
_BLOB_COLLISION = re.compile(r"content sha256:[0-9a-f]{64}: already exists")


class Checkpoints:
    """Checkpoints of sandboxes under `DockerBackendConfig.checkpoint_dir`, and restores from them."""

    def __init__(self, engine: DockerEngine, containers: Containers, images: Images) -> None:
        self._engine = engine
        self._api = engine.api
        self._config = engine.config
        self._containers = containers
        self._images = images
        self._dumped: set[str] = set()  # containers dumped by this process (for `_dump_processes`)

    def take(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        spec = self._engine.spec(sandbox_id)
        ckpt_id = uuid.uuid4().hex[:16]
        location = self._config.checkpoint_dir / ckpt_id
        location.mkdir(parents=True, exist_ok=False)
        try:
            with self._engine.lock(sandbox_id), docker_errors(CheckpointError):
                info = self._api.inspect_container(sandbox_id)
                with self._engine.paused(sandbox_id):
                    started = time.monotonic()
                    image = self._snapshot_filesystem(info, ckpt_id)
                    fs_done = time.monotonic()
                    self._dump_processes(info, location)
                    dumped = time.monotonic()
        except BaseException:
            with contextlib.suppress(docker.errors.DockerException):
                self._discard_snapshot(f"{self._config.checkpoint_repository}:{ckpt_id}", location)
            raise
        ckpt = Checkpoint(
            id=ckpt_id, sandbox_id=sandbox_id, label=label, spec=spec, image=image,
            location=str(location), created_at=time.time(),
            fs_seconds=fs_done - started, process_seconds=dumped - fs_done,
            env=tuple(info["Config"].get("Env") or ()), dump_bytes=_tree_bytes(location),
        )  # fmt: skip
        (location / "meta.json").write_text(checkpoint_to_json(ckpt))
        return ckpt

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        dump = Path(checkpoint.location) / _CRIU_NAME
        if not dump.is_dir():
            raise SandboxNotFound(f"checkpoint {checkpoint.id}: no process dump at {dump}")
        return self.start_from_dump(
            checkpoint.spec, checkpoint.image, list(checkpoint.env), lambda _created, dest: shutil.copytree(dump, dest)
        )

    def start_from_dump(
        self, spec: SandboxSpec, image: str, env: list[str], stage: Callable[[str, Path], object]
    ) -> Sandbox:
        """A new sandbox from `image`, started from a process dump: `stage(container id, directory)` puts the
        dump in that directory (and whatever else the container needs before it starts). Docker cannot
        start from a custom checkpoint directory, so it is the container's own; a unique nonce file is added
        (identical dumps otherwise fail, moby#42900). A container that fails to start is removed.

        The sandbox carries its phases (`Sandbox.restore_phases`, see the module docstring)."""
        name = self._engine.new_name()
        clock = [time.monotonic()]
        with docker_errors(RestoreError):
            created = self._containers.create(name, spec, image, env)
            clock.append(time.monotonic())
            try:
                dest = self._engine.data_root() / "containers" / created / "checkpoints" / _CRIU_NAME
                stage(created, dest)
                (dest / "nonce").write_text(uuid.uuid4().hex)
                clock.append(time.monotonic())
                self._engine.post(f"/containers/{created}/start", params={"checkpoint": _CRIU_NAME})
                clock.append(time.monotonic())
            except BaseException:
                with contextlib.suppress(docker.errors.DockerException):
                    self._api.remove_container(created, force=True, v=True)
                raise
        self._engine.remember(name, spec)
        return Sandbox(id=name, spec=spec, restore_phases=self._phases(created, clock))

    def _phases(self, container_id: str, clock: list[float]) -> tuple[tuple[str, float], ...]:
        create, stage, start = (b - a for a, b in itertools.pairwise(clock))
        criu = criu_restore_seconds(self._engine.data_root(), container_id)
        phases = (("container_create", create), ("dump_stage", stage))
        if criu is None or criu > start:  # no log where this engine's containerd keeps it
            return (*phases, ("engine_start", start))
        return (*phases, ("engine_start", start - criu), ("criu_restore", criu))

    def delete(self, checkpoint: Checkpoint) -> None:
        """Remove the dump and the snapshot image (Docker keeps an image that a sandbox still uses)."""
        with docker_errors(CheckpointError):
            self._discard_snapshot(checkpoint.image, Path(checkpoint.location))

    def exists(self, checkpoint: Checkpoint) -> bool:
        """Its process dump is on disk and its snapshot image in the engine."""
        if not (Path(checkpoint.location) / _CRIU_NAME).is_dir():
            return False
        return self._images.has(checkpoint.image)

    def load(self, checkpoint_id: str) -> Checkpoint:
        """Read a checkpoint's record back from `checkpoint_dir` (e.g. after a restart)."""
        meta = self._config.checkpoint_dir / checkpoint_id / "meta.json"
        try:
            return checkpoint_from_json(meta.read_text())
        except FileNotFoundError as exc:
            raise SandboxNotFound(f"no checkpoint {checkpoint_id}") from exc

    def drop_orphan_snapshot(self, image: str) -> None:
        """A restored sandbox kept its snapshot image alive after its checkpoint was deleted (409 in
        `_discard_snapshot`); remove the image with the last such sandbox (Docker errors untranslated)."""
        repo, _, tag = image.partition(":")
        if repo != self._config.checkpoint_repository or (self._config.checkpoint_dir / tag).exists():
            return
        with contextlib.suppress(docker.errors.NotFound):
            try:
                self._api.remove_image(image)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # still used by another restored sandbox
                    raise

    def _discard_snapshot(self, image: str, location: Path) -> None:
        shutil.rmtree(location, ignore_errors=True)
        try:
            self._api.remove_image(image)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: a restored sandbox still uses it
                raise

    def _snapshot_filesystem(self, info: dict[str, Any], ckpt_id: str) -> str:
        repo = self._config.checkpoint_repository
        if self._images.layers(info["Image"]) + 1 >= self._config.max_image_layers:
            chunks = self._api.export(info["Id"])
            self._api.import_image(src=chunks, repository=repo, tag=ckpt_id, stream_src=True)
        else:
            self._api.commit(info["Id"], repository=repo, tag=ckpt_id, pause=False)
        return f"{repo}:{ckpt_id}"

    def _dump_processes(self, info: dict[str, Any], location: Path) -> None:
        """Docker writes the dump to <CheckpointDir>/<CheckpointID>; the container keeps running.

        A container dumped before gets containerd's garbage collected first (about 30 ms), since its last
        dump's blobs may still be in the content store. A dump that collides with them anyway ("content
        sha256:…: already exists", see `containerd`: a dump by another process) is taken again once
        containerd has collected (or, where it cannot be made to, after a backoff), until `dump_retry_s`
        is spent.
        """
        body = {"CheckpointID": _CRIU_NAME, "CheckpointDir": str(location), "Exit": False}
        if info["Id"] in self._dumped:  # its last dump's blobs may still be there: collect them first
            containerd.collect_garbage(info["State"]["Pid"])
        started = time.monotonic()
        wait, tries = 0.05, 1
        while True:
            try:
                self._engine.post(f"/containers/{info['Id']}/checkpoints", json_body=body)
                break
            except docker.errors.APIError as exc:
                if (
                    not _BLOB_COLLISION.search(str(exc))
                    or time.monotonic() + wait > started + self._config.dump_retry_s
                ):
                    raise CheckpointError(
                        f"CRIU could not dump the processes: {criu_errors(str(exc))}"
                    ) from exc
            shutil.rmtree(location / _CRIU_NAME, ignore_errors=True)
            if not containerd.collect_garbage(info["State"]["Pid"]):
                time.sleep(wait)  # no way to make containerd collect: wait for its own schedule
                wait = min(wait * 2, 1.0)
            tries += 1
        self._dumped.add(info["Id"])
        if tries > 1:
            log.info("container %s: dump taken at try %d, %.2fs after the first (containerd still held the last"
                     " dump's blobs)", info["Id"][:12], tries, time.monotonic() - started)  # fmt: skip

def criu_errors(message: str, lines: int = 6) -> str:
    """Docker's checkpoint error names CRIU's log (`path= …/criu-dump.log`); add its error lines."""
    match = re.search(r"path= ?(\S+\.log)", message)
    if match is None:
        return message
    try:
        log = Path(match.group(1)).read_text(errors="replace").splitlines()
    except OSError:
        return message
    errors = [line.strip() for line in log if "Error" in line][-lines:]
    return f"{message} | CRIU: {' | '.join(errors)}" if errors else message


def criu_restore_seconds(data_root: Path, container_id: str) -> float | None:
    """How long CRIU took to restore the container, from its restore log (its last line's timestamp, "(SS.
    micros)"), where containerd keeps it: under the engine's data-root when dockerd runs containerd
    itself, else under containerd's own root. None where there is no such log."""
    task = Path("io.containerd.runtime.v2.task") / "moby" / container_id / "restore.log"
    for root in (data_root / "containerd" / "daemon", Path("/var/lib/containerd")):
        try:
            with (root / task).open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
                tail = log.read().decode(errors="replace")
        except OSError:
            continue
        stamps = re.findall(r"^\((\d+\.\d+)\)", tail, re.MULTILINE)
        return float(stamps[-1]) if stamps else None
    return None


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def checkpoint_to_json(ckpt: Checkpoint) -> str:
    """Serialise a checkpoint record (the inverse of `checkpoint_from_json`)."""
    return json.dumps(checkpoint_record(ckpt), indent=1)


def checkpoint_from_json(text: str) -> Checkpoint:
    """Parse a record written by `checkpoint_to_json`."""
    return checkpoint_from_record(json.loads(text))
