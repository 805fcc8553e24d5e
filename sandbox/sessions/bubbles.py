"""Checkpoints in inference bubbles: the manager's view of each session's LLM calls.

While a session's LLM call runs, its harness waits and its sandbox is idle. When the call starts
(`turn_started`), `AdaptivePolicy` decides whether to checkpoint the sandbox in that bubble or to defer;
the decision is a ``sandbox_checkpoint_decision`` event (``busy`` when a checkpoint or a call is
already in progress). Mode ``always`` takes every bubble it can, so that each turn of a harness inside
its sandbox has a checkpoint to fork at: its checkpoint waits for a call in progress (the runner's own
commands, say), a bubble that found a checkpoint running gets its own when that one ends, and the
turn's response ends only once its checkpoint has (`hold`, up to `HOLD_S`): the bubble stays open for
it. In the other modes the checkpoint runs in the background and is skipped if the bubble is over
before it can start (the harness may act again). With ``sandbox.standby``, what is left of a bubble after
its checkpoint (or a bubble that takes none) may go to making a standby sandbox (`standby`). When the call ends (`turn_finished`), its timings
teach the policy, and a turn that a restore discarded while it ran is discarded again.

Example::

    bubbles = BubbleObserver(slots, policy, checkpointer, events, TaskOwner("sandbox-checkpoints"))
    runner = TurnRunner(..., observers=[bubbles])      # via SandboxManager, a TurnObserver
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from core import events as ev
from core.errors import SandboxError
from core.logs import session_tag
from core.tasks import TaskOwner
from sandbox.sessions.checkpoints import Checkpointer
from sandbox.sessions.policy import AdaptivePolicy, Decision
from sandbox.sessions.records import EventLog
from sandbox.sessions.state import Slot, Slots
from store import TurnRecord

log = logging.getLogger("belayer.sandbox")

HOLD_S = 120.0
"""The longest a turn's response waits for its checkpoint in mode ``always`` (`BubbleObserver.hold`)."""


