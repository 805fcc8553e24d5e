"""The property-based fuzzer of ``tests/gateway/test_fuzz.py`` over the sandbox listener's routes: every
route of the app, valid and mutated, sent as a sandbox through `SandboxFacing` (with the identity the
listener's protocol puts in the scope), from the sandbox of the session named in the path, of another
session, or of none.

For every example: what a sandbox may call (its own session's ``/s/{sid}/…`` model routes, ``/health``)
is held to the main port's checks (no 5xx, no exception out of the app, errors in the route's
protocol shape, 415 for a body not declared as JSON, readable trajectories); everything else is a 403
``permission_error`` in the route's error shape that names no session, and changes nothing. The wire side of the
listener (a relay's challenge line) is fuzzed against `RelayVouching.identity`: any bytes, no exception,
and no identity without the node's key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.types import ASGIApp, Receive, Scope, Send

from engine_pool.fake import FakeEngine
from gateway.api.sandbox_listener import IDENTITY_SCOPE_KEY, SandboxFacing
from gateway.config import FailoverConfig
from gateway.policy.tokenization import ChatTokenizer
from sandbox.cluster.relay import RelayVouching, challenge, node_key, vouch
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from tests.gateway import fuzzing
from tests.gateway.fuzzing import ROUTES, SANDBOX_ROUTES, Plan, check_error
from tests.gateway.test_fuzz import FuzzGateway, Sent, fuzz_config, fuzzer, hang_up, reply_script, started
from tests.support import asgi_gateway

OWN_ROUTES = ["s-chat", "s-completions", "s-models", "s-messages", "s-count", "s-responses", "s-get-response"]
OTHER_ROUTES = [name for name in ROUTES if name not in OWN_ROUTES]
NOBODY = "10.99.250.250"  # an address no sandbox has


class Identified:
    """What the listener's protocol does before `SandboxFacing`: the connection's identity in the scope."""

    def __init__(self, app: ASGIApp, identity: str) -> None:
        self.app, self.identity = app, identity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app({**scope, IDENTITY_SCOPE_KEY: self.identity}, receive, send)


class ListenerFuzz(FuzzGateway):
    """The fuzzed gateway, its requests sent through the sandbox listener's ASGI side, as a sandbox."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = FakeSandboxBackend()
        self.facing: SandboxFacing | None = None
        self.boxes: dict[str, str] = {}  # session -> its sandbox's identity (address)
        self.refused = 0
        self._from: str | None = None  # the session whose sandbox sends the example's request

    async def _serve(self, ready: Any) -> None:
        probes = {"probe_interval": 0.05, "probe_timeout": 0.5}
        gateway = asgi_gateway(
            self.config,
            self.engine,
            hosts=self.hosts,
            pool_options=probes,
            timeout=60.0,
            sandbox_backend=self.backend,
        )
        async with gateway as (app, client):
            self.app, self.client = app, client
            manager = app.state.gateway.sandboxes
            manager.gateway_url = "http://10.99.0.1:7"  # the listener's socket is not run: its ASGI side is
            self.facing = SandboxFacing(app, manager, vouched=True)
            ready.set()
            await self._stop.wait()

    def keep_sessions_open(self) -> None:
        super().keep_sessions_open()
        for sid in self.sessions:  # each session a sandbox on the gateway network
            if sid not in self.boxes and sid not in self.closed:
                r = self.call(
                    "POST", f"/api/sessions/{sid}/sandbox", json={"image": "img", "network": "gateway"}
                )
                assert r.status_code == 201, r.text
                self.boxes[sid] = str(self.backend.network.address(r.json()["sandbox_id"]))

    def source(self, sent: Sent) -> tuple[str, str | None]:
        """The sandbox the request comes from: mostly the one of the session in its path, now and then
        another's or none; and the session it is."""
        pick = sent.plan.session if isinstance(sent.plan.session, int) else len(sent.plan.session)
        live = {sid: box for sid, box in self.boxes.items() if sid not in self.closed}  # a retired
        own = live.get(sent.sid)  # session's sandbox is gone with it: its address is nobody's
        if own is not None and pick % 5 != 4:
            return own, sent.sid
        others = [(box, sid) for sid, box in live.items() if sid != sent.sid]
        return others[pick % len(others)] if others and pick % 2 == 0 else (NOBODY, None)

    async def exchange(self, sent: Sent) -> httpx.Response | None:
        assert self.facing is not None
        identity, self._from = self.source(sent)
        app = Identified(self.facing, identity)
        if sent.content is not None and sent.plan.encoding.hangup:
            return await hang_up(app, sent)  # type: ignore[arg-type]
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://belayer-gateway"
        ) as c:
            try:
                return await c.request(sent.method, sent.url, content=sent.content, headers=sent.headers)
            except Exception as e:
                raise AssertionError(f"{sent}: the ASGI app raised {type(e).__name__}: {e}") from e

    def finish(self, sent: Sent, r: httpx.Response | None) -> None:
        owner = self._from
        own = (
            owner is not None and re.match(rf"/s/{re.escape(owner)}/(?!sandbox(/|$))", sent.path) is not None
        )
        if own or sent.path == "/health" or r is None:
            super().finish(sent, r)
            return
        where = f"{sent} from {owner} -> {r.status_code} {r.text[:300]!r}"
        assert r.status_code == 403, where
        body = r.json()
        check_error(sent.path, body, where)
        assert body["error"]["type"] == "permission_error", where  # OpenAI's code, Anthropic's type
        assert not any(sid in r.text for sid in self.sessions), f"{where}: a refusal names a session"
        self.refused += 1
        self.statuses[("refused", 403)] += 1
        self.after_example()


