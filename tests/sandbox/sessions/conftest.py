"""The sandbox manager over the in-memory backend (`sandbox.fake`) and a real SQLite store: no Docker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandbox.backend import SandboxSpec
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.sessions.manager import SandboxManager
from store import SessionRecord, SqliteStore, TurnRecord

SPEC = SandboxSpec(image="belayer-sandbox-busybox")


def settings(**overrides: Any) -> SandboxConfig:
    """Automatic checkpoints off, the watcher only when a test sweeps, hangs noticed in 0.2 s."""
    base: dict[str, Any] = {
        "enabled": True, "policy": PolicySettings(mode="never"), "watch_interval_s": 3600.0,
        "exec_grace_s": 0.2,
    }  # fmt: skip
    return SandboxConfig(**(base | overrides))


@dataclass
class Env:
    manager: SandboxManager
    backend: FakeSandboxBackend
    store: SqliteStore

    async def session(self, sid: str = "s1", *, spec: SandboxSpec = SPEC, **create: Any) -> str:
        """A stored session with a sandbox."""
        self.store.create_session(SessionRecord(sid, time.time(), {}))
        await self.manager.create(sid, spec, **create)
        return sid

    def start_turn(self, sid: str, prompt_tokens: int = 10) -> TurnRecord:
        """An LLM call starts: stored, then observed (like the turn runner does)."""
        parent = next((t.id for t in reversed(self.store.get_turns(sid)) if t.status == "complete"), None)
        turn = TurnRecord(sid, list(range(prompt_tokens)), [], parent, None, {}, time.time())
        self.store.begin_turn(turn)
        self.manager.turn_started(turn)
        return turn

    def finish_turn(self, turn: TurnRecord, output_tokens: int = 4, total_ms: float | None = None) -> None:
        turn.status, turn.output_ids = "complete", list(range(output_tokens))
        if total_ms is not None:
            turn.timings = {"total_ms": total_ms}
        self.store.finish_turn(turn)
        self.manager.turn_finished(turn)

    def turn_statuses(self, sid: str = "s1") -> list[str]:
        return [t.status for t in self.store.get_turns(sid)]

    def events(
        self, sid: str = "s1", prefix: str = "sandbox_", calls: bool = False
    ) -> list[tuple[str, dict[str, Any]]]:
        """The session's events whose kind starts with `prefix`; the journal's (``sandbox_call``) only
        with `calls`."""
        return [
            (e.kind, e.data)
            for e in self.store.get_events(sid)
            if e.kind.startswith(prefix) and (calls or e.kind != "sandbox_call")
        ]

    def kinds(self, sid: str = "s1") -> list[str]:
        return [kind for kind, _ in self.events(sid, "")]


EnvFactory = Callable[..., Awaitable[Env]]


@pytest.fixture
async def make_env(tmp_path: Path) -> AsyncIterator[EnvFactory]:
    """Build an `Env` with `settings(**overrides)`; every manager is closed after the test."""
    made: list[Env] = []

    async def make(
        backend: FakeSandboxBackend | None = None,
        engine_load: Callable[[], float] | None = None,
        **overrides: Any,
    ) -> Env:
        store = SqliteStore(tmp_path / f"traj-{len(made)}.db")
        fake = backend or FakeSandboxBackend()
        env = Env(SandboxManager(fake, store, settings(**overrides), engine_load), fake, store)
        made.append(env)
        return env

    yield make
    for env in made:
        await env.manager.close()
        env.store.close()


@pytest.fixture
async def env(make_env: EnvFactory) -> Env:
    return await make_env()


async def eventually(check: Callable[[], bool], what: str = "the condition", timeout_s: float = 5.0) -> None:
    """Wait (polling, with a deadline) until `check()` holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        await asyncio.sleep(0.005)
