"""A checkpoint's label names its session by the session's tag: the label goes into the checkpoint
store's ``meta.json``, where the session id (the capability to drive the session) has no business."""

from __future__ import annotations

from core.logs import session_tag
from tests.sandbox.sessions.conftest import EnvFactory


async def test_a_checkpoint_label_carries_the_session_tag_not_its_id(make_env: EnvFactory) -> None:
    env = await make_env()
    sid = await env.session("ses-the-capability-itself")
    info = await env.manager.checkpoint(sid)
    assert info.checkpoint.label == f"{session_tag(sid)}/turn-{info.turn_index}"
    assert sid not in info.checkpoint.label
