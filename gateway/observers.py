"""Who else wants to know when a session's LLM call starts and ends.

The interval between ``turn_started`` and ``turn_finished`` is the session's *inference bubble*: the
harness is waiting for the model, so its sandbox is idle and can be checkpointed (see ``sandbox/``).
Observers are called synchronously on the gateway's event loop and must not block: an observer that
needs to do work schedules it on tasks it owns.

Example::

    class Printer:
        def turn_started(self, turn: TurnRecord) -> None:
            print("bubble starts", turn.session_id, len(turn.prompt_ids))

        def turn_finished(self, turn: TurnRecord) -> None:
            print("bubble ends", turn.session_id, turn.status)
"""

from __future__ import annotations

from typing import Protocol

from gateway.store import TurnRecord


class TurnObserver(Protocol):
    def turn_started(self, turn: TurnRecord) -> None:
        """The turn is stored (status running, prompt ids known) and about to go to an engine."""

    def turn_finished(self, turn: TurnRecord) -> None:
        """The turn ended: complete, error or aborted (``turn.status`` says which)."""
