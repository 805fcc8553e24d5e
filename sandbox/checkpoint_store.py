"""Where sandbox checkpoints are written so that every node of a cluster can read them: when a node is lost,
its sandboxes are restored on another node from their newest checkpoint.

One ABC, `CheckpointStore`, over objects named by *keys*: relative, slash-separated paths such as
``ckpt/<id>/fs.tar`` (no ``..``, no leading ``/``, no empty part, no part that starts with ``.``). Two
implementations: `LocalDirStore` (a directory; on a cluster, a shared filesystem mounted on every node) and
`S3Store` (any S3-compatible service, through boto3, imported only when one is built: `sandbox.checkpoint_s3`). `store_for` builds
one from a URL. A *prefix* names a folder: ``list("ckpt/a")`` is what lies under ``ckpt/a/``.

Methods block and are thread-safe. A put is atomic: a reader sees the old object or the new one, whole.
A missing object raises `CheckpointMissing`, any other failure to read `CheckpointUnreadable`, a failure to
write, list or delete `CheckpointError`; each names the store's URL and the key. Errors of the caller's own
files (a put's source, a get's destination) stay `OSError`s.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     store = store_for(root)
    ...     store.put_bytes("ckpt/abc/meta.json", b"{}")
    ...     store.list("ckpt"), store.get_bytes("ckpt/abc/meta.json"), store.delete_prefix("ckpt/abc")
    (['ckpt/abc/meta.json'], b'{}', 1)
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, unquote, urlsplit

from core.errors import (
    CheckpointError,
    CheckpointMissing,
    CheckpointTampered,
    CheckpointUnreadable,
    SandboxArgumentError,
)

_CHUNK = 1 << 20


def check_key(key: str, *, prefix: bool = False) -> str:
    """Return `key` if it is a valid key (with `prefix`: a folder, where ``""`` is the whole store and one
    trailing ``/`` is allowed), else raise `SandboxArgumentError`.

    >>> check_key("ckpt/abc/fs.tar"), check_key("ckpt/", prefix=True)
    ('ckpt/abc/fs.tar', 'ckpt')
    """
    path = key.removesuffix("/") if prefix else key
    if prefix and path == "":
        return ""
    parts = path.split("/")
    if any(not p or p.startswith(".") for p in parts) or any(c in path for c in "\\\0\n\r"):
        raise SandboxArgumentError(
            f"bad checkpoint store key {key!r}: use a relative path of non-empty parts joined by '/', "
            "none starting with '.' (no '..', no leading '/')"
        )
    return path


class CheckpointStore(abc.ABC):
    """Objects under keys, readable by every node (see the module's docstring for an example)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL `store_for` builds this store from."""

    @abc.abstractmethod
    def put_file(self, key: str, source: Path) -> None:
        """Store `source`'s bytes under `key` (streamed; `source` stays as it is)."""

    @abc.abstractmethod
    def get_file(self, key: str, dest: Path) -> None:
        """Write the object to `dest` (streamed; `dest` appears whole or not at all)."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """The keys under the folder `prefix`, sorted."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder `prefix`; return how many were removed."""

    def describe(self) -> str:
        return self.url

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the store's connections."""

    def _missing(self, key: str) -> CheckpointMissing:
        return CheckpointMissing(
            f"checkpoint store {self.url}: no object {key!r}. The checkpoint was deleted, or written to "
            "another store: check that every node is given the same checkpoint store URL"
        )

    def _failed(self, key: str, exc: BaseException, what: str) -> CheckpointError:
        """`CheckpointUnreadable` for a read (`what` ``read``), else `CheckpointError`."""
        error = CheckpointUnreadable if what == "read" else CheckpointError
        access = "readable" if what in ("read", "list") else "writable, and not full,"
        return error(
            f"checkpoint store {self.url}: cannot {what} {key!r} ({type(exc).__name__}: {exc}). Check that "
            f"the store is reachable (mounted, or its endpoint up) and {access} from this node"
        )


class LocalDirStore(CheckpointStore):
    """A directory; each key is a file under it. Puts go to a hidden temporary file in the destination's
    directory, flushed to disk, then renamed over the key (``os.replace``).

    The directory is shared (every node mounts it), so whoever else writes it is not trusted: each part
    of a key is opened from its folder's descriptor without following a symbolic link (``O_NOFOLLOW``,
    ``dir_fd``), and a link, or anything but a folder or a regular file where the store expects one, is
    refused (`CheckpointTampered` on a read, `CheckpointError` on a write, a list or a delete) rather
    than followed: a link swapped in for ``ckpt/<id>`` would otherwise have an eviction delete, or a put
    write, wherever it points, as root. Only the root itself, the operator's own setting, may be a link."""

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise SandboxArgumentError(f"checkpoint store directory must be absolute: {str(root)!r}")
        self.root = root

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def describe(self) -> str:
        return f"directory {self.root}"

    def put_file(self, key: str, source: Path) -> None:
        # Always a copy: a hard link would share the inode, and a caller rewriting its staging file in
        # place ('wb' truncates the same inode) would change the stored checkpoint.
        with source.open("rb") as src:
            self._put(key, lambda out: shutil.copyfileobj(src, out, _CHUNK))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put(key, lambda out: out.write(data))

    def get_file(self, key: str, dest: Path) -> None:
        with self._opened(key) as src:
            _write_atomic(dest, lambda out: shutil.copyfileobj(src, out, _CHUNK))

    def get_bytes(self, key: str) -> bytes:
        with self._opened(key) as src:
            return src.read()

    def exists(self, key: str) -> bool:
        """Whether `key` is a file reached without a link: a link (or a stranger) is no object of the store
        (a gateway's start-up asks this of every checkpoint it recorded, and must not stop at one)."""
        *folders, name = check_key(key).split("/")
        with self._errors(key, "read"):
            try:
                with self._folder(folders) as fd:
                    mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except (FileNotFoundError, NotADirectoryError, _NotOurs):
                return False
        return stat.S_ISREG(mode)

    def list(self, prefix: str = "") -> list[str]:
        path = check_key(prefix, prefix=True)
        folders = path.split("/") if path else []
        found: builtins.list[str] = []
        with self._errors(prefix, "list"):
            try:
                with self._folder(folders) as fd:
                    _walk(fd, path, found)
            except (FileNotFoundError, NotADirectoryError):
                return []  # an absent folder holds nothing
        return sorted(found)

    def delete_prefix(self, prefix: str) -> int:
        path = check_key(prefix, prefix=True)
        removed = 0
        for key in self.list(prefix):
            *folders, name = key.split("/")
            with self._errors(key, "delete"):
                try:
                    with self._folder(folders) as fd:  # never through a link swapped in since the list
                        os.unlink(name, dir_fd=fd)  # the name itself: unlink never follows it
                    removed += 1
                except (FileNotFoundError, NotADirectoryError):
                    pass  # another caller removed it first
        self._remove_empty_folders(path.split("/") if path else [])
        return removed

    def _remove_empty_folders(self, folders: Sequence[str]) -> None:
        """Remove the folders under `folders` (and it) that are empty now, deepest first, through
        descriptors: a link in there is left where it is, never followed."""
        with contextlib.suppress(OSError, _NotOurs), self._folder(folders) as fd:
            _rmdir_empty(fd)
        if folders:
            *parent, name = folders
            with contextlib.suppress(OSError, _NotOurs), self._folder(parent) as fd:
                os.rmdir(name, dir_fd=fd)  # not empty: a put in flight, or a temporary file

    @contextlib.contextmanager
    def _folder(self, folders: Sequence[str], *, create: bool = False) -> Iterator[int]:
        """A descriptor of the folder `root/folders…`, each part opened from the one before without
        following a link (with `create`: made where missing)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, name in enumerate(folders):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, dir_fd=fd)
                sub = _open_at(fd, name, _DIR_FLAGS, "/".join(folders[: i + 1]), stat.S_ISDIR)
                os.close(fd)
                fd = sub
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _opened(self, key: str) -> Iterator[_StoreReader]:
        """The object's file, opened without following a link; its read errors are the store's."""
        *folders, name = check_key(key).split("/")
        with self._errors(key, "read"), self._folder(folders) as fd:
            # O_NONBLOCK: a FIFO put there must not hang the open; it is refused below
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            file_fd = _open_at(fd, name, flags, key, stat.S_ISREG, stat.S_ISDIR)
            mode = os.fstat(file_fd).st_mode
            if stat.S_ISDIR(mode):
                os.close(file_fd)
                raise IsADirectoryError(errno.EISDIR, "Is a directory", key)
            try:
                _check_kind(mode, key, stat.S_ISREG)
            except _NotOurs:
                os.close(file_fd)
                raise
        with os.fdopen(file_fd, "rb") as src:
            yield _StoreReader(src, lambda exc: self._failed(key, exc, "read"))

    def _put(self, key: str, write: Callable[[IO[bytes]], object]) -> None:
        *folders, name = check_key(key).split("/")
        for attempt in (1, 2):  # a second time if a delete_prefix removed the emptied folder meanwhile
            try:
                with self._errors(key, "write"), self._folder(folders, create=True) as fd:
                    return _write_at(fd, name, write)
            except CheckpointError as exc:
                if attempt == 2 or not isinstance(exc.__cause__, FileNotFoundError):
                    raise

    @contextlib.contextmanager
    def _errors(self, key: str, what: str) -> Iterator[None]:
        """The store's own OSErrors (and a link or a stranger found in it) become its errors."""
        try:
            yield
        except _NotOurs as exc:
            error = CheckpointTampered if what == "read" else CheckpointError
            raise error(
                f"checkpoint store {self.url}: {exc.where!r} (for {key!r}) is {exc.kind}, which no gateway "
                "writes: someone else who can write the store put it there, and it is not followed. Find "
                "who, then remove it"
            ) from None
        except CheckpointError:
            raise
        except OSError as exc:
            if what == "read" and isinstance(exc, (FileNotFoundError, NotADirectoryError)):
                raise self._missing(key) from exc
            raise self._failed(key, exc, what) from exc


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _NotOurs(Exception):
    """A symbolic link, a device, a FIFO or a socket where the store keeps only folders and files."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(where)
        self.where, self.kind = where, kind


def _check_kind(mode: int, where: str, *allowed: Callable[[int], bool]) -> None:
    if not any(test(mode) for test in allowed):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else f"not a file or a folder ({stat.filemode(mode)})"
        raise _NotOurs(where, kind)


def _open_at(folder: int, name: str, flags: int, where: str, *allowed: Callable[[int], bool]) -> int:
    """``os.open(name, flags, dir_fd=folder)`` with ``O_NOFOLLOW`` among `flags`; when it fails the way a
    link makes it fail (``ELOOP``, or ``ENOTDIR`` with ``O_DIRECTORY``), `_NotOurs` if it is one."""
    try:
        return os.open(name, flags, dir_fd=folder)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _check_kind(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode, where, *allowed)
        raise


def _walk(fd: int, path: str, found: list[str]) -> None:
    """Append the keys of the files under the folder `fd` (the key `path`) to `found`, refusing links."""
    with os.scandir(fd) as entries:
        names = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in entries]
    for name, mode in names:
        if name.startswith("."):
            continue  # a put's temporary file
        key = f"{path}/{name}" if path else name
        _check_kind(mode, key, stat.S_ISREG, stat.S_ISDIR)
        if stat.S_ISREG(mode):
            found.append(key)
            continue
        try:
            sub = _open_at(fd, name, _DIR_FLAGS, key, stat.S_ISDIR)  # a link swapped in since the scan
        except FileNotFoundError:
            continue  # removed meanwhile (a delete_prefix): it holds nothing
        try:
            _walk(sub, key, found)
        finally:
            os.close(sub)


def _rmdir_empty(fd: int) -> None:
    """Remove the empty folders under the folder `fd`, deepest first; links and files stay."""
    with os.scandir(fd) as entries:
        folders = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    for name in folders:
        with contextlib.suppress(OSError):
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                _rmdir_empty(sub)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=fd)  # not empty: a put in flight, or a temporary file


class _StoreReader:
    """A stored object's file whose read errors are the store's (`fail` builds them), so that a copy's
    errors on the caller's own destination stay `OSError`s."""

    def __init__(self, src: IO[bytes], fail: Callable[[OSError], CheckpointError]) -> None:
        self._src, self._fail = src, fail

    def read(self, size: int = -1) -> bytes:
        try:
            return self._src.read(size)
        except OSError as exc:
            raise self._fail(exc) from exc


def _write_at(folder: int, name: str, write: Callable[[IO[bytes]], object]) -> None:
    """`_write_atomic` for the file `name` of the folder `folder` (a descriptor): the temporary file made
    there without following anything, then renamed over `name` (a link there is replaced, not followed)."""
    tmp = f".{name}.{secrets.token_hex(6)}.part"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write `path` through a temporary file next to it, synced, then renamed over it; none left behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store_for(url: str, *, create_bucket: bool = False) -> CheckpointStore:
    """The store at `url`: ``/abs/path`` or ``file:///abs/path`` (a directory), or
    ``s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1`` (the endpoint defaults to
    ``AWS_ENDPOINT_URL``, else AWS itself).

    >>> store_for("file:///srv/ckpt").describe(), store_for("/srv/ckpt").url
    ('directory /srv/ckpt', 'file:///srv/ckpt')
    """
    usage = "use /abs/path, file:///abs/path or s3://bucket/prefix?endpoint=URL&region=NAME"
    shown = redacted(url)  # what messages show of it: never a password
    if url.startswith("/"):
        return LocalDirStore(Path(url))
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/") \
            and not parts.query:  # fmt: skip
        return LocalDirStore(Path(parts.path))
    if parts.scheme == "s3" and "@" in parts.netloc:
        raise SandboxArgumentError(
            f"checkpoint store URL {shown!r} carries a user name or password: give them as "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile) instead"
        )
    if parts.scheme == "s3" and parts.netloc and not parts.fragment:
        try:
            query = parse_qs(parts.query, strict_parsing=bool(parts.query))
        except ValueError:
            query = {"": []}
        if set(query) - {"endpoint", "region"} or any(len(v) != 1 for v in query.values()):
            raise SandboxArgumentError(
                f"checkpoint store URL {shown!r}: unknown or repeated query parameter; {usage}"
            )
        endpoint = query.get("endpoint", [os.environ.get("AWS_ENDPOINT_URL") or ""])[0] or None
        region = query.get("region", [""])[0] or None
        prefix = parts.path.strip("/")
        from sandbox.checkpoint_s3 import S3Store  # it holds this module's base class

        return S3Store(parts.netloc, prefix, endpoint, region, create_bucket=create_bucket)
    raise SandboxArgumentError(f"checkpoint store URL {shown!r} is not one this store can use: {usage}")


def redacted(url: str) -> str:
    """`url` (percent-decoded) with each ``user:password@``, its own or its endpoint's, shown as ``***@``.

    >>> redacted("s3://b/p?endpoint=http%3A%2F%2Fkey:secret%40minio:9000")
    's3://b/p?endpoint=http://***@minio:9000'
    """
    return re.sub(r"//[^/?#@&\s]*@", "//***@", unquote(url))
