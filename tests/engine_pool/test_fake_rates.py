"""The fake engine's per-stream rates (``belayer bench scale``: streams at 20-50 tokens/s each)."""

from __future__ import annotations

import time

import httpx

from engine_pool.fake import FakeEngine


def test_each_stream_draws_its_delay_within_the_range() -> None:
    engine = FakeEngine(token_delay=0.02, token_delay_max=0.05)
    delays = [engine._stream_delay() for _ in range(200)]
    assert all(0.02 <= d <= 0.05 for d in delays)
    assert max(delays) - min(delays) > 0.02  # spread over the range, not one rate
    assert FakeEngine(token_delay=0.02)._stream_delay() == 0.02  # no range: every stream alike


async def test_a_stream_keeps_its_rate() -> None:
    engine = FakeEngine(token_delay=0.01, token_delay_max=0.01, outputs=[[5, 6, 7, 8, 9]])
    transport = httpx.ASGITransport(app=engine.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as http:
        t0 = time.monotonic()
        body = {"model": "fake", "prompt": [1, 2], "max_tokens": 5, "stream": True}
        resp = await http.post("/v1/completions", json=body)
        assert resp.status_code == 200
    assert resp.text.count("data: ") == 6  # five tokens and [DONE]
    assert time.monotonic() - t0 >= 0.05  # a delay before each token, the first's included
