"""`SandboxBackend` on a local Docker engine, with CRIU checkpoints (`dockerd --experimental`).

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

Every container (sandboxes, the verify stage's, task-image builds) gets the same isolation
(`_host_config`): capabilities dropped, no-new-privileges, memory, process and CPU limits, and
`DockerBackendConfig.disk_quota_bytes` as ``--storage-opt size`` where the storage driver takes one
(`disk_quota` asks once). Archives stream both ways in pieces (`sandbox.backend.CHUNK_BYTES`).

Only this module imports `docker`; its errors are translated in `docker_errors`.

Example::

    backend = DockerSandboxBackend(DockerBackendConfig())
    box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
    print(backend.exec(box.id, "uname -a").stdout)
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import re
import shlex
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import docker
import docker.errors
import requests

from core.errors import (
    CheckpointError,
    ImageBuildError,
    RestoreError,
    SandboxError,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxTimeout,
    SandboxUnavailable,
)
from sandbox import supervisor
from sandbox.backend import (
    CHUNK_BYTES,
    DEFAULT_SESSION,
    Checkpoint,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxStatus,
    TarStream,
    check_env_name,
    check_exec_args,
    checkpoint_from_record,
    checkpoint_record,
    copy_bounded,
    resolve_in_root,
)
from sandbox.config import DockerBackendConfig
from sandbox.docker_network import GatewayNetwork
from sandbox.network import SandboxNetwork

log = logging.getLogger("belayer.sandbox")

_CRIU_NAME = "criu"
_SPEC_LABEL = "belayer.spec"
_MAX_ARG_BYTES = 100_000  # one argv string may not exceed 128 KiB (MAX_ARG_STRLEN)
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27


@contextlib.contextmanager
def docker_errors(wrap: type[SandboxError] = SandboxError, *, file_op: bool = False) -> Iterator[None]:
    """The one place where Docker and transport errors become `SandboxError`s."""
    try:
        yield
    except docker.errors.NotFound as exc:
        text = str(exc.explanation or exc)
        if file_op and "no such container" not in text.lower():
            raise SandboxFileNotFound(text) from exc
        raise SandboxNotFound(text) from exc
    except (requests.ConnectionError, requests.Timeout) as exc:
        raise SandboxUnavailable(f"docker engine unreachable: {exc}") from exc
    except requests.RequestException as exc:  # e.g. a stream cut halfway
        raise wrap(f"docker engine transfer failed: {exc}") from exc
    except docker.errors.DockerException as exc:
        raise wrap(str(exc)) from exc


class DockerNetwork(SandboxNetwork):
    """`SandboxNetwork` on Docker: the internal bridge and firewall chain of `sandbox.docker_network`."""

    def __init__(self, api: docker.APIClient, name: str, bridge: str) -> None:
        self._api = api
        self._name = name
        self._gateway = GatewayNetwork(api, name, bridge)

    def address(self, sandbox_id: str) -> str | None:
        with docker_errors():
            networks = self._api.inspect_container(sandbox_id)["NetworkSettings"].get("Networks") or {}
        ip = (networks.get(self._name) or {}).get("IPAddress")
        return str(ip) if ip else None

    def gateway_address(self) -> str:
        with docker_errors(SandboxUnavailable):
            return self.ensure()

    def ensure(self) -> str:
        """Create the network if needed (Docker errors propagate untranslated); the host's address."""
        return self._gateway.ensure()

    def open_gateway(self, port: int) -> None:
        with docker_errors(SandboxUnavailable):
            self._gateway.open(port)

    def close_gateway(self, port: int) -> None:
        with docker_errors(SandboxUnavailable):
            self._gateway.close(port)


