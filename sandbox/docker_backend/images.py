"""The Docker backend's images: what `sandbox.images` and `sandbox.task_images` build with (import a root
filesystem, derive an image with a few files more, build one by running a setup script under a sandbox's
limits) and what they look up, list and remove.
"""

from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import IO, Any

import docker.errors
import requests

from core.errors import ImageBuildError, SandboxUnavailable
from sandbox.backend import SandboxSpec
from sandbox.docker_backend.containers import Containers
from sandbox.docker_backend.engine import DockerEngine, docker_errors, raise_for_status


class Images:
    """The engine's images, by name (tag included)."""

    def __init__(self, engine: DockerEngine, containers: Containers) -> None:
        self._engine = engine
        self._api = engine.api
        self._containers = containers

    def has(self, name: str) -> bool:
        with docker_errors():
            try:
                self._engine.inspect_image(name)
            except docker.errors.ImageNotFound:
                return False
        return True

    def id_of(self, name: str) -> str:
        with docker_errors():
            return str(self._engine.inspect_image(name)["Id"])

    def layers(self, name: str) -> int:
        with docker_errors():
            return len(self._engine.inspect_image(name)["RootFS"].get("Layers") or [])

    def labelled(self, label: str) -> list[dict[str, Any]]:
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

    def remove(self, name: str) -> bool:
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

    def save(self, name: str, out: IO[bytes]) -> None:
        """``docker save`` image `name` (its layers, config and tag) into `out`, piece by piece."""
        with docker_errors():
            for chunk in self._api.get_image(name):
                out.write(chunk)

    def load(self, tar: bytes) -> None:
        """``docker load`` a tar that `save` wrote (on this or another engine)."""
        with docker_errors(ImageBuildError):
            for _ in self._api.load_image(tar):
                pass

    # ------------------------------------------------------------------ building
    def import_rootfs(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        """`docker import` a root filesystem tarball (a path or bytes) as `name:latest`."""
        with docker_errors(ImageBuildError):
            if isinstance(rootfs_tar, Path):
                with rootfs_tar.open("rb") as stream:
                    self._import(stream, name, changes)
            else:
                self._import(io.BytesIO(rootfs_tar), name, changes)

    def derive(self, name: str, base: str, files: dict[str, Path]) -> None:
        """Build image `name` as `base` plus `files` (container path → host file)."""
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

    def build(
        self, name: str, base: str, tar: bytes, script: str, *, labels: dict[str, str], workdir: str,
        timeout_s: float, network: bool, cap_add: tuple[str, ...],
    ) -> str:  # fmt: skip
        """See `DockerSandboxBackend.build_image` (which fills in the defaults)."""
        spec = SandboxSpec(
            image=base, workdir=workdir, network="full" if network else "none", cap_add=cap_add
        )
        with docker_errors(ImageBuildError):
            container = self._api.create_container(
                base, entrypoint=["/bin/sh", "-c", script], working_dir=workdir, user="0:0",
                labels={"belayer": "image-build"}, host_config=self._containers.host_config(spec),
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

    def build_dockerfile(
        self, name: str, context: bytes, *, labels: dict[str, str], timeout_s: float, network: bool
    ) -> str:
        """See `DockerSandboxBackend.build_dockerfile`."""
        started, lines = time.monotonic(), list[str]()
        try:
            with docker_errors(ImageBuildError):
                stream = self._api.build(
                    fileobj=io.BytesIO(context), custom_context=True, tag=name, labels=labels, rm=True,
                    forcerm=True, pull=False, decode=True, timeout=timeout_s, use_config_proxy=False,
                    network_mode="default" if network else "none",
                )  # fmt: skip
                for chunk in stream:
                    if "error" in chunk:
                        raise ImageBuildError(
                            f"building {name}: {str(chunk['error']).strip()}\n{''.join(lines)[-2000:]}"
                        )
                    lines.append(str(chunk.get("stream", "")))
                    if time.monotonic() - started > timeout_s:
                        raise ImageBuildError(f"building {name}: ran over {timeout_s:g}s")
        except (requests.exceptions.ReadTimeout, SandboxUnavailable) as exc:
            if time.monotonic() - started < timeout_s:
                raise
            raise ImageBuildError(f"building {name}: ran over {timeout_s:g}s") from exc
        if not self.has(name):
            raise ImageBuildError(
                f"building {name}: the build ended without an image\n{''.join(lines)[-2000:]}"
            )
        return "".join(lines)

    def missing(self, name: str, needs: list[tuple[str, tuple[str, ...]]]) -> list[str]:
        """What of `needs` (what, alternative paths) image `name` lacks: none of its paths is there. The
        image's files are looked at in a container created from it and never started."""
        with docker_errors(ImageBuildError):
            container = self._api.create_container(name, command=["true"], labels={"belayer": "image-probe"})
            try:
                return [
                    what for what, paths in needs if not any(self._exists(container["Id"], p) for p in paths)
                ]
            finally:
                self._api.remove_container(container["Id"], force=True)

    def workdir_of(self, name: str) -> str:
        """Image `name`'s ``WORKDIR`` ("" when it sets none)."""
        with docker_errors():
            return str(self._engine.inspect_image(name)["Config"].get("WorkingDir") or "")

    def _exists(self, container: str, path: str) -> bool:
        url = self._engine.container_url(container, "archive")
        response = self._api.head(url, params={"path": path}, timeout=self._engine.config.api_timeout_s)
        if response.status_code == 404:
            return False
        raise_for_status(response)
        return True

    def _import(self, stream: io.BufferedIOBase, name: str, changes: list[str]) -> None:
        chunks = iter(lambda: stream.read(1 << 20), b"")
        self._api.import_image(src=chunks, repository=name, tag="latest", changes=changes, stream_src=True)
