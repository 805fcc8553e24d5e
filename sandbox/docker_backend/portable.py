"""Portable checkpoints: a checkpoint that any node's Docker engine can restore, kept in a
`CheckpointStore` (a shared directory, or S3) instead of this engine's images.

A checkpoint is taken while the container is paused, so its two halves match:

- ``fs.tar``: the container's writable layer as overlayfs keeps it (its ``UpperDir``: added and changed
  files, deletions as 0/0 character devices), plus ``opaque.json``, the directories overlayfs marks
  opaque (a directory deleted and made again hides everything the image had there);
- ``criu.tar``: the CRIU dump of the processes (`Checkpoints._dump_processes`).

Both, with ``meta.json`` (the `Checkpoint` record), go under ``ckpt/<id>/`` in the store once the
container runs again. Restore, on this engine or any other with the sandbox's image, creates a
container from the *image* (never from a snapshot image, so a chain of restores never stacks layers),
unpacks ``fs.tar`` into its new writable layer, stages the dump and starts it from the dump.

Whoever else can write the store is not trusted (`sandbox.checkpoint_auth`): each part's SHA-256 is
in the record, which the gateway signs (with a `CheckpointKey`, here or in the cluster backend), and a
restore checks the MAC and then every part it fetched before it unpacks or starts anything. Unpacking
keeps every tar member and every ``opaque.json`` path inside the new container's layer (one check,
`_inside`). A sparse file is written with its holes (GNU sparse 1.0 members, which `tarfile` reads
back as holes), so a file of 256 MB apparent size and no blocks costs the store a few hundred bytes.

So nothing of a checkpoint stays on the node that took it: a lost node loses no checkpoint. It needs
the overlay2 storage driver (the writable layer is read and written as a directory) and this host's
access to Docker's data-root, as the dump staging already does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

from core.errors import CheckpointError, CheckpointTampered, RestoreError, SandboxNotFound
from sandbox.backend import Checkpoint, Sandbox
from sandbox.checkpoint_auth import CheckpointKey, check_parts, file_digest
from sandbox.checkpoint_store import CheckpointStore
from sandbox.docker_backend.checkpoints import (
    _CRIU_NAME,
    Checkpoints,
    checkpoint_from_json,
    checkpoint_to_json,
)
from sandbox.docker_backend.containers import Containers
from sandbox.docker_backend.engine import DockerEngine, docker_errors
from sandbox.docker_backend.images import Images

_OPAQUE = "trusted.overlay.opaque"
PARTS = ("fs.tar", "opaque.json", "criu.tar")
"""What a restore fetches of a checkpoint: each one's digest is in its record (`Checkpoint.digests`)."""
FILES = (*PARTS, "meta.json")
"""What one checkpoint keeps in the store, under ``ckpt/<id>/`` (meta.json last: it marks it whole)."""
_MAX_SPARSE_STORED = 0o77777777777
"""A sparse member's stored bytes must fit the tar header's size field: a PAX ``size`` record would move
where `tarfile` reads the next member from. Past it (8 GiB of data), the file is written whole."""


def checkpoint_key(checkpoint_id: str, name: str = "") -> str:
    return f"ckpt/{checkpoint_id}/{name}"


