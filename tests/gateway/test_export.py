"""`belayer export` writes trajectories a trainer loads as they are (JSONL and Parquet, one schema).

The episodes go through the gateway app over the scripted fake engine: three turns with tool results
between them, a branch off the first turn, and a rewritten history whose logprobs are recomputed. The
checks rebuild every turn's prompt and output from the columns and hold masks and logprobs to the store.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from belayer.cli import main as cli
from store import SessionQuery, SqliteStore, TurnRecord
from store.export import encode_rows, matching_sessions, session_rows
from tests.support import GatewayHarness

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


async def chat(gw: GatewayHarness, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "policy", "messages": messages, "tools": TOOLS}
    r = await gw.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()["choices"][0]["message"]
    return out


def tool_result(call: dict[str, Any], content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": content}


async def episode(gw: GatewayHarness) -> str:
    """Three turns with tool results between them (branch 0), a second tool result for the first
    call (branch 1, off turn 0), and a rewritten first answer (branch 2: its logprobs recomputed)."""
    gw.queue_replies("Let me look." + CALL, "Once more." + CALL, "Done.", "Other.", "Fine.")
    sid, _ = await gw.new_session(task="export", seed=3, tags=["a"])
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
    ]
    m1 = await chat(gw, sid, msgs)
    m2 = await chat(gw, sid, [*msgs, m1, tool_result(m1, "a.py b.py")])
    await chat(gw, sid, [*msgs, m1, tool_result(m1, "a.py b.py"), m2, tool_result(m2, "c.py")])
    await chat(gw, sid, [*msgs, m1, tool_result(m1, "nothing here")])
    summary = {"role": "assistant", "content": "(summary)"}
    await chat(gw, sid, [*msgs, summary, {"role": "user", "content": "go on"}])
    await gw.gw.runner.idle()  # the rewritten answer's logprobs are recomputed in the background
    assert (await gw.client.post(f"/api/sessions/{sid}/reward", json={"reward": 1.0})).status_code == 200
    assert (await gw.client.post(f"/api/sessions/{sid}/close")).status_code == 200
    return sid


async def open_session(gw: GatewayHarness) -> str:
    gw.queue_replies("Hi.")
    sid, _ = await gw.new_session()
    await chat(gw, sid, [{"role": "user", "content": "hello"}])
    return sid


def export_rows(db: str, out: Path, fmt: str, *flags: str) -> list[dict[str, Any]]:
    assert cli(["export", "--store", db, "--format", fmt, "--out", str(out), *flags]) == 0
    if fmt == "jsonl":
        return [json.loads(line) for line in out.read_text().splitlines()]
    import datasets  # a trainer's loader (slow to import: only where a test reads Parquet)

    rows: list[dict[str, Any]] = datasets.Dataset.from_parquet(
        str(out), cache_dir=str(out.parent / "hf-cache")
    ).to_list()
    return rows


def check_row(row: dict[str, Any], turns: dict[int, TurnRecord], traj: dict[int, dict[str, Any]]) -> None:
    """Rebuild each turn of the row from its columns, and hold masks and logprobs to the store."""
    prompt, response = row["prompt_ids"], row["response_ids"]
    n = len(response)
    assert len(row["response_mask"]) == len(row["response_logprobs"]) == len(row["recomputed_mask"]) == n
    assert row["num_turns"] == len(row["turn_spans"]) == len(row["turn_indices"]) == len(row["turn_workers"])
    assert row["weight_versions"] == [s["version"] for s in row["weight_segments"]]
    segments = []
    generated = [0] * n
    for span, index, worker in zip(row["turn_spans"], row["turn_indices"], row["turn_workers"], strict=True):
        turn = turns[index]
        start, end = span["start"], span["end"]
        segments += [{"start": start + a, "end": start + b, "version": v} for a, b, v in turn.weight_segments]
        assert prompt + response[:start] == turn.prompt_ids  # the exact prompt this turn was sampled from
        assert response[start:end] == turn.output_ids
        assert row["response_logprobs"][start:end] == turn.output_logprobs
        assert worker == turn.worker and worker is not None
        generated[start:end] = [1] * (end - start)
    assert row["response_mask"] == generated  # 1 exactly on the turns' outputs: tool and user tokens are 0
    assert row["weight_segments"] == segments and segments  # each turn's tokens, with their weight version
    leaf = turns[row["turn_indices"][-1]]
    assert prompt + response == leaf.prompt_ids + leaf.output_ids
    split = len(prompt)
    assert row["response_mask"] == leaf.loss_mask()[split:]
    shown = traj[leaf.index]  # GET /trajectory's view of the same leaf: recomputed spans included
    assert row["recomputed_mask"] == shown["recomputed_mask"][split:]
    assert row["response_logprobs"] == [0.0 if lp is None else lp for lp in shown["logprobs"][split:]]
    for lp, mask, recomputed in zip(
        row["response_logprobs"], row["response_mask"], row["recomputed_mask"], strict=True
    ):
        if not mask and not recomputed:
            assert lp == 0.0  # context: no logprob, 0.0 with mask 0
        if recomputed:
            assert mask == 0  # rewritten text: the engine's logprobs, but never trained on as sampled


async def test_rows_rebuild_every_turn_and_match_the_store(gateway: GatewayHarness, tmp_path: Path) -> None:
    sid = await episode(gateway)
    db = gateway.gw.config.store_path
    store = gateway.gw.store
    turns = {t.index: t for t in store.get_turns(sid)}
    traj = {
        t["index"]: t for t in (await gateway.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
    }

    rows = export_rows(db, tmp_path / "t.jsonl", "jsonl")
    assert [(r["branch"], r["num_turns"], r["turn_indices"]) for r in rows] == [
        (0, 3, [0, 1, 2]),
        (1, 2, [0, 3]),  # the branch off turn 0 carries turn 0's output
        (2, 1, [4]),  # rewritten history: one sampled turn after a recomputed span
    ]
    for row in rows:
        check_row(row, turns, traj)
    main, _, rewritten = rows
    assert main["prompt_ids"] == turns[0].prompt_ids  # the first turn's prompt, not the last one's
    tok = gateway.gw.tokenizer
    between = [t for t, m in zip(main["response_ids"], main["response_mask"], strict=True) if not m]
    assert "a.py b.py" in tok.decode(between) and "c.py" in tok.decode(between)  # tool results: mask 0
    span = [i for i, m in enumerate(rewritten["recomputed_mask"]) if m]
    assert span and span[0] == 0  # the prompt ends where the recomputed span starts
    text = tok.decode([rewritten["response_ids"][i] for i in span], skip_special_tokens=False)
    assert text == "(summary)<|im_end|>"
    assert all(rewritten["response_logprobs"][i] != 0.0 for i in span)
    assert main["reward"] == 1.0 and main["status"] == "closed" and main["finish_reason"] == "stop"
    assert main["metadata"] == {"seed": "3", "tags": '["a"]', "task": "export"}
    assert json.loads(main["metadata_json"]) == {"task": "export", "seed": 3, "tags": ["a"]}


async def test_parquet_carries_every_jsonl_column_and_value(gateway: GatewayHarness, tmp_path: Path) -> None:
    await episode(gateway)
    await open_session(gateway)  # no metadata: null in the struct's fields
    db = gateway.gw.config.store_path
    started = time.perf_counter()
    jsonl = export_rows(db, tmp_path / "t.jsonl", "jsonl")
    parquet = export_rows(db, tmp_path / "t.parquet", "parquet")  # loaded with `datasets`
    # A hang or a per-row cost gone wrong, not a speed: importing `datasets` alone takes seconds on a
    # loaded machine.
    assert time.perf_counter() - started < 60
    assert len(jsonl) == 4 and parquet == jsonl  # the same columns, in the same order, with the same values
    assert list(parquet[0]) == pq.read_schema(tmp_path / "t.parquet").names
    assert parquet[3]["metadata"] == {"seed": None, "tags": None, "task": None}
    assert parquet[3]["metadata_json"] == "{}" and parquet[3]["reward"] is None


def test_metadata_is_null_when_no_session_has_any() -> None:
    row = {
        "session_id": "ses_1",
        "branch": 0,
        "prompt_ids": [1],
        "response_ids": [2],
        "response_mask": [1],
        "response_logprobs": [-0.5],
        "recomputed_mask": [0],
        "num_turns": 1,
        "turn_spans": [{"start": 0, "end": 1}],
        "turn_indices": [0],
        "turn_workers": [None],
        "weight_segments": [],
        "weight_versions": [],
        "finish_reason": "stop",
        "reward": None,
        "status": "open",
        "created_at": 0.0,
        "metadata": {},
        "metadata_json": "{}",
        "parent_session": None,
        "fork_turn": None,
    }
    [line] = encode_rows([row], "jsonl").decode().splitlines()
    assert json.loads(line) == {**row, "metadata": None}
    with pytest.raises(ValueError, match="columns the schema lacks: \\['extra'\\]"):
        encode_rows([{**row, "extra": 1}], "jsonl")


async def test_filters_select_sessions(gateway: GatewayHarness, tmp_path: Path) -> None:
    closed = await episode(gateway)
    opened = await open_session(gateway)
    db = gateway.gw.config.store_path

    def sessions(*flags: str) -> list[str]:
        return sorted({r["session_id"] for r in export_rows(db, tmp_path / "f.jsonl", "jsonl", *flags)})

    assert sessions() == sorted([closed, opened])
    assert sessions("--status", "closed") == [closed]
    assert sessions("--status", "open") == [opened]
    assert sessions("--rewarded-only") == [closed]
    assert sessions("--since", "1h") == sorted([closed, opened])
    assert sessions("--since", "2999-01-01") == []
    assert sessions("--status", "open", "--session", closed) == []
    assert sessions("--since", "1970-01-01T00:00:00Z", "--session", closed) == [closed]
    # The store is read a page at a time: every match comes back once, oldest first.
    store = SqliteStore(db)
    try:
        paged = [s.id for s in matching_sessions(store, SessionQuery(), page_size=1)]
    finally:
        store.close()
    assert paged == [closed, opened] and session_rows(gateway.gw.store, "nope") == []


def test_since_is_a_duration_or_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "empty.db"
    SqliteStore(str(db)).close()
    argv = ["export", "--store", str(db), "--format", "jsonl", "--out", str(tmp_path / "o.jsonl")]
    assert cli([*argv, "--since", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "--since yesterday: not a time; give a duration back from now (30m, 2h, 7d, 1w)" in err
    assert cli([*argv, "--since=-2h"]) == 2
    assert cli([*argv, "--since", "7d", "--status", "closed", "--rewarded-only"]) == 0
    assert "exported 0 trajectories" in capsys.readouterr().out
