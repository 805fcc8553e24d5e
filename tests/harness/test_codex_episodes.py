"""Codex CLI, unchanged, through `belayer run-episode`: inside its sandbox, on the Responses API of a real
``belayer serve --sandboxes`` in front of two scripted engine processes, on tasks/fix-greet.

The scripted policy answers with Hermes ``<tool_call>`` text; the gateway turns it into a Responses
``function_call`` of Codex's ``exec_command`` tool (``{"cmd": ...}``), which Codex runs in the container.
One engine exits mid-episode and the failover is invisible to Codex; in the second episode its container
is also killed once and Codex, restored from its checkpoint with its connection closed, retries the call
and finishes. The install goes to ``.cache/harness/codex`` (idempotent); it needs the npm registry once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.policy.tokenization import ChatTokenizer
from harness_adapters.codex import Codex
from harness_adapters.episode import EpisodeRunner
from harness_adapters.scripted_engine import tool_call
from tests.harness.test_episodes import (
    CACHE,
    RUN_TEST,
    Stack,
    check_trajectory,
    failover_turns,
    kill_after_checkpoint,
    make_task,
    start_stack,
)

pytestmark = [pytest.mark.harness, pytest.mark.docker]

FIX = """sed -i 's/return "hello"/return "hello, world"/' hello.py"""
CODEX_TURNS = [
    tool_call("exec_command", {"cmd": RUN_TEST}),
    tool_call("exec_command", {"cmd": FIX}),
    tool_call("exec_command", {"cmd": RUN_TEST}),
    'Done: greet() returns "hello, world" and the test passes.',
]


@pytest.fixture(scope="module")
def codex() -> Codex:
    harness = Codex(CACHE)
    harness.install()  # idempotent: a no-op once .cache/harness/codex holds this version
    return harness


@pytest.fixture
def codex_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(tmp_path, tiny_model_dir, "CODEX-TASK", CODEX_TURNS, crash="1:5")


@pytest.fixture
def codex_kill_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(tmp_path, tiny_model_dir, "CODEX-KILL", CODEX_TURNS, crash=None, policy="always")


def test_codex_episode_inside_its_sandbox(codex_stack: Stack, codex: Codex, tmp_path: Path) -> None:
    report = EpisodeRunner(codex_stack.url, codex).run(make_task(tmp_path, "CODEX-TASK"))
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["inside"] is True
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, (report["harness_report"], report["harness_stderr_tail"])
    result = report["harness_report"]
    assert result["tools"] == ["command_execution"] * 3
    assert "hello, world" in result["commands"][1]  # run by `/bin/bash -lc` in /workspace
    assert (result["outputs"], result["exit_codes"]) == (["FAILED (failures=1)\n", "", "OK\n"], [0, 0, 0])
    assert result["result"] == CODEX_TURNS[-1]
    assert (result["errors"], result["turns"]) == ([], 1)  # one `codex exec` turn of 4 LLM calls
    assert report["sandbox_checkpoint_failures"] == 0
    sid = report["session_id"]
    turns = check_trajectory(codex_stack, sid, 4)  # exactly the ids the engines saw and sent
    assert failover_turns(codex_stack, sid) == [1]  # the engine died mid-call: Codex never noticed
    assert (codex_stack.dir / "crashed").exists()
    for turn in turns:  # every call is Codex's Responses request, with its exec_command tool
        assert turn["request"]["store"] is False
        assert "exec_command" in [t.get("name") for t in turn["request"]["tools"]]
    # Codex resends its whole input (store: false); each call extends the one before exactly
    assert (report["prefix_reuse"], report["branches"], report["fresh_prompts"]) == (3, 0, 1)
    assert result["usage"]["input_tokens"] == sum(len(t["prompt_ids"]) for t in turns)
    assert result["usage"]["output_tokens"] == sum(len(t["output_ids"]) for t in turns)


def test_codex_container_killed_and_restored(
    codex_kill_stack: Stack, codex: Codex, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    runner = EpisodeRunner(codex_kill_stack.url, codex)
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        episode = pool.submit(runner.run, make_task(tmp_path, "CODEX-KILL"))
        episode.add_done_callback(lambda _f: done.set())
        killed = kill_after_checkpoint(codex_kill_stack, 2, done)
        report = episode.result(timeout=600)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, (report["harness_report"], report["harness_stderr_tail"])
    assert report["harness_report"]["result"] == CODEX_TURNS[-1]
    assert report["sandbox_restores"] == 1
    assert report["sandbox_checkpoint_failures"] <= 1  # at most the one running when the container died
    sid = report["session_id"]
    traj = httpx.get(f"{codex_kill_stack.url}/api/sessions/{sid}/trajectory").json()
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert restored["sandbox_id"] != killed["sandbox_id"] and restored["turn_index"] >= 2
    assert restored["keep_through"] == restored["turn_index"] - 1  # it retried the call it was in
    kept = [t for t in traj["turns"] if t["status"] != "discarded"]
    discarded = [t for t in traj["turns"] if t["status"] == "discarded"]
    # the call it was in, and any it had sent since the checkpoint (on a loaded machine Codex can be a
    # turn further on when the kill lands: that turn's checkpoint was not taken yet)
    first = restored["turn_index"]
    assert (
        [t["index"] for t in discarded]
        == restored["discarded_turns"]
        == list(range(first, first + len(discarded)))
    )
    # restored waiting on that call, Codex sent the very same request again: a retry, not a new prompt
    assert kept[first]["prompt_ids"] == discarded[0]["prompt_ids"]
    # the trajectory Codex now believes: its 4 calls, once each, in order, with the engines' ids
    assert [t["status"] for t in kept] == ["complete"] * 4
    assert [tokenizer.decode(t["output_ids"]) for t in kept] == CODEX_TURNS
    for turn in kept:
        first = [
            e for e in codex_kill_stack.emissions() if e.resumed == 0 and e.prompt_ids == turn["prompt_ids"]
        ]
        assert first and all(turn["output_ids"] == e.output_ids for e in first)
