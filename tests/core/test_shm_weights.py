"""The weight store's directories and files against another local user (``core.shm_weights``).

``/dev/shm`` is everyone's and the store's name is predictable: a directory another user made (or can
write, or a link) is refused with what to do, and files are never written or read through links.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest

from core import shm_weights
from core.errors import ConfigError
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the store that a planted link points at."""
    path = tmp_path / "victim"
    path.write_text("untouched")
    return path


def test_the_store_and_each_owner_directory_are_made_0700(tmp_path: Path) -> None:
    base = tmp_path / "shm" / "belayer-weights"
    shm_weights.publish(base, "launch", "ckpt", "v1", "/models/m")
    fd = shm_weights.hold_lock(base / "ckpt")
    os.close(fd)
    assert (mode(base), mode(base / "ckpt"), mode(base / "ckpt" / shm_weights.LOCK)) == (0o700, 0o700, 0o600)
    assert os.lstat(base).st_uid == os.geteuid()
    assert mode(base / shm_weights.POINTER.format("launch")) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_store_another_user_made_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "belayer-weights"
    base.mkdir(mode=0o755)
    os.chown(base, NOBODY, NOBODY)
    for attempt in (
        lambda: shm_weights.publish(base, "launch", "ckpt", "v1", "/models/m"),
        lambda: shm_weights.hold_lock(base / "ckpt"),
    ):
        with pytest.raises(shm_weights.UnsafeStore, match=rf"belongs to uid {NOBODY}.*rm -rf '{base}'"):
            attempt()
    assert list(base.iterdir()) == []  # nothing was written into it


def test_a_store_others_may_write_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "belayer-weights"
    base.mkdir()
    base.chmod(0o777)
    with pytest.raises(shm_weights.UnsafeStore, match=r"writable by others \(mode 0777\); chmod 700 it"):
        shm_weights.hold_lock(base / "ckpt")
    (base / "ckpt").mkdir()
    base.chmod(0o700)
    (base / "ckpt").chmod(0o775)  # an owner directory, group-writable
    with pytest.raises(shm_weights.UnsafeStore, match="writable by others"):
        shm_weights.hold_lock(base / "ckpt")


def test_a_store_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    base = tmp_path / "belayer-weights"
    base.symlink_to(elsewhere)
    with pytest.raises(shm_weights.UnsafeStore, match="not a directory but a link"):
        shm_weights.publish(base, "launch", "ckpt", "v1", "/models/m")
    assert list(elsewhere.iterdir()) == []


def test_files_are_never_written_or_read_through_a_planted_link(tmp_path: Path, victim: Path) -> None:
    directory = tmp_path / "belayer-weights" / "ckpt"
    os.close(shm_weights.hold_lock(directory))
    # the temporary name of the next write is predictable: a link there must not redirect the write
    (directory / f".{shm_weights.OWNER}.{os.getpid()}.tmp").symlink_to(victim)
    shm_weights.write_json(directory / shm_weights.OWNER, {"pid": 1, "ready": True})
    assert victim.read_text() == "untouched"
    assert shm_weights.read_json(directory / shm_weights.OWNER) == {"pid": 1, "ready": True}

    (directory / "linked.json").symlink_to(victim)
    assert shm_weights.read_json(directory / "linked.json") is None  # not followed
    with pytest.raises(OSError):
        shm_weights.open_existing(directory / "linked.json")
    (directory / shm_weights.LOCK).unlink()
    (directory / shm_weights.LOCK).symlink_to(victim)
    with pytest.raises(OSError):  # the lock file, kept across owners, is never a link either
        shm_weights.hold_lock(directory)
    assert not shm_weights.owner_alive(directory)
    assert victim.read_text() == "untouched"


def test_open_new_creates_only_new_files(tmp_path: Path, victim: Path) -> None:
    directory = shm_weights.secure_dir(tmp_path / "store")
    with shm_weights.open_new(directory / "weights.tmp") as f:
        f.write(b"abc")
    assert mode(directory / "weights.tmp") == 0o600
    with shm_weights.open_new(directory / "weights.tmp") as f:  # a leftover of this process: replaced
        f.write(b"new")
    assert (directory / "weights.tmp").read_bytes() == b"new"
    (directory / "other.tmp").symlink_to(victim)
    with shm_weights.open_new(directory / "other.tmp") as f:  # the link is replaced, not followed
        f.write(b"mine")
    assert victim.read_text() == "untouched" and not (directory / "other.tmp").is_symlink()


async def test_the_pool_refuses_a_weight_owner_directory_it_cannot_trust(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    base = tmp_path / "belayer-weights"
    base.mkdir()
    base.chmod(0o777)
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=1, log_dir=str(tmp_path),
        launch=LaunchConfig(weight_owner=True, weight_owner_dir=str(base)),
    )  # fmt: skip
    async with httpx.AsyncClient() as http:
        with pytest.raises(ConfigError, match=r"weight store.s .* is writable by others"):
            build_pool(config, http)
