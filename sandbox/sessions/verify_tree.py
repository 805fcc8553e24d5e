"""The agent's working directory in the verify stage (`sandbox.sessions.verify`), as tars.

Its copy (`WorkspaceCopy`: a tar spooled to a temporary file) is read one member at a time (`AgentTree`):
regular files, directories and symbolic links only (hard links become files with their target's bytes;
no devices or fifos), no ``__pycache__``/``*.pyc``. `protect` lists what the agent changed of the
protected paths; `write_tree` streams the tree the verifier unpacks, every protected path back to the
task's original content. `files_tar` packs the verifier's own files (Belayer's ``/belayer-verify``,
Harbor's ``/tests``).

Example::

    tree = AgentTree(copy.tar, "/workspace")
    changes = protect(tree, {"test_a.py": (b"...", 0o644)}, ("test_*.py",))
    chunks = write_tree(tree, "/workspace", {"test_a.py": (b"...", 0o644)}, ("test_*.py",))
"""

from __future__ import annotations

import difflib
import fnmatch
import io
import posixpath
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

from core.errors import SandboxError
from sandbox.backend import tar_chunks

SPOOL_MEMORY_BYTES = 1 << 20
"""A copy of the working directory up to this size stays in memory; a larger one goes to a temporary
file (the gateway holds a piece of it at a time, never the whole)."""
DIFF_MAX_BYTES = 1 << 20
"""A protected file's diff is counted when both versions are at most this size (else ``diff_lines`` is
-1)."""
Change = Literal["modified", "deleted", "added"]


@dataclass(frozen=True, slots=True)
class ProtectedChange:
    path: str
    change: Change
    diff_lines: int
    """Lines added plus lines removed (a unified diff of the two versions, as text); -1: not counted,
    a version is over `DIFF_MAX_BYTES`."""
    bytes_before: int
    bytes_after: int

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "change": self.change, "diff_lines": self.diff_lines,
            "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
        }  # fmt: skip


def is_protected(path: str, patterns: tuple[str, ...]) -> bool:
    """Whether relative `path` is protected by one of `patterns`.

    >>> is_protected("tests/unit/test_a.py", ("tests",)), is_protected("a/test_x.py", ("test_*.py",))
    (True, False)
    >>> is_protected("a/test_x.py", ("*/test_*.py",)), is_protected("test_x.py", ("test_*.py",))
    (True, True)
    """
    for pattern in patterns:
        pattern = pattern.strip("/")
        if fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern + "/"):
            return True
        parts = path.split("/")  # a pattern matching a directory protects what is under it
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
            return True
    return False


@dataclass(frozen=True, slots=True)
class WorkspaceCopy:
    """The agent's working directory as copied out: a tar spooled to a temporary file (in memory only
    while under `SPOOL_MEMORY_BYTES`), and how big it was. Over `limit`, the copy stopped there and
    `tar` holds only its start. `VerifyStage.judge` closes it."""

    tar: IO[bytes]
    size: int
    limit: int | None = None

    @property
    def too_large(self) -> bool:
        return self.limit is not None and self.size > self.limit

    def close(self) -> None:
        self.tar.close()


@dataclass(frozen=True, slots=True)
class _Member:
    rel: str
    """The path relative to the working directory."""
    info: tarfile.TarInfo
    content: tarfile.TarInfo | None
    """Where a file's bytes are: itself, or a hard link's target; None for directories and links."""
    archive: tarfile.TarFile

    def open(self) -> IO[bytes]:
        stream = self.archive.extractfile(self.content) if self.content is not None else None
        if stream is None:
            raise SandboxError(f"{self.rel} has no content")
        return stream

    def head(self, limit: int) -> bytes:
        """Up to `limit` bytes of a file; a symbolic link's target; nothing for a directory."""
        return self.open().read(limit) if self.content is not None else self.info.linkname.encode()


class AgentTree:
    """The agent's working directory in its archive (`WorkspaceCopy.tar`, seekable), read one member at
    a time, each time it is walked: never the whole tree in memory, files' bytes least of all.

    Kept: directories, regular files (hard links become regular files with their target's bytes) and
    symbolic links; nothing else, and no bytecode."""

    def __init__(self, tar: IO[bytes], workdir: str) -> None:
        self._tar = tar
        self._top = posixpath.basename(workdir.rstrip("/"))
        self._targets = {posixpath.normpath(m.linkname) for _, m in self._scan() if m.islnk()}
        """Files that hard links point at (their headers are kept while walking; no others are)."""

    def members(self) -> Iterator[_Member]:
        held: dict[str, tarfile.TarInfo] = {}
        for archive, member in self._scan():
            name = posixpath.normpath(member.name)
            if member.isreg() and name in self._targets:
                held[name] = member
            if name == self._top or not name.startswith(self._top + "/"):
                continue
            rel = name[len(self._top) + 1 :]
            if rel.startswith("../") or "/../" in rel or _bytecode(rel):
                continue
            if member.isdir() or member.issym():
                yield _Member(rel, member, None, archive)
            elif member.isreg():
                yield _Member(rel, member, member, archive)
            elif member.islnk() and posixpath.normpath(member.linkname) in held:
                yield _Member(rel, member, held[posixpath.normpath(member.linkname)], archive)

    def _scan(self) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
        self._tar.seek(0)
        with tarfile.open(fileobj=self._tar, mode="r:") as archive:
            while (member := archive.next()) is not None:
                archive.members.clear()  # type: ignore[attr-defined]  # else it keeps every header read
                yield archive, member


