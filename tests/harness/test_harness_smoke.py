"""Real harnesses (Claude Code, mini-swe-agent), unchanged, through a real ``belayer serve`` over the
scripted engine: the episode edits a file, and every turn is in the trajectory with the exact ids.

The installs go to ``.cache/harness`` (idempotent); this needs the npm and PyPI registries once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.worker import free_port
from harness_adapters.base import Episode, HarnessAdapter
from harness_adapters.claude_code import ClaudeCode
from harness_adapters.mini_swe_agent import MiniSweAgent
from harness_adapters.scripted_engine import Emission, read_log, tool_call

pytestmark = pytest.mark.harness

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "harness"
ORIGINAL = 'def greet():\n    return "hello"\n'


@dataclass(frozen=True, slots=True)
class Stack:
    url: str
    log: Path


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "hello.py").write_text(ORIGINAL)
    return path


def claude_turns(repo: Path) -> list[str]:
    target = str(repo / "hello.py")
    edit = {"file_path": target, "old_string": 'return "hello"', "new_string": 'return "hello, claude"'}
    return [
        tool_call("Bash", {"command": "ls", "description": "List files"}),
        tool_call("Read", {"file_path": target}),  # Claude Code edits only files it has read
        tool_call("Edit", edit),
        'Done: greet() returns "hello, claude".',
    ]


def mini_turns() -> list[str]:
    return [
        tool_call("bash", {"command": "ls"}),
        tool_call("bash", {"command": 'sed -i \'s/return "hello"/return "hello, mini"/\' hello.py'}),
        tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
    ]


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("harness")


@pytest.fixture(scope="module")
def stack(workspace: Path, tiny_model_dir: Path) -> Iterator[Stack]:
    """The scripted engine and ``belayer serve`` as subprocesses, with both harnesses' scripts."""
    scripts = {
        "scripts": [
            {"marker": "CLAUDE-TASK", "turns": claude_turns(workspace / "claude-repo")},
            {"marker": "MINI-TASK", "turns": mini_turns()},
        ]
    }
    (workspace / "scripts.json").write_text(json.dumps(scripts))
    log = workspace / "emitted.jsonl"
    engine_port, gw_port = free_port(), free_port()
    engine_cmd = [
        sys.executable,
        "-m",
        "harness_adapters.scripted_engine",
        "--model-dir",
        str(tiny_model_dir),
    ]
    engine_cmd += ["--script", str(workspace / "scripts.json"), "--port", str(engine_port), "--log", str(log)]
    gw_cmd = [sys.executable, "-m", "belayer.cli", "serve", "--model", str(tiny_model_dir)]
    gw_cmd += ["--engine-url", f"http://127.0.0.1:{engine_port}", "--max-model-len", "65536"]
    gw_cmd += ["--port", str(gw_port), "--store", str(workspace / "traj.db"), "--log-level", "WARNING"]
    out = (workspace / "servers.log").open("wb")
    procs = [subprocess.Popen(engine_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)]
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}", procs)
        procs.append(subprocess.Popen(gw_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        wait_healthy(f"http://127.0.0.1:{gw_port}", procs)
        yield Stack(f"http://127.0.0.1:{gw_port}", log)
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        out.close()


def new_session(stack: Stack, harness: str) -> tuple[str, str]:
    r = httpx.post(f"{stack.url}/api/sessions", json={"metadata": {"harness": harness}})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["base_url"]


def check_trajectory(stack: Stack, sid: str, script: int, n_turns: int) -> list[dict[str, Any]]:
    """Every scripted emission is a complete turn in the session, in order, with the exact ids."""
    emitted: list[Emission] = [e for e in read_log(stack.log) if e.script == script]
    assert [e.turn for e in emitted] == list(range(n_turns))
    turns: list[dict[str, Any]] = httpx.get(f"{stack.url}/api/sessions/{sid}/trajectory").json()["turns"]
    assert len(turns) == n_turns
    for turn, e in zip(turns, emitted, strict=True):
        assert turn["status"] == "complete", turn["error"]
        assert turn["prompt_ids"] and turn["prompt_ids"] == e.prompt_ids
        assert turn["output_ids"] == e.output_ids
    return turns


def run_episode(adapter: HarnessAdapter, stack: Stack, repo: Path, task: str) -> tuple[str, Any]:
    adapter.install()
    sid, base_url = new_session(stack, adapter.name)
    outcome = adapter.run(Episode(task=task, workdir=repo, max_turns=8, timeout_s=150), base_url)
    assert outcome.ok, (outcome.returncode, outcome.stdout[-3000:], outcome.stderr[-3000:])
    return sid, outcome


def test_claude_code_episode(stack: Stack, workspace: Path) -> None:
    repo = make_repo(workspace / "claude-repo")
    task = "CLAUDE-TASK: make greet() in hello.py return 'hello, claude'."
    sid, outcome = run_episode(ClaudeCode(CACHE), stack, repo, task)
    assert (repo / "hello.py").read_text() == ORIGINAL.replace('"hello"', '"hello, claude"')
    assert outcome.report["num_turns"] == 4 and outcome.report["result"].startswith("Done:")
    turns = check_trajectory(stack, sid, script=0, n_turns=4)
    assert [t["finish_reason"] for t in turns] == ["tool_calls"] * 3 + ["stop"]


def test_mini_swe_agent_episode(stack: Stack, workspace: Path) -> None:
    repo = make_repo(workspace / "mini-repo")
    task = "MINI-TASK: make greet() in hello.py return 'hello, mini'."
    sid, outcome = run_episode(MiniSweAgent(CACHE), stack, repo, task)
    assert (repo / "hello.py").read_text() == ORIGINAL.replace('"hello"', '"hello, mini"')
    assert outcome.report["exit_status"] == "Submitted"
    turns = check_trajectory(stack, sid, script=1, n_turns=3)
    assert [t["branch"] for t in turns] == [0, 0, 0]  # history came back unchanged: pure prefix reuse
