"""The API token stays on the trainer side: `EpisodeRunner` sends it on its own ``/api/`` calls, and a
harness process gets only its session's URLs, whatever the runner's own environment holds (the
episodes with ``--api-token`` are in test_episodes.py and test_openhands_episodes.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness_adapters.base import Episode, HarnessAdapter, Outcome, SandboxRef
from harness_adapters.episode import EpisodeRunner
from harness_adapters.registry import ADAPTERS
from harness_adapters.task import Task

SECRET = "trainer-s3cret"
URL = "http://127.0.0.1:8000/s/ses_1/v1"


class PrintEnv(HarnessAdapter):
    """A harness beside its sandbox that reports its environment and the sandbox it was given."""

    name = "print-env"

    def install(self) -> None:
        pass

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {"OPENAI_BASE_URL": session_base_url}

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        code = "import json, os, sys; print(json.dumps({'env': dict(os.environ), 'argv': sys.argv[1:]}))"
        assert episode.sandbox is not None
        return [sys.executable, "-c", code, episode.sandbox.gateway, episode.sandbox.session_id]

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        return Outcome(proc.returncode, proc.returncode == 0, proc.stdout, proc.stderr, duration_s)


def test_a_harness_beside_its_sandbox_gets_its_session_and_never_the_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BELAYER_API_TOKEN", SECRET)  # as `belayer run-episode` has it
    runner = EpisodeRunner("http://127.0.0.1:8000/", PrintEnv(tmp_path), api_token=SECRET)
    assert runner.http.headers["authorization"] == f"Bearer {SECRET}"  # the runner's own calls
    task = Task("t", tmp_path, "fix it", tmp_path, tmp_path / "verify.sh")
    outcome = runner._run_beside("ses_1", task, URL)
    assert outcome.ok, outcome.stderr
    seen = json.loads(outcome.stdout)
    assert seen["argv"] == ["http://127.0.0.1:8000", "ses_1"]  # its sandbox: /s/ses_1/sandbox/...
    assert seen["env"]["OPENAI_BASE_URL"] == URL
    assert SECRET not in outcome.stdout


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_no_harness_is_handed_the_token(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BELAYER_API_TOKEN", SECRET)
    harness = ADAPTERS[name](tmp_path)
    episode = Episode("fix it", tmp_path, sandbox=SandboxRef("http://127.0.0.1:8000", "ses_1"))
    # the oracle runs no program of its own (solve.sh goes through the session's capability URL)
    program = [] if name == "oracle" else harness.command(episode, URL, tmp_path)
    given = [*harness.env(URL, tmp_path).items(), *program]
    if harness.inside:
        given.append(harness.inside_script(episode, URL, "/root", "/tmp/out"))
    assert not any(SECRET in str(g) or "BELAYER_API_TOKEN" in str(g) for g in given)
