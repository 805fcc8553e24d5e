"""The Codex adapter's own logic, without running Codex: its command line (the provider and everything
that would fetch turned off, as ``-c`` overrides) and how it reads ``codex exec --json`` (a stream
recorded from Codex 0.171.0 on fix-greet; the episodes are in test_codex_episodes.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from harness_adapters.base import Episode
from harness_adapters.codex import INSIDE_BINARY, INSIDE_RG, Codex
from harness_adapters.registry import adapter

URL = "http://127.0.0.1:8000/s/ses_1/v1"
RUN = "/bin/bash -lc 'python3 -m unittest -q test_hello 2>&1 | tail -1'"
WARNING = "Model metadata for `policy` not found. Defaulting to fallback metadata; this can degrade performance and cause issues."
USAGE = {"input_tokens": 29787, "cached_input_tokens": 22335, "cache_write_input_tokens": 0,
         "output_tokens": 141, "reasoning_output_tokens": 0}  # fmt: skip


def run_item(n: int, command: str, output: str) -> dict[str, Any]:
    item = {"id": f"item_{n}", "type": "command_execution", "command": command}
    return {"type": "item.completed", "item": {**item, "aggregated_output": output, "exit_code": 0, "status": "completed"}}  # fmt: skip


STREAM: list[dict[str, Any]] = [
    {"type": "thread.started", "thread_id": "01a22e56-e911-7523-b193-9335f91fcdc7"},
    {"type": "item.completed", "item": {"id": "item_0", "type": "error", "message": WARNING}},
    {"type": "turn.started"},
    {
        "type": "item.started",
        "item": {
            "id": "item_1",
            "type": "command_execution",
            "command": RUN,
            "aggregated_output": "",
            "exit_code": None,
            "status": "in_progress",
        },
    },
    run_item(1, RUN, "FAILED (failures=1)\n"),
    run_item(2, '/bin/bash -lc "sed -i \'s/return \\"hello\\"/return \\"hello, world\\"/\' hello.py"', ""),
    run_item(3, RUN, "OK\n"),
    {"type": "item.completed", "item": {"id": "item_4", "type": "agent_message", "text": "Done."}},
    {"type": "turn.completed", "usage": USAGE},
]


def collect(events: list[dict[str, Any]], rc: int = 0) -> tuple[bool, dict[str, Any]]:
    stdout = "\n".join(json.dumps(e) for e in events) + "\n"
    outcome = Codex(Path("/nonexistent")).collect(
        subprocess.CompletedProcess([], rc, stdout, ""), Path("/"), 1.0
    )
    return outcome.ok, outcome.report


def test_registered_as_codex(tmp_path: Path) -> None:
    codex = adapter("codex", tmp_path, model="m")
    assert isinstance(codex, Codex) and (codex.model, codex.inside) == ("m", True)
    assert codex.prefix == tmp_path.resolve() / "codex"
    assert set(codex.image_files()) == {INSIDE_BINARY, INSIDE_RG}


def test_command_configures_the_session_inline(tmp_path: Path) -> None:
    codex = Codex(tmp_path)
    argv = codex.command(Episode("fix it", tmp_path), URL, tmp_path / "home", inside=True)
    assert argv[:5] == ["sh", "-c", 'mkdir -p "$CODEX_HOME" && exec "$@"', "codex", INSIDE_BINARY]
    assert argv[5] == "exec" and argv[-1] == "fix it"
    assert argv[-6:-1] == ["--skip-git-repo-check", "--ephemeral", "-s", "danger-full-access", "--json"]
    overrides = dict(v.split("=", 1) for k, v in zip(argv[6:-6:2], argv[7:-6:2], strict=True) if k == "-c")
    assert len(overrides) == len(argv[6:-6]) // 2  # nothing but -c pairs between
    assert overrides["model_provider"] == '"belayer"' and overrides["model"] == '"policy"'
    assert overrides["model_providers.belayer.base_url"] == json.dumps(URL)
    assert overrides["model_providers.belayer.wire_api"] == '"responses"'
    assert (overrides["approval_policy"], overrides["sandbox_mode"]) == ('"never"', '"danger-full-access"')
    for off in ("check_for_update_on_startup", "analytics.enabled", "feedback.enabled",
                "features.multi_agent", "features.image_generation"):  # fmt: skip
        assert overrides[off] == "false"
    assert overrides["web_search"] == '"disabled"'
    assert codex.env(URL, tmp_path) == {"CODEX_HOME": str(tmp_path / ".codex")}


def test_a_finished_episode() -> None:
    ok, report = collect(STREAM)
    assert ok is True
    assert report["tools"] == ["command_execution"] * 3
    assert report["commands"][0] == RUN
    assert (report["outputs"], report["exit_codes"]) == (["FAILED (failures=1)\n", "", "OK\n"], [0, 0, 0])
    assert (report["result"], report["usage"], report["turns"]) == ("Done.", USAGE, 1)
    assert (report["errors"], report["error_events"], report["warnings"]) == ([], [], [WARNING])


def test_a_failed_turn_is_not_ok() -> None:
    message = "Incomplete response returned, reason: max_output_tokens"
    failed = {"type": "turn.failed", "error": {"message": message}}
    ok, report = collect([*STREAM[:3], {"type": "error", "message": message}, failed], rc=1)
    assert ok is False
    assert (report["errors"], report["error_events"], report["turns"], report["usage"]) == (
        [failed],
        [message],
        0,
        {},
    )


def test_a_retry_is_not_an_error_and_no_usage_is_not_ok() -> None:
    retry = {"type": "error", "message": "Reconnecting... 1/5"}
    ok, report = collect([*STREAM[:-1], retry, STREAM[-1]])
    assert ok is True and report["error_events"] == ["Reconnecting... 1/5"]
    ok, _ = collect(STREAM[:-1])  # exit 0 without a completed turn: not a finished episode
    assert ok is False
