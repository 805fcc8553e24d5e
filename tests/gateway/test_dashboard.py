"""The dashboard's page and assets as the gateway serves them (the browser test drives the page itself)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from gateway.observe.dashboard.routes import STATIC
from tests.support import asgi_gateway


@pytest.fixture
async def client(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="t0ken")
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        yield client


async def test_the_page_is_served_without_the_token_and_runs_only_its_own_scripts(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "<script" in r.text and "http" not in re.sub(r"<!doctype[^>]*>", "", r.text, flags=re.I)
    # Its data is behind the token as for any client.
    assert (await client.get("/api/dashboard/state")).status_code == 401


async def test_every_asset_the_page_names_is_served(client: httpx.AsyncClient) -> None:
    page = (await client.get("/dashboard")).text
    assets = re.findall(r'(?:src|href)="(dashboard/static/[^"]+)"', page)
    assert {"dashboard/static/app.js", "dashboard/static/vendor/uPlot.iife.min.js"} <= set(assets)
    for asset in assets:
        r = await client.get(f"/{asset}")
        assert r.status_code == 200, asset
    js = await client.get("/dashboard/static/app.js")
    assert "javascript" in js.headers["content-type"]


def test_modules_import_only_modules_that_ship() -> None:
    for module in STATIC.glob("*.js"):
        for name in re.findall(r'from "\./([^"]+)"', module.read_text()):
            assert (STATIC / name).is_file(), f"{module.name} imports missing {name}"
    assert (STATIC / "vendor" / "uPlot.LICENSE").read_text().startswith("The MIT License")


async def test_a_trailing_slash_redirects_to_the_page(client: httpx.AsyncClient) -> None:
    r = await client.get("/dashboard/")
    assert r.status_code == 308 and r.headers["location"] == "../dashboard"
