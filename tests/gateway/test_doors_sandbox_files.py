"""A session holder cannot exhaust the gateway's memory through the sandbox file API (issue 31, finding 6).

Through the app, with the in-memory sandbox backend (`sandbox.fake`), whose reads record the size asked
for first (``read_file``) apart from the bytes taken (``file_body``), as the Docker backend asks for the
archive's stat header before its body:

- a file over ``sandbox.max_read_bytes`` is refused with a 413 and none of its bytes is taken;
- the journal of writes since the last checkpoint holds each content once and stays under
  ``sandbox.max_journal_bytes`` (a checkpoint empties it first, or, with none to take, a 429);
- the store's ``sandbox_call`` events (and the live feed they go to) carry no large file's bytes;
- a path with a second symbolic link, or a loop of them, is a 400 that reaches the backend once.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.sessions.journal import INLINE_BYTES
from store import TrajectoryStore
from tests.support import asgi_gateway

TOKEN = {"authorization": "Bearer t0ken"}
MAX_READ = 4096
MAX_JOURNAL = 100_000
CHUNK = 40_000  # over INLINE_BYTES: recorded by digest only


class Rig:
    def __init__(self, app: Any, client: httpx.AsyncClient, backend: FakeSandboxBackend) -> None:
        self.app, self.client, self.backend = app, client, backend

    @property
    def store(self) -> TrajectoryStore:
        gw: Gateway = self.app.state.gateway
        return gw.store

    async def session(self) -> tuple[str, str]:
        """A session with a sandbox; its id and its sandbox's."""
        r = await self.client.post("/api/sessions", json={"sandbox": {"image": "img"}}, headers=TOKEN)
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        return sid, await self.box(sid)

    async def box(self, sid: str) -> str:
        return str((await self.state(sid))["sandbox_id"])

    async def state(self, sid: str) -> dict[str, Any]:
        r = await self.client.get(f"/api/sessions/{sid}/sandbox", headers=TOKEN)
        assert r.status_code == 200, r.text
        state: dict[str, Any] = r.json()
        return state

    async def read(self, sid: str, path: str) -> httpx.Response:
        return await self.client.get(f"/s/{sid}/sandbox/files", params={"path": path})

    async def write(self, sid: str, path: str, content: str) -> httpx.Response:
        return await self.client.put(f"/s/{sid}/sandbox/files", json={"path": path, "content": content})

    def triggers(self, sid: str) -> list[str]:
        return [e.data["trigger"] for e in self.store.get_events(sid) if e.kind == "sandbox_checkpoint"]


async def rig_for(tmp_path: Path, tiny_model_dir: Path, **sandbox: Any) -> AsyncIterator[Rig]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        api_token="t0ken",
        sandbox=SandboxConfig(
            enabled=True, sandbox_port=None, max_read_bytes=MAX_READ, max_journal_bytes=MAX_JOURNAL, **sandbox
        ),
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    backend = FakeSandboxBackend()
    async with asgi_gateway(config, httpx.ASGITransport(engine.app()), sandbox_backend=backend) as (app, c):
        yield Rig(app, c, backend)


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    async for made in rig_for(tmp_path, tiny_model_dir):
        yield made


