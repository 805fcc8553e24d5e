"""The checkpoint store (`sandbox.checkpoint_store`): one contract, run against a directory and against a
real S3 API (``moto_server`` on 127.0.0.1, started once for the session; dummy credentials, nothing leaves
the machine)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import CheckpointError, CheckpointMissing, SandboxArgumentError
from sandbox import checkpoint_store
from sandbox.checkpoint_s3 import S3Store
from sandbox.checkpoint_store import CheckpointStore, LocalDirStore, store_for

MB = 1 << 20


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param == "local":
        made: CheckpointStore = LocalDirStore(tmp_path / "store")
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        request.getfixturevalue("aws_env")
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        made = S3Store(bucket, "node-a", endpoint_url=endpoint, region="us-east-1", create_bucket=True)
    try:
        yield made
    finally:
        made.close()


def _file(path: Path, size: int, seed: bytes = b"x") -> str:
    """Write `size` pseudo-random bytes to `path`; return their SHA-256."""
    digest, block = hashlib.sha256(), hashlib.sha256(seed).digest() * (MB // 32)
    with path.open("wb") as out:
        for i in range(0, size, MB):
            piece = block[: min(MB, size - i)]
            out.write(piece)
            digest.update(piece)
    return digest.hexdigest()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the contract, on both stores
def test_bytes_round_trip(store: CheckpointStore) -> None:
    store.put_bytes("ckpt/a/meta.json", b'{"id": "a"}')
    store.put_bytes("ckpt/a/empty", b"")
    assert store.get_bytes("ckpt/a/meta.json") == b'{"id": "a"}'
    assert store.get_bytes("ckpt/a/empty") == b""


def test_a_multi_megabyte_file_round_trips(store: CheckpointStore, tmp_path: Path) -> None:
    source = tmp_path / "fs.tar"
    sha = _file(source, 20 * MB + 123)  # over boto3's multipart threshold (8 MiB)
    store.put_file("ckpt/a/fs.tar", source)
    assert source.exists() and _sha(source) == sha  # the caller's staging file stays as it was
    dest = tmp_path / "out" / "fs.tar"
    dest.parent.mkdir()
    store.get_file("ckpt/a/fs.tar", dest)
    assert _sha(dest) == sha
    assert [p.name for p in dest.parent.iterdir()] == ["fs.tar"]  # no temporary file left next to it


def test_exists_list_and_delete_prefix(store: CheckpointStore) -> None:
    for key in ("ckpt/a/meta.json", "ckpt/a/criu/core-1.img", "ckpt/ab/meta.json", "other/x"):
        store.put_bytes(key, key.encode())
    assert store.exists("ckpt/a/meta.json") and not store.exists("ckpt/a/nothing")
    assert store.list("ckpt/a") == store.list("ckpt/a/") == ["ckpt/a/criu/core-1.img", "ckpt/a/meta.json"]
    assert store.list("ckpt") == ["ckpt/a/criu/core-1.img", "ckpt/a/meta.json", "ckpt/ab/meta.json"]
    assert len(store.list()) == 4
    assert store.delete_prefix("ckpt/a") == 2  # a folder: ckpt/ab is not under it
    assert store.list() == ["ckpt/ab/meta.json", "other/x"]
    assert store.delete_prefix("ckpt/a") == 0
    assert store.delete_prefix("") == 2 and store.list() == []


def test_a_missing_object_says_where_and_what_to_do(store: CheckpointStore, tmp_path: Path) -> None:
    for read in (
        lambda: store.get_bytes("ckpt/gone/fs.tar"),
        lambda: store.get_file("ckpt/gone/fs.tar", tmp_path / "f"),
    ):
        with pytest.raises(CheckpointMissing) as caught:
            read()
        assert store.url in str(caught.value) and "'ckpt/gone/fs.tar'" in str(caught.value)
        assert "same checkpoint store URL" in str(caught.value)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "..", "a/./b", "a/", "a\\b", "a/.hidden"])
def test_bad_keys_are_refused(store: CheckpointStore, key: str, tmp_path: Path) -> None:
    with pytest.raises(SandboxArgumentError, match="bad checkpoint store key"):
        store.put_bytes(key, b"x")
    with pytest.raises(SandboxArgumentError):
        store.get_bytes(key)
    with pytest.raises(SandboxArgumentError):
        store.exists(key)
    if key not in ("", "a/"):  # "" is the whole store, "a/" the folder a
        with pytest.raises(SandboxArgumentError):
            store.delete_prefix(key)


def test_a_reader_sees_the_old_or_the_new_object_whole(store: CheckpointStore, tmp_path: Path) -> None:
    versions = {tmp_path / "old": b"", tmp_path / "new": b""}
    for i, path in enumerate(versions):
        _file(path, (2 + 7 * i) * MB, seed=path.name.encode())  # 9 MiB: a multipart upload
        versions[path] = path.read_bytes()
    store.put_file("ckpt/a/fs.tar", tmp_path / "old")
    done, seen, errors = threading.Event(), set(), []

    def read() -> None:
        try:
            while not done.is_set():
                seen.add(hashlib.sha256(store.get_bytes("ckpt/a/fs.tar")).hexdigest())
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(6):
            for path in versions:
                store.put_file("ckpt/a/fs.tar", path)
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not errors
    assert seen <= {hashlib.sha256(data).hexdigest() for data in versions.values()} and seen


# --------------------------------------------------------------------------- one store's own parts
def test_a_failed_local_put_leaves_the_old_object_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalDirStore(tmp_path / "store")
    store.put_bytes("ckpt/a/fs.tar", b"old")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_store.os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match=r"cannot write 'ckpt/a/fs.tar'.*No space left"):
        store.put_bytes("ckpt/a/fs.tar", b"new")
    assert os.listdir(tmp_path / "store" / "ckpt" / "a") == ["fs.tar"]
    assert store.get_bytes("ckpt/a/fs.tar") == b"old"


def test_an_unreadable_local_object_is_a_checkpoint_error(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    (tmp_path / "ckpt").mkdir()  # a folder where the key's file should be
    with pytest.raises(CheckpointError, match=r"cannot read 'ckpt'.*IsADirectoryError"):
        store.get_bytes("ckpt")


def test_a_missing_bucket_is_named(moto_endpoint: str, aws_env: None) -> None:
    store = S3Store("no-such-bucket", endpoint_url=moto_endpoint, region="us-east-1")
    with pytest.raises(CheckpointError, match=r"bucket 'no-such-bucket' does not exist.*create_bucket=True"):
        store.put_bytes("a", b"x")


def test_importing_the_module_does_not_import_boto3() -> None:
    code = "import sys, sandbox.checkpoint_store as m; m.store_for('/tmp/x'); print('boto3' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- URLs
def test_store_for_parses_each_url_form(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    local = store_for("/srv/ckpt")
    assert isinstance(local, LocalDirStore) and local.root == Path("/srv/ckpt")
    assert (
        store_for("file:///srv/ckpt").url == store_for("file://localhost/srv/ckpt/").url == "file:///srv/ckpt"
    )
    s3 = store_for("s3://bucket/a/b/?endpoint=http://127.0.0.1:9000&region=eu-west-1")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.endpoint_url, s3.region) == (
        "bucket",
        "a/b",
        "http://127.0.0.1:9000",
        "eu-west-1",
    )
    assert s3.url == "s3://bucket/a/b?endpoint=http://127.0.0.1:9000&region=eu-west-1"
    again = store_for(s3.url)
    assert isinstance(again, S3Store) and again.url == s3.url
    bare = store_for("s3://bucket")
    assert isinstance(bare, S3Store) and (bare.prefix, bare.endpoint_url, bare.region) == ("", None, None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9001")
    from_env = store_for("s3://bucket/p")
    assert isinstance(from_env, S3Store) and from_env.endpoint_url == "http://127.0.0.1:9001"


@pytest.mark.parametrize(
    "url",
    ["relative/dir", "file://host/srv", "file:relative", "file:///srv?x=1", "s3://", "s3:///prefix",
     "s3://b/p?endpoint=a&endpoint=b", "s3://b/p?color=red", "s3://b/a/../c", "gs://b/p", ""],
)  # fmt: skip
def test_store_for_refuses_bad_urls_in_one_line(url: str, aws_env: None) -> None:
    with pytest.raises(SandboxArgumentError) as caught:
        store_for(url)
    assert "\n" not in str(caught.value)
