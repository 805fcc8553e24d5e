"""The OpenHands adapter's own logic, without running OpenHands: its command line, its verdict, and the
interpreter it picks (the episodes are in test_openhands_episodes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import HarnessError
from harness_adapters.base import Episode, SandboxRef
from harness_adapters.openhands import MIN_PYTHON, PLUGIN, OpenHands, _version, find_python
from harness_adapters.registry import adapter

URL = "http://127.0.0.1:8000/s/ses_1/v1"


def test_registered_as_openhands(tmp_path: Path) -> None:
    oh = adapter("openhands", tmp_path, model="m")
    assert isinstance(oh, OpenHands) and (oh.model, oh.inside) == ("m", False)
    assert oh.venv == tmp_path.resolve() / "openhands-venv"


def test_command_names_the_session_and_its_sandbox(tmp_path: Path) -> None:
    oh = OpenHands(tmp_path)
    sandbox = SandboxRef("http://127.0.0.1:8000", "ses_1")
    argv = oh.command(Episode("fix it", tmp_path, max_turns=7, sandbox=sandbox), URL, tmp_path)
    assert argv[:2] == [str(oh.python), str(PLUGIN)]
    options = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert options == {
        "--base-url": URL,
        "--model": "policy",
        "--gateway": "http://127.0.0.1:8000",
        "--session": "ses_1",
        "--cwd": "/workspace",
        "--task": "fix it",
        "--max-iterations": "7",
        "--command-timeout": "120",
        "--output": str(tmp_path / "openhands.report.json"),
    }
    env = oh.env(URL, tmp_path)
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert not any(k.startswith(("LMNR_", "OTEL_")) for k in env)  # no telemetry endpoint


def test_it_runs_beside_a_sandbox_only(tmp_path: Path) -> None:
    oh = OpenHands(tmp_path)
    with pytest.raises(HarnessError, match="beside"):
        oh.command(Episode("t", tmp_path), URL, tmp_path, inside=True)
    with pytest.raises(HarnessError, match="sandbox"):
        oh.command(Episode("t", tmp_path), URL, tmp_path)


@pytest.mark.parametrize(
    ("rc", "report", "ok"),
    [(0, {"status": "finished"}, True), (0, {"status": "error"}, False), (1, {"status": "finished"}, False)],
)
def test_ok_means_exit_0_and_finished(tmp_path: Path, rc: int, report: dict[str, str], ok: bool) -> None:
    (tmp_path / "openhands.report.json").write_text(json.dumps(report))
    outcome = OpenHands(tmp_path).collect(subprocess.CompletedProcess([], rc, "", ""), tmp_path, 1.0)
    assert (outcome.ok, outcome.report) == (ok, report)


def test_no_report_is_not_ok(tmp_path: Path) -> None:
    outcome = OpenHands(tmp_path).collect(subprocess.CompletedProcess([], 0, "", "boom"), tmp_path, 1.0)
    assert (outcome.ok, outcome.report, outcome.stderr) == (False, {}, "boom")


def test_version_of_an_interpreter() -> None:
    assert _version(sys.executable) == sys.version_info[:2]
    assert _version("/nonexistent/python") == (0, 0)


@pytest.mark.harness
def test_a_python_for_openhands_is_found() -> None:
    """The OpenHands episodes need Python 3.12+ on the machine (pyenv's, here)."""
    assert _version(find_python()) >= MIN_PYTHON
