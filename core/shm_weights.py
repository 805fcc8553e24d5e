"""The shared-memory weight store: the format a weight owner writes and vLLM workers map.

One owner per host (per device) holds a model's weights in files under ``/dev/shm`` (tmpfs: memory,
not disk), independently of any worker. A launched vLLM worker (``--load-format belayer_shm``, the
loader in ``belayer_vllm``) maps those files instead of reading the checkpoint, so every worker and
shadow shares one copy. This module is the contract between the two sides, in plain Python (no torch,
no vLLM), so the engine pool can check an owner's health without importing either::

    <base>/current.<launch hash>.json    which owner holds the pool's current weights (`publish`):
                                         {"checkpoint", "version", "path"}; one per launch checkpoint
    <base>/<checkpoint hash>/            one owner's directory (`owner_dir`)
        owner.lock                       flock'ed (exclusive) by the live owner, for its lifetime
        owner.json                       {"pid", "ready", "layouts"}: written when the weights are in place
        <layout key>/                    one vLLM parameter layout (dtype, tensor-parallel rank, vLLM version)
            weights.bin                  every tensor, each at a page-aligned offset
            manifest.json                written last: {"key", "tensors": {name: {dtype, shape, offset, nbytes}}}
            loads/<pid>.json             what each worker's loader did (source owner|disk, seconds)

After a weight update the pool starts an owner for the new checkpoint (its directory named by
`weights_id`: the update's files, not just their headers, which an RL step leaves unchanged), and once it
is ready points ``current.<launch hash>.json`` at it; a worker launched after that maps the new weights
and says which version it mapped in its load report. A worker that was running during the update wrote
the new weights into its own (copy-on-write) pages; the pool then asks it (`REMAP`) to point those
weights at the new owner's, which hold the same bytes (`owner_holds`), and its private copy goes.

A worker maps ``weights.bin`` only while the owner holds its lock (`owner_alive`) and the manifest is
complete; otherwise it loads from disk as vLLM normally does. The files are written before the manifest,
and the manifest by rename, so a complete manifest means complete weights.

The base's name is predictable and ``/dev/shm`` is everyone's, so another user could make it first and
plant weights, or links that send the owner's writes elsewhere. Every directory of the store is made
0700 (`secure_dir`) and used only when it is a real directory of this user that no one else may write
(`check_dir`; `UnsafeStore` says what to do otherwise); files are opened without following links, and
new ones are created exclusively (``O_EXCL|O_NOFOLLOW``, `open_new`).

Example::

    >>> import tempfile
    >>> d = owner_dir(tempfile.mkdtemp(), "abc123")
    >>> owner_alive(d)
    False
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from core.errors import ConfigError

DEFAULT_BASE = "/dev/shm/belayer-weights"
LOCK = "owner.lock"
OWNER = "owner.json"
MANIFEST = "manifest.json"
WEIGHTS = "weights.bin"
LOADS = "loads"
POINTER = "current.{}.json"
ALIGN = 4096
"""Each tensor starts at a multiple of the page size: a worker maps each one on its own."""
WORKER_EXTENSION = "belayer_vllm.worker.SharedWeights"
"""The class ``--worker-extension-cls`` mixes into each worker of a ``belayer_shm`` engine: it adds `REMAP`."""
REMAP = "belayer_remap_weights"
"""The ``collective_rpc`` method (kwargs ``weights_path``) that brings a worker whose weights an update made
private back onto the current owner's pages (`owner_holds` decides whether it may)."""


class UnsafeStore(ConfigError, PermissionError):
    """A directory of the weight store that is a link, another user's, or writable by others: refused,
    since whoever controls it controls the weights the workers map. The message says what to do."""


def check_dir(path: str | os.PathLike[str]) -> None:
    """Raise `UnsafeStore` unless `path` is missing or a directory (not a link) of this user, that
    neither its group nor others may write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    fix = (
        f"remove it (rm -rf {os.fspath(path)!r}, as its owner or root) and start again, or give the weight "
        "owner a directory of your own (launch.weight_owner_dir)"
    )
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeStore(
            f"the weight store's {os.fspath(path)} is not a directory but a link or file; {fix}"
        )
    if st.st_uid != os.geteuid():
        raise UnsafeStore(
            f"the weight store's {os.fspath(path)} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}): another user may have made it to plant weights; {fix}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStore(
            f"the weight store's {os.fspath(path)} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"chmod 700 it, or {fix}"
        )


def secure_dir(path: str | os.PathLike[str]) -> Path:
    """Make `path` (mode 0700) unless it exists; return it once `check_dir` accepts it. Its parents are
    made as usual (``/dev/shm`` exists)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_dir(path)
    return path


