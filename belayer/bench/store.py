"""``belayer bench store``: store bytes per generated token, the old layout against the current one.

``--episodes`` scripted episodes of ``--turns`` turns each grow as an agent's do: a system prompt and
tools, then per turn ~``--generated`` generated tokens (an assistant message with a tool call) and
~``--tool-output`` tokens of tool output, with requests whose ``messages`` grow by those two messages.
The same episodes are written

* as the store wrote them before schema version 2 (every turn's whole prompt ids and whole request:
  O(turns²) per episode), with a copy of that version's SQL, and
* through `SqliteStore` (each turn as what it adds to its parent: O(tokens)),

and each file's size (after a WAL checkpoint) is divided by the generated tokens. The old file is then
opened with `SqliteStore`, which migrates it in place; its trajectories must read back exactly.

With ``--postgres URL`` (or ``auto``: a throwaway local server, `belayer.testing.postgres_local`, with fsync on)
the same episodes are also written through `PostgresStore`, in the same run: its write and read
times (``pg_*``) next to SQLite's (``new_*``), its bytes, whether it reads back exactly, and the write
time per turn of two store instances (two gateway replicas) writing half the episodes each at once.

Figures go to stdout as ``name: value`` lines (``target_*: pass|fail``: at least 10× smaller).
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from belayer.bench import emit
from core.events import PrefixReuse
from store import SessionRecord, SqliteStore, TrajectoryStore, TurnRecord
from store.base import TURN_COMPLETE

V1_SCHEMA = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY, created_at REAL NOT NULL, metadata TEXT NOT NULL, status TEXT NOT NULL,
    reward REAL, reward_info TEXT, closed_at REAL, ephemeral INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    idx INTEGER NOT NULL, branch INTEGER NOT NULL, parent_id INTEGER, ext_key TEXT,
    status TEXT NOT NULL, prompt_ids BLOB NOT NULL, prompt_gen_spans TEXT NOT NULL,
    output_ids BLOB NOT NULL, output_logprobs BLOB NOT NULL, request TEXT NOT NULL, response TEXT,
    finish_reason TEXT, worker TEXT, timings TEXT NOT NULL, error TEXT, received_at REAL NOT NULL,
    UNIQUE (session_id, idx)
);
CREATE INDEX turns_ext ON turns (session_id, ext_key);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, turn_id INTEGER, ts REAL NOT NULL,
    kind TEXT NOT NULL, data TEXT NOT NULL
);
CREATE INDEX events_session ON events (session_id);
CREATE INDEX sessions_created ON sessions (created_at);
"""
"""The store's tables before schema version 2 (verbatim)."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name}: " + "run it and read what it prints. " * 8,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
        },
    }
    for name in ("bash", "read_file", "write_file", "search")
]
WORDS = ["the", "of", "a", "to", "in", "file", "test", "error", "line", "def", "return", "import", "self"]


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))  # ~ one token a word


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def episode(rng: random.Random, sid: str, turns: int, generated: int, tool_output: int) -> list[TurnRecord]:
    """An episode's turns, finished, as the gateway would record them (ids and index left to the store)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _text(rng, 300)},
        {"role": "user", "content": _text(rng, 80)},
    ]
    prompt = _ids(rng, 450)  # the template renders tools and system prompt
    spans: list[tuple[int, int, int]] = []
    out: list[TurnRecord] = []
    for k in range(turns):
        n_out = max(1, int(rng.gauss(generated, generated / 5)))
        request = {"model": "policy", "messages": list(messages), "tools": TOOLS, "temperature": 1.0}
        turn = TurnRecord(sid, list(prompt), list(spans), None, None, request, time.time())
        turn.output_ids = _ids(rng, n_out)
        turn.output_logprobs = [-rng.random() for _ in range(n_out)]
        call = {"name": "bash", "arguments": json.dumps({"arg": _text(rng, n_out // 2 - 10)})}
        message = {"role": "assistant", "content": _text(rng, n_out // 2), "tool_calls": [
            {"id": f"call_{k}", "type": "function", "function": call}]}  # fmt: skip
        turn.response = {"message": message, "finish_reason": "tool_calls"}
        turn.finish_reason, turn.status, turn.worker = "tool_calls", TURN_COMPLETE, "worker-0"
        turn.timings = {"ttft_ms": 12.5, "total_ms": 250.0 + k}
        out.append(turn)
        n_tool = max(1, int(rng.gauss(tool_output, tool_output / 5)))
        spans.append((len(prompt), len(prompt) + n_out, -1))  # the turn's id is filled in when written
        prompt += turn.output_ids + _ids(rng, n_tool + 5)  # + the tool message's template tokens
        messages += [message, {"role": "tool", "tool_call_id": f"call_{k}", "content": _text(rng, n_tool)}]
    return out


def _event(turn: TurnRecord, parent: TurnRecord | None) -> PrefixReuse:
    return PrefixReuse("extends turn" if parent else "fresh", len(turn.prompt_ids))


def _first_event(parent: TurnRecord | None) -> Callable[[TurnRecord], PrefixReuse]:
    return lambda turn: _event(turn, parent)


def write_v1(path: Path, episodes: list[list[TurnRecord]]) -> float:
    """The episodes as the old store wrote them (its SQL, verbatim); seconds per turn written."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(V1_SCHEMA)
    spent = 0.0
    for turns in episodes:
        sid = turns[0].session_id
        db.execute(
            "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (sid, 0.0, "{}", "closed", 1.0, None, 1.0, 0),
        )
        parent_id: int | None = None
        spans: list[tuple[int, int, int]] = []
        for k, t in enumerate(turns):
            t0 = time.perf_counter()
            db.execute("BEGIN IMMEDIATE")
            cur = db.execute(
                "INSERT INTO turns (session_id, idx, branch, parent_id, ext_key, status, prompt_ids, "
                "prompt_gen_spans, output_ids, output_logprobs, request, timings, received_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sid, k, 0, parent_id, None, "running", array("I", t.prompt_ids).tobytes(), json.dumps(spans),
                 b"", b"", json.dumps(t.request), json.dumps({}), t.received_at),
            )  # fmt: skip
            turn_id = int(cur.lastrowid or 0)
            db.execute(
                "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
                (sid, turn_id, 0.0, "prefix_reuse", json.dumps(_event(t, None).data())),
            )
            db.execute("COMMIT")
            db.execute(
                "UPDATE turns SET status = ?, ext_key = ?, output_ids = ?, output_logprobs = ?, response = ?, "
                "finish_reason = ?, worker = ?, timings = ? WHERE id = ?",
                (t.status, f"key{k}", array("I", t.output_ids).tobytes(), array("d", t.output_logprobs).tobytes(),
                 json.dumps(t.response), t.finish_reason, t.worker, json.dumps(t.timings), turn_id),
            )  # fmt: skip
            spent += time.perf_counter() - t0
            spans = [*spans, (len(t.prompt_ids), len(t.prompt_ids) + len(t.output_ids), turn_id)]
            parent_id = turn_id
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return spent / sum(len(turns) for turns in episodes)


def write_current(path: Path, episodes: list[list[TurnRecord]]) -> tuple[float, list[list[TurnRecord]]]:
    """The episodes through `SqliteStore`; seconds per turn written, and the turns as written."""
    store = SqliteStore(path)
    spent, written = write_through(store, episodes)
    store.close()  # the last connection's close checkpoints the WAL into the file
    return spent / sum(len(turns) for turns in episodes), written


def write_through(
    store: TrajectoryStore, episodes: list[list[TurnRecord]]
) -> tuple[float, list[list[TurnRecord]]]:
    """The episodes through `store`; seconds spent writing turns, and the turns as written."""
    spent, written = 0.0, []
    for turns in episodes:
        sid = turns[0].session_id
        store.create_session(SessionRecord(sid, 0.0, {}, status="closed", reward=1.0, closed_at=1.0))
        parent: TurnRecord | None = None
        spans: list[tuple[int, int, int]] = []
        mine = []
        for k, t in enumerate(turns):
            turn = TurnRecord(
                sid, t.prompt_ids, list(spans), parent.id if parent else None, None, t.request, t.received_at
            )
            t0 = time.perf_counter()
            store.begin_turn(turn, _first_event(parent), parent=parent)
            turn.output_ids, turn.output_logprobs, turn.response = t.output_ids, t.output_logprobs, t.response
            turn.status, turn.finish_reason, turn.worker, turn.timings = (
                t.status,
                t.finish_reason,
                t.worker,
                t.timings,
            )
            turn.ext_key = f"key{k}"
            store.finish_turn(turn)
            spent += time.perf_counter() - t0
            spans = [*spans, (len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.output_ids), turn.id)]
            parent = turn
            mine.append(turn)
        written.append(mine)
    return spent, written


def run_postgres(url: str, episodes: list[list[TurnRecord]], sqlite_bytes: int) -> bool:
    """The same episodes through `PostgresStore` (fresh session ids); its figures. True: exact."""
    from store.postgres import PostgresStore

    renamed = [
        [replace(t, session_id=f"pg{time.time_ns()}_{t.session_id}") for t in turns] for turns in episodes
    ]
    n_turns = sum(len(turns) for turns in episodes)
    store = PostgresStore(url)
    before = store.size_bytes()
    spent, written = write_through(store, renamed)
    t0 = time.perf_counter()
    read = [store.get_turns(turns[0].session_id) for turns in written]
    read_s = (time.perf_counter() - t0) / len(written)
    exact = all(_same(r, w) for r, w in zip(read, written, strict=True))
    grown = store.size_bytes() - before
    store.close()

    halves = [[[replace(t, session_id=f"r{k}{time.time_ns()}_{t.session_id}") for t in turns]
               for turns in episodes[k::2]] for k in range(2)]  # fmt: skip
    replicas = [PostgresStore(url), PostgresStore(url)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write_through, replicas, halves))
    both_s = time.perf_counter() - t0
    for r in replicas:
        r.close()
    emit("pg_write_ms_per_turn", spent / n_turns * 1000)
    emit("pg_get_turns_ms_per_episode", read_s * 1000)
    emit("pg_bytes", grown)
    emit("pg_bytes_over_sqlite_bytes", grown / sqlite_bytes)
    emit("pg_round_trip_exact", str(exact).lower())
    emit("pg_2_replicas_wall_ms_per_turn", both_s / n_turns * 1000)
    return exact


def _same(read: list[TurnRecord], written: list[TurnRecord]) -> bool:
    fields = ("prompt_ids", "prompt_gen_spans", "output_ids", "output_logprobs", "response")
    return len(read) == len(written) and all(
        all(getattr(a, f) == getattr(b, f) for f in fields) and json.dumps(a.request) == json.dumps(b.request)
        for a, b in zip(read, written, strict=True)
    )


def run(opts: argparse.Namespace, workdir: Path) -> bool:
    rng = random.Random(opts.seed)
    episodes = [
        episode(rng, f"ses_{e:04d}", opts.turns, opts.generated, opts.tool_output)
        for e in range(opts.episodes)
    ]
    generated = sum(len(t.output_ids) for turns in episodes for t in turns)
    old, new = workdir / "v1.db", workdir / "current.db"
    old_write = write_v1(old, episodes)
    new_write, written = write_current(new, episodes)
    old_bytes, new_bytes = old.stat().st_size, new.stat().st_size

    store = SqliteStore(new)
    t0 = time.perf_counter()
    read = [store.get_turns(turns[0].session_id) for turns in written]
    read_s = (time.perf_counter() - t0) / len(written)
    last = [store.get_turn(turns[-1].id) for turns in written]
    exact = all(_same(r, w) for r, w in zip(read, written, strict=True)) and all(
        t is not None and _same([t], [w[-1]]) for t, w in zip(last, written, strict=True)
    )
    store.close()

    t0 = time.perf_counter()
    migrated = SqliteStore(old)  # opening a version 1 store migrates it
    migrate_s = time.perf_counter() - t0
    migrated_exact = all(_same(migrated.get_turns(w[0].session_id), w) for w in written)
    migrated.close()
    migrated_bytes = old.stat().st_size

    ratio = old_bytes / new_bytes
    emit("episodes", opts.episodes)
    emit("turns_per_episode", opts.turns)
    emit("generated_tokens", generated)
    emit("final_prompt_tokens", statistics.mean(len(turns[-1].prompt_ids) for turns in episodes))
    emit("old_bytes", old_bytes)
    emit("new_bytes", new_bytes)
    emit("old_bytes_per_generated_token", old_bytes / generated)
    emit("new_bytes_per_generated_token", new_bytes / generated)
    emit("ratio_old_over_new", ratio)
    emit("old_write_ms_per_turn", old_write * 1000)
    emit("new_write_ms_per_turn", new_write * 1000)
    emit("new_get_turns_ms_per_episode", read_s * 1000)
    emit("new_round_trip_exact", str(exact).lower())
    emit("migrate_s", migrate_s)
    emit("migrated_bytes_per_generated_token", migrated_bytes / generated)
    emit("migrated_round_trip_exact", str(migrated_exact).lower())
    ok = ratio >= 10 and exact and migrated_exact
    emit("target_10x_smaller", "pass" if ok else "fail")
    if opts.postgres is not None:
        from belayer.testing.postgres_local import database_url

        with database_url(opts.postgres) as url:
            ok = run_postgres(url, episodes, new_bytes) and ok
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="belayer bench store", description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--generated", type=int, default=100, help="generated tokens per turn (mean)")
    p.add_argument("--tool-output", type=int, default=200, help="tool output tokens per turn (mean)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="where to write the stores (default: a temporary directory)")
    p.add_argument(
        "--postgres",
        metavar="URL",
        help="also write through the PostgreSQL store at URL (auto: a throwaway local server)",
    )
    opts = p.parse_args(argv)
    if opts.dir:
        Path(opts.dir).mkdir(parents=True, exist_ok=True)
        return 0 if run(opts, Path(opts.dir)) else 1
    with tempfile.TemporaryDirectory(prefix="belayer-bench-store-") as tmp:
        return 0 if run(opts, Path(tmp)) else 1


if __name__ == "__main__":
    sys.exit(main())
