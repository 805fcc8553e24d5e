"""The typed events (`core.events`): the registry, the wire format, and that nothing publishes a kind
the registry does not hold."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest

from core import events as ev
from core.errors import UnknownEvent
from core.telemetry import Event, Telemetry
from store import EventRecord

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "core",
    "engine_pool",
    "gateway",
    "sandbox",
    "store",
    "harness_adapters",
    "belayer",
    "belayer_vllm",
)


EVENT_NAMES = ("e", "ev", "event", "record", "row")
"""What the code calls an event it reads (other things have a ``kind`` too: a fault, a worker)."""


def _sample(cls: type[ev.Payload]) -> ev.Payload:
    """An instance of `cls` whose every field holds a value of its own (its name), ABSENT ones too."""
    return cls(**{f.name: f"{f.name}-value" for f in dataclasses.fields(cls)})


def test_every_kind_is_registered_once_with_a_topic_and_documented_fields() -> None:
    assert len(ev.REGISTRY) == len(ev.EVENTS) == 53
    source = ast.parse((ROOT / "core" / "events.py").read_text())
    documented = {
        (cls.name, f.target.id)
        for cls in source.body
        if isinstance(cls, ast.ClassDef)
        for f, doc in zip(cls.body, cls.body[1:], strict=False)
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }  # fmt: skip
    for kind, cls in ev.REGISTRY.items():
        assert cls.kind == kind and cls.topic in ("engine pool", "turns", "gateway", "store", "sandbox")
        assert cls.__doc__ and dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls):
            owner = next(c for c in cls.__mro__ if f.name in inspect.get_annotations(c))
            assert (owner.__name__, f.name) in documented, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("kind", sorted(ev.REGISTRY))
def test_data_round_trips_through_decode_and_json(kind: str) -> None:
    event = _sample(ev.REGISTRY[kind])
    data = event.data()
    assert ev.decode(kind, data) == event
    assert ev.decode(kind, json.loads(json.dumps(data))).data() == data


def test_the_wire_keys_are_those_the_publishers_wrote_before_they_were_typed() -> None:
    """Keys, in order: what `GET /api/events`, the stored rows and the exports carried."""
    state = ev.WorkerState("worker-0", "ready", "dead", "exited", "http://w0", None, False)
    assert list(state.data()) == ["worker", "from", "to", "why", "url", "pid", "launched"]
    failure = ev.SandboxFailure("exit", "gone", "box")
    assert failure.data() == {"kind": "exit", "detail": "gone", "sandbox_id": "box"}
    assert ev.SandboxFailure("exit", "gone", "box", after_replay=True).data()["after_replay"] is True
    assert ev.FreshPrompt("fresh", 0).data() == {"reason": "fresh", "reused_tokens": 0}
    assert ev.PrefixReuse("extends", 3, 0).data() == {
        "reason": "extends",
        "reused_tokens": 3,
        "parent_turn": 0,
    }
    assert ev.WeightOwner("down", why="killed").data() == {"state": "down", "why": "killed"}
    assert list(_sample(ev.Failover).data()) == [
        "token_index", "from_worker", "error", "cause", "to_worker", "detect_ms", "lost_ms", "sampling",
        "noticed_at", "resubmitted_at", "resumed_at", "from_version", "to_version",
    ]  # fmt: skip
    assert list(_sample(ev.QueryOfDeath).data()) == [
        "fingerprint",
        "prompt_hash",
        "prompt_tokens",
        "sampling",
        "session",
        "workers_killed",
        "deaths",
    ]


def test_a_restore_is_written_byte_for_byte_as_when_the_manager_kept_its_own_record() -> None:
    """`SandboxRestored` is also the sandbox manager's record of a restore (it had one of its own, turned
    into this event by its JSON): the stored JSON, and an old row without the replay fields, are as before."""
    truncated = ev.SandboxRestored("ck_1", 2, 2, [3, 4], "box-2", 0.1235, "exited: gone")
    assert json.dumps(truncated.data()) == (
        '{"checkpoint_id": "ck_1", "turn_index": 2, "keep_through": 2, "discarded_turns": [3, 4], '
        '"sandbox_id": "box-2", "seconds": 0.1235, "reason": "exited: gone", "mode": "truncate", '
        '"replayed": 0, "diverged": 0}'
    )
    replayed = ev.SandboxRestored("", -1, 5, [], "box-3", 1.5, "tool_hang: x", "replay", 3, 1)
    assert json.dumps(replayed.data()) == (
        '{"checkpoint_id": "", "turn_index": -1, "keep_through": 5, "discarded_turns": [], '
        '"sandbox_id": "box-3", "seconds": 1.5, "reason": "tool_hang: x", "mode": "replay", '
        '"replayed": 3, "diverged": 1}'
    )
    before_replay = {k: v for k, v in truncated.data().items() if k not in ("mode", "replayed", "diverged")}
    assert ev.decode("sandbox_restored", before_replay) == truncated


def test_decode_refuses_an_unknown_kind_a_field_too_many_and_one_missing() -> None:
    with pytest.raises(UnknownEvent, match="no event kind 'nope'"):
        ev.decode("nope", {})
    with pytest.raises(UnknownEvent, match="has no field 'extra'"):
        ev.decode("shadow_promoted", {"worker": "w", "extra": 1})
    with pytest.raises(UnknownEvent, match="does not fit"):
        ev.decode("worker_cold_start", {"worker": "w"})


def test_publish_refuses_an_unregistered_kind_and_carries_the_typed_event() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Stray(ev.Payload):
        kind: ClassVar[str] = "stray"
        note: str

    @dataclasses.dataclass(frozen=True, slots=True)
    class Impostor(ev.Payload):  # a registered kind's name on another class
        kind: ClassVar[str] = "shadow_promoted"
        worker: str

    hub = Telemetry()
    for stray in (Stray("x"), Impostor("w")):
        with pytest.raises(UnknownEvent):
            hub.publish(stray)
    assert hub.seq == 0
    with pytest.raises(UnknownEvent):
        hub.publish_record("stray", {"note": "x"}, None, None, 0.0)
    event = hub.publish(ev.ShadowPromoted("worker-1"), "ses_1")
    assert (event.kind, event.data, event.payload, event.typed) == (
        "shadow_promoted", {"worker": "worker-1"}, ev.ShadowPromoted("worker-1"), ev.ShadowPromoted("worker-1")
    )  # fmt: skip
    stored = {"reason": "restore", "after_turn": 2, "turn_indices": [3]}  # another order: kept as stored
    event = hub.publish_record("turns_discarded", stored, "ses_1", None, 5.0)
    assert event.data is stored and event.typed == ev.TurnsDiscarded(2, [3], "restore")
    assert Event(9, 0.0, "shadow_promoted", None, None, {"worker": "w"}).typed == ev.ShadowPromoted("w")


def test_a_stored_record_is_written_from_and_read_back_as_its_typed_event() -> None:
    record = EventRecord.of("ses_1", 7, ev.TurnFailed("error", "boom"), ts=3.0)
    assert record == EventRecord("ses_1", 7, 3.0, "turn_failed", {"status": "error", "error": "boom"})
    assert record.typed == ev.TurnFailed("error", "boom")


def _reads_kind(node: ast.expr) -> bool:
    """``e.kind`` (an event's, `EVENT_NAMES`) or ``e["kind"]`` (an event's JSON)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kind" and isinstance(node.value, ast.Name) and node.value.id in EVENT_NAMES
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == "kind"
    )


