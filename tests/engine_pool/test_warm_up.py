"""A launched worker's warm-up (`engine_pool.workers.warm_up`): what it sends, and that a pool sends it to
each launched worker before the worker takes traffic or stands as a shadow."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine_pool.engine.client import EngineClient
from engine_pool.fake import FakeEngine
from engine_pool.pool import READY, SHADOW
from engine_pool.workers.warm_up import PROMPT_LENGTHS, TOKENS, prompt, warm_up
from gateway.app import build_pool
from gateway.config import FailoverConfig, GatewayConfig


async def test_the_warm_up_sends_growing_unseeded_greedy_prompts_capped_to_half_the_context() -> None:
    engine = FakeEngine(outputs=[[5, 6, 7, 8]])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(engine.app())) as http:
        took = await warm_up(EngineClient("http://w", "policy", http), max_model_len=400)
    assert took >= 0
    assert [len(r["prompt"]) for r in engine.requests] == [16, 128, 200]
    assert [r["prompt"] for r in engine.requests] == [prompt(16), prompt(128), prompt(200)]
    for r in engine.requests:
        # unseeded: a seeded request whose prefill spans scheduler steps kills vLLM 0.32 (a query of death)
        assert "seed" not in r and r["temperature"] == 0.0 and r["max_tokens"] == TOKENS, r


async def test_a_tiny_context_gets_one_warm_up_prompt() -> None:
    engine = FakeEngine(outputs=[[5]])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(engine.app())) as http:
        await warm_up(EngineClient("http://w", "policy", http), max_model_len=20)
    assert [len(r["prompt"]) for r in engine.requests] == [10]


def _prompt_tokens(metrics: str) -> float:
    [line] = [x for x in metrics.splitlines() if x.startswith("vllm:prompt_tokens_total")]
    return float(line.split()[-1])


@pytest.mark.parametrize("warm", [True, False])
async def test_a_pool_warms_each_launched_worker_before_it_serves_or_stands_by(
    warm: bool, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Launched fake workers (real processes): once the pool has started, the active worker and the
    shadow have each prefilled exactly the warm-up prompts (none with ``failover.warm_up`` off)."""
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=1, shadows=1, log_dir=str(tmp_path / "logs"),
        worker_start_timeout=60.0, failover=FailoverConfig(warm_up=warm),
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        try:
            await pool.start()
            members = pool.roster.members
            assert sorted(m.state for m in members) == [READY, SHADOW]
            context = pool.max_model_len
            want = sum(min(n, context // 2) for n in PROMPT_LENGTHS) if warm else 0
            for m in members:
                got = _prompt_tokens((await http.get(f"{m.client.base_url}/metrics")).text)
                assert got == want, (m.name, m.state)
        finally:
            await pool.stop()