def open_new(path: str | os.PathLike[str]) -> IO[bytes]:
    """A new file at `path`, for writing (mode 0600): created here, never an existing file or a link
    (``O_EXCL|O_NOFOLLOW``). A leftover of this process (same name: a crash, a reused pid) is removed
    first; the directory is checked, so no one else can have put it there."""
    check_dir(os.path.dirname(os.fspath(path)) or ".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "wb")


def open_existing(path: str | os.PathLike[str]) -> IO[bytes]:
    """`path` for reading, refusing a link (``O_NOFOLLOW``: `OSError`)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def checkpoint_hash(model_dir: str | os.PathLike[str]) -> str:
    """A fingerprint of a model directory's safetensors files: their names and headers (tensor names,
    dtypes, shapes, offsets), as vLLM's weight cache keys them, plus their sizes; no weight is read.
    Raises `FileNotFoundError` when the directory has none."""
    files = sorted(glob.glob(os.path.join(os.fspath(model_dir), "*.safetensors")), key=os.path.basename)
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files to share")
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            size = f.read(8)
            (length,) = struct.unpack("<Q", size)
            h.update(os.path.basename(path).encode())
            h.update(size + f.read(length))
            h.update(str(os.fstat(f.fileno()).st_size).encode())
    return h.hexdigest()[:24]


def weights_id(model_dir: str | os.PathLike[str]) -> str:
    """The owner directory's name for weights an update brought (`checkpoint_hash` and, because every
    step of a training run has the same headers, the files themselves: their real path, size, inode and
    modification time). Raises `FileNotFoundError` when the directory has no safetensors files."""
    h = hashlib.sha256(checkpoint_hash(model_dir).encode())
    for path in sorted(glob.glob(os.path.join(os.fspath(model_dir), "*.safetensors"))):
        st = os.stat(path)
        h.update(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0".encode())
    return "w" + h.hexdigest()[:23]


def owner_dir(base: str | os.PathLike[str], checkpoint: str) -> Path:
    """The directory of the owner of the checkpoint whose `checkpoint_hash` is `checkpoint`."""
    return Path(base) / checkpoint


def layout_name(key: Mapping[str, Any]) -> str:
    """The directory name of one parameter layout: a hash of its key (dtype, ranks, vLLM version…)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def owner_alive(directory: str | os.PathLike[str]) -> bool:
    """Whether a live process holds the owner's lock (a shared lock taken here fails while it does)."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def hold_lock(directory: str | os.PathLike[str]) -> int:
    """Take the owner's lock (exclusive, not waiting) and return its descriptor: held until the process
    exits. `BlockingIOError` when another live owner holds it; `UnsafeStore` when the store or the
    directory is not safe (`check_dir`). The lock file is kept across owners (a restarted owner reuses a
    complete layout), but never followed as a link."""
    secure_dir(Path(directory).parent)
    secure_dir(directory)
    flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.path.join(directory, LOCK), flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object written by `write_json`, or None when it is absent or not (yet) whole."""
    try:
        with open_existing(path) as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: str | os.PathLike[str], value: Mapping[str, Any]) -> None:
    """Write atomically (a temporary file renamed into place): a reader sees all of it or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open_new(tmp) as f:
        f.write(json.dumps(value, sort_keys=True).encode())
    os.replace(tmp, path)


def owner_ready(directory: str | os.PathLike[str], pid: int | None = None) -> bool:
    """The owner's weights are in place (its ``owner.json`` says ready), by process `pid` if given, and
    it is alive."""
    info = read_json(Path(directory) / OWNER)
    if not info or not info.get("ready") or (pid is not None and info.get("pid") != pid):
        return False
    return owner_alive(directory)


def publish(base: str | os.PathLike[str], launch: str, checkpoint: str, version: str, path: str) -> None:
    """Point the workers launched from the checkpoint whose `checkpoint_hash` is `launch` at the owner
    directory `checkpoint`, which holds the weights of `version` (read from `path`). Atomic: a loader
    sees the old pointer or the new one."""
    secure_dir(base)
    pointer = {"checkpoint": checkpoint, "version": version, "path": path}
    write_json(Path(base) / POINTER.format(launch), pointer)


def current(base: str | os.PathLike[str], launch: str) -> dict[str, str] | None:
    """The pointer `publish` wrote for `launch` (``checkpoint``, ``version``, ``path``), or None when
    there is none or it is not whole. It says where the weights are, not that their owner lives.

    >>> import tempfile
    >>> base = tempfile.mkdtemp()
    >>> publish(base, "abc", "wdef", "step-1", "/ckpt/1")
    >>> current(base, "abc")["version"], current(base, "other")
    ('step-1', None)
    """
    value = read_json(Path(base) / POINTER.format(launch))
    fields = ("checkpoint", "version", "path")
    if value is None or not all(isinstance(value.get(f), str) and value[f] for f in fields):
        return None
    if "/" in value["checkpoint"] or value["checkpoint"] in (".", ".."):
        return None  # a directory name under `base`, nothing else
    return {f: str(value[f]) for f in fields}


def owner_holds(pointer: Mapping[str, str] | None, path: str | os.PathLike[str]) -> bool:
    """Whether the owner a pointer (`current`) names holds exactly the weights at `path`: the pointer names
    that directory, and the owner's name is still what its files give: their `weights_id` (an update's
    owner; a file rewritten since then changes it) or `checkpoint_hash` (the launch weights' owner, named
    as workers launched from them look it up). False when there is no pointer or no safetensors there.

    >>> owner_holds(None, "/ckpt/1")
    False
    """
    if pointer is None or os.path.realpath(pointer["path"]) != os.path.realpath(path):
        return False
    try:
        return pointer["checkpoint"] in (weights_id(path), checkpoint_hash(path))
    except (OSError, struct.error):
        return False


def unpublish(base: str | os.PathLike[str], launch: str) -> None:
    """Remove `launch`'s pointer, and `base` itself when nothing else is left in it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path(base) / POINTER.format(launch))
    with contextlib.suppress(OSError):
        os.rmdir(base)