@pytest.fixture
async def no_checkpoints(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    async for made in rig_for(tmp_path, tiny_model_dir, policy=PolicySettings(mode="never")):
        yield made


def check_error(r: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, r.text
    assert (error["code"], error["param"]) == (code, param), r.text
    return str(error["message"])


async def test_a_file_over_max_read_bytes_is_a_413_and_none_of_it_is_read(rig: Rig) -> None:
    sid, box = await rig.session()
    rig.backend.write_file(box, "/workspace/big", b"x" * (MAX_READ + 1))
    rig.backend.write_file(box, "/workspace/fits", b"y" * MAX_READ)

    message = check_error(await rig.read(sid, "/workspace/big"), 413, "file_too_large", "path")
    assert f"holds {MAX_READ + 1} bytes, over the {MAX_READ}" in message and "head -c" in message
    assert (rig.backend.ops("read_file"), rig.backend.ops("file_body")) == ([box], [])  # its size only

    r = await rig.read(sid, "/workspace/fits")
    assert r.status_code == 200 and r.json()["size"] == MAX_READ, r.text
    assert (rig.backend.ops("read_file"), rig.backend.ops("file_body")) == ([box, box], [box])


async def test_the_journal_holds_a_content_once_and_checkpoints_before_its_cap(rig: Rig) -> None:
    sid, _ = await rig.session()
    same = "a" * CHUNK
    for n in range(24):  # the finding: 24 writes of one file were held 24 times, in memory and the store
        assert (await rig.write(sid, f"/workspace/same-{n}", same)).status_code == 200
    state = await rig.state(sid)
    assert (state["journaled_calls"], state["journal_bytes"], rig.triggers(sid)) == (24, CHUNK, [])

    assert (await rig.write(sid, "/workspace/b", "b" * CHUNK)).status_code == 200
    state = await rig.state(sid)
    assert (state["journaled_calls"], state["journal_bytes"], rig.triggers(sid)) == (25, 2 * CHUNK, [])

    # a third content would take the journal to 120,000 bytes, over 100,000: a checkpoint empties it first
    assert (await rig.write(sid, "/workspace/c", "c" * CHUNK)).status_code == 200
    state = await rig.state(sid)
    assert (state["journaled_calls"], state["journal_bytes"], rig.triggers(sid)) == (
        1,
        CHUNK,
        ["journal_full"],
    )

    # the store has each large write by its digest, not its bytes (nor the live feed, which it feeds)
    writes = [e.data for e in rig.store.get_events(sid) if e.kind == "sandbox_call"]
    assert len(writes) == 26
    digest = hashlib.sha256(same.encode()).hexdigest()
    assert writes[0]["args"] == {"path": "/workspace/same-0", "mode": 0o644, "size": CHUNK, "sha256": digest}
    assert all("data" not in w["args"] for w in writes)

    # and the journal still replays: the sandbox dies, the checkpoint and the write after it come back
    rig.backend.kill(await rig.box(sid))
    r = await rig.client.post(
        f"/s/{sid}/sandbox/exec", json={"command": "cat /workspace/same-23 /workspace/c"}
    )
    assert r.status_code == 200 and r.json()["stdout"] == same + "c" * CHUNK, r.text
    assert (await rig.state(sid))["last_restore"]["replayed"] == 1


async def test_a_small_write_is_recorded_with_its_bytes_for_a_restarted_gateway(rig: Rig) -> None:
    sid, _ = await rig.session()
    assert (await rig.write(sid, "/workspace/small", "s" * INLINE_BYTES)).status_code == 200
    assert (await rig.write(sid, "/workspace/larger", "s" * (INLINE_BYTES + 1))).status_code == 200
    small, larger = [e.data["args"] for e in rig.store.get_events(sid) if e.kind == "sandbox_call"]
    assert (small["size"], base64.b64decode(small["data"])) == (INLINE_BYTES, b"s" * INLINE_BYTES)
    assert (larger["size"], "data" in larger) == (INLINE_BYTES + 1, False)


async def test_with_checkpoints_off_a_full_journal_refuses_the_call_with_a_429(no_checkpoints: Rig) -> None:
    rig = no_checkpoints
    sid, box = await rig.session()
    for name in ("a", "b"):
        assert (await rig.write(sid, f"/workspace/{name}", name * CHUNK)).status_code == 200

    r = await rig.write(sid, "/workspace/c", "c" * CHUNK)
    message = check_error(r, 429, "sandbox_journal_full", None)
    assert r.headers["retry-after"] == "5" and r.json()["error"]["type"] == "sandbox_error"
    assert "hold 80000 bytes" in message and "POST /api/sessions/{id}/sandbox/checkpoints" in message
    assert rig.backend.ops("write_file") == [box, box]  # nothing of it ran
    assert (await rig.state(sid))["journal_bytes"] == 2 * CHUNK

    r = await rig.client.post(f"/api/sessions/{sid}/sandbox/checkpoints", headers=TOKEN)
    assert r.status_code == 201, r.text
    assert (await rig.write(sid, "/workspace/c", "c" * CHUNK)).status_code == 200  # as the message said
    assert (await rig.state(sid))["journal_bytes"] == CHUNK


async def test_the_file_api_follows_one_symbolic_link_and_refuses_a_second_or_a_loop(rig: Rig) -> None:
    sid, box = await rig.session()
    rig.backend.write_file(box, "/workspace/real.txt", b"real\n")
    rig.backend.symlink(box, "/workspace/one", "real.txt")
    rig.backend.symlink(box, "/workspace/two", "one")
    rig.backend.symlink(box, "/workspace/loop-a", "/workspace/loop-b")
    rig.backend.symlink(box, "/workspace/loop-b", "loop-a")
    rig.backend.symlink(box, "/workspace/self", "self")

    r = await rig.read(sid, "/workspace/one")
    assert r.status_code == 200 and r.json()["content"] == "real\n", r.text
    for path in ("/workspace/two", "/workspace/loop-a", "/workspace/self", "/workspace/self/x"):
        message = check_error(await rig.read(sid, path), 400, "path_refused", "path")
        assert "more than one symbolic link" in message
    message = check_error(await rig.write(sid, "/workspace/loop-a/x", "x"), 400, "path_refused", "path")
    assert "more than one symbolic link" in message
    assert len(rig.backend.ops("read_file")) == 5 and len(rig.backend.ops("write_file")) == 2  # once each
    message = check_error(await rig.read(sid, "/workspace"), 400, "path_outside_sandbox", "path")
    rig.backend.write_file(box, "/workspace/dir/f", b"")
    message = check_error(await rig.read(sid, "/workspace/dir"), 400, "path_refused", "path")
    assert "is a directory" in message

    state = await rig.state(sid)  # refused paths are the caller's error: the sandbox was not restored
    assert (state["status"], state["last_restore"]) == ("running", None)

    # a write replaces a link at its path (as tar does), never writes through it
    assert (await rig.write(sid, "/workspace/one", "new\n")).status_code == 200
    assert rig.backend.read_file(box, "/workspace/real.txt") == b"real\n"
