"""Trajectories in a form a trainer loads as they are: one row per branch of each session.

A row splits the branch's token sequence where the policy's part begins: ``prompt_ids`` is the context
before the first token that has a logprob (the first turn's prompt, unless a rewritten assistant
message comes first), ``response_ids`` is everything after it: every turn's generated tokens and the
tool and user tokens between turns. Aligned with ``response_ids``: ``response_mask`` (1 where the
policy generated the token), ``response_logprobs`` (the sampled logprobs; the engine's recomputed
ones on a rewritten assistant span; 0.0 on context tokens, which have mask 0) and ``recomputed_mask``.
``turn_spans`` locates each turn's generated tokens in ``response_ids``, so that turn ``k``'s prompt is
``prompt_ids + response_ids[:turn_spans[k]["start"]]``; ``weight_segments`` says which weight version
generated each run of them (a failover or a weight update splits a turn), and ``weight_versions`` lists
those versions in order (slime's ``Sample.weight_versions``). The columns, and how they map to verl's,
SkyRL's and slime's fields, are in ``docs/export.md``. JSONL and Parquet carry the same columns: both
are written from one Arrow table (`row_schema`).

Example::

    belayer export --store trajectories.db --format parquet --out rollouts.parquet --status closed
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.atif import write_trajectories
from core.errors import NotFound
from store import EventRecord, SessionQuery, SessionRecord, TurnRecord
from store.base import TURN_COMPLETE
from store.roles import Exporter, TrajectoryReader

if TYPE_CHECKING:
    import pyarrow as pa


def _dumps(value: object) -> str:
    """JSON that any reader can parse back: a non-finite number is an error here, never stored."""
    return json.dumps(value, allow_nan=False)


Runs = list[tuple[int, list[float | None]]]
"""(start, logprobs) runs of recomputed prompt logprobs."""

Span = tuple[int, int, TurnRecord | None]
"""(start, end, turn): tokens of a sequence that `turn` generated (None: a turn no longer stored)."""


def generated_spans(turn: TurnRecord, by_id: dict[int, TurnRecord]) -> list[Span]:
    """The spans of ``turn.prompt_ids`` that earlier turns generated, with those turns, in prompt
    order. A span recorded without its turn id (-1, older stores) belongs to the turn's ancestors,
    which are taken in order."""
    chain: list[TurnRecord] = []
    parent = turn.parent_id
    while parent is not None and parent in by_id:
        chain.append(by_id[parent])
        parent = by_id[parent].parent_id
    chain.reverse()
    positional = iter(chain)
    spans = [
        (start, end, by_id.get(source) if source >= 0 else next(positional, None))
        for start, end, source in turn.prompt_gen_spans
    ]
    return sorted(spans, key=lambda s: s[0])


def aligned_logprobs(
    turn: TurnRecord,
    by_id: dict[int, TurnRecord],
    recomputed: Runs | None = None,
) -> list[float | None]:
    """Logprobs aligned with ``prompt_ids + output_ids``: a generated span of the prompt has the
    logprobs its turn sampled; a rewritten span has those the engine recomputed (``recomputed``:
    (start, logprobs) runs, from ``recomputed_logprobs`` events); other prompt tokens have None."""
    out: list[float | None] = [None] * len(turn.prompt_ids)
    for start, values in recomputed or []:
        out[start : start + len(values)] = values
    for start, end, origin in generated_spans(turn, by_id):
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


def metadata_text(metadata: dict[str, Any]) -> dict[str, str | None]:
    """Top-level metadata as text, for the ``metadata`` struct: a string as it is, null as null, any
    other value as its JSON (``metadata_json`` keeps the values as they were).

    >>> metadata_text({"task": "t1", "seed": 3, "tags": ["a"], "note": None})
    {'task': 't1', 'seed': '3', 'tags': '["a"]', 'note': None}
    """
    return {
        k: v if isinstance(v, str) or v is None else json.dumps(v, allow_nan=False, separators=(",", ":"))
        for k, v in metadata.items()
    }


def weight_segments(turns: list[Span], split: int) -> list[dict[str, Any]]:
    """Where each turn's weight segments sit in ``response_ids`` (the sequence cut at `split`): a turn
    whose output is the span (start, end) of the sequence has its output positions shifted by start;
    a span that keeps only part of its turn's output keeps the segments' part in it.

    >>> t = TurnRecord("s", [], [], None, None, {}, 0.0, weight_segments=[(0, 2, "v1"), (2, 5, "v2")])
    >>> weight_segments([(10, 14, t)], 8)
    [{'start': 2, 'end': 4, 'version': 'v1'}, {'start': 4, 'end': 6, 'version': 'v2'}]
    """
    out = []
    for start, end, turn in turns:
        for a, b, version in turn.weight_segments if turn is not None else []:
            a, b = start + a, min(start + b, end)
            if a < b:
                out.append({"start": a - split, "end": b - split, "version": version})
    return out


def branch_row(
    session: SessionRecord, leaf: TurnRecord, by_id: dict[int, TurnRecord], runs: Runs
) -> dict[str, Any]:
    """One branch (the sequence that ends with `leaf`) as an export row; see the module docstring."""
    sequence = leaf.prompt_ids + leaf.output_ids
    prompt_len = len(leaf.prompt_ids)
    turns = [*generated_spans(leaf, by_id), (prompt_len, len(sequence), leaf)]
    # The prompt ends at the first token with a logprob: generated, or rewritten and recomputed. So a
    # recomputed span is never hidden in the prompt, and in the usual case it is the first turn's prompt.
    split = min([prompt_len] + [start for start, _, _ in turns] + [start for start, vs in runs if vs])
    logprobs = aligned_logprobs(leaf, by_id, runs)[split:]
    segments = weight_segments(turns, split)
    return {
        "session_id": session.id,
        "branch": leaf.branch,
        "prompt_ids": sequence[:split],
        "response_ids": sequence[split:],
        "response_mask": leaf.loss_mask()[split:],
        "response_logprobs": [0.0 if lp is None else lp for lp in logprobs],
        "recomputed_mask": recomputed_mask(leaf, runs)[split:],
        "num_turns": len(turns),
        "turn_spans": [{"start": a - split, "end": b - split} for a, b, _ in turns],
        "turn_indices": [t.index if t is not None else None for _, _, t in turns],
        "turn_workers": [t.worker if t is not None else None for _, _, t in turns],
        "weight_segments": segments,
        "weight_versions": [s["version"] for s in segments],
        "finish_reason": leaf.finish_reason,
        "reward": session.reward,
        "status": session.status,
        "created_at": session.created_at,
        "metadata": metadata_text(session.metadata),
        "metadata_json": _dumps(session.metadata),
        "parent_session": session.parent_session,
        "fork_turn": session.fork_turn,
    }


def session_rows(store: TrajectoryReader, session_id: str) -> list[dict[str, Any]]:
    """The session's export rows, one per branch (``[]`` for an unknown session)."""
    session = store.get_session(session_id)
    if session is None:
        return []
    turns = store.get_turns(session_id)
    by_id = {t.id: t for t in turns}
    events = [e for sid in {t.session_id for t in turns} | {session_id} for e in store.get_events(sid)]
    recomputed = recomputed_runs(events)
    # A fork child's rows are its own branches: those that end in the turns it shares are its parent's.
    leaves = [leaf for leaf in branch_leaves(turns) if leaf.session_id == session_id]
    return [branch_row(session, leaf, by_id, recomputed.get(leaf.id, [])) for leaf in leaves]


PAGE = 1000
"""Sessions read from the store per query while an export pages through its matches."""


def matching_sessions(
    store: TrajectoryReader, query: SessionQuery, page_size: int = PAGE
) -> Iterator[SessionRecord]:
    """Every session that `query`'s filters match (its limit, offset and order are ignored), oldest
    first, read a page at a time."""
    offset = 0
    while True:
        page = replace(query, limit=page_size, offset=offset, newest_first=False)
        sessions, _ = store.query_sessions(page)
        yield from sessions
        if len(sessions) < page_size:
            return
        offset += page_size


def export(
    store: Exporter,
    out: str | Path,
    fmt: str,
    session_ids: list[str] | None = None,
    query: SessionQuery | None = None,
) -> int:
    """Write the sessions' branches to ``out``; returns the number of rows (ATIF: trajectories, one
    ``trajectory.json`` each under the directory ``out``, `core.atif`). Without `query`, every
    stored session (one-off ``/v1`` requests included) or the given ones; with it, the sessions its
    filters match (among the given ones, if any). An unknown session id raises `NotFound` before
    anything is written."""
    unknown = [sid for sid in session_ids or [] if store.get_session(sid) is None]
    if unknown:
        raise NotFound(f"no session {', '.join(map(repr, unknown))} in the store")
    if query is None:
        ids = session_ids or [s.id for s in store.list_sessions()]
    else:
        wanted = set(session_ids or [])
        ids = [s.id for s in matching_sessions(store, query) if not wanted or s.id in wanted]
    path = Path(out)
    if fmt == "atif":  # a directory: one trajectory.json per branch, as Harbor lays them out
        from store.atif import session_trajectories  # it builds on this module

        n = write_trajectories((t for sid in ids for t in session_trajectories(store, sid)), path)
    else:
        rows = [row for sid in ids for row in session_rows(store, sid)]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.write(encode_rows(rows, fmt))
        n = len(rows)
    store.mark_exported(ids)  # for `belayer store prune --exported-only`
    return n


def encode_sessions(store: TrajectoryReader, session_ids: list[str], fmt: str) -> tuple[bytes, int]:
    """The sessions' export in `fmt` as one body (ATIF: JSON Lines, one trajectory per line), and how
    many rows or trajectories it holds."""
    if fmt == "atif":
        from store.atif import encode_trajectories, session_trajectories

        trajectories = [t for sid in session_ids for t in session_trajectories(store, sid)]
        return encode_trajectories(trajectories), len(trajectories)
    rows = [row for sid in session_ids for row in session_rows(store, sid)]
    return encode_rows(rows, fmt), len(rows)


FORMATS = {
    "jsonl": "application/x-ndjson",
    "parquet": "application/vnd.apache.parquet",
    "atif": "application/x-ndjson",
}
"""The export formats and their media types over HTTP (``atif``: one ATIF trajectory per line;
``belayer export`` writes those to a directory instead, `core.atif`)."""


def row_schema(metadata_keys: list[str]) -> pa.Schema:
    """The export's columns, for JSONL and Parquet alike. ``metadata`` is a struct of the exported
    sessions' top-level keys (null when no session has any: Parquet has no empty struct)."""
    import pyarrow as pa

    tokens = pa.list_(pa.int32())
    mask = pa.list_(pa.int8())
    metadata = pa.struct([(k, pa.string()) for k in metadata_keys]) if metadata_keys else pa.null()
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("branch", pa.int32()),
            ("prompt_ids", tokens),
            ("response_ids", tokens),
            ("response_mask", mask),
            ("response_logprobs", pa.list_(pa.float64())),
            ("recomputed_mask", mask),
            ("num_turns", pa.int32()),
            ("turn_spans", pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32())]))),
            ("turn_indices", pa.list_(pa.int32())),
            ("turn_workers", pa.list_(pa.string())),
            (
                "weight_segments",
                pa.list_(pa.struct([("start", pa.int32()), ("end", pa.int32()), ("version", pa.string())])),
            ),
            ("weight_versions", pa.list_(pa.string())),
            ("finish_reason", pa.string()),
            ("reward", pa.float64()),
            ("status", pa.string()),
            ("created_at", pa.float64()),
            ("metadata", metadata),
            ("metadata_json", pa.string()),
            ("parent_session", pa.string()),
            ("fork_turn", pa.int32()),
        ]
    )


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    """The rows as one Arrow table with `row_schema`: every row gets every metadata key (null where
    its session has none), and a column the schema lacks is an error, not a silent drop."""
    import pyarrow as pa

    keys = sorted({k for row in rows for k in row["metadata"]})
    schema = row_schema(keys)
    extra = {k for row in rows for k in row} - set(schema.names)
    if extra:
        raise ValueError(f"export rows have columns the schema lacks: {sorted(extra)}")
    filled = [
        {**row, "metadata": {k: row["metadata"].get(k) for k in keys} if keys else None} for row in rows
    ]
    return pa.Table.from_pylist(filled, schema=schema)


def encode_rows(rows: list[dict[str, Any]], fmt: str) -> bytes:
    """Rows as a JSONL or Parquet file's bytes, both from the same Arrow table."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"unknown export format '{fmt}' for rows; use jsonl or parquet")
    table = rows_table(rows)
    if fmt == "jsonl":
        return "".join(_dumps(row) + "\n" for row in table.to_pylist()).encode()
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
