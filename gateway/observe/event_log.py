"""Log lines for recoveries, from the live feed: one per failover, sandbox failure, sandbox restore,
discard of turns, interruption of a gone gateway's running turns, and a session moved off a loaded
worker (the ``group`` routing policy), naming what happened in words
(``belayer.recovery`` logger).

`log_event` is a `Telemetry` listener; every other kind of event it ignores. The event's session,
turn and data go with the line as structured fields (``event``, ``session_tag``, ``turn_id``, ``data``)
for ``--log-format json``. A session is named by its tag (`core.logs.session_tag`), never by its id,
which is the capability to drive it: in the words, in the fields, and wherever a value holds a session
id (a fork child's routing group is its parent's id when the parent named none; an error may name a
session), so the feed's events (which carry ids, for the token holder) never put one in a log.

Example::

    gw.telemetry.listen(log_event)

>>> describe(Event(1, 0.0, "failover", "ses_3f2a", 7, {"token_index": 12, "from_worker": "worker-0",
...     "to_worker": "worker-1", "cause": "dead", "error": "reset", "lost_ms": 412.5}))
(30, 'session s-1cec09b2865f turn 7: worker worker-0 lost at token 12 (dead), resumed on worker-1 after 412 ms')
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from core.logs import session_tag, without_session_ids
from core.telemetry import Event

log = logging.getLogger("belayer.recovery")

Line = tuple[int, str]
"""A log level and the message."""


def _tag(e: Event) -> str:
    return session_tag(e.session_id) if e.session_id is not None else "-"


def _failover(e: Event, d: dict[str, Any]) -> Line:
    lost = f"session {_tag(e)} turn {e.turn_id}: worker {d.get('from_worker')} lost at token {d.get('token_index')} ({d.get('cause') or d.get('error')})"
    if d.get("to_worker") is None:
        return logging.WARNING, f"{lost}, not resumed: {d.get('error')}"
    return logging.WARNING, f"{lost}, resumed on {d['to_worker']} after {d.get('lost_ms', 0):.0f} ms"


def _sandbox_failure(e: Event, d: dict[str, Any]) -> Line:
    again = " again after a replay" if d.get("after_replay") else ""
    return (
        logging.WARNING,
        f"session {_tag(e)}: sandbox {d.get('sandbox_id')} failed{again} ({d.get('kind')}): {d.get('detail')}",
    )


def _sandbox_restored(e: Event, d: dict[str, Any]) -> Line:
    origin = (
        f"checkpoint {d['checkpoint_id']} (turn {d.get('turn_index')})"
        if d.get("checkpoint_id")
        else "scratch"
    )
    standby = " (its standby, unfrozen)" if d.get("standby") else ""
    message = f"session {_tag(e)}: sandbox restored ({d.get('mode')}) from {origin}{standby} into {d.get('sandbox_id')} in {d.get('seconds', 0):.2f} s"
    if d.get("mode") == "replay":
        message += f", {d.get('replayed')} tool calls replayed ({d.get('diverged')} gave another result)"
    if d.get("discarded_turns"):
        message += f", turns {d['discarded_turns']} discarded"
    return logging.INFO, f"{message} ({d.get('reason')})"


def _turns_interrupted(e: Event, d: dict[str, Any]) -> Line:
    return (
        logging.WARNING,
        f"session {_tag(e)}: turns {d.get('turn_indices')} interrupted ({d.get('reason')}), "
        f"keeping {d.get('output_tokens')} generated tokens",
    )


def _turns_discarded(e: Event, d: dict[str, Any]) -> Line:
    after = f" after turn {d['after_turn']}" if d.get("after_turn") is not None else ""
    return (
        logging.WARNING,
        f"session {_tag(e)}: turns {d.get('turn_indices')} discarded{after} ({d.get('reason')})",
    )


def _session_moved(e: Event, d: dict[str, Any]) -> Line:
    group = f" (group {d['group']})" if d.get("group") is not None else ""
    return (
        logging.INFO,
        f"session {_tag(e)}{group}: moved from worker {d.get('from_worker')} "
        f"({d.get('from_outstanding_tokens')} outstanding tokens) to {d.get('to_worker')} "
        f"({d.get('to_outstanding_tokens')}) for load",
    )


def _sandbox_restore_failed(e: Event, d: dict[str, Any]) -> Line:
    return (
        logging.ERROR,
        f"session {_tag(e)}: restoring checkpoint {d.get('checkpoint_id')} failed ({d.get('reason')}): "
        f"{d.get('error')}",
    )


_DESCRIBE: dict[str, Callable[[Event, dict[str, Any]], Line]] = {
    "failover": _failover,
    "sandbox_failure": _sandbox_failure,
    "sandbox_restored": _sandbox_restored,
    "sandbox_restore_failed": _sandbox_restore_failed,
    "turns_discarded": _turns_discarded,
    "turns_interrupted": _turns_interrupted,
    "session_moved": _session_moved,
}


def describe(event: Event) -> Line | None:
    """The level and message for `event`, or None for a kind that is not logged here."""
    how = _DESCRIBE.get(event.kind)
    if how is None:
        return None
    level, message = how(event, event.data)
    return level, without_session_ids(message)  # a group or an error's words may hold a session id


def log_event(event: Event) -> None:
    """Log `event` if it is a recovery (see the module docstring)."""
    line = describe(event)
    if line is None:
        return
    level, message = line
    fields = {
        "event": event.kind,
        "session_tag": session_tag(event.session_id) if event.session_id is not None else None,
        "turn_id": event.turn_id,
        "data": _without_session_ids(event.data),
    }
    log.log(level, "%s", message, extra=fields)


def _without_session_ids(value: Any) -> Any:
    """An event's data as JSON values, with every session id in its strings shown as its tag."""
    if isinstance(value, str):
        return without_session_ids(value)
    if isinstance(value, dict):
        return {key: _without_session_ids(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_without_session_ids(item) for item in value]
    return value
