"""Engine-free parts of the sandbox package: path confinement, scripts, result parsing, records."""

from __future__ import annotations

import pytest

from core.errors import PathEscapeError, SandboxError, SandboxTimeout
from sandbox.backend import Checkpoint, SandboxSpec, check_session_name, resolve_in_root
from sandbox.docker_backend.checkpoints import checkpoint_from_json, checkpoint_to_json
from sandbox.docker_backend.exec import build_script, parse_client_output


@pytest.mark.parametrize(
    ("path", "expected"),
    [("a.txt", "/workspace/a.txt"), ("src/../b", "/workspace/b"), ("/workspace/x/./y", "/workspace/x/y")],
)
def test_resolve_in_root(path: str, expected: str) -> None:
    assert resolve_in_root("/workspace", path) == expected


@pytest.mark.parametrize("path", ["..", "../x", "/etc", "/workspace2/x", "a/\0b", "", "/workspace/.."])
def test_resolve_in_root_refuses_escapes(path: str) -> None:
    with pytest.raises(PathEscapeError):
        resolve_in_root("/workspace", path)


def test_build_script_quotes_cwd_and_env() -> None:
    script = build_script("ls", cwd="/my dir", env={"A": "it's"})
    assert script == "cd -- '/my dir' || return 1\nexport A='it'\"'\"'s'\nls"
    with pytest.raises(ValueError):
        build_script("ls", cwd=None, env={"BAD-NAME": "x"})
    with pytest.raises(ValueError):
        check_session_name("../x")


def test_parse_client_output() -> None:
    err = b"warn\n\n\x1eBELAYER rc=3 timeout=0 out=12 err=5 fresh=0\n"
    result = parse_client_output(b"0123456789", err, 10, 0.5, 30)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "0123456789", "warn\n")
    assert result.stdout_truncated and not result.stderr_truncated
    with pytest.raises(SandboxTimeout) as caught:
        parse_client_output(b"part", b"\n\x1eBELAYER rc=137 timeout=1 out=4 err=0 fresh=0\n", 10, 1, 1)
    assert caught.value.stdout == "part"
    with pytest.raises(SandboxError):
        parse_client_output(b"", b"OCI runtime exec failed", 10, 0.1, 1)


def test_checkpoint_record_round_trips() -> None:
    ckpt = Checkpoint(
        id="c1", sandbox_id="s1", label="turn-1", spec=SandboxSpec(image="img", env={"K": "v"}),
        image="belayer-checkpoint:c1", location="/tmp/c1", created_at=1.5, fs_seconds=0.1,
        process_seconds=0.2, env=("PATH=/bin", "K=v"),
    )  # fmt: skip
    assert checkpoint_from_json(checkpoint_to_json(ckpt)) == ckpt
