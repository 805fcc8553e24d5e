"""Recovery log lines from the live feed: one per failover, sandbox failure and restore, and discard."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from core.logs import JsonFormatter, session_tag
from core.telemetry import Event
from engine_pool.fake import FakeEngine, Fault, FaultInjector
from gateway.config import GatewayConfig
from gateway.observe.event_log import describe, log_event
from tests.support import asgi_gateway

TAG = session_tag("ses_1")
"""What the lines show of the session: its tag, never its id (the capability)."""


def event(kind: str, data: dict[str, object], turn_id: int | None = None) -> Event:
    return Event(1, 0.0, kind, "ses_1", turn_id, data)


RESTORE = {
    "checkpoint_id": "ck-2", "turn_index": 2, "keep_through": 2, "discarded_turns": [3, 4],
    "sandbox_id": "box-9", "seconds": 1.25, "reason": "oom: killed", "mode": "truncate",
    "replayed": 0, "diverged": 0,
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "data", "level", "message"),
    [
        (
            "failover",
            {"token_index": 5, "from_worker": "w0", "to_worker": "w1", "cause": "stall", "lost_ms": 812.4},
            logging.WARNING,
            f"session {TAG} turn 7: worker w0 lost at token 5 (stall), resumed on w1 after 812 ms",
        ),
        (
            "failover",
            {"token_index": 0, "from_worker": "w0", "to_worker": None, "cause": "dead", "error": "refused"},
            logging.WARNING,
            f"session {TAG} turn 7: worker w0 lost at token 0 (dead), not resumed: refused",
        ),
        (
            "sandbox_failure",
            {"kind": "oom", "detail": "exec failed: killed", "sandbox_id": "box-1"},
            logging.WARNING,
            f"session {TAG}: sandbox box-1 failed (oom): exec failed: killed",
        ),
        (
            "sandbox_restored",
            RESTORE,
            logging.INFO,
            f"session {TAG}: sandbox restored (truncate) from checkpoint ck-2 (turn 2) into box-9 in 1.25 s, "
            "turns [3, 4] discarded (oom: killed)",
        ),
        (
            "sandbox_restored",
            {**RESTORE, "mode": "replay", "replayed": 3, "diverged": 1, "discarded_turns": []},
            logging.INFO,
            f"session {TAG}: sandbox restored (replay) from checkpoint ck-2 (turn 2) into box-9 in 1.25 s, "
            "3 tool calls replayed (1 gave another result) (oom: killed)",
        ),
        (
            "turns_discarded",
            {"after_turn": 2, "turn_indices": [3, 4], "reason": "restored"},
            logging.WARNING,
            f"session {TAG}: turns [3, 4] discarded after turn 2 (restored)",
        ),
        (
            "session_moved",
            {
                "from_worker": "w0",
                "to_worker": "w1",
                "group": "g7",
                "from_outstanding_tokens": 41000,
                "to_outstanding_tokens": 1200,
                "from_outstanding": 5,
                "to_outstanding": 1,
            },
            logging.INFO,
            f"session {TAG} (group g7): moved from worker w0 (41000 outstanding tokens) to w1 (1200) for load",
        ),
    ],
)
def test_recoveries_are_described(kind: str, data: dict[str, object], level: int, message: str) -> None:
    assert describe(event(kind, data, turn_id=7)) == (level, message)


def test_other_events_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, "belayer.recovery")
    for kind in ("turn_started", "sandbox_checkpoint", "worker_state", "sample"):
        log_event(event(kind, {}))
    assert caplog.records == []


def test_the_json_line_carries_the_event(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "belayer.recovery")
    log_event(event("sandbox_restored", RESTORE))
    [rec] = caplog.records
    parsed = json.loads(JsonFormatter().format(rec))
    assert (parsed["event"], parsed["session_tag"], parsed["turn_id"]) == ("sandbox_restored", TAG, None)
    assert parsed["data"] == RESTORE


async def test_a_failover_in_the_gateway_is_one_warning(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector(httpx.ASGITransport(FakeEngine().app()))
    faults.faults["e0"] = [Fault("drop_after", 3)]
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    caplog.set_level(logging.INFO, "belayer.recovery")
    async with asgi_gateway(config, faults, hosts=["http://e0", "http://e1"]) as (_, client):
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "stream": True}
        r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200 and '"error"' not in r.text
    [rec] = [r for r in caplog.records if r.name == "belayer.recovery"]
    assert rec.levelno == logging.WARNING
    message = rec.getMessage()
    assert (
        message.startswith(f"session {session_tag(sid)} turn ")
        and " worker remote-0 lost at token 3 (" in message
    )
    assert ", resumed on remote-1 after " in message and message.endswith(" ms")