def protect(
    tree: AgentTree, originals: dict[str, tuple[bytes, int]], patterns: tuple[str, ...]
) -> list[ProtectedChange]:
    """What the agent changed of the protected paths: each one that `write_tree` resets (a protected
    file that differs from its original or has none, or an original that is missing)."""
    changes: list[ProtectedChange] = []
    seen: set[str] = set()
    for member in tree.members():
        if not is_protected(member.rel, patterns) and member.rel not in originals:
            continue
        original = originals.get(member.rel)
        size = member.content.size if member.content is not None else len(member.info.linkname.encode())
        if original is None:
            if not member.info.isdir():
                after = member.head(DIFF_MAX_BYTES + 1)
                changes.append(ProtectedChange(member.rel, "added", _diff_lines(b"", after), 0, size))
            continue
        seen.add(member.rel)
        data, _mode = original
        if member.content is not None and size == len(data) and member.head(len(data)) == data:
            continue
        after = member.head(DIFF_MAX_BYTES + 1)
        changes.append(ProtectedChange(member.rel, "modified", _diff_lines(data, after), len(data), size))
    for rel in set(originals) - seen:
        data = originals[rel][0]
        changes.append(ProtectedChange(rel, "deleted", _diff_lines(data, b""), len(data), 0))
    return sorted(changes, key=lambda change: change.path)


def write_tree(
    tree: AgentTree, workdir: str, originals: dict[str, tuple[bytes, int]], patterns: tuple[str, ...]
) -> Iterator[bytes]:
    """The tree as a tar to unpack at ``/`` (names under `workdir`), made as it is sent: the agent's
    files, minus the protected paths (a protected directory stays), then every original. A file or
    link where a parent directory of an original goes is dropped, so the original is written where
    the verifier will read it."""
    root = workdir.strip("/")
    above = {"/".join(rel.split("/")[:i]) for rel in originals for i in range(1, rel.count("/") + 1)}

    def members() -> Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]]:
        for member in tree.members():
            protected = is_protected(member.rel, patterns) or member.rel in originals
            if protected and not (member.info.isdir() and member.rel not in originals):
                continue
            if member.rel in above and not member.info.isdir():
                continue
            info = tarfile.TarInfo(f"{root}/{member.rel}")
            info.mode, info.mtime = member.info.mode, member.info.mtime
            if member.content is not None:
                info.size = member.content.size
            else:
                info.type, info.linkname = member.info.type, member.info.linkname
            yield info, member.open() if member.content is not None else None
        now = int(time.time())
        for rel, (data, mode) in sorted(originals.items()):
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size, info.mode, info.mtime = len(data), mode, now
            yield info, io.BytesIO(data)

    return tar_chunks(members())


def files_tar(root: str, files: dict[str, tuple[bytes, int]], dirs: dict[str, int], what: str) -> bytes:
    """A tar to unpack at ``/``: the directories `dirs` (name: mode), then `files` under `root`; a file
    path that leaves `root` is a `SandboxError` naming it as `what`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, dir_mode in dirs.items():
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, dir_mode
            tar.addfile(info)
        for rel, (data, mode) in sorted(files.items()):
            clean = posixpath.normpath(rel)
            if clean.startswith(("/", "..")):
                raise SandboxError(f"{what} {rel!r} is not a relative path inside the task")
            info = tarfile.TarInfo(f"{root}/{clean}")
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _bytecode(rel: str) -> bool:
    return rel.endswith((".pyc", ".pyo")) or "__pycache__" in rel.split("/")


def _diff_lines(before: bytes, after: bytes) -> int:
    """Lines added plus removed; -1 (not counted) when a side is over `DIFF_MAX_BYTES`."""
    if len(before) > DIFF_MAX_BYTES or len(after) > DIFF_MAX_BYTES:
        return -1
    a = before.decode(errors="replace").splitlines()
    b = after.decode(errors="replace").splitlines()
    return sum(
        1
        for line in difflib.unified_diff(a, b, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )
