"""Schema versions: a new store, the in-place migration of a version 1 store, and what is refused."""

from __future__ import annotations

import json
import logging
import sqlite3
from array import array
from pathlib import Path
from typing import Any

import pytest

from core.errors import StoreError
from store import SessionRecord, SqliteStore, TurnRecord
from store.schema import SCHEMA_VERSION

V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, created_at REAL NOT NULL, metadata TEXT NOT NULL, status TEXT NOT NULL,
    reward REAL, reward_info TEXT, closed_at REAL, ephemeral INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    idx INTEGER NOT NULL, branch INTEGER NOT NULL, parent_id INTEGER, ext_key TEXT,
    status TEXT NOT NULL, prompt_ids BLOB NOT NULL, prompt_gen_spans TEXT NOT NULL,
    output_ids BLOB NOT NULL, output_logprobs BLOB NOT NULL, request TEXT NOT NULL, response TEXT,
    finish_reason TEXT, worker TEXT, timings TEXT NOT NULL, error TEXT, received_at REAL NOT NULL,
    UNIQUE (session_id, idx)
);
CREATE INDEX IF NOT EXISTS turns_ext ON turns (session_id, ext_key);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, turn_id INTEGER, ts REAL NOT NULL,
    kind TEXT NOT NULL, data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_session ON events (session_id);
CREATE INDEX IF NOT EXISTS sessions_created ON sessions (created_at);
"""
"""The tables as the store wrote them before schema version 2 (verbatim)."""


class V1Writer:
    """Writes turns with the version 1 store's SQL; remembers each turn as it must read back."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(V1_SCHEMA)
        self.expected: dict[int, dict[str, Any]] = {}

    def session(self, sid: str, status: str = "closed") -> None:
        self.db.execute(
            "INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (sid, 1.0, "{}", status, None, None, 2.0, 0),
        )
        self.db.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (?, NULL, 1.0, 'note', '{}')",
            (sid,),
        )

    def turn(
        self, sid: str, idx: int, parent: int | None, prompt: list[int], output: list[int],
        spans: list[list[int]], request: dict[str, Any], status: str = "complete",
    ) -> int:  # fmt: skip
        cur = self.db.execute(
            "INSERT INTO turns (session_id, idx, branch, parent_id, ext_key, status, prompt_ids, "
            "prompt_gen_spans, output_ids, output_logprobs, request, response, timings, received_at) "
            "VALUES (?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, '{}', 0.0)",
            (sid, idx, parent, f"k{idx}", status, array("I", prompt).tobytes(), json.dumps(spans),
             array("I", output).tobytes(), array("d", [-1.0] * len(output)).tobytes(), json.dumps(request),
             json.dumps({"message": {"role": "assistant"}})),
        )  # fmt: skip
        turn_id = int(cur.lastrowid or 0)
        self.expected[turn_id] = {
            "prompt_ids": prompt, "output_ids": output, "request": request, "status": status,
            "prompt_gen_spans": [(s[0], s[1], s[2] if len(s) > 2 else -1) for s in spans],
        }  # fmt: skip
        return turn_id

    def episode(self, sid: str, turns: int) -> list[int]:
        """A linear episode whose prompts and messages grow; some spans in the oldest (2-number) form."""
        self.session(sid)
        prompt, messages, spans, ids = list(range(300)), [{"role": "user", "content": "go"}], [], []
        parent = None
        for k in range(turns):
            output = [1000 + k] * 20
            request = {"model": "policy", "messages": list(messages), "temperature": 1}
            parent = self.turn(sid, k, parent, list(prompt), output, [list(s) for s in spans], request)
            ids.append(parent)
            spans.append(
                [len(prompt), len(prompt) + 20] if k < 2 else [len(prompt), len(prompt) + 20, parent]
            )
            prompt += output + list(range(5000 + 40 * k, 5040 + 40 * k))
            messages += [{"role": "assistant", "content": f"a{k}"}, {"role": "tool", "content": "x" * 200}]
        return ids

    def close(self) -> None:
        self.db.close()


def _check(store: SqliteStore, expected: dict[int, dict[str, Any]]) -> None:
    for turn_id, want in expected.items():
        got = store.get_turn(turn_id)
        assert got is not None
        assert {k: getattr(got, k) for k in want if k != "request"} == {
            k: v for k, v in want.items() if k != "request"
        }
        assert json.dumps(got.request) == json.dumps(want["request"])


def _version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    finally:
        db.close()


def test_a_new_store_has_the_current_version_and_incremental_vacuum(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "t.db").close()
    assert _version(tmp_path / "t.db") == SCHEMA_VERSION == 4
    db = sqlite3.connect(tmp_path / "t.db")
    assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    db.close()


