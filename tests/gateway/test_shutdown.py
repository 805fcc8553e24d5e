"""Shutdown order: background work finishes (or is cancelled and says so) before the store closes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from store import SqliteStore


class HeldPromptLogprobs(httpx.AsyncBaseTransport):
    """The fake engine, but a prompt-logprobs request (a recomputation) waits for `release`."""

    def __init__(self, engine: FakeEngine) -> None:
        self.inner = httpx.ASGITransport(engine.app())
        self.release = asyncio.Event()
        self.held = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions" and "prompt_logprobs" in json.loads(request.content):
            self.held.set()
            await self.release.wait()
        return await self.inner.handle_async_request(request)


async def test_a_recomputation_running_at_shutdown_is_joined_before_the_store_closes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = FakeEngine(max_model_len=4096)
    transport = HeldPromptLogprobs(engine)
    db = tmp_path / "t.db"
    async with httpx.AsyncClient(transport=transport) as http:
        pool = EnginePool(http)
        pool.add_remote("http://fake-engine")
        app = build_app(GatewayConfig(model=str(tiny_model_dir), store_path=str(db)), pool=pool)
        async with app.router.lifespan_context(app):
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")
            tok = app.state.gateway.tokenizer
            eos = tok.encode(tok.eos_token)
            engine.outputs += [tok.encode("one") + eos, tok.encode("two") + eos]
            sid = (await client.post("/api/sessions", json={})).json()["id"]
            url = f"/s/{sid}/v1/chat/completions"
            first = [{"role": "user", "content": "a"}]
            r = await client.post(url, json={"model": "policy", "messages": first})
            assert r.status_code == 200
            # History rewritten (the answer edited): its logprobs are recomputed in the background.
            rewritten = [
                *first,
                {"role": "assistant", "content": "(summary)"},
                {"role": "user", "content": "b"},
            ]
            assert (
                await client.post(url, json={"model": "policy", "messages": rewritten})
            ).status_code == 200
            await transport.held.wait()
            # Shutdown begins with the recomputation in flight; the engine answers meanwhile.
            asyncio.get_running_loop().call_later(0.05, transport.release.set)
        store = SqliteStore(db)
        kinds = [e.kind for e in store.get_events(sid)]
        store.close()
    assert "recomputed_logprobs" in kinds and "recompute_failed" not in kinds
