"""Stored rows and the records read from them: the columns read, the decoding of a turn stored as a
segment of its base (`store.layout`), and what a fork child's writes need to know of its shared turns."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any

from core.errors import StoreError
from store import layout, schema
from store.base import SessionRecord, TurnRecord, split_group

TURN_COLS = (
    "id, session_id, idx, branch, parent_id, ext_key, status, prompt_ids, prompt_gen_spans, output_ids, "
    "output_logprobs, request, response, finish_reason, worker, timings, error, received_at, base_id, "
    "prompt_base, spans_base, request_delta, weight_segments"
)
SESSION_COLS = (
    "id, created_at, metadata, status, reward, reward_info, closed_at, ephemeral, parent_session, fork_turn"
)

_loads = schema.load_json


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _segments(text: str | None) -> list[tuple[int, int, str]]:
    """Weight segments as stored (NULL: a turn stored before versions were recorded)."""
    return [(int(a), int(b), str(v)) for a, b, v in _loads(text)] if text else []


def dump_segments(segments: list[tuple[int, int, str]] | None) -> str | None:
    return schema.dump_json([list(s) for s in segments]) if segments is not None else None


def _floats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def shape(turn: TurnRecord) -> layout.Turn:
    return layout.Turn(turn.prompt_ids, turn.output_ids, turn.prompt_gen_spans, turn.request)


def turn_record(row: tuple[Any, ...], base: TurnRecord | None) -> TurnRecord:
    """A turn from its row (`TURN_COLS`) and, when it is stored as a segment (``base_id``), its base."""
    if row[18] is not None and base is None:
        raise StoreError(f"turn {row[0]} is stored beyond turn {row[18]}, which is missing")
    stored = layout.Encoded(
        row[18] is not None,
        row[19],
        layout.unpack_ids(row[7]),
        row[20],
        schema.load_spans(row[8]),
        _loads(row[11]),
        bool(row[21]),
    )
    prompt_ids, spans, request = layout.decode(stored, shape(base) if base is not None else None)
    return TurnRecord(
        id=row[0],
        session_id=row[1],
        index=row[2],
        branch=row[3],
        parent_id=row[4],
        ext_key=row[5],
        status=row[6],
        prompt_ids=prompt_ids,
        prompt_gen_spans=spans,
        output_ids=layout.unpack_ids(row[9]),
        output_logprobs=_floats(row[10]),
        request=request,
        response=_loads(row[12]) if row[12] else None,
        finish_reason=row[13],
        worker=row[14],
        timings=_loads(row[15]),
        error=row[16],
        received_at=row[17],
        weight_segments=_segments(row[22]),
    )


def session_record(row: tuple[Any, ...]) -> SessionRecord:
    """A session from its row (`SESSION_COLS`)."""
    metadata, group, seed = split_group(_loads(row[2]))
    return SessionRecord(
        id=row[0],
        created_at=row[1],
        metadata=metadata,
        status=row[3],
        reward=_finite(row[4]),  # an older version stored inf / NaN rewards
        reward_info=_loads(row[5]) if row[5] else None,
        closed_at=row[6],
        ephemeral=bool(row[7]),
        parent_session=row[8],
        fork_turn=row[9],
        group=group,
        seed=seed,
    )


@dataclass(frozen=True, slots=True)
class Fork:
    """What writing a fork child's turns needs to know of the turns it shares (fixed at the fork)."""

    at_turn: int
    turn_id: int
    """The shared turn at index `at_turn`."""
    ids: frozenset[int]
    newest: dict[int, int]
    """Branch -> the newest shared turn's id on it."""
    max_branch: int
