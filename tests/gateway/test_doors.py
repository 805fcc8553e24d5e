"""The doors an outsider could get in by (issue 22), each reproduced against the app and shown shut:
auxiliary calls admitted like policy calls, every plain route under ``plain_v1``, no DNS-rebinding
or cross-site request on the defaults, and a read-only ``GET /api/export``."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from belayer.cli import main
from core.errors import ConfigError
from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from gateway.config.loader import ConfigLoader
from gateway.gateway import Gateway
from gateway.http.access import is_plain
from store import SessionQuery
from tests.support import REPO, app_routes, asgi_gateway

TOKEN = {"authorization": "Bearer t0ken"}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JUDGE = {"model": "judge-x", "messages": [{"role": "user", "content": "grade this"}], "max_tokens": 2}
RESPONSE = {"model": "judge-x", "input": "grade this"}


class Rig:
    def __init__(self, app: Starlette, client: httpx.AsyncClient, provider: FakeEngine) -> None:
        self.app, self.client, self.provider = app, client, provider
        self.gw: Gateway = app.state.gateway


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """A protected gateway (API token, plain /v1 off) with an external auxiliary route."""
    options: dict[str, Any] = getattr(request, "param", {})
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        api_token="t0ken",
        plain_v1="off",
        auxiliary_models={"judge-*": "http://provider.test/v1#judge-large"},
        **options,
    )
    provider = FakeEngine(model="judge-large")
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    aux = httpx.ASGITransport(provider.app())
    async with asgi_gateway(config, httpx.ASGITransport(engine.app()), aux_transport=aux) as (app, client):
        yield Rig(app, client, provider)


# --- door 1: auxiliary models pass the same admission as the policy --------------------------------


async def test_an_auxiliary_call_for_an_unknown_session_reaches_no_provider_and_writes_nothing(
    rig: Rig,
) -> None:
    r = await rig.client.post("/s/doesnotexist/v1/chat/completions", json=JUDGE)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "session_not_found"), r.text
    r = await rig.client.post("/s/doesnotexist/v1/messages", json=JUDGE)
    assert (r.status_code, r.json()["type"]) == (404, "error")
    r = await rig.client.post("/s/doesnotexist/v1/responses", json=RESPONSE)
    assert r.status_code == 404
    assert rig.provider.requests == []  # the provider (and its API key) never saw the request
    assert rig.gw.store.get_events("doesnotexist") == []  # nothing written for a session that is not


async def test_an_auxiliary_call_on_a_plain_route_obeys_plain_v1(rig: Rig) -> None:
    for url, body in [("/v1/chat/completions", JUDGE), ("/v1/responses", RESPONSE)]:
        r = await rig.client.post(url, json=body, headers=TOKEN)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "permission_error"), (url, r.text)
    assert rig.provider.requests == []


async def test_an_auxiliary_call_for_a_closed_session_is_refused(rig: Rig) -> None:
    sid = (await rig.client.post("/api/sessions", json={}, headers=TOKEN)).json()["id"]
    assert (await rig.client.post(f"/api/sessions/{sid}/close", headers=TOKEN)).status_code == 200
    r = await rig.client.post(f"/s/{sid}/v1/chat/completions", json=JUDGE)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "session_closed")
    assert rig.provider.requests == []
    assert [e for e in rig.gw.store.get_events(sid) if e.kind == "auxiliary_call"] == []


async def test_an_auxiliary_call_for_an_open_session_is_forwarded_and_recorded(rig: Rig) -> None:
    sid = (await rig.client.post("/api/sessions", json={}, headers=TOKEN)).json()["id"]
    r = await rig.client.post(f"/s/{sid}/v1/chat/completions", json=JUDGE)
    assert r.status_code == 200 and r.json()["model"] == "judge-large"
    assert [e.data["status"] for e in rig.gw.store.get_events(sid) if e.kind == "auxiliary_call"] == [200]


# --- door 2: every plain route, taken from the router, obeys plain_v1 ------------------------------


@pytest.mark.parametrize("plain_v1", ["off", "token"])
async def test_every_plain_route_from_the_router_obeys_plain_v1(
    tmp_path: Path, tiny_model_dir: Path, plain_v1: str
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="t0ken", plain_v1=plain_v1
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        routes = app_routes(app, "/v1/")
        assert {
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/resp_x"),
            ("POST", "/v1/chat/completions"),
        } <= set(routes)
        governed = [(m, p) for m, p in routes if is_plain(p)]
        assert [(m, p) for m, p in routes if not is_plain(p)] == [("GET", "/v1/models")]
        for method, path in governed:
            r = await client.request(method, path, json=CHAT if method == "POST" else None)
            assert r.status_code == (403 if plain_v1 == "off" else 401), (method, path, r.text)
        assert (await client.get("/v1/models")).status_code == 200
        assert engine.requests == []  # no one-request session was served


# --- door 3: DNS rebinding and blind cross-site requests, on the default configuration ---------------


@pytest.fixture
async def default_gw(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as pair:
        yield pair


async def test_a_rebound_name_reaches_no_route_on_the_defaults(
    default_gw: tuple[Starlette, httpx.AsyncClient],
) -> None:
    app, client = default_gw
    routes = app_routes(app)
    assert len(routes) > 30
    for method, path in routes:
        r = await client.request(method, path, headers={"host": "rebind.attacker.example"}, json={})
        assert r.status_code == 400, (method, path, r.status_code, r.text)
        assert "does not answer for host" in r.text and "--allowed-hosts" in r.text
    assert app.state.gateway.store.query_sessions(SessionQuery())[1] == 0
    for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3:8000", "LOCALHOST"):
        assert (await client.get("/api/sessions", headers={"host": host})).status_code == 200, host


async def test_a_request_without_a_host_is_answered_on_the_defaults_only(
    default_gw: tuple[Starlette, httpx.AsyncClient], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """HAProxy's ``option httpchk`` sends ``GET /health HTTP/1.0`` with no Host; no browser does."""

    async def status_without_host(app: Starlette) -> int:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.0", "method": "GET",
            "scheme": "http", "path": "/health", "raw_path": b"/health", "query_string": b"", "root_path": "",
            "headers": [], "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return int(sent[0]["status"])

    assert await status_without_host(default_gw[0]) == 200
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "x.db"), allowed_hosts=["gw"])
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (app, _):
        assert await status_without_host(app) == 400  # base_urls come from the Host there: it must be given