class PortableCheckpoints(Checkpoints):
    """Checkpoints in `store`, restorable by any engine that has the sandbox's image (see above). With
    `key`, each one is signed when taken and checked before it is restored or loaded; without one (a
    cluster node's backend: the gateway signs and checks), its parts are still checked against its
    record's digests."""

    def __init__(
        self, engine: DockerEngine, containers: Containers, images: Images, store: CheckpointStore,
        key: CheckpointKey | None = None,
    ) -> None:  # fmt: skip
        super().__init__(engine, containers, images)
        self.store = store
        self._key = key

    def take(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        spec = self._engine.spec(sandbox_id)
        ckpt_id = uuid.uuid4().hex[:16]
        staging = self._config.checkpoint_dir / f"stage-{ckpt_id}"
        staging.mkdir(parents=True, exist_ok=False)
        try:
            with self._engine.lock(sandbox_id), docker_errors(CheckpointError):
                info = self._api.inspect_container(sandbox_id)
                with self._engine.paused(sandbox_id):
                    started = time.monotonic()
                    _pack_layer(_upper_dir(info), staging)
                    fs_done = time.monotonic()
                    self._dump_processes(info, staging)
                    dumped = time.monotonic()
            with tarfile.open(staging / "criu.tar", "w") as tar:
                tar.add(staging / _CRIU_NAME, arcname=".")
            ckpt = Checkpoint(
                id=ckpt_id, sandbox_id=sandbox_id, label=label, spec=spec, image=spec.image,
                location=f"{self.store.url.rstrip('/')}/{checkpoint_key(ckpt_id)}", created_at=time.time(),
                fs_seconds=fs_done - started, process_seconds=dumped - fs_done,
                env=tuple(info["Config"].get("Env") or ()),
                dump_bytes=(staging / "criu.tar").stat().st_size + (staging / "fs.tar").stat().st_size,
                digests=tuple((name, file_digest(staging / name)) for name in PARTS),
            )  # fmt: skip
            if self._key is not None:
                ckpt = self._key.sign(ckpt)
            (staging / "meta.json").write_text(checkpoint_to_json(ckpt))
            for name in FILES:
                self.store.put_file(checkpoint_key(ckpt_id, name), staging / name)
        except BaseException:
            with contextlib.suppress(Exception):
                self.store.delete_prefix(checkpoint_key(ckpt_id))
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return ckpt

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        if self._key is not None:
            self._key.verify(checkpoint)  # the record first: its digests are what the parts are held to
        if not self._images.has(checkpoint.spec.image):
            raise RestoreError(
                f"checkpoint {checkpoint.id}: image {checkpoint.spec.image} is not on this node's engine; "
                "build it there first (sandbox images are built per node)"
            )
        with tempfile.TemporaryDirectory(dir=self._config.checkpoint_dir, prefix="restore-") as tmp:
            local = Path(tmp)
            for name_in_store in PARTS:
                self.store.get_file(checkpoint_key(checkpoint.id, name_in_store), local / name_in_store)
            check_parts(checkpoint, local)  # before anything is unpacked or started

            def stage(created: str, dest: Path) -> None:  # the layer into its writable layer, then the dump
                _unpack_layer(local, _upper_dir(self._api.inspect_container(created)))
                dest.mkdir(parents=True)
                with tarfile.open(local / "criu.tar") as tar:
                    tar.extractall(dest, filter="data")

            spec = checkpoint.spec
            return self.start_from_dump(spec, spec.image, list(checkpoint.env), stage)

    def delete(self, checkpoint: Checkpoint) -> None:
        self.store.delete_prefix(checkpoint_key(checkpoint.id))

    def exists(self, checkpoint: Checkpoint) -> bool:
        return self.store.exists(checkpoint_key(checkpoint.id, "meta.json"))

    def load(self, checkpoint_id: str) -> Checkpoint:
        key = checkpoint_key(checkpoint_id, "meta.json")
        if not self.store.exists(key):
            raise SandboxNotFound(f"no checkpoint {checkpoint_id} in {self.store.url}")
        ckpt = checkpoint_from_json(self.store.get_bytes(key).decode())
        if ckpt.id != checkpoint_id:
            raise CheckpointTampered(f"{self.store.url}: {key} holds the record of checkpoint {ckpt.id}")
        if self._key is not None:
            self._key.verify(ckpt)
        return ckpt

    def drop_orphan_snapshot(self, image: str) -> None:
        """Nothing to drop: a portable checkpoint makes no snapshot image."""


def _upper_dir(info: dict[str, Any]) -> Path:
    driver = info.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if driver.get("Name") != "overlay2" or not upper:
        raise CheckpointError(
            f"portable checkpoints need the overlay2 storage driver; this engine uses {driver.get('Name')!r}"
        )
    return Path(upper)


def _pack_layer(upper: Path, staging: Path) -> None:
    """``fs.tar`` (the writable layer, whiteouts as they are, sparse files with their holes) and
    ``opaque.json`` into `staging`."""
    opaque = []
    with tarfile.open(staging / "fs.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(upper):
            for name in sorted(dirs):
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    if os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y":
                        opaque.append(os.path.relpath(path, upper))
            for name in [*sorted(dirs), *sorted(files)]:
                path = os.path.join(root, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, upper))
                if not info.isreg():
                    tar.addfile(info)
                    continue
                with open(path, "rb") as src:
                    _add_regular(tar, info, src)
    (staging / "opaque.json").write_text(json.dumps(opaque))


def _add_regular(tar: tarfile.TarFile, info: tarfile.TarInfo, src: IO[bytes]) -> None:
    """Add a regular file; one with holes as a GNU sparse 1.0 member: a map of its data (``count``, then
    ``offset`` and ``size`` of each piece, one number a line, padded to a block) before the pieces
    themselves, the real name and size in PAX records. `tarfile` writes no sparse members, but reads
    them back with the holes left as holes."""
    pieces = _data_pieces(src.fileno(), info.size)
    stored = sum(size for _, size in pieces) if pieces is not None else 0
    if pieces is None or stored >= _MAX_SPARSE_STORED:
        src.seek(0)
        tar.addfile(info, src)
        return
    lines = [str(len(pieces)), *(str(n) for piece in pieces for n in piece)]
    table = ("\n".join(lines) + "\n").encode()
    table += b"\0" * (-len(table) % tarfile.BLOCKSIZE)
    info.pax_headers = {
        "GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": info.name,
        "GNU.sparse.realsize": str(info.size),
    }  # fmt: skip
    info.size = len(table) + stored
    tar.addfile(info, _SparseReader(table, src.fileno(), pieces))


def _data_pieces(fd: int, size: int) -> list[tuple[int, int]] | None:
    """Where a file's data lies (offset, length), its end as a last empty piece when it ends in a hole;
    None when it has no holes worth skipping (all its bytes allocated, or the filesystem cannot say)."""
    if os.fstat(fd).st_blocks * 512 >= size:
        return None
    pieces: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: nothing but a hole from `offset` on
                return None
            break
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        pieces.append((start, end - start))
        offset = end
    if sum(length for _, length in pieces) == size:
        return None
    if not pieces or sum(pieces[-1]) < size:
        pieces.append((size, 0))
    return pieces


class _SparseReader:
    """What a sparse member stores: the map, then each piece of data, read at its offset."""

    def __init__(self, table: bytes, fd: int, pieces: list[tuple[int, int]]) -> None:
        self._table, self._fd = table, fd
        self._pieces = [piece for piece in pieces if piece[1]]

    def read(self, size: int = -1, /) -> bytes:
        size = size if size >= 0 else len(self._table) + sum(length for _, length in self._pieces)
        out = bytearray()
        while len(out) < size:
            if self._table:
                take = self._table[: size - len(out)]
                out += take
                self._table = self._table[len(take) :]
                continue
            if not self._pieces:
                break
            offset, length = self._pieces[0]
            chunk = os.pread(self._fd, min(size - len(out), length, 1 << 20), offset)
            if not chunk:
                raise CheckpointError("a sparse file shrank while its checkpoint was taken")
            out += chunk
            self._pieces[0] = (offset + len(chunk), length - len(chunk))
            if self._pieces[0][1] == 0:
                self._pieces.pop(0)
        return bytes(out)


def _inside(root: Path, name: str, *, link: bool = False) -> Path:
    """Where the layer path `name` lands in the layer `root` (through what is unpacked there already: a
    link there is followed, except, with `link`, the last part, which a symbolic link member replaces);
    `RestoreError` if that is outside `root` (``..``, an absolute path, a link that points out).

    The one check of both the tar's members and ``opaque.json``'s paths: the tar could come from a store
    that someone else writes, and neither may reach the node's own files."""
    last = Path(name).name
    target = (root / name).parent.resolve() / last if link else (root / name).resolve()
    if root not in target.parents or (link and last in ("", ".", "..")):
        raise RestoreError(f"checkpoint layer path {name!r} leaves the container's layer")
    return target


def _unpack_layer(local: Path, upper: Path) -> None:
    """Unpack ``fs.tar`` into a new container's empty writable layer, devices (whiteouts) and owners as
    they were; then mark the opaque directories. A member or an opaque path may not leave `upper`
    (`_inside`), nor go through a link that points out of it."""
    root = upper.resolve()
    with tarfile.open(local / "fs.tar") as tar:
        for member in tar:
            _inside(root, member.name, link=member.issym())
            if member.islnk():
                _inside(root, member.linkname)
            tar.extract(member, root, numeric_owner=True, filter="fully_trusted")
    opaque = json.loads((local / "opaque.json").read_text())
    if not isinstance(opaque, list) or not all(isinstance(path, str) for path in opaque):
        raise RestoreError("checkpoint layer: opaque.json is not a list of paths")
    for path in opaque:
        target = _inside(root, path)
        if not target.is_dir():
            raise RestoreError(f"checkpoint layer: opaque path {path!r} is not a directory of the layer")
        os.setxattr(target, _OPAQUE, b"y", follow_symlinks=False)
