"""Shared fixtures: the tiny model (built once, cached) and a gateway over a scripted fake engine.

Shared helpers (not fixtures) live in ``tests/support.py``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import FakeEngine
from gateway.config import FailoverConfig, GatewayConfig
from gateway.policy.tokenization import ChatTokenizer
from tests.store_backends import postgres, sql_store_backend, store_backend  # noqa: F401  (fixtures: every store)
from tests.support import REPO, GatewayHarness, asgi_gateway


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model, built by `belayer model build-tiny` (cached under .cache/ like `make` does)."""
    # absolute: server processes the tests start run in the repository, whatever pytest's cwd
    path = Path(os.environ.get("BELAYER_TINY_MODEL", REPO / ".cache" / "tiny-model")).resolve()
    if not (path / "model.safetensors").exists():
        from belayer.testing.tiny_model import build_tiny

        build_tiny(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


@pytest.fixture
async def gateway(
    tmp_path: Path, tiny_model_dir: Path, fake_engine: FakeEngine
) -> AsyncIterator[GatewayHarness]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        max_body_bytes=256 * 1024,
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
        allowed_hosts=["gw"],  # the test client's host: checked, and session base_urls are built from it
    )
    async with asgi_gateway(config, httpx.ASGITransport(fake_engine.app())) as (app, client):
        yield GatewayHarness(app, client, fake_engine)