async def test_the_public_url_host_is_answered_and_others_are_not(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), public_url="https://rl.example.org/"
    )
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        assert (await client.get("/api/sessions", headers={"host": "rl.example.org"})).status_code == 200
        assert (await client.get("/api/sessions", headers={"host": "example.org"})).status_code == 400


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "https://evil.example"},
        {"origin": "null"},
        {"origin": "http://localhost:3000"},  # another port is another origin
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site", "origin": "http://localhost"},
        {"sec-fetch-site": "cross-site", "origin": "http://localhost"},
    ],
)
async def test_a_cross_site_request_changes_nothing(
    default_gw: tuple[Starlette, httpx.AsyncClient], headers: dict[str, str]
) -> None:
    app, client = default_gw
    store = app.state.gateway.store
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    attempts = [
        ("POST", "/api/sessions", {}),
        ("POST", f"/api/sessions/{sid}/reward", {"reward": 1.0}),
        ("POST", f"/api/sessions/{sid}/close", None),
        ("DELETE", f"/api/sessions/{sid}", None),
        ("POST", f"/s/{sid}/v1/chat/completions", CHAT),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/api/export", None),
    ]
    for method, path, body in attempts:
        r = await client.request(method, path, json=body, headers=headers)
        assert r.status_code == 403, (method, path, r.text)
        assert "another site" in r.text and "cross_site_request" in r.text
    session = store.get_session(sid)
    assert session is not None and (session.status, session.reward) == ("open", None)
    assert store.get_turns(sid) == [] and store.query_sessions(SessionQuery())[1] == 1


async def test_same_origin_and_non_browser_requests_go_through(
    default_gw: tuple[Starlette, httpx.AsyncClient],
) -> None:
    _, client = default_gw
    for headers in (
        {},  # a program: no Origin, no Sec-Fetch-Site
        {"origin": "http://localhost", "sec-fetch-site": "same-origin"},  # the dashboard
        {"sec-fetch-site": "none"},  # typed into the address bar
        {"origin": "http://127.0.0.1:8000", "host": "127.0.0.1:8000"},
    ):
        r = await client.post("/api/sessions", json={}, headers=headers)
        assert r.status_code == 201, (headers, r.text)
    # reads are not state changes: a page can send them, and the browser keeps the answer from it
    assert (await client.get("/api/sessions", headers={"sec-fetch-site": "cross-site"})).status_code == 200


@pytest.mark.parametrize("route", ["/api/sessions", "/v1/chat/completions"])
async def test_a_body_without_a_content_type_is_refused(
    default_gw: tuple[Starlette, httpx.AsyncClient], route: str
) -> None:
    app, client = default_gw
    r = await client.post(route, content=b'{"model": "policy", "messages": []}')
    assert "content-type" not in r.request.headers
    assert (r.status_code, r.json()["error"]["code"]) == (415, "unsupported_media_type")
    assert "no Content-Type" in r.json()["error"]["message"]
    assert app.state.gateway.store.query_sessions(SessionQuery())[1] == 0

    async def chunks() -> AsyncIterator[bytes]:
        yield b"{}"

    r = await client.post(route, content=chunks())  # chunked: no content-length either
    assert r.status_code == 415
    # no body at all needs no type
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200


# --- door 4: GET /api/export only reads ----------------------------------------------------------------


