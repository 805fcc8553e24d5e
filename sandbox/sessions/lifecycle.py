"""Starting, replacing and removing a session's sandbox.

A sandbox with ``network="gateway"`` can reach the gateway's sandbox listener (`gateway_url`) and
nothing else; it gets ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and ``BELAYER_SESSION_URL`` pointing
at its own session, and the listener only serves that session (`SandboxManager.owner_of`,
by the sandbox's address on the network, looked up here whenever the sandbox changes). An address is
forgotten before its container is removed, and taken from any other session that still holds it when
a new sandbox is found there: Docker hands a freed address to the next container.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from core.errors import ImageNotFound, SandboxError, SandboxNotFound
from core.logs import session_tag
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.records import CheckpointInfo
from sandbox.sessions.state import RecoveryMode, Slot

log = logging.getLogger("belayer.sandbox")
SESSION_LABEL = "belayer.session"
"""The label naming a sandbox's session."""


class Lifecycle:
    """Creates a slot's sandbox, replaces it (from a checkpoint or afresh) and drops it."""

    def __init__(
        self,
        io: SandboxIO,
        owner_labels: dict[str, str] | None = None,
        located: Callable[[Slot], None] | None = None,
    ) -> None:
        self.io = io
        self.owner_labels = owner_labels or {}
        """Labels of every sandbox this gateway makes (its store's identity: `adoption`)."""
        self.located = located
        """Called when a slot's sandbox was found at its address (the manager takes the address from
        any other slot still holding it: a container that stopped left it, and Docker gave it anew)."""

    async def start(
        self,
        session_id: str,
        spec: SandboxSpec,
        *,
        harness_inside: bool,
        recovery: RecoveryMode,
        gateway_url: str | None,
    ) -> Slot:
        """Create the session's sandbox; return its new slot. A harness inside is always truncated:
        its memory comes back with the checkpoint."""
        labels = {**spec.labels, **self.owner_labels, SESSION_LABEL: session_id}
        env = gateway_env(session_id, spec, gateway_url)
        spec = spec.model_copy(update={"labels": labels, "env": env})
        box = await self._create(spec)
        slot = Slot(session_id, spec, harness_inside, "truncate" if harness_inside else recovery, box.id)
        await self.locate(slot)
        return slot

    async def replace(self, slot: Slot, chosen: CheckpointInfo | None) -> str:
        """Replace the slot's sandbox: restored from `chosen`, or (None) started afresh from its spec."""
        await self.drop(slot)
        try:
            if chosen is None:
                box = await self.io.op(self.io.backend.create, slot.spec)
            else:  # with the slot's own labels: a fork child's checkpoint may be its parent's
                spec = chosen.checkpoint.spec.model_copy(update={"labels": slot.spec.labels})
                box = await self.io.op(self.io.backend.restore, replace(chosen.checkpoint, spec=spec))
        except SandboxError as exc:
            what = f"restore of checkpoint {chosen.checkpoint.id}" if chosen else "a fresh sandbox"
            slot.failure = f"{what} failed: {exc}"
            raise
        slot.sandbox_id, slot.failure = box.id, None
        await self.locate(slot)
        return box.id

    async def swap_in(self, slot: Slot, box: str) -> None:
        """Replace the slot's sandbox with `box`, one that runs already (its standby, unfrozen)."""
        await self.drop(slot)
        slot.sandbox_id, slot.failure = box, None
        await self.locate(slot)

    async def drop(self, slot: Slot) -> None:
        """Remove the slot's sandbox, if any (a failed one may be gone already). Its address is
        forgotten first: once the container goes, Docker may give the address to another sandbox, whose
        requests must never be taken for this session's."""
        slot.address = None
        if slot.sandbox_id is not None:
            try:
                await self.io.op(self.io.backend.destroy, slot.sandbox_id)
            except SandboxNotFound:
                pass
            except SandboxError as exc:
                tag = session_tag(slot.session_id)  # the id is the session's capability: never logged
                log.warning("session %s: could not remove sandbox %s: %s", tag, slot.sandbox_id, exc)
        slot.sandbox_id = None

    async def locate(self, slot: Slot) -> None:
        """Look the sandbox's gateway-network address up (the listener tells sessions apart by it)."""
        slot.address = None
        if slot.spec.network == "gateway" and slot.sandbox_id is not None:
            slot.address = await self.io.address(slot.sandbox_id)
            if slot.address is not None and self.located is not None:
                self.located(slot)

    async def _create(self, spec: SandboxSpec) -> Sandbox:
        try:
            return await self.io.op(self.io.backend.create, spec)
        except SandboxNotFound as e:
            raise ImageNotFound(
                f"cannot create the sandbox: {e}; build it with `belayer sandbox build-image`"
            ) from e


def gateway_env(session_id: str, spec: SandboxSpec, gateway_url: str | None) -> dict[str, str]:
    """The sandbox's environment: for ``network="gateway"``, the session's URLs under `gateway_url`
    (the spec's own values win)."""
    if spec.network != "gateway":
        return spec.env
    if gateway_url is None:
        raise SandboxError(
            "network='gateway' needs the gateway's sandbox listener, which is not running here "
            "(it needs a Docker engine and iptables as root); use network='none'"
        )
    url = f"{gateway_url}/s/{session_id}"
    defaults = {
        "BELAYER_SESSION_URL": url, "OPENAI_BASE_URL": f"{url}/v1", "ANTHROPIC_BASE_URL": url,
        "OPENAI_API_KEY": "belayer", "ANTHROPIC_API_KEY": "belayer",
    }  # fmt: skip
    return {**defaults, **spec.env}
