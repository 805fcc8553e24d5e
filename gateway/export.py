"""Trajectories in a form a trainer loads directly: one row per branch of each session.

A row holds the branch's full token sequence (``input_ids`` = its last turn's prompt + output), the
loss mask (1 where the policy generated the token), the generated tokens' logprobs aligned with
``input_ids`` (null for context tokens), the reward, and the session's metadata.

Example::

    belayer export --store trajectories.db --format parquet --out rollouts.parquet
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import NotFound
from gateway.store import EventRecord, TrajectoryStore, TurnRecord
from gateway.store.base import TURN_COMPLETE


def _dumps(value: object) -> str:
    """JSON that any reader can parse back: a non-finite number is an error here, never stored."""
    return json.dumps(value, allow_nan=False)


Runs = list[tuple[int, list[float | None]]]
"""(start, logprobs) runs of recomputed prompt logprobs."""


def aligned_logprobs(
    turn: TurnRecord,
    by_id: dict[int, TurnRecord],
    recomputed: Runs | None = None,
) -> list[float | None]:
    """Logprobs aligned with ``prompt_ids + output_ids``: a generated span of the prompt has the
    logprobs its turn sampled; a rewritten span has those the engine recomputed (``recomputed``:
    (start, logprobs) runs, from ``recomputed_logprobs`` events); other prompt tokens have None."""
    chain: list[TurnRecord] = []
    parent = turn.parent_id
    while parent is not None and parent in by_id:
        chain.append(by_id[parent])
        parent = by_id[parent].parent_id
    chain.reverse()
    out: list[float | None] = [None] * len(turn.prompt_ids)
    for start, values in recomputed or []:
        out[start : start + len(values)] = values
    positional = iter(chain)  # spans recorded without their turn id belong to the ancestors, in order
    for start, end, source in turn.prompt_gen_spans:
        origin = by_id.get(source) if source >= 0 else next(positional, None)
        if origin is not None:
            out[start:end] = origin.output_logprobs[: end - start]
    return out + list(turn.output_logprobs)


def recomputed_mask(turn: TurnRecord, runs: Runs) -> list[int]:
    """1 for the prompt tokens whose logprobs were recomputed (rewritten assistant text), else 0."""
    mask = [0] * (len(turn.prompt_ids) + len(turn.output_ids))
    for start, values in runs:
        mask[start : start + len(values)] = [1] * len(values)
    return mask


def recomputed_runs(events: list[EventRecord]) -> dict[int, Runs]:
    """The ``recomputed_logprobs`` events, as (start, logprobs) runs per turn id (one pass)."""
    runs: dict[int, Runs] = {}
    for e in events:
        if e.kind == "recomputed_logprobs" and e.turn_id is not None:
            runs.setdefault(e.turn_id, []).extend(
                (int(start), list(values)) for start, values in e.data["runs"]
            )
    return runs


def branch_leaves(turns: list[TurnRecord]) -> list[TurnRecord]:
    """The newest complete turn of every branch."""
    leaves: dict[int, TurnRecord] = {}
    for t in turns:
        if t.status == TURN_COMPLETE:
            leaves[t.branch] = t
    return [leaves[b] for b in sorted(leaves)]


def session_rows(store: TrajectoryStore, session_id: str) -> list[dict[str, Any]]:
    session = store.get_session(session_id)
    if session is None:
        return []
    turns = store.get_turns(session_id)
    by_id = {t.id: t for t in turns}
    recomputed = recomputed_runs(store.get_events(session_id))
    rows = []
    for leaf in branch_leaves(turns):
        rows.append(
            {
                "session_id": session_id,
                "branch": leaf.branch,
                "num_turns": sum(1 for t in turns if t.branch == leaf.branch and t.status == TURN_COMPLETE),
                "input_ids": leaf.prompt_ids + leaf.output_ids,
                "loss_mask": leaf.loss_mask(),
                "logprobs": aligned_logprobs(leaf, by_id, recomputed.get(leaf.id)),
                "recomputed_mask": recomputed_mask(leaf, recomputed.get(leaf.id, [])),
                "prompt_len": len(leaf.prompt_ids),
                "finish_reason": leaf.finish_reason,
                "reward": session.reward,
                "status": session.status,
                "metadata": _dumps(session.metadata),
            }
        )
    return rows


def export(store: TrajectoryStore, out: str | Path, fmt: str, session_ids: list[str] | None = None) -> int:
    """Write every (or the given) session's branches to ``out``; returns the number of rows. An unknown
    session id raises `NotFound` before anything is written."""
    unknown = [sid for sid in session_ids or [] if store.get_session(sid) is None]
    if unknown:
        raise NotFound(f"no session {', '.join(map(repr, unknown))} in the store")
    ids = session_ids or [s.id for s in store.list_sessions()]
    rows = [row for sid in ids for row in session_rows(store, sid)]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(encode_rows(rows, fmt))
    return len(rows)


FORMATS = {"jsonl": "application/x-ndjson", "parquet": "application/vnd.apache.parquet"}
"""The export formats and their media types."""


def encode_rows(rows: list[dict[str, Any]], fmt: str) -> bytes:
    """Rows as a JSONL or Parquet file's bytes."""
    if fmt == "jsonl":
        return "".join(_dumps(row) + "\n" for row in rows).encode()
    if fmt == "parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [
                ("session_id", pa.string()),
                ("branch", pa.int32()),
                ("num_turns", pa.int32()),
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.int8())),
                ("logprobs", pa.list_(pa.float64())),
                ("prompt_len", pa.int32()),
                ("finish_reason", pa.string()),
                ("reward", pa.float64()),
                ("status", pa.string()),
                ("metadata", pa.string()),
            ]
        )
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
        return buf.getvalue()
    raise ValueError(f"unknown export format '{fmt}'; use jsonl or parquet")
