"""The Docker backend's files: single files in and out of a sandbox, and whole trees as tar streams.

Paths resolve inside the container's root (the engine does that), so nothing outside the container is
reachable. Archives stream both ways in pieces (`sandbox.backend.CHUNK_BYTES`), never whole in memory.

A file read asks for the file's stat first (``HEAD /containers/{id}/archive``: its size, mode and link
target in the ``X-Docker-Container-Path-Stat`` header), and takes its bytes only when it is a regular
file no larger than the read's `max_bytes` (a sparse 50 GB file costs the sandbox nothing and the
gateway only that header). A symbolic link at the path is followed once (its own target, read from its
archive, which holds the link alone, and kept under the workdir); a target that is a link again, or a
path whose links loop (the engine cannot stat it), is refused with `SandboxPathRefused`: a read makes at
most four engine calls, whatever the links. Links in the directories on the way are the engine's to
resolve, inside the container's root. A write replaces a link at its path (tar does), never follows it.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import tarfile
import time
from collections.abc import Iterator
from typing import IO, Any

import docker.utils

from core.errors import SandboxError, SandboxFileTooLarge, SandboxPathRefused
from sandbox.backend import CHUNK_BYTES, ChunkReader, TarStream, copy_bounded, resolve_in_root
from sandbox.docker_backend.engine import DockerEngine, docker_errors, raise_for_status

_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_IRREGULAR = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
"""Go's `fs.ModeType` bits (directory, link, named pipe, socket, device, char device, irregular)."""
_LINK_ERRORS = ("too many links", "too many levels of symbolic links")
"""How the engine words a path whose symbolic links loop (Go's `EvalSymlinks`, or ELOOP)."""
STAT_HEADER = "X-Docker-Container-Path-Stat"


class Files:
    """Reads, writes, archives and extracts files in sandboxes, each call under the sandbox's lock."""

    def __init__(self, engine: DockerEngine) -> None:
        self._engine = engine
        self._api = engine.api

    def read(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """See `SandboxBackend.read_file` and the module docstring: the stat, then the bytes."""
        workdir = self._engine.spec(sandbox_id).workdir
        target = resolve_in_root(workdir, path)
        with self._engine.lock(sandbox_id), _path_errors(path), docker_errors(file_op=True):
            stat = self.stat(sandbox_id, target)
            if int(stat.get("mode", 0)) & _GO_MODE_SYMLINK:
                link = posixpath.join(posixpath.dirname(target), self._readlink(sandbox_id, target))
                target = resolve_in_root(workdir, link)  # it must stay inside
                stat = self.stat(sandbox_id, target)
                if int(stat.get("mode", 0)) & _GO_MODE_SYMLINK:
                    raise SandboxPathRefused.links(path)
            size = _regular_size(stat, target)
            if max_bytes is not None and size > max_bytes:
                raise SandboxFileTooLarge.of(target, size, max_bytes)
            return self._body(sandbox_id, target, max_bytes)

    def stat(self, sandbox_id: str, target: str) -> dict[str, Any]:
        """The engine's stat of `target` (not following a link there), from the archive's header only."""
        url = self._engine.container_url(sandbox_id, "archive")
        timeout = self._engine.config.api_timeout_s
        response = self._api.head(url, params={"path": target}, timeout=timeout)
        if not response.ok:
            # A HEAD answer has no body, so no reason (a missing file, or a missing container?): ask
            # again for the engine's message (an error answer is small; a successful one is closed unread).
            response = self._api.get(url, params={"path": target}, stream=True, timeout=timeout)
            with contextlib.closing(response):
                raise_for_status(response)
        raise_for_status(response)
        header = response.headers.get(STAT_HEADER)
        if not header:
            raise SandboxError(f"the engine sent no stat of {target}")
        stat: dict[str, Any] = docker.utils.decode_json_header(header)
        return stat

    def _readlink(self, sandbox_id: str, target: str) -> str:
        """The link `target`'s own target, as written (the stat's ``linkTarget`` is the end of the whole
        chain): from its archive, which holds the link alone."""
        response = self._api.get(
            self._engine.container_url(sandbox_id, "archive"), params={"path": target}, stream=True,
            timeout=self._engine.config.api_timeout_s, headers={"Accept-Encoding": "identity"},
        )  # fmt: skip
        with contextlib.closing(response):
            raise_for_status(response)
            with tarfile.open(fileobj=ChunkReader(response.iter_content(CHUNK_BYTES)), mode="r|") as tar:
                member = tar.next()
        if member is None or not member.issym():
            raise SandboxPathRefused(f"{target} changed while it was read; read it again")
        return member.linkname

    def _body(self, sandbox_id: str, target: str, max_bytes: int | None) -> bytes:
        """The bytes of the regular file `target`, read from its archive; its tar header is checked
        against `max_bytes` again before the bytes, should the file have grown since its stat."""
        response = self._api.get(
            self._engine.container_url(sandbox_id, "archive"), params={"path": target}, stream=True,
            timeout=self._engine.config.api_timeout_s, headers={"Accept-Encoding": "identity"},
        )  # fmt: skip
        with contextlib.closing(response):
            raise_for_status(response)
            chunks = response.iter_content(CHUNK_BYTES)
            with tarfile.open(fileobj=ChunkReader(chunks), mode="r|") as tar:
                member = tar.next()
                if member is None or not member.isfile():
                    raise SandboxPathRefused(f"{target} is not a regular file")
                if max_bytes is not None and member.size > max_bytes:
                    raise SandboxFileTooLarge.of(target, member.size, max_bytes)
                extracted = tar.extractfile(member)
                if extracted is None:
                    raise SandboxPathRefused(f"{target} is not a regular file")
                return extracted.read()

    def write(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        target = resolve_in_root(self._engine.spec(sandbox_id).workdir, path)
        with self._engine.lock(sandbox_id), _path_errors(path):
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


@contextlib.contextmanager
def _path_errors(path: str) -> Iterator[None]:
    """The engine's refusal of a path whose links loop, as the caller's error (not the sandbox's)."""
    try:
        yield
    except SandboxError as exc:
        if type(exc) is SandboxError and any(words in str(exc).lower() for words in _LINK_ERRORS):
            raise SandboxPathRefused.links(path) from exc
        raise


def _regular_size(stat: dict[str, Any], target: str) -> int:
    mode = int(stat.get("mode", 0))
    if mode & _GO_MODE_DIR:
        raise SandboxPathRefused(f"{target} is a directory, not a file")
    if mode & _GO_MODE_IRREGULAR:
        raise SandboxPathRefused(f"{target} is not a regular file")
    return int(stat.get("size", 0))
