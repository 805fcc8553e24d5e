"""What an episode's report says besides the harness's own outcome (`harness_adapters.episode`).

`summarize` reads the session's trajectory: how the gateway built each prompt (prefix reuse, a fresh
prompt, or a branch), and for every branch the first place where the harness's history differs from
what it sent before (``branch_reasons``). The others shape the verify stage's verdict for the report and
for the reward (`reward_info`: no verifier output), the harness's outcome, and a Harbor task's settings.

Example::

    report = {**verdict_report(verdict), **outcome_report(outcome), **summarize(trajectory)}
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from harness_adapters.base import Outcome
from harness_adapters.task import Task


def harbor_report(task: Task) -> dict[str, Any]:
    if task.harbor is None:
        return {}
    spec = task.harbor
    storage = None
    if spec.storage_mb is not None:
        storage = {
            "asked_mb": spec.storage_mb,
            "enforced": False,
            "why": "the gateway's sandbox disk quota applies",
        }
    return {
        "harbor": {
            "name": spec.name, "workdir": task.workdir, "network": spec.network, "storage_mb": storage,
        }
    }  # fmt: skip


def verdict_report(verdict: dict[str, Any]) -> dict[str, Any]:
    return {
        "reward": verdict["reward"],
        "rewards": verdict.get("rewards"),
        "verify_mode": verdict.get("mode"),
        "verify_format": verdict.get("format"),
        "verified": verdict["verified"],
        "verifier_output": verdict["output"][-2000:],
        "verifier_exit_code": verdict["exit_code"],
        "verifier_timed_out": verdict["timed_out"],
        "protected_path_changes": verdict["changes"],
        "tamper_action": verdict["tamper_action"],
        "verify_reason": verdict.get("reason"),  # why there is no verdict: workspace_too_large
    }


def outcome_report(outcome: Outcome) -> dict[str, Any]:
    return {
        "harness_ok": outcome.ok,
        "harness_returncode": outcome.returncode,
        "harness_report": {k: v for k, v in outcome.report.items() if k != "messages"},
        "harness_stderr_tail": outcome.stderr[-2000:],
    }


def reward_info(verdict: dict[str, Any]) -> dict[str, Any]:
    """The verdict without the verifier's output (the reward is part of what a trainer reads back)."""
    keys = ("verified", "exit_code", "timed_out", "tamper_action", "protected_paths_modified", "seconds")
    extra = {"verify_reason": verdict.get("reason"), "verify_mode": verdict.get("mode")}
    if verdict.get("rewards") is not None:
        extra["rewards"] = verdict["rewards"]
    return {**{f"verify_{k}": verdict[k] for k in keys}, **extra}


def summarize(trajectory: dict[str, Any]) -> dict[str, Any]:
    """How the gateway built each prompt (prefix reuse, fresh, branch) and why each branch happened."""
    turns = trajectory["turns"]
    events = trajectory["events"]
    first: dict[int, str] = {}
    for e in events:
        if e["kind"] in ("prefix_reuse", "fresh_prompt", "branch") and e["turn_index"] is not None:
            first.setdefault(e["turn_index"], e["kind"])
    by_index = {t["index"]: t for t in turns}
    reasons = []
    for index, kind in sorted(first.items()):
        if kind == "prefix_reuse" or index == 0:
            continue
        previous = by_index.get(index - 1)
        turn = by_index[index]
        reasons.append({"turn": index, "kind": kind, **_first_difference(previous, turn)})
    statuses = Counter(t["status"] for t in turns)
    kinds = Counter(e["kind"] for e in events)
    return {
        "turns": len(turns),
        "statuses": dict(statuses),
        "prefix_reuse": sum(1 for k in first.values() if k == "prefix_reuse"),
        "fresh_prompts": sum(1 for k in first.values() if k == "fresh_prompt"),
        "branches": sum(1 for k in first.values() if k == "branch"),
        "branch_reasons": reasons,
        "failovers": kinds.get("failover", 0),
        "sandbox_checkpoints": kinds.get("sandbox_checkpoint", 0),
        "sandbox_checkpoint_failures": kinds.get("sandbox_checkpoint_failed", 0),
        "sandbox_restores": kinds.get("sandbox_restored", 0),
        "prompt_tokens": [len(t["prompt_ids"]) for t in turns],
        "output_tokens": [len(t["output_ids"]) for t in turns],
    }


def _first_difference(previous: dict[str, Any] | None, turn: dict[str, Any]) -> dict[str, Any]:
    """Where `turn`'s messages stop extending the previous turn's (request messages, then its reply)."""
    if previous is None:
        return {"difference": "no previous turn"}
    before, after = _messages(previous), _messages(turn)
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if _norm(a) != _norm(b):
            return {"message_index": i, "before": _norm(a)[:400], "after": _norm(b)[:400]}
    if len(after) <= len(before):
        return {"difference": f"history went from {len(before)} to {len(after)} messages"}
    reply = (previous.get("response") or {}).get("message")
    return {
        "message_index": len(before),
        "difference": "the harness sent back the reply differently from how the gateway gave it",
        "before": _norm(reply)[:400],
        "after": _norm(after[len(before)])[:400],
    }


def _messages(turn: dict[str, Any]) -> list[Any]:
    request = turn.get("request") or {}
    return list(request.get("messages") or [])


def _norm(message: Any) -> str:
    return json.dumps(_strip(message), sort_keys=True, ensure_ascii=False)


def _strip(value: Any) -> Any:
    """Drop what does not render into the prompt (Anthropic's cache_control moves between requests)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
