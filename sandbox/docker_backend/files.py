"""The Docker backend's files: single files in and out of a sandbox, and whole trees as tar streams.

Paths resolve inside the container's root (the engine does that), so nothing outside the container is
reachable. Archives stream both ways in pieces (`sandbox.backend.CHUNK_BYTES`), never whole in memory.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import time
from typing import IO

from core.errors import SandboxError
from sandbox.backend import CHUNK_BYTES, TarStream, copy_bounded, resolve_in_root
from sandbox.docker_backend.engine import DockerEngine, docker_errors, raise_for_status

_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27


class Files:
    """Reads, writes, archives and extracts files in sandboxes, each call under the sandbox's lock."""

    def __init__(self, engine: DockerEngine) -> None:
        self._engine = engine
        self._api = engine.api

    def read(self, sandbox_id: str, path: str) -> bytes:
        workdir = self._engine.spec(sandbox_id).workdir
        target = resolve_in_root(workdir, path)
        with self._engine.lock(sandbox_id), docker_errors(file_op=True):
            stream, stat = self._api.get_archive(sandbox_id, target)
            raw = b"".join(stream)
        mode = int(stat.get("mode", 0))
        if mode & _GO_MODE_SYMLINK:
            link = str(stat.get("linkTarget", ""))
            resolve_in_root(workdir, link)  # raises if it leaves the root
            return self.read(sandbox_id, link)
        if mode & _GO_MODE_DIR:
            raise SandboxError(f"{target} is a directory")
        return _single_file(raw, target)

    def write(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        target = resolve_in_root(self._engine.spec(sandbox_id).workdir, path)
        with self._engine.lock(sandbox_id):
            self.upload(sandbox_id, target, data, mode)

    def upload(self, sandbox_id: str, target: str, data: bytes, mode: int) -> None:
        """Write `data` at the absolute `target` (no lock taken, no path check: callers do both)."""
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
        """See `SandboxBackend.archive`: a running sandbox is paused while its tar streams out."""
        with self._engine.lock(sandbox_id), docker_errors(file_op=True):
            running = bool(self._api.inspect_container(sandbox_id)["State"].get("Running"))
            with self._engine.paused(sandbox_id) if running else contextlib.nullcontext():
                response = self._api.get(
                    self._engine.container_url(sandbox_id, "archive"), params={"path": path}, stream=True,
                    timeout=self._engine.config.api_timeout_s, headers={"Accept-Encoding": "identity"},
                )  # fmt: skip
                with contextlib.closing(response):  # closed early: the engine stops sending
                    raise_for_status(response)
                    return copy_bounded(response.iter_content(CHUNK_BYTES), out, max_bytes)

    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        # Pieces go out as they come (a chunked request body): the whole tar is never in memory.
        with self._engine.lock(sandbox_id), docker_errors(file_op=True):
            self._api.put_archive(sandbox_id, "/", tar)


def _single_file(raw: bytes, target: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        member = tar.next()
        if member is None or not member.isfile():
            raise SandboxError(f"{target} is not a regular file")
        extracted = tar.extractfile(member)
        if extracted is None:
            raise SandboxError(f"{target} is not a regular file")
        return extracted.read()
