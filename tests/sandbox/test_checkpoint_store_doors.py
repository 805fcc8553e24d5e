"""The checkpoint store is shared, so its other writers are not trusted (issue 31, finding 5a, and the
S3 endpoint with a password): a symbolic link swapped into a `LocalDirStore` is refused, never followed
(an eviction would otherwise delete, a put write, a get read wherever it points, as root), and a URL
whose endpoint carries a user name or password is refused without echoing it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from core.errors import CheckpointError, CheckpointTampered, SandboxArgumentError
from sandbox.checkpoint_s3 import S3Store
from sandbox.checkpoint_store import LocalDirStore, store_for


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder of the node's own, which a writer of the store points a link at."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "passwd").write_text("root:x:0:0")
    (folder / "meta.json").write_text("{}")
    return folder


def _untouched(victim: Path) -> None:
    assert sorted(os.listdir(victim)) == ["meta.json", "passwd"]
    assert (victim / "passwd").read_text() == "root:x:0:0" and (victim / "meta.json").read_text() == "{}"


def test_a_link_swapped_in_for_a_checkpoint_folder_is_refused_and_its_target_untouched(
    tmp_path: Path, victim: Path
) -> None:
    (tmp_path / "mounted").mkdir()
    os.symlink(tmp_path / "mounted", tmp_path / "store")  # the root may be a link: the operator's own
    store = LocalDirStore(tmp_path / "store")
    store.put_bytes("ckpt/abc/meta.json", b"{}")
    store.put_bytes("ckpt/other/meta.json", b"{}")
    shutil.rmtree(store.root / "ckpt" / "abc")
    os.symlink(victim, store.root / "ckpt" / "abc")  # what a writer of the shared directory can do

    refused: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: store.delete_prefix("ckpt/abc"), CheckpointError),  # an eviction
        (lambda: store.delete_prefix("ckpt"), CheckpointError),
        (lambda: store.put_bytes("ckpt/abc/passwd", b"owned"), CheckpointError),
        (lambda: store.get_bytes("ckpt/abc/passwd"), CheckpointTampered),
        (lambda: store.get_file("ckpt/abc/meta.json", tmp_path / "out"), CheckpointTampered),
        (lambda: store.list("ckpt"), CheckpointError),
    ]
    for call, error in refused:
        with pytest.raises(
            error, match=r"'ckpt/abc' \(for '.*'\) is a symbolic link, which no gateway writes"
        ):
            call()
        _untouched(victim)
    assert not (tmp_path / "out").exists()
    assert not store.exists("ckpt/abc/meta.json")  # not an object of the store: its target is not read
    assert store.get_bytes("ckpt/other/meta.json") == b"{}"  # through the root's link, as before
    assert store.delete_prefix("ckpt/other") == 1 and os.listdir(tmp_path / "mounted" / "ckpt") == ["abc"]


def test_a_link_swapped_in_for_a_stored_file_is_refused_and_its_target_untouched(
    tmp_path: Path, victim: Path
) -> None:
    store = LocalDirStore(tmp_path / "store")
    store.put_bytes("ckpt/abc/fs.tar", b"layer")
    store.put_bytes("ckpt/abc/meta.json", b"{}")
    os.unlink(store.root / "ckpt" / "abc" / "fs.tar")
    os.symlink(victim / "passwd", store.root / "ckpt" / "abc" / "fs.tar")

    with pytest.raises(
        CheckpointTampered, match=r"'ckpt/abc/fs.tar' \(for 'ckpt/abc/fs.tar'\) is a symbolic link"
    ):
        store.get_bytes("ckpt/abc/fs.tar")
    with pytest.raises(CheckpointTampered, match="is a symbolic link"):
        store.get_file("ckpt/abc/fs.tar", tmp_path / "fs.tar")
    assert not store.exists("ckpt/abc/fs.tar") and store.exists("ckpt/abc/meta.json")
    with pytest.raises(CheckpointError, match=r"'ckpt/abc/fs.tar' \(for 'ckpt/abc'\) is a symbolic link"):
        store.delete_prefix("ckpt/abc")  # an eviction
    _untouched(victim)
    assert store.root.joinpath("ckpt", "abc", "fs.tar").is_symlink()  # left for the operator to see
    store.put_bytes("ckpt/abc/fs.tar", b"new layer")  # a put replaces the link itself, never its target
    assert store.get_bytes("ckpt/abc/fs.tar") == b"new layer"
    _untouched(victim)
    assert store.delete_prefix("ckpt/abc") == 2 and store.list() == []


def test_a_fifo_in_the_store_is_refused_without_hanging_the_reader(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    store.put_bytes("ckpt/abc/meta.json", b"{}")
    os.mkfifo(store.root / "ckpt" / "abc" / "criu.tar")
    with pytest.raises(CheckpointTampered, match=r"'ckpt/abc/criu.tar' .* is not a file or a folder \(prw"):
        store.get_bytes("ckpt/abc/criu.tar")


# --------------------------------------------------------------------------- S3 URLs with a password
@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/p?endpoint=http://AKIAKEY:s3cr3t@127.0.0.1:9000",
        "s3://bucket/p?endpoint=http%3A%2F%2FAKIAKEY%3As3cr3t%40127.0.0.1%3A9000",
        "s3://AKIAKEY:s3cr3t@bucket/p",
    ],
)
def test_a_store_url_with_a_password_is_refused_without_echoing_it(url: str, aws_env: None) -> None:
    with pytest.raises(
        SandboxArgumentError, match=r"carries a user name or password.*AWS_ACCESS_KEY_ID"
    ) as caught:
        store_for(url)
    assert "s3cr3t" not in str(caught.value) and "AKIAKEY" not in str(caught.value)
    assert "***@" in str(caught.value)


def test_an_endpoint_with_a_password_from_the_environment_is_refused(
    aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://user:s3cr3t@minio:9000")
    with pytest.raises(SandboxArgumentError, match=r"endpoint 'http://\*\*\*@minio:9000' carries") as caught:
        store_for("s3://bucket/p")
    assert "s3cr3t" not in str(caught.value)
    with pytest.raises(SandboxArgumentError, match="carries a user name or password"):
        S3Store("bucket", endpoint_url="http://user:s3cr3t@minio:9000")


def test_other_refusals_do_not_echo_a_password_either(aws_env: None) -> None:
    with pytest.raises(SandboxArgumentError, match="unknown or repeated query parameter") as caught:
        store_for("s3://bucket/p?endpoint=http://user:s3cr3t@minio:9000&color=red")
    assert "s3cr3t" not in str(caught.value)
