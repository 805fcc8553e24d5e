"""The journal after a gateway restart (issue 31, finding 6): a large write's bytes are not in the store.

A write over `INLINE_BYTES` is recorded by its digest (its bytes stay in the gateway's memory only), so
a restarted gateway rebuilds it without them: the adopted sandbox goes on as it was, and should it fail
later, it is restored without a replay (truncated, as the module says), never a replay that cannot run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from core.errors import NoCheckpoint, SandboxRestored
from sandbox.sessions.journal import INLINE_BYTES
from tests.sandbox.sessions.test_adoption import Gateways


@pytest.fixture
async def gws(tmp_path: Path) -> AsyncIterator[Gateways]:
    gateways = Gateways(tmp_path / "traj.db")
    yield gateways
    for manager in gateways.managers:
        await manager.close()
    gateways.store.close()


async def test_a_large_write_rebuilt_without_its_bytes_restores_without_a_replay(gws: Gateways) -> None:
    sid = await gws.session("s1")
    ckpt = await gws.manager.checkpoint(sid)
    await gws.manager.write_file(sid, "small", b"s" * INLINE_BYTES)
    await gws.manager.write_file(sid, "large", b"L" * (INLINE_BYTES + 1))

    manager = await gws.crash_and_restart()
    state = manager.describe(sid)
    assert (state["journaled_calls"], state["journal_bytes"]) == (2, INLINE_BYTES)  # the large one's unknown
    assert await manager.read_file(sid, "large") == b"L" * (INLINE_BYTES + 1)  # adopted alive: all there
    with pytest.raises(NoCheckpoint, match="recorded before the gateway restarted"):
        await manager.fork(sid, ["child"], at_turn=0)

    gws.backend.kill(manager.sandbox_id(sid))
    with pytest.raises(SandboxRestored) as restored:
        await manager.exec(sid, "cat large")
    assert (restored.value.info.mode, restored.value.info.checkpoint_id) == ("truncate", ckpt.checkpoint.id)
    state = manager.describe(sid)
    assert (state["status"], state["journaled_calls"], state["journal_bytes"]) == ("running", 0, 0)
