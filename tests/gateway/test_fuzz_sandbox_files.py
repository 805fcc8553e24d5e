"""The sandbox file routes under the property-based fuzzer, with sandboxes on (the in-memory backend): reads
and writes of drawn paths (through one link, two, a loop, a directory, outside the root), sizes about
``sandbox.max_read_bytes`` and ``sandbox.max_journal_bytes``, mutated bodies. Every answer is under 500 and
in the protocol's error shape, a read over the limit is a 413 that took none of the file's bytes, and the
journal never holds more than its cap plus one call."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from sandbox.config import SandboxConfig
from sandbox.fake import FakeSandboxBackend
from tests.gateway import fuzzing
from tests.gateway.fuzzing import SANDBOX_MAX_JOURNAL, SANDBOX_MAX_READ, SANDBOX_SIZES, Mutation, check_answer
from tests.gateway.test_fuzz import LIMIT, FuzzGateway, fuzzer, started
from tests.support import asgi_gateway

READ_STATUSES = {200, 400, 404, 413}
WRITE_STATUSES = {200, 400, 413, 429}


class SandboxFuzzGateway(FuzzGateway):
    """`FuzzGateway` with sandboxes on, over `backend`."""

    def __init__(
        self, config: GatewayConfig, engine: httpx.AsyncBaseTransport, backend: FakeSandboxBackend
    ) -> None:
        super().__init__(config, engine)
        self.backend = backend

    async def _serve(self, ready: asyncio.Event) -> None:
        async with asgi_gateway(self.config, self.engine, sandbox_backend=self.backend, timeout=60.0) as (
            app,
            c,
        ):
            self.app, self.client = app, c
            ready.set()
            await self._stop.wait()


@pytest.fixture(scope="module")
def boxes(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[SandboxFuzzGateway]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path_factory.mktemp("fuzz-files") / "traj.db"),
        store_synchronous="OFF",
        max_body_bytes=LIMIT,
        sandbox=SandboxConfig(
            enabled=True,
            sandbox_port=None,
            max_read_bytes=SANDBOX_MAX_READ,
            max_journal_bytes=SANDBOX_MAX_JOURNAL,
        ),
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    backend = FakeSandboxBackend()
    gw = SandboxFuzzGateway(config, httpx.ASGITransport(engine.app()), backend)
    with started(gw):
        for sid in gw.sessions:
            assert gw.call("POST", f"/api/sessions/{sid}/sandbox", json={"image": "img"}).status_code == 201
            box = gw.call("GET", f"/api/sessions/{sid}/sandbox").json()["sandbox_id"]
            backend.write_file(box, "/workspace/big", b"b" * (SANDBOX_MAX_READ + 1))
            backend.write_file(box, "/workspace/dir/f", b"")
            backend.symlink(box, "/workspace/one", "a")
            backend.symlink(box, "/workspace/two", "one")
            backend.symlink(box, "/workspace/loop", "loop")
        yield gw


def test_sandbox_file_routes_survive_drawn_and_mutated_requests(boxes: SandboxFuzzGateway) -> None:
    @fuzzer(0.04)
    @given(
        which=st.integers(0, 2),
        capability=st.booleans(),
        read=st.booleans(),
        query=fuzzing.sandbox_read_queries,
        body=fuzzing.sandbox_write_bodies(),
        mutations=fuzzing.mutations,
    )
    def example(
        which: int, capability: bool, read: bool, query: str, body: dict[str, Any], mutations: list[Mutation]
    ) -> None:
        sid = boxes.sessions[which]
        base = f"/s/{sid}/sandbox/files" if capability else f"/api/sessions/{sid}/sandbox/files"
        if read:
            bodies_before = len(boxes.backend.ops("file_body"))
            url = f"{base}?{query}" if query else base
            r = boxes.call("GET", url)
            answer = check_answer("GET", url, r, f"GET {url}")
            assert r.status_code in READ_STATUSES, r.text
            if r.status_code == 413:
                assert answer["error"]["code"] == "file_too_large", r.text
                assert len(boxes.backend.ops("file_body")) == bodies_before  # none of its bytes
            if r.status_code == 200:
                assert answer["size"] <= SANDBOX_MAX_READ, r.text
        else:
            content = fuzzing.encode_json(fuzzing.apply(body, mutations)).encode()
            r = boxes.call("PUT", base, content=content, headers={"content-type": "application/json"})
            check_answer("PUT", base, r, f"PUT {base} {content[:200]!r}")
            assert r.status_code in WRITE_STATUSES, r.text
        state = boxes.call("GET", f"/api/sessions/{sid}/sandbox").json()
        assert state["status"] == "running" and state["last_restore"] is None, state  # nothing broke it
        assert state["journal_bytes"] <= SANDBOX_MAX_JOURNAL + max(SANDBOX_SIZES), state

    example()
