"""A portable checkpoint's layer (`sandbox.docker_backend.portable`), packed and unpacked without Docker:
``opaque.json``'s paths are held to the layer as its tar members are (issue 31, finding 5b), and a sparse
file costs the store its data, not its apparent size. Runs as root (trusted.* extended attributes)."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest

from core.errors import RestoreError
from sandbox.docker_backend.portable import _OPAQUE, _pack_layer, _unpack_layer

MB = 1 << 20
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="a layer's opaque marks are trusted.* attributes: root only"
)


def _checkpoint(tmp_path: Path, opaque: list[str], *, link_to: Path | None = None) -> Path:
    """A checkpoint's fetched parts: a layer with the folder ``d`` (and a link ``out`` to `link_to`)."""
    local = tmp_path / "local"
    local.mkdir()
    with tarfile.open(local / "fs.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_dir("d"))
        if link_to is not None:
            link = tarfile.TarInfo("out")
            link.type, link.linkname = tarfile.SYMTYPE, str(link_to)
            tar.addfile(link)
    (local / "opaque.json").write_text(json.dumps(opaque))
    return local


def _dir(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder of the node's own, next to the layer."""
    folder = tmp_path / "victim"
    (folder / "inner").mkdir(parents=True)
    return folder


@pytest.mark.parametrize("form", ["../victim", "absolute", "out", "out/inner", "d/../../victim"])
def test_an_opaque_path_outside_the_layer_is_refused_and_marks_nothing(
    tmp_path: Path, victim: Path, form: str
) -> None:
    path = str(victim) if form == "absolute" else form
    local = _checkpoint(tmp_path, ["d", path], link_to=victim)  # "out": a link in the layer to the victim
    upper = tmp_path / "upper"
    upper.mkdir()
    with pytest.raises(RestoreError, match=f"checkpoint layer path {path!r} leaves the container's layer"):
        _unpack_layer(local, upper)
    for folder in (victim, victim / "inner"):
        assert os.listxattr(folder, follow_symlinks=False) == []


def test_an_opaque_path_in_the_layer_is_marked(tmp_path: Path) -> None:
    local = _checkpoint(tmp_path, ["d"])
    upper = tmp_path / "upper"
    upper.mkdir()
    _unpack_layer(local, upper)
    assert os.getxattr(upper / "d", _OPAQUE, follow_symlinks=False) == b"y"


def test_a_sparse_file_costs_the_store_its_data_not_its_apparent_size(tmp_path: Path) -> None:
    upper, staging, restored = tmp_path / "upper", tmp_path / "staging", tmp_path / "restored"
    for folder in (upper, staging, restored):
        folder.mkdir()
    with (upper / "empty").open("wb") as out:  # truncate -s 256M: no blocks at all
        out.truncate(256 * MB)
    with (upper / "holes").open("wb") as out:  # data, a hole, data, a hole at the end
        out.write(b"head" * 1024)
        out.seek(100 * MB)
        out.write(b"tail" * 1024)
        out.truncate(300 * MB)
    (upper / "plain").write_bytes(b"x" * 10_000)

    _pack_layer(upper, staging)
    assert (staging / "fs.tar").stat().st_size < 64 * 1024  # today: 556 MB of zeros
    _unpack_layer(staging, restored)

    empty, holes = restored / "empty", restored / "holes"
    assert (empty.stat().st_size, empty.stat().st_blocks) == (256 * MB, 0)
    assert holes.stat().st_size == 300 * MB and holes.stat().st_blocks * 512 < 1 * MB
    with holes.open("rb") as src:
        assert src.read(4096) == b"head" * 1024 and src.read(4096) == bytes(4096)
        src.seek(100 * MB)
        assert src.read(4097) == b"tail" * 1024 + b"\0"
        src.seek(300 * MB - 3)
        assert src.read() == bytes(3)
    assert (restored / "plain").read_bytes() == b"x" * 10_000
    assert sorted(os.listdir(restored)) == ["empty", "holes", "plain"]
