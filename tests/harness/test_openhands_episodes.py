"""OpenHands (the openhands-sdk agent, unchanged) through `belayer run-episode`, beside its sandbox with its
``terminal`` and ``file_editor`` tools acting on the sandbox: a real ``belayer serve --sandboxes`` in
front of two scripted engine processes (`tests.harness.test_episodes.start_stack`), the fix-greet task
and its verifier. One engine process exits in the middle of the edit's reply: the gateway fails over to
the other, and OpenHands does not notice. Every turn holds exactly the ids the engines saw and sent.
Its sandbox's container is also killed mid-episode: the gateway restores the last checkpoint and replays
the commands and file writes since, and OpenHands does not notice that either. That gateway runs with
``--api-token``, which OpenHands never gets: its tools reach the sandbox under its session's URL. A second episode
walks the tools' other paths (a directory view, a persistent ``cd`` and ``export``, create, insert,
undo, a relative path, a terminal reset, a literal for a command, a timeout, a call to no tool, bad
arguments) and pins what the model is
shown for each: OpenHands' own observation texts, about the sandbox.

The install goes to ``.cache/harness/openhands-venv`` (idempotent; PyPI once, Python 3.12+).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.policy.tokenization import ChatTokenizer
from harness_adapters.openhands import OpenHands
from harness_adapters.scripted_engine import tool_call
from tests.harness.test_episodes import (
    API_TOKEN,
    CACHE,
    FIX,
    RUN_TEST,
    Stack,
    check_trajectory,
    failover_turns,
    kill_after_checkpoint,
    make_task,
    start_stack,
)

pytestmark = [pytest.mark.harness, pytest.mark.docker, pytest.mark.slow]  # minutes: make test-all

HELLO = "/workspace/hello.py"
DONE = 'Done: greet() returns "hello, world" and the test passes.'
OPENHANDS_TURNS = [
    tool_call("terminal", {"command": RUN_TEST}),
    tool_call("file_editor", {"command": "view", "path": HELLO}),
    tool_call(
        "file_editor",
        {"command": "str_replace", "path": HELLO, "old_str": FIX["old_string"], "new_str": FIX["new_string"]},
    ),
    tool_call("terminal", {"command": RUN_TEST}),
    tool_call("finish", {"message": DONE}),
]


@pytest.fixture
def openhands_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(
        tmp_path, tiny_model_dir, "OPENHANDS-TASK", OPENHANDS_TURNS, crash="2:5", policy="always",
        api_token=API_TOKEN,
    )  # fmt: skip


def test_openhands_episode_beside_its_sandbox(
    openhands_stack: Stack, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    runner = openhands_stack.runner(OpenHands(CACHE))
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        episode = pool.submit(runner.run, make_task(tmp_path, "OPENHANDS-TASK"))
        episode.add_done_callback(lambda _f: done.set())
        killed = kill_after_checkpoint(openhands_stack, 2, done)  # its sandbox dies mid-episode
        report = episode.result(timeout=600)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["inside"] is False
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, (report["harness_report"], report["harness_stderr_tail"])
    result = report["harness_report"]
    assert result["tools"] == ["terminal", "file_editor", "file_editor", "terminal", "finish"]
    assert (result["errors"], result["exception"], result["result"]) == ([], "", DONE)
    sid = report["session_id"]
    turns = check_trajectory(openhands_stack, sid, 5)
    assert [tokenizer.decode(t["output_ids"]) for t in turns] == OPENHANDS_TURNS
    assert failover_turns(openhands_stack, sid) == [2]  # the engine died mid-edit; OpenHands never knew
    assert (openhands_stack.dir / "crashed").exists()
    traj = openhands_stack.api(f"sessions/{sid}/trajectory")
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    assert (restored["mode"], restored["discarded_turns"], restored["diverged"]) == ("replay", [], 0)
    assert restored["sandbox_id"] != killed["sandbox_id"]
    # what the tools did in the sandbox came back to the model as OpenHands' own observations
    request = traj["turns"][-1]["request"]
    texts = [m["content"][0]["text"] for m in request["messages"] if m["role"] == "tool"]
    assert texts[0].startswith("FAILED (failures=1)\n[The command completed with exit code 0.]\n")
    assert texts[1].startswith("Here's the result of running `cat -n` on /workspace/hello.py:")
    assert texts[2].startswith("The file /workspace/hello.py has been edited.")
    assert texts[3] == (
        "OK\n[The command completed with exit code 0.]\n[Current working directory: /workspace]\n"
        "[Python interpreter: /usr/bin/python3]\n[Command finished with exit code 0]"
    )
    assert "belayer-openhands-" not in json.dumps(request)  # no path of its local mirror leaks
    # OpenHands sends its history back exactly: pure prefix reuse, no branch
    assert (report["prefix_reuse"], report["branches"], report["fresh_prompts"]) == (4, 0, 1), report[
        "branch_reasons"
    ]


NOTES = "/workspace/pkg/notes.txt"
TOOLS_TURNS = [
    tool_call("file_editor", {"command": "view", "path": "/workspace"}),
    tool_call("terminal", {"command": "mkdir -p pkg && cd pkg && export GREETING=hi"}),
    tool_call("terminal", {"command": 'echo "$GREETING from $(pwd)"'}),
    tool_call("file_editor", {"command": "create", "path": NOTES, "file_text": "one\n"}),
    tool_call("file_editor", {"command": "insert", "path": NOTES, "insert_line": 1, "new_str": "two"}),
    tool_call("file_editor", {"command": "undo_edit", "path": NOTES}),
    tool_call("file_editor", {"command": "view", "path": "hello.py"}),
    tool_call("terminal", {"command": "cat pkg/notes.txt; echo ${GREETING:-unset}", "reset": True}),
    tool_call("terminal", {"command": '["ls", "-l"]'}),
    tool_call("terminal", {"command": "sleep 5", "timeout": 1}),
    tool_call("browser", {"url": "http://example.com"}),  # no such tool
    tool_call("file_editor", {"command": "delete", "path": NOTES}),  # no such command
    tool_call("finish", {"message": "Done."}),
]


@pytest.fixture
def tools_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(tmp_path, tiny_model_dir, "OPENHANDS-TOOLS", TOOLS_TURNS, crash=None)


def test_openhands_tools_act_on_the_sandbox(tools_stack: Stack, tmp_path: Path) -> None:
    task = dataclasses.replace(make_task(tmp_path, "OPENHANDS-TOOLS"), max_turns=len(TOOLS_TURNS))
    report = tools_stack.runner(OpenHands(CACHE)).run(task)  # an open gateway
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    assert report["harness_ok"] is True, (report["harness_report"], report["harness_stderr_tail"])
    traj = tools_stack.api(f"sessions/{report['session_id']}/trajectory")
    request = traj["turns"][-1]["request"]
    texts = ["".join(c["text"] for c in m["content"]) for m in request["messages"] if m["role"] == "tool"]
    footer = (
        "\n[Current working directory: {}]\n[Python interpreter: /usr/bin/python3]\n"
        "[Command finished with exit code 0]"
    )
    done = "\n[The command completed with exit code 0.]" + footer
    error = "[An error occurred during execution.]\n"
    expected = [
        "Here's the files and directories up to 2 levels deep in /workspace, excluding hidden items:\n"
        "/workspace/\n/workspace/hello.py\n/workspace/test_hello.py",
        done.format("/workspace/pkg"),  # cd and export stay in the sandbox's shell ...
        "hi from /workspace/pkg" + done.format("/workspace/pkg"),
        f"File created successfully at: {NOTES}",
        f"The file {NOTES} has been edited. Here's the result of running `cat -n` on a snippet of the edited "
        "file:\n     1\tone\n     2\ttwo\nReview the changes and make sure they are as expected (correct "
        "indentation, no duplicate lines, etc). Edit the file again if necessary.",
        f"Last edit to {NOTES} undone successfully. Here's the result of running `cat -n` on {NOTES}:\n"
        "     1\tone\n",
        error + "Invalid `path` parameter: hello.py. The path should be an absolute path. "
        "Maybe you meant /workspace/hello.py?",
        # ... until a reset; the undone edit is what the sandbox holds
        "Terminal session has been reset. All previous environment variables and session state have been "
        "cleared.\n\none\nunset" + done.format("/workspace"),
    ]
    assert texts[:8] == expected
    assert texts[8].startswith(
        error + "[Tool-argument error] The `command` argument looks like a Python/JSON"
    )
    assert texts[9].startswith("command timed out after 1s; the command was killed")
    assert texts[9].endswith(
        "[The command was killed after 1 seconds. Set the `timeout` parameter for a command that takes longer.]"
    )
    # a call to no tool it has, or with arguments its schema refuses, is an error shown to the model
    assert (
        texts[10]
        == "Tool 'browser' not found. Available: ['terminal', 'file_editor', 'task_tracker', 'finish', 'think']"
    )
    assert texts[11].startswith(
        "Error validating tool 'file_editor': 1 validation error for FileEditorAction"
    )
    assert report["harness_report"]["errors"] == texts[10:12]
    # its history goes back exactly as the gateway gave it, errors included: no branch
    check_trajectory(tools_stack, report["session_id"], len(TOOLS_TURNS))
    assert (report["prefix_reuse"], report["branches"]) == (len(TOOLS_TURNS) - 1, 0), report["branch_reasons"]