def find_load_report(base: str | os.PathLike[str], pids: list[int]) -> dict[str, Any] | None:
    """The load report of whichever of `pids` (a worker's processes) loaded a model, under any owner
    directory of `base`; None when none has one (a report goes with its owner's directory)."""
    for pid in pids:
        for path in glob.glob(os.path.join(os.fspath(base), "*", "*", LOADS, f"{pid}.json")):
            if (report := read_json(path)) is not None:
                return report
    return None


def mapped_memory(pid: int, prefix: str | os.PathLike[str]) -> dict[str, int]:
    """What process `pid` maps of the files under `prefix`, from ``/proc/<pid>/smaps``: ``rss`` and
    ``pss`` (its proportional share: a page mapped by N processes counts 1/N) in bytes, and ``mappings``.
    Zeros when the process is gone."""
    prefix = os.fspath(prefix).rstrip("/") + "/"
    out = {"rss": 0, "pss": 0, "mappings": 0}
    inside = False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(":"):  # a mapping's header line: "start-end perms offset dev inode path"
                fields = line.split(None, 5)
                inside = len(fields) == 6 and fields[5].strip().startswith(prefix)
                out["mappings"] += inside
            elif inside and head in ("Rss:", "Pss:"):
                out[head[:-1].lower()] += int(line.split()[1]) * 1024
    return out


def process_memory(pid: int) -> dict[str, int]:
    """A process's whole ``rss``, ``pss`` and ``uss`` (its private pages: what it alone costs) in bytes,
    and ``anon``: its anonymous pages, which no other process can share (a shared-memory page mapped by
    this process alone counts as private in ``uss``, but not here; a copy-on-write copy of one does), from
    ``/proc/<pid>/smaps_rollup``; zeros when it is gone."""
    out = {"rss": 0, "pss": 0, "uss": 0, "anon": 0}
    names = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss",
             "Anonymous:": "anon"}  # fmt: skip
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            head, *rest = line.split()
            if head in names and rest:
                out[names[head]] += int(rest[0]) * 1024
    return out


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (a launched worker: the reaper, the server, its helpers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.append(int(entry))
    return sorted(pids)


def load_reports(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """What each worker's loader recorded under an owner's directory, by worker pid."""
    reports = {}
    for path in glob.glob(os.path.join(os.fspath(directory), "*", LOADS, "*.json")):
        if (report := read_json(path)) is not None:
            reports[int(Path(path).stem)] = report
    return reports
