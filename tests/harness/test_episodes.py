"""Real harnesses (Claude Code, OpenCode, mini-swe-agent), unchanged, through `belayer run-episode`: a real
``belayer serve --sandboxes`` in front of two scripted engine processes, a task directory with a failing
test, and the task's verifier. Claude Code and OpenCode run *inside* their sandbox (on the gateway-only network);
mini-swe-agent runs beside it, with its commands executed in the sandbox.

Most stacks run the gateway with ``--api-token``: the runner holds the token (the trainer side), the
harness never does (its model calls and, beside its sandbox, its tool calls go to its session's
capability URLs), and its episode still goes through.

One engine process exits mid-episode (``--crash``): the gateway fails over to the other, and the
harness does not notice. Every turn is in the trajectory with exactly the ids the engines saw and sent.
Claude Code's container is also killed mid-episode: Claude Code comes back from its last checkpoint
(CRIU: its memory, its connection closed), retries its LLM call, and still solves the task. So is
mini-swe-agent's: the gateway restores the checkpoint and replays the commands since, unseen by mini.

The installs go to ``.cache/harness`` (idempotent); this needs the npm and PyPI registries once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from core.net import free_port
from gateway.policy.tokenization import ChatTokenizer
from harness_adapters.base import HarnessAdapter
from harness_adapters.claude_code import ClaudeCode
from harness_adapters.episode import EpisodeRunner
from harness_adapters.mini_swe_agent import MiniSweAgent
from harness_adapters.opencode import OpenCode
from harness_adapters.scripted_engine import Emission, read_log, tool_call
from harness_adapters.task import Task
from tests.support import belayer_argv, spawn, stop, wait_healthy

pytestmark = [pytest.mark.harness, pytest.mark.docker, pytest.mark.slow]  # minutes: make test-all

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "harness"
TASK = REPO / "tasks" / "fix-greet"
RUN_TEST = "python3 -m unittest -q test_hello 2>&1 | tail -1"  # OK or FAILED: no timing, replays match
FIX = {"old_string": 'return "hello"', "new_string": 'return "hello, world"'}


API_TOKEN = "trainer-t0ken"


@dataclass(frozen=True, slots=True)
class Stack:
    url: str
    logs: list[Path]
    dir: Path
    token: str | None = None
    """The gateway's --api-token: the runner's and the test's, never the harness's."""

    def emissions(self) -> list[Emission]:
        return [e for log in self.logs for e in read_log(log)]

    def api(self, path: str, check: bool = True) -> Any:
        """``GET /api/{path}``'s JSON, as the trainer (with the token); an error's too unless `check`."""
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        r = httpx.get(f"{self.url}/api/{path}", headers=headers, timeout=60)
        assert r.status_code == 200 or not check, r.text
        return r.json()

    def runner(self, adapter: HarnessAdapter) -> EpisodeRunner:
        return EpisodeRunner(self.url, adapter, api_token=self.token)


CLAUDE_TURNS = [
    tool_call("Bash", {"command": RUN_TEST, "description": "Run the failing test"}),
    tool_call("Read", {"file_path": "/workspace/hello.py"}),  # Claude Code edits only files it has read
    tool_call("Edit", {"file_path": "/workspace/hello.py", **FIX}),
    tool_call("Bash", {"command": RUN_TEST, "description": "Run the test again"}),
    'Done: greet() returns "hello, world" and the test passes.',
]
OPENCODE_TURNS = [
    tool_call("bash", {"command": RUN_TEST}),
    tool_call("read", {"filePath": "/workspace/hello.py"}),
    tool_call(
        "edit",
        {"filePath": "/workspace/hello.py", "oldString": FIX["old_string"], "newString": FIX["new_string"]},
    ),
    tool_call("bash", {"command": RUN_TEST}),
    'Done: greet() returns "hello, world" and the test passes.',
]
MINI_TURNS = [
    tool_call("bash", {"command": RUN_TEST}),
    tool_call("bash", {"command": 'sed -i \'s/return "hello"/return "hello, world"/\' hello.py'}),
    tool_call("bash", {"command": "python3 -m unittest -q test_hello"}),
    tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
]


def start_stack(
    tmp: Path,
    model_dir: Path,
    marker: str,
    turns: list[str],
    crash: str | None,
    policy: str = "adaptive",
    *,
    engines: int = 2,
    scripts: list[dict[str, Any]] | None = None,
    api_token: str | None = None,
    serve_args: list[str] | None = None,
) -> Iterator[Stack]:
    """Two scripted engine processes (either may crash once at `crash`) and `belayer serve --sandboxes`
    (with `api_token`, ``--api-token``).
    Tokens come 30 ms apart: each LLM call is an inference bubble of a second or so, long enough for a
    checkpoint to start in it on a busy machine (at 10 ms, CI once saw every bubble end first).
    `scripts` replaces the one script of `marker` and `turns`; `engines` how many processes serve it;
    `serve_args` go to ``belayer serve`` as well."""
    scripts = scripts or [{"marker": marker, "turns": turns}]
    (tmp / "scripts.json").write_text(json.dumps({"scripts": scripts}))
    out = tmp / "servers.log"
    procs: list[subprocess.Popen[bytes]] = []
    logs, engine_urls = [], []
    try:
        for i in range(engines):
            port = free_port()
            logs.append(tmp / f"emitted-{i}.jsonl")
            cmd = [sys.executable, "-m", "harness_adapters.scripted_engine", "--model-dir", str(model_dir)]
            cmd += ["--script", str(tmp / "scripts.json"), "--port", str(port), "--log", str(logs[-1])]
            if crash is not None:
                cmd += ["--crash", crash, "--crash-once", str(tmp / "crashed")]
            cmd += ["--token-delay", "0.03"]
            procs.append(spawn(cmd, out))
            engine_urls.append(f"http://127.0.0.1:{port}")
            wait_healthy(f"{engine_urls[-1]}/health", procs, 60.0, out)
        gw_port = free_port()
        cmd = belayer_argv("serve", "--model", str(model_dir), "--sandboxes")
        for url in engine_urls:
            cmd += ["--engine-url", url]
        cmd += ["--max-model-len", "65536", "--port", str(gw_port), "--store", str(tmp / "traj.db")]
        cmd += ["--checkpoint-dir", str(tmp / "checkpoints"), "--log-level", "WARNING"]
        cmd += ["--checkpoint-policy", policy]
        if api_token is not None:
            cmd += ["--api-token", api_token]
        procs.append(spawn([*cmd, *(serve_args or [])], out))
        wait_healthy(f"http://127.0.0.1:{gw_port}/health", procs, 60.0, out)
        yield Stack(f"http://127.0.0.1:{gw_port}", logs, tmp, api_token)
    finally:
        for p in reversed(procs):
            stop(p, grace=10, require_exit=False)


def make_task(tmp: Path, marker: str) -> Task:
    root = tmp / "task"
    shutil.copytree(TASK, root)
    (root / "instruction.md").write_text(f"{marker}: {(TASK / 'instruction.md').read_text()}")
    return Task.load(root)


def check_trajectory(stack: Stack, sid: str, n_turns: int) -> list[dict[str, Any]]:
    """Every turn is complete, with the prompt ids the engine saw and the ids it sent (a failover's
    turn: the crashed engine's whole reply, of which the other engine sent the rest; or, not streamed,
    the other engine's answer to the same prompt)."""
    first = [e for e in stack.emissions() if e.resumed == 0 and e.turn is not None]
    turns: list[dict[str, Any]] = stack.api(f"sessions/{sid}/trajectory")["turns"]
    assert [t["status"] for t in turns] == ["complete"] * n_turns
    for turn in turns:
        answers = [e.output_ids for e in first if e.prompt_ids == turn["prompt_ids"]]
        assert answers and all(turn["output_ids"] == answer for answer in answers)
    return turns


def failover_turns(stack: Stack, sid: str) -> list[int]:
    traj = stack.api(f"sessions/{sid}/trajectory")
    return [e["turn_index"] for e in traj["events"] if e["kind"] == "failover"]


@pytest.fixture
def claude_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(
        tmp_path, tiny_model_dir, "CLAUDE-TASK", CLAUDE_TURNS, crash="2:5", policy="always"
    )


@pytest.fixture
def opencode_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(
        tmp_path, tiny_model_dir, "OPENCODE-TASK", OPENCODE_TURNS, crash="2:5", api_token=API_TOKEN
    )


@pytest.fixture
def mini_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(
        tmp_path, tiny_model_dir, "MINI-TASK", MINI_TURNS, crash="1:0", policy="always", api_token=API_TOKEN
    )


def kill_after_checkpoint(stack: Stack, turn: int, done: threading.Event) -> dict[str, Any]:
    """Once the session's sandbox has a checkpoint from `turn`'s bubble, kill its container."""
    # a deadline for a machine busy with other work too (the episode itself ends by `done`)
    deadline, seen = time.monotonic() + 300, []
    while time.monotonic() < deadline and not done.is_set():
        sessions = stack.api("sessions")["data"]
        for s in sessions:
            state = stack.api(f"sessions/{s['id']}/sandbox", check=False)  # (none yet: a 404)
            seen = [c["turn_index"] for c in state.get("checkpoints", [])]
            if any(t >= turn for t in seen):
                docker.from_env().containers.get(state["sandbox_id"]).kill()
                return dict(state)
        time.sleep(0.1)  # the episode runs in another thread: poll the gateway's view of it
    what = "the episode ended" if done.is_set() else "300 s passed"
    raise AssertionError(f"no checkpoint of turn {turn} before {what} (checkpoints at turns {seen})")


def test_claude_code_episode_inside_its_sandbox(
    claude_stack: Stack, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    runner = EpisodeRunner(claude_stack.url, ClaudeCode(CACHE))
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        episode = pool.submit(runner.run, make_task(tmp_path, "CLAUDE-TASK"))
        episode.add_done_callback(lambda _f: done.set())
        killed = kill_after_checkpoint(claude_stack, 3, done)
        report = episode.result(timeout=600)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["inside"] is True
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, report["harness_stderr_tail"]
    assert report["harness_report"]["result"].startswith("Done:")
    assert report["sandbox_checkpoint_failures"] <= 1  # at most the one running when the container died
    assert report["sandbox_restores"] == 1
    sid = report["session_id"]
    traj = claude_stack.api(f"sessions/{sid}/trajectory")
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert restored["sandbox_id"] != killed["sandbox_id"] and restored["turn_index"] >= 3
    assert restored["keep_through"] == restored["turn_index"] - 1  # it retried the call it was in
    kept = [t for t in traj["turns"] if t["status"] != "discarded"]
    discarded = [t["index"] for t in traj["turns"] if t["status"] == "discarded"]
    assert set(restored["discarded_turns"]) <= set(discarded)  # (+ the call in flight at the kill)
    assert min(discarded) == restored["keep_through"] + 1
    # the trajectory Claude Code now believes: its 5 turns, once each, in order
    assert [t["status"] for t in kept] == ["complete"] * 5
    assert [tokenizer.decode(t["output_ids"]) for t in kept] == CLAUDE_TURNS
    assert failover_turns(claude_stack, sid) == [2]  # the engine died mid-Edit, before the kill
    assert (claude_stack.dir / "crashed").exists()
    for turn in kept:  # the ids are exactly the engines' ids
        first = [e for e in claude_stack.emissions() if e.resumed == 0 and e.prompt_ids == turn["prompt_ids"]]
        assert first and all(turn["output_ids"] == e.output_ids for e in first)
    for reason in report["branch_reasons"]:  # every branch says where the history changed
        assert "message_index" in reason or "difference" in reason


def test_opencode_episode_inside_its_sandbox(opencode_stack: Stack, tmp_path: Path) -> None:
    report = opencode_stack.runner(OpenCode(CACHE)).run(make_task(tmp_path, "OPENCODE-TASK"))
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["inside"] is True
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, (report["harness_report"], report["harness_stderr_tail"])
    assert report["harness_report"]["tools"] == ["bash", "read", "edit", "bash"]
    assert report["harness_report"]["result"].startswith("Done:")
    assert report["sandbox_checkpoint_failures"] == 0  # its SQLite locks and inotify watches dump fine
    check_trajectory(opencode_stack, report["session_id"], 5)
    assert failover_turns(opencode_stack, report["session_id"]) == [2]
    assert report["prefix_reuse"] + report["branches"] == 4
    for reason in report["branch_reasons"]:
        assert "message_index" in reason or "difference" in reason


def test_mini_swe_agent_episode_in_a_sandbox(mini_stack: Stack, tmp_path: Path) -> None:
    runner = mini_stack.runner(MiniSweAgent(CACHE))  # its tool calls go to /s/{id}/sandbox, with no token
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        episode = pool.submit(runner.run, make_task(tmp_path, "MINI-TASK"))
        episode.add_done_callback(lambda _f: done.set())
        killed = kill_after_checkpoint(mini_stack, 2, done)  # its sandbox dies mid-episode
        report = episode.result(timeout=600)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["inside"] is False
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, report["harness_stderr_tail"]
    assert report["harness_report"]["exit_status"] == "Submitted"
    # mini never noticed the container's death: the gateway restored the checkpoint, replayed the
    # commands run since, and answered the call; no turn was discarded
    check_trajectory(mini_stack, report["session_id"], 4)
    assert failover_turns(mini_stack, report["session_id"]) == [1]
    traj = mini_stack.api(f"sessions/{report['session_id']}/trajectory")
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert (restored["mode"], restored["discarded_turns"], restored["diverged"]) == ("replay", [], 0)
    assert restored["sandbox_id"] != killed["sandbox_id"]
    # mini sends its history back unchanged: pure prefix reuse, no branch
    assert (report["prefix_reuse"], report["branches"], report["fresh_prompts"]) == (3, 0, 1)
