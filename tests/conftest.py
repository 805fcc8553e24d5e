"""Shared fixtures: the tiny model (built once, cached) and a gateway over a scripted fake engine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig
from gateway.runtime import Gateway
from gateway.tokenization import ChatTokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model, built by `belayer model build-tiny` (cached under .cache/ like `make` does)."""
    path = Path(os.environ.get("BELAYER_TINY_MODEL", REPO / ".cache" / "tiny-model"))
    if not (path / "model.safetensors").exists():
        from belayer.tiny_model import build_tiny

        build_tiny(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


class GatewayHarness:
    """A gateway app over a fake engine, reachable through ``httpx.ASGITransport``."""

    def __init__(self, app: object, client: httpx.AsyncClient, engine: FakeEngine) -> None:
        self.app = app
        self.client = client
        self.engine = engine

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway  # type: ignore[attr-defined]
        return gw

    def encode_reply(self, text: str, eos: bool = True) -> list[int]:
        tok = self.gw.tokenizer
        return tok.encode(text) + ([tok.encode(tok.eos_token)[0]] if eos else [])

    async def new_session(self, **metadata: object) -> tuple[str, str]:
        r = await self.client.post("/api/sessions", json={"metadata": metadata})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["base_url"]


@pytest.fixture
async def gateway(
    tmp_path: Path, tiny_model_dir: Path, fake_engine: FakeEngine
) -> AsyncIterator[GatewayHarness]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        max_body_bytes=256 * 1024,
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
    )
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(fake_engine.app()))
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")
        yield GatewayHarness(app, client, fake_engine)
        await client.aclose()
    await engine_http.aclose()