def test_a_version_1_store_is_migrated_in_place(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "old.db"
    old = V1Writer(path)
    main = old.episode("s1", 30)
    old.episode("s2", 3)
    # a branch from the first turn, a rewrite that leaves the parent's tokens, a discarded turn, a running one
    first = old.expected[main[0]]
    old.turn("s1", 30, main[0], first["prompt_ids"] + first["output_ids"] + [7], [8], [[300, 320]], {"m": 1})
    old.turn("s1", 31, main[5], [0, 1, 2, 99], [9], [], {"messages": [{"role": "user", "content": "new"}]})
    old.turn("s1", 32, main[-1], [5, 5], [1], [], {"prompt": [5, 5]}, status="discarded")
    running = old.turn("s1", 33, None, [0, 1, 2, 3], [], [], {}, status="running")
    old.close()
    before = path.stat().st_size

    with caplog.at_level(logging.INFO, logger="belayer.store"):
        store = SqliteStore(path)
    [line] = [r.getMessage() for r in caplog.records if "migrated" in r.getMessage()]
    assert "from schema version 1 to 4: 2 sessions, 37 turns" in line and " s" in line
    old.expected[running]["status"] = "interrupted"  # as any store left running by a crash
    _check(store, old.expected)
    assert [t.index for t in store.get_turns("s1")] == list(range(34))
    found = store.find_turn_by_ext_keys("s1", ["k29"])
    assert found is not None and found.prompt_ids == old.expected[main[-1]]["prompt_ids"]
    # its one event, and the one that says the running turn was interrupted (with no tokens written)
    interrupted = {"turn_indices": [33], "output_tokens": [0], "reason": "gateway_gone"}
    assert [e.kind for e in store.get_events("s1")] == ["note", "turns_interrupted"]
    assert store.get_events("s1")[1].data == interrupted and store.get_session("s2") is not None
    store.close()
    assert _version(path) == 4 and path.stat().st_size < before / 3  # compacted and vacuumed

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="belayer.store"):
        again = SqliteStore(path)  # once is enough
    assert not [r for r in caplog.records if "migrated" in r.getMessage()]
    _check(again, old.expected)
    again.close()


def test_a_failed_migration_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = V1Writer(path)
    old.episode("s1", 3)
    old.db.execute("UPDATE turns SET request = '{not json' WHERE idx = 2")
    old.close()
    with pytest.raises(StoreError, match=r"cannot migrate trajectory store .* the store is unchanged"):
        SqliteStore(path)
    db = sqlite3.connect(path)
    assert "meta" not in {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
    assert "base_id" not in {r[1] for r in db.execute("PRAGMA table_info(turns)")}
    db.close()


def test_a_newer_store_and_a_foreign_one_are_refused(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "new.db").close()
    db = sqlite3.connect(tmp_path / "new.db")
    db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="schema version 99, newer than this Belayer reads"):
        SqliteStore(tmp_path / "new.db")

    db = sqlite3.connect(tmp_path / "other.db")
    db.execute("CREATE TABLE turns (id INTEGER PRIMARY KEY, whatever TEXT)")
    db.close()
    with pytest.raises(StoreError, match=r"not a Belayer trajectory store .* lacks"):
        SqliteStore(tmp_path / "other.db")


def test_a_version_3_store_gains_weight_segments(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Schema 4: a version 3 store gets the ``weight_segments`` column in place; its turns read with
    none, and new ones keep theirs."""
    path = tmp_path / "v3.db"
    store = SqliteStore(path)
    store.create_session(SessionRecord("s1", 0.0, {}))
    old = store.begin_turn(TurnRecord("s1", [1, 2], [], None, None, {}, 0.0))
    old.output_ids, old.output_logprobs, old.status = [3], [-0.5], "complete"
    store.finish_turn(old)
    store.close()
    db = sqlite3.connect(path)  # make it the version 3 store an older Belayer wrote
    db.execute("ALTER TABLE turns DROP COLUMN weight_segments")
    db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    db.commit()
    db.close()

    with caplog.at_level(logging.INFO, logger="belayer.store"):
        store = SqliteStore(path)
    assert any("from schema version 3 to 4" in r.getMessage() for r in caplog.records)
    assert _version(path) == 4
    got = store.get_turn(old.id)
    assert got is not None and got.weight_segments == [] and got.output_ids == [3]
    new = store.begin_turn(TurnRecord("s1", [1, 2, 3, 4], [], old.id, None, {}, 0.0))
    new.output_ids, new.output_logprobs, new.status = [5, 6, 7], [-0.1] * 3, "complete"
    new.weight_segments = [(0, 2, "v1"), (2, 3, "step-2")]
    store.finish_turn(new)
    store.close()
    again = SqliteStore(path)
    assert [t.weight_segments for t in again.get_turns("s1")] == [[], [(0, 2, "v1"), (2, 3, "step-2")]]
    again.close()