class BubbleObserver:
    """A `TurnObserver` that checkpoints idle sandboxes inside their sessions' LLM calls."""

    def __init__(
        self,
        slots: Slots,
        policy: AdaptivePolicy,
        checkpointer: Checkpointer,
        events: EventLog,
        tasks: TaskOwner,
        engine_load: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.slots = slots
        self.policy = policy
        self.checkpointer = checkpointer
        self.standbys = checkpointer.standbys
        self.events = events
        self.tasks = tasks
        self.engine_load = engine_load
        self._taking: dict[int, asyncio.Event] = {}
        """Turn id -> set once the checkpoint scheduled or queued in its bubble has ended (mode always)."""
        self._ends: dict[int, float] = {}
        """Turn id -> when its bubble is predicted to end (monotonic; `AdaptivePolicy.standby_bubble`): what
        a standby may still use."""

    def turn_started(self, turn: TurnRecord) -> None:
        slot = self.slots.get(turn.session_id)
        if slot is None or slot.sandbox_id is None:
            return
        slot.turns.start(turn)
        slot.history.turns_since += 1
        decision = self._decide(slot, turn)
        always = self.policy.settings.mode == "always"  # it waits for a call holding the sandbox
        busy = slot.history.pending or (slot.lock.locked() and not always)
        action = "busy" if decision.checkpoint and busy else decision.action
        self.events.add(turn.session_id, turn.id, _decision_event(decision, action, slot))
        self._ends[turn.id] = time.monotonic() + self.policy.standby_bubble(decision.predicted_bubble_s)
        if decision.checkpoint and not busy:
            self._spawn(slot, turn, decision)
        elif not decision.checkpoint and not busy:  # a bubble without a checkpoint: the standby's
            self._offer_standby(slot, turn)
        elif decision.checkpoint and always:
            if slot.history.queued is not None:  # replaced: its bubble is not held for it any more
                self._release(slot.history.queued)
            slot.history.queued = turn
            self._taking.setdefault(turn.id, asyncio.Event())

    def _spawn(self, slot: Slot, turn: TurnRecord, decision: Decision) -> None:
        slot.history.pending, slot.history.queued = True, None
        self._taking.setdefault(turn.id, asyncio.Event())
        self.tasks.spawn(self._checkpoint(slot, turn, decision), f"checkpoint/{session_tag(turn.session_id)}")

    def _release(self, turn: TurnRecord) -> None:
        taking = self._taking.pop(turn.id, None)
        if taking is not None:
            taking.set()

    async def hold(self, turn: TurnRecord) -> None:
        """In mode ``always``, keep the bubble open (the client waits for the end of its response) until
        the checkpoint scheduled in it has ended, so that every turn gets one to fork at even when a
        call held the sandbox (the harness's runner polling it, say) while the turn streamed. Bounded
        by `HOLD_S`: a long call holding the sandbox delays a response that long at most."""
        taking = self._taking.get(turn.id)
        if taking is None or self.policy.settings.mode != "always":
            return
        try:
            async with asyncio.timeout(HOLD_S):
                await taking.wait()
        except TimeoutError:
            log.warning("session %s: turn %d's checkpoint did not end within %.0f s; the response goes on",
                        session_tag(turn.session_id), turn.index, HOLD_S)  # fmt: skip

    def _offer_standby(self, slot: Slot, turn: TurnRecord) -> None:
        """What is left of `turn`'s bubble may hold the making of a standby (`standby`)."""
        if self.standbys.enabled and not slot.lock.locked():
            left = self._ends.get(turn.id, 0.0) - time.monotonic()
            self.standbys.offer(slot, turn, left)

    def turn_finished(self, turn: TurnRecord) -> None:
        self._ends.pop(turn.id, None)
        slot = self.slots.get(turn.session_id)
        if slot is None:
            return
        if slot.turns.finish(turn.id):  # it finished after a restore had discarded it
            self.events.discard_turns(turn.session_id, [turn.id], "finished after a sandbox restore")
        total_ms, ttft_ms = turn.timings.get("total_ms"), turn.timings.get("ttft_ms")
        if total_ms is not None:
            self.policy.observe_turn(
                prompt_tokens=len(turn.prompt_ids), output_tokens=len(turn.output_ids),
                seconds=total_ms / 1000, ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
            )  # fmt: skip

    def _decide(self, slot: Slot, turn: TurnRecord) -> Decision:
        newest = slot.history.newest()
        return self.policy.decide(
            prompt_tokens=len(turn.prompt_ids),
            engine_load=self.engine_load(),
            turns_since_checkpoint=slot.history.turns_since,
            last_dump_bytes=newest.dump_bytes if newest else 0,
            bytes_written_since=slot.history.bytes_since,
            session_cost_s=slot.history.last_cost_s,
        )

    async def _checkpoint(self, slot: Slot, turn: TurnRecord, decision: Decision) -> None:
        try:
            async with slot.lock:
                if slot.sandbox_id is None or not self.slots.current(slot):
                    return
                if turn.id not in slot.turns.running:  # the bubble is over: the harness may act again
                    self.events.add(slot.session_id, turn.id, ev.SandboxCheckpointSkipped("bubble over"))
                    return
                await self.checkpointer.take(slot, decision.action, turn)
            self._offer_standby(slot, turn)  # out of the lock: a call may take it meanwhile
        except SandboxError as exc:
            log.warning(
                "session %s: checkpoint in turn %d failed: %s", session_tag(slot.session_id), turn.index, exc
            )
            self.events.add(slot.session_id, turn.id, ev.SandboxCheckpointFailed(str(exc)))
        finally:
            slot.history.pending = False
            self._release(turn)
            queued = slot.history.queued
            if queued is not None and queued.id in slot.turns.running and self.slots.current(slot):
                self._spawn(slot, queued, self._decide(slot, queued))  # its bubble is still open
            elif queued is not None:
                slot.history.queued = None
                self._release(queued)


def _decision_event(d: Decision, action: str, slot: Slot) -> ev.SandboxCheckpointDecision:
    return ev.SandboxCheckpointDecision(
        action=action,
        predicted_bubble_s=round(d.predicted_bubble_s, 4),
        predicted_cost_s=round(d.predicted_cost_s, 4),
        turns_since_checkpoint=slot.history.turns_since,
        reason=d.reason,
    )
