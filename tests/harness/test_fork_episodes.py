"""Tree rollouts with a real harness: Claude Code, inside its sandbox, forked mid-episode by
``belayer run-episode --fork-at 3 --siblings 3`` (`EpisodeRunner.run(fork_at=...)`).

The scripted engine plays one episode up to turn 3; at turn 4 it gives the parent its own answer and
each child, retrying the call its parent was making when the checkpoint was taken, another one, which
carries the marker of that child's own script (``fork_answers``). The engine keys them by session (the
gateway names it in each engine request's ``X-Request-Id``), so a child that retries keeps its answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.policy.tokenization import ChatTokenizer
from harness_adapters.claude_code import ClaudeCode
from harness_adapters.episode import EpisodeRunner
from harness_adapters.scripted_engine import tool_call
from tests.harness.test_episodes import CACHE, FIX, RUN_TEST, Stack, make_task, start_stack

pytestmark = [pytest.mark.harness, pytest.mark.docker, pytest.mark.slow]  # minutes: make test-all

MARKER = "CLAUDE-FORK"
FORK_AT = 3
SHARED = [
    tool_call("Bash", {"command": RUN_TEST, "description": "Run the failing test"}),
    tool_call("Read", {"file_path": "/workspace/hello.py"}),
    tool_call("Bash", {"command": "echo shared > shared.txt", "description": "Take a note"}),
    tool_call("Bash", {"command": RUN_TEST, "description": "Run it once more"}),
]
PARENT = [
    tool_call("Edit", {"file_path": "/workspace/hello.py", **FIX}),
    tool_call("Bash", {"command": RUN_TEST, "description": "Run the test again"}),
    "Done: the parent fixed greet().",
]
SED = 'sed -i \'s/return "hello"/return "{}"/\' hello.py && '
# each sibling: (its marker, its command at turn 4, whether the verifier then passes)
SIBLINGS = {
    "BRANCH-A": (SED.format("hello, world") + "echo A > branch.txt", True),
    "BRANCH-B": ("echo B > branch.txt", False),
    "BRANCH-C": (SED.format("HELLO") + "echo C > branch.txt", False),
}


def sibling_turn(marker: str) -> str:
    return tool_call("Bash", {"command": SIBLINGS[marker][0], "description": f"{marker}: my own way"})


def scripts() -> list[dict[str, Any]]:
    """One script per sibling (from turn 5, picked by its marker), then the parent's."""
    own = [{"marker": m, "turns": [*SHARED, sibling_turn(m), f"Done: {m} finished."]} for m in SIBLINGS]
    parent = {
        "marker": MARKER,
        "turns": [*SHARED, *PARENT],
        "fork_turn": FORK_AT + 1,
        "fork_answers": [sibling_turn(m) for m in SIBLINGS],
    }
    return [*own, parent]


@pytest.fixture
def fork_stack(tmp_path: Path, tiny_model_dir: Path, docker_engine: None) -> Iterator[Stack]:
    yield from start_stack(
        tmp_path, tiny_model_dir, MARKER, [], crash=None, policy="always", engines=1, scripts=scripts()
    )


def trajectory(stack: Stack, sid: str) -> dict[str, Any]:
    return dict(httpx.get(f"{stack.url}/api/sessions/{sid}/trajectory", timeout=60).json())


def test_claude_code_episode_forked_into_three_siblings(
    fork_stack: Stack, tmp_path: Path, tokenizer: ChatTokenizer
) -> None:
    runner = EpisodeRunner(fork_stack.url, ClaudeCode(CACHE), poll_s=0.5)
    report = runner.run(make_task(tmp_path, MARKER), fork_at=FORK_AT, siblings=3, keep=True)
    (tmp_path / "report.json").write_text(json.dumps(report, indent=1))
    # the parent finishes unaffected
    assert report["verified"] is True, report
    assert report["harness_ok"] is True, report["harness_stderr_tail"]
    assert report["harness_report"]["result"].startswith("Done: the parent")
    parent = trajectory(fork_stack, report["session_id"])
    kept = [t for t in parent["turns"] if t["status"] == "complete"]
    assert [tokenizer.decode(t["output_ids"]) for t in kept] == [*SHARED, *PARENT]
    shared = kept[: FORK_AT + 1]
    prefix = [*shared[-1]["prompt_ids"], *shared[-1]["output_ids"]]

    fork = report["fork"]
    assert fork["at_turn"] == FORK_AT and len(fork["siblings"]) == 3
    seen: dict[str, str] = {}  # marker -> the sibling that played it
    for sibling in fork["siblings"]:
        sid = sibling["session_id"]
        assert sibling["harness_ok"] is True, sibling["harness_stderr_tail"]
        assert sibling["reused_turns"] == FORK_AT + 1
        assert sibling["reused_output_tokens"] == sum(len(t["output_ids"]) for t in shared)
        assert sibling["reused_tool_calls"] == FORK_AT + 1  # one tool call a turn
        traj = trajectory(fork_stack, sid)
        turns = [t for t in traj["turns"] if t["status"] == "complete"]
        texts = [tokenizer.decode(t["output_ids"]) for t in turns]
        assert texts[: FORK_AT + 1] == SHARED  # the parent's turns, shared
        [marker] = [m for m in SIBLINGS if m in texts[FORK_AT + 1]]
        assert texts[FORK_AT + 1 :] == [sibling_turn(marker), f"Done: {marker} finished."]
        assert sibling["turns"] == len(turns) == FORK_AT + 3
        seen[marker] = sid
        # its prompts extend the parent's ids through turn 3 exactly
        for turn in turns[FORK_AT + 1 :]:
            assert turn["prompt_ids"][: len(prefix)] == prefix
        # its files diverged as scripted, and its verifier says so
        assert sibling["verified"] is SIBLINGS[marker][1], sibling["verifier_output"]
        files = httpx.post(
            f"{fork_stack.url}/api/sessions/{sid}/sandbox/exec",
            json={"command": "cat branch.txt shared.txt; grep return hello.py"},
            timeout=60,
        ).json()["stdout"]
        assert files.split("\n")[:2] == [marker[-1], "shared"], files
    assert sorted(seen) == sorted(SIBLINGS)  # each sibling went its own way
    # no request of a sibling landed in another session: each session's own turns hold only its script
    for marker, sid in seen.items():
        others = [m for m in SIBLINGS if m != marker]
        for other in [report["session_id"], *(s for m, s in seen.items() if m != marker)]:
            text = " ".join(tokenizer.decode(t["output_ids"]) for t in trajectory(fork_stack, other)["turns"])
            assert marker not in text
        own = [t for t in trajectory(fork_stack, sid)["turns"] if t["index"] > FORK_AT]
        assert not any(o in tokenizer.decode(t["output_ids"]) for t in own for o in others)
    parent_text = " ".join(tokenizer.decode(t["output_ids"]) for t in parent["turns"])
    assert not any(m in parent_text for m in SIBLINGS)
    # and on the engine's side: each request that got a sibling's answer named that sibling's session
    for e in fork_stack.emissions():
        text = tokenizer.decode(e.output_ids)
        for marker in (m for m in SIBLINGS if m in text):
            assert e.session == seen[marker], (marker, e.session)
    for sid in [report["session_id"], *seen.values()]:
        httpx.post(f"{fork_stack.url}/api/sessions/{sid}/close", timeout=60)
