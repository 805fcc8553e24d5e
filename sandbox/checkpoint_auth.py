"""Checkpoints that a writer of the checkpoint store cannot forge: a digest of each part and the gateway's
MAC over the record.

A portable checkpoint's parts (``fs.tar``, ``opaque.json``, ``criu.tar``) are unpacked as root on a node
and started as the sandbox's processes, with the credentials, capabilities and seccomp filters its CRIU
images name; anyone who can write the store (a shared directory, a bucket) could otherwise run code on
every node. So:

- the backend that takes a checkpoint records each part's SHA-256 in the `Checkpoint` (``digests``);
- the gateway signs the record (`CheckpointKey.sign`): an HMAC-SHA256, with a key only it holds, over
  what a restore uses of it (id, image, environment, the spec less its labels, the digests), kept in
  ``mac`` (the gateway's own record, the trajectory store's ``sandbox_checkpoint`` event, holds it, and
  the store's ``meta.json`` as well);
- a restore checks the MAC first (`CheckpointKey.verify`), then each part it fetched against its digest
  (`check_parts`), before anything is unpacked or started. A mismatch raises `CheckpointTampered`.

The key (`CheckpointKey.load`) is a file the operator gives (``sandbox.checkpoint_key_file``), else one
made at the first start under the gateway's ``checkpoint_dir`` (0600, 32 random bytes, hex). It has to
outlive the process: a restarted gateway restores the checkpoints it took before, with the same file. A
gateway that takes over another's sessions (a replica started with a dead one's ``--gateway-id`` on
another machine) needs that gateway's file; the error says so, naming both keys' ids.

What it does not stop: a store writer can still delete or truncate checkpoints (the restore fails: a
denial of service), and can read them (the record carries the session's URL, its capability).

Example::

    key = CheckpointKey.load(Path("/var/lib/belayer/checkpoints/checkpoint.key"))
    signed = key.sign(ckpt)          # ckpt.digests filled in by the backend that took it
    key.verify(signed)               # before the restore: CheckpointTampered if anything changed
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import replace
from pathlib import Path

from core.errors import CheckpointTampered, ConfigError
from sandbox.backend import Checkpoint

_SCHEME = "hmac-sha256"
_MIN_KEY_BYTES = 32
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """The SHA-256 (hex) of `path`'s bytes, read in pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while piece := src.read(_CHUNK):
            digest.update(piece)
    return digest.hexdigest()


def check_parts(ckpt: Checkpoint, folder: Path) -> None:
    """Raise `CheckpointTampered` unless every part the record names is in `folder` with its digest (and
    the record names some: a record without digests cannot be checked)."""
    if not ckpt.digests:
        raise CheckpointTampered(
            f"checkpoint {ckpt.id} records no digests of its parts (taken before checkpoints were "
            "authenticated): it cannot be told from one a writer of the store made, so it is not restored"
        )
    for name, want in ckpt.digests:
        got = file_digest(folder / name)
        if not hmac.compare_digest(got, want):
            raise CheckpointTampered(
                f"checkpoint {ckpt.id}: {name} in the store is not the one the gateway wrote (SHA-256 "
                f"{got[:16]}…, recorded {want[:16]}…): someone who can write the checkpoint store changed "
                "it; nothing was unpacked. Find who writes the store, then take a new checkpoint"
            )


class CheckpointKey:
    """The gateway's key for checkpoints' MACs. `key_id` (a digest of the key, not the key) tells two keys
    apart in messages."""

    def __init__(self, secret: bytes, source: str = "") -> None:
        if len(secret) < _MIN_KEY_BYTES:
            raise ConfigError(
                f"checkpoint key {source or '(given)'} has {len(secret)} bytes; it needs at least "
                f"{_MIN_KEY_BYTES}: make one with `openssl rand -hex 32 > FILE; chmod 600 FILE`"
            )
        self._secret = secret
        self.key_id = hashlib.sha256(b"belayer checkpoint key id\0" + secret).hexdigest()[:12]

    @classmethod
    def load(cls, path: Path) -> CheckpointKey:
        """The key in `path`, made there first (0600, under a 0700 folder if it makes one) when absent.
        A key file that others than its owner may read or write is refused: anyone who reads it can
        forge checkpoints."""
        if not path.is_absolute():
            raise ConfigError(f"checkpoint key file must be an absolute path: {str(path)!r}")
        with contextlib.suppress(FileExistsError):
            _create(path)
        try:
            info = path.stat()
            secret = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the checkpoint key file {path} ({exc.strerror})") from None
        if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077 or info.st_uid != os.geteuid():
            raise ConfigError(
                f"checkpoint key file {path} must be a file of this user's that no one else may read or "
                f"write (mode {stat.filemode(info.st_mode)}, owner {info.st_uid}): chmod 600 it"
            )
        return cls(secret, str(path))

    def sign(self, ckpt: Checkpoint) -> Checkpoint:
        """`ckpt` with its MAC."""
        return replace(ckpt, mac=f"{_SCHEME}:{self.key_id}:{self._mac(ckpt)}")

    def verify(self, ckpt: Checkpoint) -> None:
        """Raise `CheckpointTampered` unless `ckpt` carries this key's MAC over its record."""
        scheme, _, rest = ckpt.mac.partition(":")
        key_id, _, mac = rest.partition(":")
        if scheme != _SCHEME or not mac:
            raise CheckpointTampered(
                f"checkpoint {ckpt.id} carries no MAC (taken before checkpoints were signed, or by a backend "
                "without the gateway's key): it cannot be told from one a writer of the store made, so it "
                "is not restored"
            )
        if key_id != self.key_id:
            raise CheckpointTampered(
                f"checkpoint {ckpt.id} was signed with another key (id {key_id}; this gateway's is "
                f"{self.key_id}): give this gateway the key file of the gateway that took it "
                "(sandbox.checkpoint_key_file)"
            )
        if not hmac.compare_digest(mac, self._mac(ckpt)):
            raise CheckpointTampered(
                f"checkpoint {ckpt.id}: its record does not match the MAC the gateway signed it with (its "
                "image, environment, limits or part digests were changed): not restored"
            )

    def _mac(self, ckpt: Checkpoint) -> str:
        return hmac.new(self._secret, signed_bytes(ckpt), hashlib.sha256).hexdigest()


def signed_bytes(ckpt: Checkpoint) -> bytes:
    """What the MAC covers: all that a restore uses of the record. Not the spec's labels (a fork child
    restores its parent's checkpoint under its own labels; labels grant nothing), nor what only describes
    it (sandbox id, label, location, times, sizes). Defaults are left out of the spec, so a field added to
    `SandboxSpec` later does not change the bytes of a checkpoint taken before."""
    spec = ckpt.spec.model_dump(mode="json", exclude_defaults=True, exclude={"labels"})
    body = {
        "v": 1, "id": ckpt.id, "image": ckpt.image, "env": list(ckpt.env), "spec": spec,
        "digests": [list(pair) for pair in ckpt.digests],
    }  # fmt: skip
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _create(path: Path) -> None:
    """Write a new key to `path` whole or not at all: a temporary file, then a hard link (which fails
    when another process made the key first: both then read the same one)."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        raise FileExistsError(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, path)
    finally:
        os.unlink(tmp)
