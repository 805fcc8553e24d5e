"""`belayer export` writes trajectories a trainer can load directly (jsonl and parquet)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from belayer.cli import main as cli
from tests.support import GatewayHarness


async def _episode(gw: GatewayHarness) -> tuple[str, list[dict[str, Any]]]:
    gw.queue_replies("first", "second", "rewritten")
    sid, _ = await gw.new_session(task="export")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    r = await gw.client.post(f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": msgs})
    msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "b"}]
    await gw.client.post(f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": msgs})
    await gw.client.post(
        f"/s/{sid}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "z"}]},
    )
    await gw.client.post(f"/api/sessions/{sid}/reward", json={"reward": 1.0})
    turns = (await gw.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
    return sid, turns


async def test_export_jsonl_and_parquet(gateway: GatewayHarness, tmp_path: Path, capsys: Any) -> None:
    sid, turns = await _episode(gateway)
    db = gateway.gw.config.store_path
    assert cli(["export", "--store", db, "--format", "jsonl", "--out", str(tmp_path / "t.jsonl")]) == 0
    assert (
        cli(
            [
                "export",
                "--store",
                db,
                "--format",
                "parquet",
                "--out",
                str(tmp_path / "t.parquet"),
                "--session",
                sid,
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    table = pq.read_table(tmp_path / "t.parquet").to_pylist()
    assert len(rows) == len(table) == 2  # the main branch and the rewritten one
    main, other = rows
    leaf = turns[1]
    assert main["input_ids"] == leaf["prompt_ids"] + leaf["output_ids"]
    assert main["loss_mask"] == leaf["loss_mask"] and main["logprobs"] == leaf["logprobs"]
    assert (
        main["num_turns"] == 2
        and main["reward"] == 1.0
        and json.loads(main["metadata"]) == {"task": "export"}
    )
    assert other["input_ids"] == turns[2]["prompt_ids"] + turns[2]["output_ids"] and other["branch"] == 1
    for a, b in zip(rows, table, strict=True):
        assert (
            b["input_ids"] == a["input_ids"]
            and b["loss_mask"] == a["loss_mask"]
            and b["logprobs"] == a["logprobs"]
        )
    assert "exported 2 trajectories" in capsys.readouterr().out
