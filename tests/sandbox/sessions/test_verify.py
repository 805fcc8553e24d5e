"""The verify stage's rewriting of the agent's working directory (`sandbox.sessions.verify_tree`): protected
paths reset and reported, bytecode and special files dropped, links above a reset path removed."""

from __future__ import annotations

import io
import tarfile

from sandbox.sessions.verify import VERIFY_DIR, verifier_tar, verify_command
from sandbox.sessions.verify_tree import AgentTree, ProtectedChange, protect, write_tree

TEST = b"import unittest\nassert 1 == 1\n"


def agent_tar(*members: tuple[str, bytes, str]) -> bytes:
    """A tar as `docker cp /workspace` writes it: (name under workspace/, data, kind)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        root = tarfile.TarInfo("workspace")
        root.type = tarfile.DIRTYPE
        tar.addfile(root)
        for name, data, kind in members:
            info = tarfile.TarInfo(f"workspace/{name}")
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, data.decode()
                tar.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, f"workspace/{data.decode()}"
                tar.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
    return buf.getvalue()


def tree(tar: bytes) -> AgentTree:
    return AgentTree(io.BytesIO(tar), "/workspace")


def rewrite(
    tar: bytes, originals: dict[str, tuple[bytes, int]], patterns: tuple[str, ...]
) -> tuple[list[ProtectedChange], bytes]:
    """What `protect` reports and what `write_tree` sends, for the agent's archive `tar`."""
    agent = tree(tar)
    changes = protect(agent, originals, patterns)
    return changes, b"".join(write_tree(agent, "/workspace", originals, patterns))


def names(tar: bytes) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for m in archive:
            f = archive.extractfile(m) if m.isfile() else None
            out[m.name] = f.read() if f is not None else ("dir" if m.isdir() else f"-> {m.linkname}")
    return out


def test_an_untouched_protected_file_is_no_change() -> None:
    changes, out = rewrite(
        agent_tar(("test_a.py", TEST, "file")), {"test_a.py": (TEST, 0o644)}, ("test_a.py",)
    )
    assert changes == [] and names(out)["workspace/test_a.py"] == TEST


def test_modified_deleted_and_added_protected_paths_are_reset_and_reported() -> None:
    tar = agent_tar(
        ("test_a.py", b"import unittest\n", "file"),
        ("tests", b"", "dir"),
        ("tests/conftest.py", b"x = 1\n", "file"),
        ("hello.py", b"def greet(): ...\n", "file"),
    )
    originals = {"test_a.py": (TEST, 0o644), "tests/test_b.py": (b"b\n", 0o600)}
    changes, tar_out = rewrite(tar, originals, ("test_a.py", "tests"))
    assert [(c.path, c.change, c.diff_lines) for c in changes] == [
        ("test_a.py", "modified", 1),
        ("tests/conftest.py", "added", 1),
        ("tests/test_b.py", "deleted", 1),
    ]
    out = names(tar_out)
    assert out["workspace/test_a.py"] == TEST and out["workspace/tests/test_b.py"] == b"b\n"
    assert "workspace/tests/conftest.py" not in out
    assert out["workspace/hello.py"] == b"def greet(): ...\n"  # the agent's work is kept


def test_a_protected_file_turned_into_a_link_and_a_linked_parent_are_replaced() -> None:
    tar = agent_tar(("test_a.py", b"/etc/passwd", "symlink"), ("tests", b"/tmp/mine", "symlink"))
    changes, tar_out = rewrite(
        tar, {"test_a.py": (TEST, 0o644), "tests/t.py": (b"t", 0o644)}, ("test_*.py", "tests/t.py")
    )
    assert {c.path: c.change for c in changes} == {"test_a.py": "modified", "tests/t.py": "deleted"}
    out = names(tar_out)
    assert out["workspace/test_a.py"] == TEST and "workspace/tests" not in out
    assert out["workspace/tests/t.py"] == b"t"


def test_bytecode_and_special_files_are_dropped_and_hard_links_made_regular() -> None:
    tar = agent_tar(
        ("a.py", b"A", "file"),
        ("__pycache__", b"", "dir"),
        ("__pycache__/a.cpython-311.pyc", b"forged", "file"),
        ("b.pyc", b"forged", "file"),
        ("pipe", b"", "fifo"),
        ("c.py", b"a.py", "hardlink"),
    )
    out = names(rewrite(tar, {}, ())[1])
    assert out == {"workspace/a.py": b"A", "workspace/c.py": b"A"}


def test_the_verifier_goes_to_its_own_directory_and_runs_with_a_clean_environment() -> None:
    out = names(verifier_tar({"verify.sh": (b"exit 0", 0o644), "tests/test_h.py": (b"h", 0o644)}))
    root = VERIFY_DIR.strip("/")
    assert out == {
        root: "dir",
        f"{root}/home": "dir",
        f"{root}/verify.sh": b"exit 0",
        f"{root}/tests/test_h.py": b"h",
    }
    command = verify_command("/workspace")
    assert (
        "/usr/bin/env -i " in command
        and "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in command
    )
    assert command.endswith(f"/bin/sh {VERIFY_DIR}/verify.sh")