async def test_get_export_marks_nothing_and_post_export_marks(
    default_gw: tuple[Starlette, httpx.AsyncClient],
) -> None:
    app, client = default_gw
    store = app.state.gateway.store
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    assert (await client.post(f"/s/{sid}/v1/chat/completions", json=CHAT)).status_code == 200
    assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200
    later = time.time() + 3600
    r = await client.get("/api/export?format=jsonl")
    assert r.status_code == 200 and sid in r.text
    assert store.prune(later, exported_only=True) == []  # nothing marked by a GET (an <img> tag can send one)
    assert store.get_session(sid) is not None
    r = await client.post("/api/export?format=jsonl", json={"status": "closed"})
    assert r.status_code == 400 and "query string" in r.json()["error"]["message"]
    r = await client.post("/api/export?format=jsonl")
    assert r.status_code == 200 and sid in r.text
    assert store.prune(later, exported_only=True) == [sid]
    assert store.get_session(sid) is None


# --- smaller doors: tokens out of `ps`, engines and weights inside their allowlists --------------------


def test_tokens_come_from_files_and_never_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "api-token"
    token_file.write_text("s3cret-from-file\n")
    config = ConfigLoader({"model": "m", "api_token_file": str(token_file)}, {}).load()
    assert config.api_token == "s3cret-from-file"
    monkeypatch.setenv("BELAYER_ADMIN_TOKEN_FILE", str(token_file))
    assert ConfigLoader({"model": "m"}, {}).load().admin_token == "s3cret-from-file"
    monkeypatch.delenv("BELAYER_ADMIN_TOKEN_FILE")
    with pytest.raises(ConfigError, match="as a value or as a file, not both"):
        ConfigLoader({"model": "m", "api_token": "x", "api_token_file": str(token_file)}, {}).load()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ConfigLoader({"model": "m", "api_token_file": str(tmp_path / "empty")}, {}).load()
    with pytest.raises(ConfigError, match="cannot read the token file"):
        ConfigLoader({"model": "m", "api_token_file": str(tmp_path / "nope")}, {}).load()


def test_serve_help_says_how_to_keep_the_token_out_of_ps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--api-token-file" in text and "BELAYER_API_TOKEN" in text and "`ps`" in text


def test_engines_outside_engine_allow_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="not in --engine-allow"):
        ConfigLoader({"model": "m", "engine_urls": ["http://169.254.169.254"], "engine_allow": ["10.0.0.0/8"]},
                     {}).load()  # fmt: skip
    with pytest.raises(ConfigError, match="neither an IP network"):
        ConfigLoader({"model": "m", "engine_allow": ["10.0.0.0/99"]}, {}).load()


async def test_registering_an_engine_outside_engine_allow_is_a_400(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        admin_token="adm1n",
        engine_allow=["fake-engine", "*.engines.internal"],
    )
    admin = {"authorization": "Bearer adm1n"}
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (app, client):
        for url in (
            "http://169.254.169.254/latest",
            "http://127.0.0.1:22",
            "http://engines.internal.evil.example",
        ):
            r = await client.post("/api/engines", json={"url": url}, headers=admin)
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
                400, "engine_not_allowed", "url",
            ), r.text  # fmt: skip
        assert [m.name for m in app.state.gateway.pool.roster.members] == ["remote-0"]
        r = await client.post("/api/engines", json={"url": "http://w1.engines.internal:8000"}, headers=admin)
        assert r.status_code == 201, r.text


async def test_a_weights_path_outside_the_weights_root_is_a_400(tmp_path: Path, tiny_model_dir: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    (outside / "model.safetensors").write_bytes(b"weights")
    (root / "link").symlink_to(outside)  # a link inside the root that leads out of it
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        admin_token="adm1n",
        weights_root=str(root),
    )
    admin = {"authorization": "Bearer adm1n"}
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (app, client):
        for path in (outside, root / "link", root / ".." / "elsewhere"):
            r = await client.post("/api/weights", json={"version": "v2", "path": str(path)}, headers=admin)
            assert (r.status_code, r.json()["error"]["param"]) == (400, "path"), r.text
            assert "outside the weights root" in r.json()["error"]["message"]
        assert app.state.gateway.pool.versions.version == "base"


def test_every_row_of_the_threat_model_names_tests_that_exist() -> None:
    page = (REPO / "docs" / "operations" / "security.md").read_text()  # the docs site's threat model
    table = page[page.index("**Who may do what (threat model).**") :].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| who")]
    assert len(rows) == 14, rows
    for row in rows:
        shown_by = row.rstrip(" |").rsplit(" | ", 1)[1]
        refs = re.findall(r"`([\w/.]*?)(?:::(\w+))?`", shown_by)
        assert refs, row
        file = None
        for path, name in refs:
            file = REPO / "tests" / path if path else file
            assert file is not None and file.is_file(), (row[:40], path)
            if name:
                assert re.search(rf"^(async )?def {name}\(", file.read_text(), re.M), (file.name, name)
