"""CRIU's own share of a restore's start, read from its restore log where the engine's containerd keeps it
(`sandbox.docker_backend.checkpoints.criu_restore_seconds`), without an engine."""

from __future__ import annotations

from pathlib import Path

from sandbox.docker_backend.checkpoints import criu_restore_seconds

TASKS = Path("containerd/daemon/io.containerd.runtime.v2.task/moby")


def test_criu_time_is_the_restore_logs_last_timestamp(tmp_path: Path) -> None:
    log = tmp_path / TASKS / "abc" / "restore.log"
    log.parent.mkdir(parents=True)
    lines = ["(00.000000) CRIU run id = x", "(00.108812) \tRPC", *["(00.5) pie: filler"] * 400,
             "(00.931216) \tRPC", "not a stamped line"]  # fmt: skip
    log.write_text("\n".join(lines) + "\n")
    assert criu_restore_seconds(tmp_path, "abc") == 0.931216


def test_no_log_no_figure(tmp_path: Path) -> None:
    assert criu_restore_seconds(tmp_path, "no-such-container") is None
    (tmp_path / TASKS / "empty").mkdir(parents=True)
    (tmp_path / TASKS / "empty" / "restore.log").write_text("")
    assert criu_restore_seconds(tmp_path, "empty") is None
