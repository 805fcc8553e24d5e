"""Where sandbox checkpoints are written so that every node of a cluster can read them: when a node is lost,
its sandboxes are restored on another node from their newest checkpoint.

One ABC, `CheckpointStore`, over objects named by *keys*: relative, slash-separated paths such as
``ckpt/<id>/fs.tar`` (no ``..``, no leading ``/``, no empty part, no part that starts with ``.``). Two
implementations: `LocalDirStore` (a directory; on a cluster, a shared filesystem mounted on every node) and
`S3Store` (any S3-compatible service, through boto3, imported only when one is built). `store_for` builds
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
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, quote, urlsplit

from core.errors import CheckpointError, CheckpointMissing, CheckpointUnreadable, SandboxArgumentError

_CHUNK = 1 << 20
_S3_MISSING = {"404", "NoSuchKey", "NotFound"}


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
    directory, flushed to disk, then renamed over the key (``os.replace``)."""

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
        with self._reading(key), self._path(key).open("rb") as src:
            _write_atomic(dest, lambda out: shutil.copyfileobj(src, out, _CHUNK))

    def get_bytes(self, key: str) -> bytes:
        with self._reading(key):
            return self._path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):  # an absent folder holds nothing; others fail
                raise self._failed(prefix, exc, "list") from exc

        walk = os.walk(self.root / check_key(prefix, prefix=True), onerror=fail)
        found = [Path(d, n) for d, _, names in walk for n in names if not n.startswith(".")]  # no temporaries
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def delete_prefix(self, prefix: str) -> int:
        removed = 0
        for key in self.list(prefix):
            try:
                self._path(key).unlink()
                removed += 1
            except FileNotFoundError:
                pass  # another caller removed it first
            except OSError as exc:
                raise self._failed(key, exc, "delete") from exc
        for folder, _, _ in os.walk(self.root / check_key(prefix, prefix=True), topdown=False):
            if Path(folder) != self.root:
                with contextlib.suppress(OSError):  # not empty: a put in flight, or a temporary file
                    os.rmdir(folder)
        return removed

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _put(self, key: str, write: Callable[[IO[bytes]], object]) -> None:
        path = self._path(key)
        for attempt in (1, 2):  # a second time if a delete_prefix removed the emptied folder meanwhile
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                return _write_atomic(path, write)
            except FileNotFoundError as exc:
                if attempt == 2:
                    raise self._failed(key, exc, "write") from exc
            except OSError as exc:
                raise self._failed(key, exc, "write") from exc

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if exc.filename is not None and Path(exc.filename) != self._path(key):
                raise  # the caller's own destination
            if isinstance(exc, FileNotFoundError):
                raise self._missing(key) from exc
            raise self._failed(key, exc, "read") from exc


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