@pytest.fixture(scope="module")
def listener_fuzz(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ListenerFuzz]:
    config = fuzz_config(
        tmp_path_factory,
        tiny_model_dir,
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=5.0),
        sandbox=SandboxConfig(
            enabled=True, sandbox_port=None, policy=PolicySettings(mode="never"), watch_interval_s=3600.0
        ),
    )
    engine = FakeEngine(max_model_len=4096, script=reply_script(ChatTokenizer.load(tiny_model_dir)))
    with started(ListenerFuzz(config, httpx.ASGITransport(engine.app()))) as gw:
        yield gw


def run(fuzz: ListenerFuzz, routes: list[str], share: float) -> None:
    @fuzzer(share)
    @given(plan=fuzzing.plans(routes))
    def example(plan: Plan) -> None:
        fuzz.send(plan)

    example()
    fuzz.check_readable()


def test_a_sandbox_reaches_its_own_sessions_model_routes_under_the_main_ports_checks(
    listener_fuzz: ListenerFuzz,
) -> None:
    run(listener_fuzz, OWN_ROUTES, 0.1)
    listener_fuzz.check_reached(["s-chat", "s-messages", "s-models"])
    assert listener_fuzz.refused > 0  # and requests from other sandboxes, or none, were refused


def test_every_other_route_is_refused_through_the_listener(listener_fuzz: ListenerFuzz) -> None:
    before = listener_fuzz.refused
    run(listener_fuzz, OTHER_ROUTES, 0.05)
    assert listener_fuzz.refused > before


@pytest.mark.parametrize(("method", "path"), SANDBOX_ROUTES)
def test_the_sandbox_routes_are_refused_to_a_sandbox_even_for_its_own_session(
    listener_fuzz: ListenerFuzz, method: str, path: str
) -> None:
    sid = next(s for s in reversed(listener_fuzz.sessions) if s in listener_fuzz.boxes)
    app = Identified(listener_fuzz.facing, listener_fuzz.boxes[sid])  # type: ignore[arg-type]

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://belayer-gateway"
        ) as c:
            return await c.request(method, path.replace("{sid}", sid), json={"command": "id"})

    r = listener_fuzz.run(call)
    assert r.status_code == 403, r.text
    assert sid not in r.text


MASTER = b"m" * 32


lines = st.one_of(
    st.binary(max_size=600),
    st.builds(
        lambda node, box, mac: b" ".join([b"BELAYER", node, box, mac]),
        st.binary(max_size=40),
        st.binary(max_size=80),
        st.binary(max_size=80),
    ),
)


@fuzzer(0.1)
@given(line=lines, flip=st.integers(0, 1 << 16), bit=st.integers(0, 7))
def test_any_answer_line_is_judged_without_an_exception(line: bytes, flip: int, bit: int) -> None:
    """Random lines, and a valid vouch with one bit flipped: never an exception, never an identity."""
    vouching = RelayVouching(MASTER, lambda box: "n1")
    asked = challenge()
    good = vouch(node_key(MASTER, "n1"), "n1", "box", asked)
    assert good is not None and vouching.identity(asked, good) == "box@n1"
    i = flip % len(good)
    flipped = good[:i] + bytes([good[i] ^ (1 << bit)]) + good[i + 1 :]
    assert vouching.identity(asked, line) is None
    assert vouching.identity(asked, flipped) is None
