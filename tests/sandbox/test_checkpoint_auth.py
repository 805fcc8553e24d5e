"""Checkpoints a writer of the store cannot forge (`sandbox.checkpoint_auth`, issue 31, finding 5c): the
gateway's key in a 0600 file that outlives a restart, its MAC over what a restore uses of a record, the
parts held to their digests; and the gateway's answer when one fails (503 ``checkpoint_tampered``)."""

from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from core.errors import CheckpointTampered, ConfigError
from gateway.http.errors import for_exception
from sandbox.backend import Checkpoint, SandboxSpec, checkpoint_from_record, checkpoint_record
from sandbox.backends import docker_config
from sandbox.checkpoint_auth import CheckpointKey, check_parts, file_digest
from sandbox.config import SandboxConfig

PARTS = ("fs.tar", "opaque.json", "criu.tar")


def _parts(folder: Path) -> tuple[tuple[str, str], ...]:
    folder.mkdir(exist_ok=True)
    for name in PARTS:
        (folder / name).write_bytes(f"the {name} the gateway wrote".encode())
    return tuple((name, file_digest(folder / name)) for name in PARTS)


def _checkpoint(digests: tuple[tuple[str, str], ...] = ()) -> Checkpoint:
    spec = SandboxSpec(image="belayer-sandbox-busybox", env={"A": "1"}, labels={"belayer.session": "s-1"})
    return Checkpoint(
        id="0123456789abcdef", sandbox_id="belayer-sbx-1", label="s-1/turn-2", spec=spec,
        image=spec.image, location="file:///srv/ckpt/ckpt/0123456789abcdef/", created_at=1.5,
        fs_seconds=0.25, process_seconds=0.125, env=("PATH=/bin", "A=1"), dump_bytes=10, digests=digests,
    )  # fmt: skip


# --------------------------------------------------------------------------- the key
def test_the_key_is_made_once_0600_and_read_back_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state" / "checkpoint.key"
    first = CheckpointKey.load(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n") and int(text, 16) >= 0  # 32 random bytes, hex
    again = CheckpointKey.load(path)  # a restarted gateway: the same file, the same key
    assert again.key_id == first.key_id and path.read_text() == text
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.key"]  # no temporary file left
    signed = first.sign(_checkpoint())
    again.verify(signed)


def test_the_gateway_keeps_its_key_where_it_stages_checkpoints_unless_told(tmp_path: Path) -> None:
    config = SandboxConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    assert docker_config(config).checkpoint_key_file == tmp_path / "ckpt" / "checkpoint.key"
    given = SandboxConfig(checkpoint_dir=str(tmp_path), checkpoint_key_file="/run/secrets/ckpt.key")
    assert docker_config(given).checkpoint_key_file == Path("/run/secrets/ckpt.key")


def test_a_key_file_others_may_read_or_a_short_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.key"
    path.write_text("ab" * 32)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=r"no one else may read or write \(mode -rw-r--r--.*chmod 600 it"):
        CheckpointKey.load(path)
    path.write_text("short")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="has 5 bytes; it needs at least 32: make one with `openssl rand"):
        CheckpointKey.load(path)
    with pytest.raises(ConfigError, match="must be an absolute path"):
        CheckpointKey.load(Path("relative.key"))


# --------------------------------------------------------------------------- the MAC
def test_a_signed_record_verifies_after_a_round_trip_through_the_gateways_record(tmp_path: Path) -> None:
    key = CheckpointKey(b"k" * 32)
    signed = key.sign(_checkpoint(_parts(tmp_path / "parts")))
    assert signed.mac.startswith(f"hmac-sha256:{key.key_id}:") and len(signed.mac.split(":")[2]) == 64
    stored = checkpoint_from_record(json.loads(json.dumps(checkpoint_record(signed))))  # the store's event
    assert stored == signed
    key.verify(stored)
    # a fork child restores its parent's checkpoint under its own labels: labels grant nothing
    key.verify(replace(signed, spec=signed.spec.model_copy(update={"labels": {"belayer.session": "s-2"}})))


@pytest.mark.parametrize(
    "change",
    [
        {"env": ("PATH=/bin", "A=1", "LD_PRELOAD=/tmp/x.so")},
        {"image": "attacker/image"},
        {"id": "fedcba9876543210"},
        {"digests": (("fs.tar", "0" * 64), ("opaque.json", "1" * 64), ("criu.tar", "2" * 64))},
        {"spec": SandboxSpec(image="belayer-sandbox-busybox", env={"A": "1"}, cap_add=("SYS_ADMIN",))},
        {"spec": SandboxSpec(image="belayer-sandbox-busybox", env={"A": "1"}, network="full")},
    ],
    ids=["env", "image", "id", "digests", "cap_add", "network"],
)
def test_a_changed_record_fails_its_mac(tmp_path: Path, change: dict[str, object]) -> None:
    key = CheckpointKey(b"k" * 32)
    signed = key.sign(_checkpoint(_parts(tmp_path / "parts")))
    with pytest.raises(CheckpointTampered, match="does not match the MAC the gateway signed it with"):
        key.verify(replace(signed, **change))  # type: ignore[arg-type]


def test_a_record_without_a_mac_or_signed_with_another_key_is_refused_with_what_to_do() -> None:
    key, other = CheckpointKey(b"k" * 32), CheckpointKey(b"o" * 32)
    with pytest.raises(CheckpointTampered, match="carries no MAC"):
        key.verify(_checkpoint())
    with pytest.raises(CheckpointTampered, match="carries no MAC"):
        key.verify(replace(_checkpoint(), mac="sha1:whatever"))
    with pytest.raises(
        CheckpointTampered,
        match=rf"signed with another key \(id {other.key_id}; this gateway's is {key.key_id}\): give this "
        r"gateway the key file of the gateway that took it \(sandbox.checkpoint_key_file\)",
    ):
        key.verify(other.sign(_checkpoint()))


# --------------------------------------------------------------------------- the parts
@pytest.mark.parametrize("part", PARTS)
def test_a_part_changed_in_the_store_fails_its_digest(tmp_path: Path, part: str) -> None:
    ckpt = _checkpoint(_parts(tmp_path / "parts"))
    check_parts(ckpt, tmp_path / "parts")
    data = bytearray((tmp_path / "parts" / part).read_bytes())
    data[len(data) // 2] ^= 1  # one bit
    (tmp_path / "parts" / part).write_bytes(bytes(data))
    with pytest.raises(CheckpointTampered, match=rf"{part} in the store is not the one the gateway wrote"):
        check_parts(ckpt, tmp_path / "parts")


def test_a_record_without_digests_cannot_be_checked(tmp_path: Path) -> None:
    _parts(tmp_path / "parts")
    with pytest.raises(CheckpointTampered, match="records no digests of its parts"):
        check_parts(_checkpoint(), tmp_path / "parts")


def test_the_gateway_answers_a_tampered_checkpoint_503_with_its_own_code() -> None:
    status, body = for_exception(CheckpointTampered("checkpoint c: fs.tar in the store is not the one"))
    assert status == 503
    assert body["error"]["code"] == "checkpoint_tampered" and body["error"]["type"] == "sandbox_error"
    assert (
        body["error"]["message"]
        == "the sandbox could not be restored: checkpoint c: fs.tar in the store is not the one"
    )