class S3Store(CheckpointStore):
    """A bucket (and a key prefix in it) of any S3-compatible service. Credentials come from boto3's usual
    sources (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance role). Big objects go
    in multipart uploads, which S3 shows only once complete. With `create_bucket`, a missing bucket is
    created; otherwise using one raises an error that says so."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None,
        *, create_bucket: bool = False,
    ) -> None:  # fmt: skip
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, check_key(prefix, prefix=True)
        self.endpoint_url, self.region = endpoint_url, region
        # Another service than AWS: path-style addresses (no DNS per bucket), and checksums only where the
        # API requires them (boto3 >= 1.36 adds them to every request; many S3-compatible services refuse).
        extra: dict[str, Any] = {}
        if endpoint_url:
            extra = {"s3": {"addressing_style": "path"}, "request_checksum_calculation": "when_required",
                     "response_checksum_validation": "when_required"}  # fmt: skip
        config = Config(retries={"mode": "standard", "max_attempts": 5}, **extra)
        session = boto3.session.Session()  # its own: boto3's default session is not thread-safe
        self._client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        if create_bucket:
            self._create_bucket()

    @property
    def url(self) -> str:
        query = "&".join(
            f"{name}={quote(value, safe=':/')}"
            for name, value in (("endpoint", self.endpoint_url), ("region", self.region)) if value
        )  # fmt: skip
        return f"s3://{self.bucket}/{self.prefix}" + (f"?{query}" if query else "")

    def describe(self) -> str:
        where = self.endpoint_url or "AWS"
        return f"S3 bucket {self.bucket!r}, prefix {self.prefix!r}, at {where} (region {self.region or 'default'})"

    def put_file(self, key: str, source: Path) -> None:
        source.stat()  # the caller's own file: its OSError, not the store's
        with self._errors(key, reading=False):
            self._client.upload_file(str(source), self.bucket, self._name(key))

    def get_file(self, key: str, dest: Path) -> None:
        # s3transfer writes a temporary file next to `dest` and renames it when complete.
        with self._errors(key, reading=True):
            self._client.download_file(self.bucket, self._name(key), str(dest))

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(key, reading=False):
            self._client.put_object(Bucket=self.bucket, Key=self._name(key), Body=data)

    def get_bytes(self, key: str) -> bytes:
        with self._errors(key, reading=True):
            return bytes(self._client.get_object(Bucket=self.bucket, Key=self._name(key))["Body"].read())

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key, reading=True):
                self._client.head_object(Bucket=self.bucket, Key=self._name(key))
        except CheckpointMissing:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        folder = self._folder(prefix)
        with self._errors(prefix, reading=False, what="list"):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder)
            names = [obj["Key"] for page in pages for obj in page.get("Contents", ())]
        start = len(self._folder(""))
        return sorted(name[start:] for name in names)

    def delete_prefix(self, prefix: str) -> int:
        keys, removed = self.list(prefix), 0
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1,000 keys
            batch = [{"Key": self._name(k)} for k in keys[i : i + 1000]]
            with self._errors(prefix, reading=False, what="delete"):
                answer = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise CheckpointError(f"checkpoint store {self.url}: cannot delete {first.get('Key')!r}"
                                      f" ({first.get('Code')}: {first.get('Message')})")  # fmt: skip
            removed += len(batch)
        return removed

    def close(self) -> None:
        self._client.close()

    def _name(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, check_key(key)) if p)

    def _folder(self, prefix: str) -> str:
        name = "/".join(p for p in (self.prefix, check_key(prefix, prefix=True)) if p)
        return name + "/" if name else ""

    def _create_bucket(self) -> None:
        with self._errors(self.bucket, reading=False, what="create bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except self._client.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _S3_MISSING | {"NoSuchBucket"}:
                    raise
            where = {} if self.region in (None, "us-east-1") else {"LocationConstraint": self.region}
            with contextlib.suppress(self._client.exceptions.BucketAlreadyOwnedByYou):
                self._client.create_bucket(
                    Bucket=self.bucket, **({"CreateBucketConfiguration": where} if where else {})
                )

    @contextlib.contextmanager
    def _errors(self, key: str, *, reading: bool, what: str = "write") -> Iterator[None]:
        """The one place where boto3's errors become the sandbox's."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if reading and code in _S3_MISSING:
                raise self._missing(key) from exc
            if code == "NoSuchBucket":
                raise (CheckpointUnreadable if reading else CheckpointError)(
                    f"checkpoint store {self.url}: bucket {self.bucket!r} does not exist: create it, or "
                    "build the store with create_bucket=True"
                ) from exc
            raise self._failed(key, exc, "read" if reading else what) from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise self._failed(key, exc, "read" if reading else what) from exc


def store_for(url: str, *, create_bucket: bool = False) -> CheckpointStore:
    """The store at `url`: ``/abs/path`` or ``file:///abs/path`` (a directory), or
    ``s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1`` (the endpoint defaults to
    ``AWS_ENDPOINT_URL``, else AWS itself).

    >>> store_for("file:///srv/ckpt").describe(), store_for("/srv/ckpt").url
    ('directory /srv/ckpt', 'file:///srv/ckpt')
    """
    usage = "use /abs/path, file:///abs/path or s3://bucket/prefix?endpoint=URL&region=NAME"
    if url.startswith("/"):
        return LocalDirStore(Path(url))
    parts = urlsplit(url)
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/") \
            and not parts.query:  # fmt: skip
        return LocalDirStore(Path(parts.path))
    if parts.scheme == "s3" and parts.netloc and not parts.fragment:
        try:
            query = parse_qs(parts.query, strict_parsing=bool(parts.query))
        except ValueError:
            query = {"": []}
        if set(query) - {"endpoint", "region"} or any(len(v) != 1 for v in query.values()):
            raise SandboxArgumentError(
                f"checkpoint store URL {url!r}: unknown or repeated query parameter; {usage}"
            )
        endpoint = query.get("endpoint", [os.environ.get("AWS_ENDPOINT_URL") or ""])[0] or None
        region = query.get("region", [""])[0] or None
        prefix = parts.path.strip("/")
        return S3Store(parts.netloc, prefix, endpoint, region, create_bucket=create_bucket)
    raise SandboxArgumentError(f"checkpoint store URL {url!r} is not one this store can use: {usage}")
