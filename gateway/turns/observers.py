"""Who else wants to know when a session's LLM call starts and ends.

The interval between ``turn_started`` and ``turn_finished`` is the session's *inference bubble*: the
harness is waiting for the model, so its sandbox is idle and can be checkpointed (see ``sandbox/``).
Observers are called synchronously on the gateway's event loop and must not block: an observer that
needs to do work schedules it on tasks it owns. The one exception is ``turn_ending``, awaited once the
output is complete and before the client gets the end of the response: an observer may keep the bubble
open there (the sandbox manager does in checkpoint mode ``always``, until the turn's checkpoint is taken).

Example::

    class Printer:
        def turn_started(self, turn: TurnRecord) -> None:
            print("bubble starts", turn.session_id, len(turn.prompt_ids))

        async def turn_ending(self, turn: TurnRecord) -> None:
            pass  # the client has every token but not the end of the response yet

        def turn_finished(self, turn: TurnRecord) -> None:
            print("bubble ends", turn.session_id, turn.status)
"""

from __future__ import annotations

from typing import Protocol

from store import TurnRecord


class TurnObserver(Protocol):
    def turn_started(self, turn: TurnRecord) -> None:
        """The turn is stored (status running, prompt ids known) and about to go to an engine."""

    async def turn_ending(self, turn: TurnRecord) -> None:
        """The turn's output is complete; the client gets the end of the response when this returns."""

    def turn_finished(self, turn: TurnRecord) -> None:
        """The turn ended: complete, error or aborted (``turn.status`` says which)."""