def _literal_kinds() -> list[tuple[str, int, str]]:
    """(file, line, kind) of every event kind named as a string in the packages' code: the first
    argument of ``publish_record``, the kind of an ``EventRecord(...)``, and a kind compared with
    ``e.kind ==`` / ``e["kind"] in (...)`` (`_reads_kind`)."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names: list[Any] = []
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name in ("publish", "publish_record") and node.args:
                        names = [node.args[0]]
                    elif name == "EventRecord" and len(node.args) >= 4:
                        names = [node.args[3]]
                elif isinstance(node, ast.Compare) and _reads_kind(node.left):
                    for right in node.comparators:
                        names += right.elts if isinstance(right, ast.Tuple | ast.Set | ast.List) else [right]
                for n in names:
                    if isinstance(n, ast.Constant) and isinstance(n.value, str):
                        found.append((str(path.relative_to(ROOT)), node.lineno, n.value))
    return found


def test_every_kind_the_code_names_is_registered() -> None:
    """Publishers build typed events (mypy checks their fields); a kind still named as a string (a
    reader's comparison, a stored record) must be a registered one, or it reads nothing."""
    named = _literal_kinds()
    assert named, "the scan found nothing: it no longer sees the code"
    unknown = [(f, line, k) for f, line, k in named if k not in ev.REGISTRY]
    assert unknown == []
