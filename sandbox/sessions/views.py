"""What the API and the dashboard show of a session's sandbox: frozen JSON views of a `Slot`, read
without its lock (a view may be a moment old, never half-written: each field is read once).

- `describe`: one session's sandbox in full (``GET /api/sessions/{id}/sandbox``): its state, network,
  recovery mode, journal, checkpoints and last restore;
- `brief`: every sandbox in brief (the dashboard's table): state, counts and the node that holds it.

A sandbox's state here is ``running``, ``restoring`` (a restore holds its lock) or ``failed`` (its
recovery gave up).
"""

from __future__ import annotations

from typing import Any

from sandbox.sessions.state import Slot


def describe(slot: Slot, gateway_url: str | None) -> dict[str, Any]:
    """`slot`'s sandbox in full; `gateway_url`: where network=gateway sandboxes reach the gateway."""
    gateway_url = gateway_url if slot.spec.network == "gateway" else None
    return {
        "session_id": slot.session_id,
        "sandbox_id": slot.sandbox_id,
        "status": "failed" if slot.failure else "running",
        "failure": slot.failure,
        "image": slot.spec.image,
        "harness_inside": slot.harness_inside,
        "network": slot.spec.network,
        "gateway_url": f"{gateway_url}/s/{slot.session_id}" if gateway_url else None,
        "recovery": slot.recovery,
        "journaled_calls": len(slot.journal),
        "journal_bytes": slot.journal.held,
        "forked_from": slot.lineage[0] if slot.lineage else None,
        "checkpoints": [c.as_json() for c in slot.history.items],
        "last_restore": slot.restores.last.data() if slot.restores.last else None,
    }


def brief(slot: Slot, node: str | None) -> dict[str, Any]:
    """`slot`'s sandbox in brief; `node`: the cluster node that holds it (None on one host)."""
    return {
        "session_id": slot.session_id,
        "sandbox_id": slot.sandbox_id,
        "image": slot.spec.image,
        "state": "restoring" if slot.restores.in_progress else "failed" if slot.failure else "running",
        "checkpoints": len(slot.history.items),
        "last_restore": slot.restores.last.data() if slot.restores.last else None,
        "restores": slot.restores.count,
        "node": node,
    }