class DockerSandboxBackend(SandboxBackend):
    """Sandboxes as Docker containers; checkpoints as commit + CRIU dump. See the module docstring."""

    def __init__(self, config: DockerBackendConfig, client: docker.DockerClient | None = None) -> None:
        self._config = config
        with docker_errors(SandboxUnavailable):
            self._client = client or _make_client(config)
        self._api = self._client.api
        self._specs: dict[str, SandboxSpec] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._data_root: Path | None = None
        self._quota: tuple[bool, str] | None = None
        self._network = DockerNetwork(self._api, config.gateway_network, config.gateway_bridge)

    # ------------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec) -> Sandbox:
        name = self._new_name()
        bundle = supervisor.bundle_tar(self._config.busybox)
        with docker_errors():
            image_env = self._inspect_image(spec.image)["Config"].get("Env") or []
            env = [*image_env, *(f"{k}={v}" for k, v in spec.env.items())]
            self._create_container(name, spec, spec.image, env)
        try:
            with docker_errors():
                self._api.put_archive(name, "/", bundle)  # before start: the supervisor is PID 1
                self._api.start(name)
            self._specs[name] = spec
            self.exec(name, ":", timeout_s=10)  # supervisor up, main session spawned
        except BaseException:
            with contextlib.suppress(SandboxError):
                self.destroy(name)
            raise
        return Sandbox(id=name, spec=spec)

    def destroy(self, sandbox_id: str) -> None:
        with docker_errors():
            try:
                image = str(self._api.inspect_container(sandbox_id)["Config"]["Image"])
            except docker.errors.NotFound:
                image = ""
            self._api.remove_container(sandbox_id, force=True, v=True)
            self._drop_orphan_snapshot(image)
        with self._guard:
            self._specs.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)

    def close(self) -> None:
        self._client.close()

    def kill(self, sandbox_id: str) -> None:
        """Stop the sandbox now (SIGKILL), as a crash would; it stays until `destroy` (tests, benchmarks)."""
        with docker_errors():
            self._api.kill(sandbox_id)

    def status(self, sandbox_id: str) -> SandboxStatus:
        with docker_errors():
            state = self._api.inspect_container(sandbox_id)["State"]
        if state.get("Running"):
            return SandboxStatus(running=True)
        detail = f"container {state.get('Status', 'stopped')}, exit code {state.get('ExitCode')}"
        if state.get("OOMKilled"):
            detail += ", killed for running out of memory (raise memory_mb)"
        if state.get("Error"):
            detail += f": {state['Error']}"
        return SandboxStatus(
            running=False, exit_code=state.get("ExitCode"), oom_killed=bool(state.get("OOMKilled")),
            detail=detail,
        )  # fmt: skip

    @property
    def network(self) -> DockerNetwork:
        return self._network

    def list_sandboxes(self, labels: Mapping[str, str]) -> list[Sandbox]:
        """Belayer's containers (they carry the spec label) with every one of `labels`, running or not;
        each one's id is its name, as `create` and `restore` gave it."""
        filters = {"label": [_SPEC_LABEL, *(f"{k}={v}" for k, v in labels.items())]}
        with docker_errors():
            found = self._api.containers(all=True, filters=filters)
        boxes = []
        for container in found:
            names = [str(n).lstrip("/") for n in container.get("Names") or []]
            own = (container.get("Labels") or {}).get(_SPEC_LABEL)
            if not names or own is None:
                continue
            spec = SandboxSpec.model_validate_json(own)
            if any(spec.labels.get(k) != v for k, v in labels.items()):
                continue  # the filter matched a label set outside the spec: not one of ours
            self._specs.setdefault(names[0], spec)
            boxes.append(Sandbox(id=names[0], spec=spec))
        return boxes

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        """Its process dump is on disk and its snapshot image in the engine."""
        if not (Path(checkpoint.location) / _CRIU_NAME).is_dir():
            return False
        return self.has_image(checkpoint.image)

    # ------------------------------------------------------------------ exec
    def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        session: str = DEFAULT_SESSION,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        check_exec_args(session, timeout_s, max_output_bytes)
        spec = self._spec(sandbox_id)
        script = build_script(command, cwd=cwd, env=env or {})
        with self._lock(sandbox_id):
            started = time.monotonic()
            argv = self._client_argv(sandbox_id, spec, session, script, timeout_s, max_output_bytes)
            with docker_errors():
                exec_id = self._api.exec_create(sandbox_id, argv, user="0:0", workdir="/")["Id"]
                out, err = self._api.exec_start(exec_id, demux=True)
            elapsed = time.monotonic() - started
        try:
            return parse_client_output(out or b"", err or b"", max_output_bytes, elapsed, timeout_s)
        except SandboxTimeout:
            raise
        except SandboxError as exc:
            raise SandboxError(f"{exc}{self._failure_note(sandbox_id)}") from exc

    def _failure_note(self, sandbox_id: str) -> str:
        """Why the exec client may have failed: the container stopped, or its process slots ran out."""
        with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
            self._api.wait(sandbox_id, timeout=1)  # a dying container: its state lags the broken exec
        try:
            status = self.status(sandbox_id)
            if not status.running:
                return f"; {status.detail}"
            current = len(self._api.top(sandbox_id).get("Processes") or [])  # listed from the host
        except (SandboxError, docker.errors.DockerException):
            return ""
        limit = self._spec(sandbox_id).pids_limit
        if limit - current > 4:  # an exec needs a few processes itself
            return ""
        return (
            f"; the sandbox is out of process slots ({current} processes, pids_limit {limit}): "
            "processes started by earlier commands hold them"
        )

    def _client_argv(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        session: str,
        script: str,
        timeout_s: float,
        max_output_bytes: int,
    ) -> list[str]:
        arg = script
        if len(script.encode()) > _MAX_ARG_BYTES:
            self._upload(sandbox_id, supervisor.large_script_path(session), script.encode(), 0o644)
            arg = supervisor.LARGE_SCRIPT
        timeout_cs = str(max(1, math.ceil(timeout_s * 100)))
        return [
            supervisor.BUSYBOX, "sh", supervisor.CLIENT, session, spec.shell, spec.workdir,
            timeout_cs, str(max_output_bytes), arg,
        ]  # fmt: skip

    # ------------------------------------------------------------------ files
    def read_file(self, sandbox_id: str, path: str) -> bytes:
        target = resolve_in_root(self._spec(sandbox_id).workdir, path)
        with self._lock(sandbox_id), docker_errors(file_op=True):
            stream, stat = self._api.get_archive(sandbox_id, target)
            raw = b"".join(stream)
        mode = int(stat.get("mode", 0))
        if mode & _GO_MODE_SYMLINK:
            link = str(stat.get("linkTarget", ""))
            resolve_in_root(self._spec(sandbox_id).workdir, link)  # raises if it leaves the root
            return self.read_file(sandbox_id, link)
        if mode & _GO_MODE_DIR:
            raise SandboxError(f"{target} is a directory")
        return _single_file(raw, target)

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        target = resolve_in_root(self._spec(sandbox_id).workdir, path)
        with self._lock(sandbox_id):
            self._upload(sandbox_id, target, data, mode)

    def _upload(self, sandbox_id: str, target: str, data: bytes, mode: int) -> None:
        # Extracted at "/": Docker creates missing parent directories and resolves every path
        # inside the container's root, so nothing outside the container is reachable.
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        with docker_errors(file_op=True):
            self._api.put_archive(sandbox_id, "/", buf.getvalue())

    def archive(self, sandbox_id: str, path: str, out: IO[bytes], *, max_bytes: int | None = None) -> int:
        with self._lock(sandbox_id), docker_errors(file_op=True):
            running = bool(self._api.inspect_container(sandbox_id)["State"].get("Running"))
            with self._paused(sandbox_id) if running else contextlib.nullcontext():
                url = f"{self._api.base_url}/v{self._api.api_version}/containers/{quote(sandbox_id)}/archive"
                response = self._api.get(
                    url, params={"path": path}, stream=True, timeout=self._config.api_timeout_s,
                    headers={"Accept-Encoding": "identity"},
                )  # fmt: skip
                with contextlib.closing(response):  # closed early: the engine stops sending
                    _raise_for_status(response)
                    return copy_bounded(response.iter_content(CHUNK_BYTES), out, max_bytes)

    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        # Pieces go out as they come (a chunked request body): the whole tar is never in memory.
        with self._lock(sandbox_id), docker_errors(file_op=True):
            self._api.put_archive(sandbox_id, "/", tar)

    def writable_bytes(self, sandbox_id: str) -> int:
        """The container's writable layer (``SizeRw``: the engine walks it, so it takes a while on a
        large one)."""
        url = f"{self._api.base_url}/v{self._api.api_version}/containers/{quote(sandbox_id)}/json"
        with docker_errors():
            response = self._api.get(url, params={"size": "1"}, timeout=self._config.api_timeout_s)
            _raise_for_status(response)
        return int(response.json().get("SizeRw") or 0)

    @property
    def disk_quota_bytes(self) -> int | None:
        return self._config.disk_quota_bytes

    def disk_quota(self) -> tuple[bool, str]:
        """Whether the storage driver enforces `DockerBackendConfig.disk_quota_bytes`, and why (or why
        not). Asked once: ``docker info`` names the driver and its backing file system; overlay2 takes a
        size only over xfs mounted with project quotas, which only trying tells, so one container is
        created with the option from an image at hand (never started) and removed."""
        with self._guard:
            if self._quota is not None:
                return self._quota
        answer, final = self._probe_quota()
        if final:
            with self._guard:
                self._quota = answer
        return answer

    def _probe_quota(self) -> tuple[tuple[bool, str], bool]:
        if self._config.disk_quota_bytes is None:
            return (False, "no disk quota is configured"), True
        with docker_errors():
            info = self._api.info()
            images = self._api.images(quiet=True)
        driver = str(info.get("Driver", "?"))
        status = {str(k): str(v) for k, v in info.get("DriverStatus") or []}
        backing = status.get("Backing Filesystem", "")
        where = f"storage driver {driver}" + (f" on {backing}" if backing else "")
        if driver == "overlay2" and backing != "xfs":
            return (False, f"{where}: overlay2 takes a size only over xfs with project quotas"), True
        if driver not in ("overlay2", "devicemapper", "btrfs", "zfs"):
            return (False, f"{where}: this driver takes no size"), True
        if not images:
            return (False, f"{where}: not probed yet (no image to probe with)"), False
        try:
            with docker_errors():
                host = self._api.create_host_config(storage_opt={"size": str(self._config.disk_quota_bytes)})
                probe = self._api.create_container(
                    images[0], command=["true"], labels={"belayer": "quota-probe"}, host_config=host
                )
                self._api.remove_container(probe["Id"], force=True)
        except SandboxError as exc:
            return (False, f"{where}: the engine refused a size ({str(exc)[:300]})"), True
        return (True, f"{where}: each sandbox's writable layer is limited"), True

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        kinds = {0: "modified", 1: "added", 2: "deleted"}
        with docker_errors():
            changes = self._api.diff(sandbox_id) or []
        return [(kinds.get(c["Kind"], "modified"), str(c["Path"])) for c in changes]

    def processes(self, sandbox_id: str) -> list[str]:
        shell = self._spec(sandbox_id).shell
        with docker_errors():
            top = self._api.top(sandbox_id)
        column = (top.get("Titles") or []).index("CMD") if "CMD" in (top.get("Titles") or []) else -1
        commands = [str(row[column]) for row in top.get("Processes") or []]
        return [c for c in commands if supervisor.ROOT + "/" not in c and c != shell]

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        spec = self._spec(sandbox_id)
        ckpt_id = uuid.uuid4().hex[:16]
        location = self._config.checkpoint_dir / ckpt_id
        location.mkdir(parents=True, exist_ok=False)
        try:
            with self._lock(sandbox_id), docker_errors(CheckpointError):
                info = self._api.inspect_container(sandbox_id)
                with self._paused(sandbox_id):
                    started = time.monotonic()
                    image = self._snapshot_filesystem(info, ckpt_id)
                    fs_done = time.monotonic()
                    self._dump_processes(info["Id"], location)
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
        name = self._new_name()
        with docker_errors(RestoreError):
            created = self._create_container(name, checkpoint.spec, checkpoint.image, list(checkpoint.env))
            try:
                self._stage_dump(created, dump)
                self._post(f"/containers/{created}/start", params={"checkpoint": _CRIU_NAME})
            except BaseException:
                with contextlib.suppress(docker.errors.DockerException):
                    self._api.remove_container(created, force=True, v=True)
                raise
        self._specs[name] = checkpoint.spec
        return Sandbox(id=name, spec=checkpoint.spec)

    def delete_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Remove the dump and the snapshot image (Docker keeps an image that a sandbox still uses)."""
        with docker_errors(CheckpointError):
            self._discard_snapshot(checkpoint.image, Path(checkpoint.location))

    def _discard_snapshot(self, image: str, location: Path) -> None:
        shutil.rmtree(location, ignore_errors=True)
        try:
            self._api.remove_image(image)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: a restored sandbox still uses it
                raise

    def _drop_orphan_snapshot(self, image: str) -> None:
        """A restored sandbox kept its snapshot image alive after its checkpoint was deleted (409 in
        `_discard_snapshot`); remove the image with the last such sandbox."""
        repo, _, tag = image.partition(":")
        if repo != self._config.checkpoint_repository or (self._config.checkpoint_dir / tag).exists():
            return
        with contextlib.suppress(docker.errors.NotFound):
            try:
                self._api.remove_image(image)
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # still used by another restored sandbox
                    raise

    def load_checkpoint(self, checkpoint_id: str) -> Checkpoint:
        """Read a checkpoint's record back from `checkpoint_dir` (e.g. after a restart)."""
        meta = self._config.checkpoint_dir / checkpoint_id / "meta.json"
        try:
            return checkpoint_from_json(meta.read_text())
        except FileNotFoundError as exc:
            raise SandboxNotFound(f"no checkpoint {checkpoint_id}") from exc

    def _snapshot_filesystem(self, info: dict[str, Any], ckpt_id: str) -> str:
        repo = self._config.checkpoint_repository
        if self.image_layers(info["Image"]) + 1 >= self._config.max_image_layers:
            chunks = self._api.export(info["Id"])
            self._api.import_image(src=chunks, repository=repo, tag=ckpt_id, stream_src=True)
        else:
            self._api.commit(info["Id"], repository=repo, tag=ckpt_id, pause=False)
        return f"{repo}:{ckpt_id}"

    def _dump_processes(self, container_id: str, location: Path) -> None:
        # Docker writes the dump to <CheckpointDir>/<CheckpointID>; the container keeps running.
        body = {"CheckpointID": _CRIU_NAME, "CheckpointDir": str(location), "Exit": False}
        try:
            self._post(f"/containers/{container_id}/checkpoints", json_body=body)
        except docker.errors.APIError as exc:
            raise CheckpointError(f"CRIU could not dump the processes: {criu_errors(str(exc))}") from exc

    def _stage_dump(self, container_id: str, dump: Path) -> None:
        dest = self._docker_data_root() / "containers" / container_id / "checkpoints" / _CRIU_NAME
        shutil.copytree(dump, dest)
        (dest / "nonce").write_text(uuid.uuid4().hex)  # moby#42900: make every restore unique

    @contextlib.contextmanager
    def _paused(self, container_id: str) -> Iterator[None]:
        self._api.pause(container_id)
        try:
            yield
        finally:
            self._api.unpause(container_id)

    # ------------------------------------------------------------------ images
    def has_image(self, name: str) -> bool:
        """Whether the engine has image `name` (see `sandbox.images`)."""
        with docker_errors():
            try:
                self._inspect_image(name)
            except docker.errors.ImageNotFound:
                return False
        return True

    def image_id(self, name: str) -> str:
        """Image `name`'s id (``sha256:…``)."""
        with docker_errors():
            return str(self._inspect_image(name)["Id"])

    def image_layers(self, name: str) -> int:
        """How many layers image `name` has (Docker refuses to stack more than 125)."""
        with docker_errors():
            return len(self._inspect_image(name)["RootFS"].get("Layers") or [])

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        """`docker import` a root filesystem tarball (a path or bytes) as `name:latest`."""
        with docker_errors(ImageBuildError):
            if isinstance(rootfs_tar, Path):
                with rootfs_tar.open("rb") as stream:
                    self._import(stream, name, changes)
            else:
                self._import(io.BytesIO(rootfs_tar), name, changes)

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None:
        """Build image `name` (tag included) as `base` plus `files` (container path → host file)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for target, source in files.items():
                info = tar.gettarinfo(str(source), arcname=target.lstrip("/"))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with source.open("rb") as f:
                    tar.addfile(info, f)
        with docker_errors(ImageBuildError):
            container = self._api.create_container(base, command=["true"], labels={"belayer": "image-build"})
            try:
                self._api.put_archive(container["Id"], "/", buf.getvalue())
                repo, _, tag = name.partition(":")
                self._api.commit(container["Id"], repository=repo, tag=tag or "latest")
            finally:
                self._api.remove_container(container["Id"], force=True)

    def build_image(
        self,
        name: str,
        base: str,
        tar: bytes,
        script: str,
        *,
        labels: dict[str, str],
        workdir: str = "/workspace",
        timeout_s: float = 1800.0,
        network: bool = False,
        cap_add: tuple[str, ...] = (),
    ) -> str:
        """Build image `name` (tag included): `base`, plus `tar` unpacked at ``/``, after ``sh -c script``
        ran in `workdir`; returns the script's output. The image carries `labels`.

        The script runs under a sandbox's own limits (`SandboxSpec`'s defaults: every capability
        dropped but `cap_add`, no-new-privileges, its memory, process and CPU limits, the disk quota),
        with no network unless `network` (then the engine's default bridge)."""
        spec = SandboxSpec(
            image=base, workdir=workdir, network="full" if network else "none", cap_add=cap_add
        )
        with docker_errors(ImageBuildError):
            container = self._api.create_container(
                base, entrypoint=["/bin/sh", "-c", script], working_dir=workdir, user="0:0",
                labels={"belayer": "image-build"}, host_config=self._host_config(spec),
            )  # fmt: skip
            try:
                self._api.put_archive(container["Id"], "/", tar)
                self._api.start(container["Id"])
                try:
                    status = self._api.wait(container["Id"], timeout=timeout_s)
                except requests.exceptions.ReadTimeout as exc:
                    raise ImageBuildError(f"building {name}: setup ran over {timeout_s:g}s") from exc
                logs: str = self._api.logs(container["Id"]).decode(errors="replace")
                if status.get("StatusCode") != 0:
                    raise ImageBuildError(
                        f"building {name}: setup exited {status.get('StatusCode')}: {logs[-2000:]}"
                    )
                repo, _, tag = name.partition(":")
                changes = [f"LABEL {k}={json.dumps(v)}" for k, v in labels.items()]
                changes += [f"WORKDIR {workdir}", "ENTRYPOINT []", 'CMD ["/bin/sh"]']
                self._api.commit(container["Id"], repository=repo, tag=tag or "latest", changes=changes)
            finally:
                self._api.remove_container(container["Id"], force=True)
        return logs

    def images(self, label: str) -> list[dict[str, Any]]:
        """Images carrying `label`: name (first tag), id, created (epoch s), size (bytes), labels."""
        with docker_errors():
            found = self._api.images(filters={"label": label})
        return [
            {
                "name": (img.get("RepoTags") or [img["Id"]])[0],
                "id": img["Id"],
                "created": float(img.get("Created") or 0),
                "size": int(img.get("Size") or 0),
                "labels": dict(img.get("Labels") or {}),
            }
            for img in found
        ]

    def remove_image(self, name: str) -> bool:
        """Remove image `name`; False when a container still uses it (it is kept)."""
        with docker_errors():
            try:
                self._api.remove_image(name)
            except docker.errors.NotFound:
                return True
            except docker.errors.APIError as exc:
                if exc.status_code == 409:
                    return False
                raise
        return True

    def _import(self, stream: io.BufferedIOBase, name: str, changes: list[str]) -> None:
        chunks = iter(lambda: stream.read(1 << 20), b"")
        self._api.import_image(src=chunks, repository=name, tag="latest", changes=changes, stream_src=True)

    # ------------------------------------------------------------------ helpers
    def _create_container(self, name: str, spec: SandboxSpec, image: str, env: list[str]) -> str:
        created = self._api.create_container(
            image,
            name=name,
            entrypoint=[supervisor.BUSYBOX, "sh", supervisor.SUPERVISOR, spec.workdir],
            environment=env,
            user="0:0",
            working_dir="/",
            labels={**spec.labels, _SPEC_LABEL: spec.model_dump_json()},
            host_config=self._host_config(spec),
        )
        return str(created["Id"])

    def _host_config(self, spec: SandboxSpec) -> dict[str, Any]:
        """A sandbox's isolation: `spec`'s network, capabilities and limits, and the disk quota."""
        if spec.network == "gateway":
            self._network.ensure()
        network_mode = {"none": "none", "full": "bridge", "gateway": self._config.gateway_network}
        host_config: dict[str, Any] = self._api.create_host_config(
            network_mode=network_mode[spec.network],
            cap_drop=["ALL"],
            cap_add=list(spec.cap_add) or None,
            security_opt=["no-new-privileges"],
            mem_limit=spec.memory_bytes,
            memswap_limit=spec.memory_bytes,
            pids_limit=spec.pids_limit,
            nano_cpus=int(spec.cpus * 1e9),
            storage_opt=self._storage_opt(),
        )
        return host_config

    def _storage_opt(self) -> dict[str, str] | None:
        quota = self._config.disk_quota_bytes
        return {"size": str(quota)} if quota is not None and self.disk_quota()[0] else None

    def _post(
        self, path: str, *, json_body: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> None:
        """A raw engine call for what docker-py lacks (checkpoints); errors become DockerExceptions."""
        url = f"{self._api.base_url}/v{self._api.api_version}{path}"
        response = self._api.post(url, json=json_body, params=params, timeout=self._config.api_timeout_s)
        _raise_for_status(response)

    def _inspect_image(self, name: str) -> dict[str, Any]:
        image: dict[str, Any] = self._api.inspect_image(name)  # type: ignore[no-untyped-call,unused-ignore]
        return image

    def _docker_data_root(self) -> Path:
        if self._data_root is None:
            self._data_root = Path(self._api.info()["DockerRootDir"])
        return self._data_root

    def _spec(self, sandbox_id: str) -> SandboxSpec:
        spec = self._specs.get(sandbox_id)
        if spec is None:  # created by another backend instance: the spec travels as a label
            with docker_errors():
                labels = self._api.inspect_container(sandbox_id)["Config"].get("Labels") or {}
            if _SPEC_LABEL not in labels:
                raise SandboxNotFound(f"{sandbox_id} is not a Belayer sandbox")
            spec = SandboxSpec.model_validate_json(labels[_SPEC_LABEL])
            self._specs[sandbox_id] = spec
        return spec

    def _lock(self, sandbox_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(sandbox_id, threading.Lock())

    def _new_name(self) -> str:
        return f"{self._config.name_prefix}-{uuid.uuid4().hex[:12]}"


def _raise_for_status(response: requests.Response) -> None:
    """An engine's error answer as docker-py's exception (`docker_errors` translates it)."""
    try:
        response.raise_for_status()
    except requests.HTTPError as exc:
        raise docker.errors.create_api_error_from_http_exception(exc) from exc


def _make_client(config: DockerBackendConfig) -> docker.DockerClient:
    if config.base_url is None:
        return docker.from_env(timeout=int(config.api_timeout_s))
    return docker.DockerClient(base_url=config.base_url, timeout=int(config.api_timeout_s))


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


def build_script(command: str, *, cwd: str | None, env: dict[str, str]) -> str:
    """The text a session shell sources: apply cwd and env (they persist), then the command."""
    lines = []
    if cwd is not None:
        lines.append(f"cd -- {shlex.quote(cwd)} || return 1")
    lines.extend(f"export {check_env_name(k)}={shlex.quote(v)}" for k, v in env.items())
    lines.append(command)
    return "\n".join(lines)


def parse_client_output(out: bytes, err: bytes, limit: int, elapsed: float, timeout_s: float) -> ExecResult:
    """Split the exec client's output into an `ExecResult`, or raise `SandboxTimeout`."""
    cut = err.rfind(supervisor.TRAILER.encode())
    if cut < 0:
        raise SandboxError(f"sandbox exec client failed: {err[-2000:].decode(errors='replace')}")
    fields = dict(item.split("=", 1) for item in err[cut + len(supervisor.TRAILER) :].decode().split())
    stdout, stderr = out.decode(errors="replace"), err[:cut].decode(errors="replace")
    if fields["timeout"] == "1":
        raise SandboxTimeout(f"command timed out after {timeout_s:g}s", stdout=stdout, stderr=stderr)
    rc = fields.get("rc", "")
    return ExecResult(
        exit_code=int(rc) if rc.lstrip("-").isdigit() else 255,
        stdout=stdout,
        stderr=stderr,
        duration_s=elapsed,
        stdout_truncated=_cut(fields.get("out"), stdout, limit),
        stderr_truncated=_cut(fields.get("err"), stderr, limit),
    )


def _cut(size: str | None, shown: str, limit: int) -> bool:
    """Whether output was cut at `limit`; a size the client could not measure (no process left to
    fork under `pids_limit`) counts as cut when the output reaches the limit."""
    if size is not None and size.isdigit():
        return int(size) > limit
    return len(shown.encode()) >= limit


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _single_file(raw: bytes, target: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        member = tar.next()
        if member is None or not member.isfile():
            raise SandboxError(f"{target} is not a regular file")
        extracted = tar.extractfile(member)
        if extracted is None:
            raise SandboxError(f"{target} is not a regular file")
        return extracted.read()


def checkpoint_to_json(ckpt: Checkpoint) -> str:
    """Serialise a checkpoint record (the inverse of `checkpoint_from_json`)."""
    return json.dumps(checkpoint_record(ckpt), indent=1)


def checkpoint_from_json(text: str) -> Checkpoint:
    """Parse a record written by `checkpoint_to_json`."""
    return checkpoint_from_record(json.loads(text))
