"""The weight owner on GPUs (``engine_pool.weights.cache``): vLLM's weight-cache daemon per device group,
with workers and shadows launched to map it over CUDA IPC.

This machine has no GPU, so the launch plan is checked exactly (each daemon's command and devices, each
worker's loader arguments, devices and memory share), the pool's handling of its daemons (start, health,
restart of the one that died, stop) runs with a stand-in daemon process that answers ``/health`` as
``vllm preload`` does, and the real ``vllm preload`` (through ``belayer_vllm.preload``) is started on
this CPU to check that its refusal reaches the operator as one clear line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from core.errors import EngineUnavailable, InvalidRequest
from engine_pool.pool import DEAD, DRAINING, READY, SHADOW, EnginePool
from engine_pool.weights.cache import LOAD_FORMAT, CacheDaemon, GpuWeightCache, health_ok
from engine_pool.workers.worker import WorkerSpec
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig
from tests.support import serve_config

# answers /health with 200 on the port it is given: what `vllm preload --weight-cache-health-port` does
WORKER_KEY = "k3y"
"""The key the launched workers ask (core.worker_auth), given so that the test can call one itself."""
WORKER_AUTH = {"authorization": f"Bearer {WORKER_KEY}"}

HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class StandInDaemon(CacheDaemon):
    """A process in the daemon's place (same launch, reaper, process group, health port), no vLLM."""

    def argv(self) -> list[str]:
        return [sys.executable, "-c", HEALTH_SERVER, str(self.health_port)]


def config_of(args: list[str]) -> GatewayConfig:
    return serve_config(*args)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_device_group_gets_a_daemon_and_shadows_share_the_groups(tiny_model_dir: Path) -> None:
    """2 GPUs, 2 workers and 2 shadows: 2 groups suffice (without the cache they would need 4). Each
    launched worker maps its own group's daemon, and the group's two processes split its memory."""
    model = str(tiny_model_dir)
    config = config_of([
        "--model", model, "--worker-profile", "gpu", "--gpus", "0,1", "--weight-owner",
        "--workers", "2", "--shadows", "2", "--vllm-arg=--max-num-seqs=8",
    ])  # fmt: skip
    pool = build_pool(config, httpx.AsyncClient())
    cache = pool.weights.owner
    assert isinstance(cache, GpuWeightCache) and pool.settings.colocate
    assert sorted(cache.daemons) == [(0,), (1,)]
    members = [pool.factory.new(shadow=i >= 2) for i in range(4)]
    placed = []
    for m in members:
        assert m.process is not None
        spec = m.process.spec
        argv = spec.argv()
        placed.append(spec.devices)
        assert spec.env()["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, spec.devices or ()))
        assert option(argv, "--load-format") == "belayer_ipc"
        assert json.loads(option(argv, "--model-loader-extra-config")) == {
            "socket_dir": cache.socket_dir(spec.devices)
        }
        assert "--gpu-memory-utilization=0.45" in argv and "--max-num-seqs=8" in argv
    assert placed == [(0,), (1,), (0,), (1,)]

    daemon = cache.daemons[(1,)]
    argv = daemon.argv()
    assert argv[1:3] == ["-m", "belayer_vllm.preload"]
    own, worker = argv[3 : argv.index("--")], argv[argv.index("--") + 1 :]
    assert own == [
        "--weight-cache-socket-dir", str(cache.base / "1"),
        "--weight-cache-health-port", str(daemon.health_port), "--weight-cache-health-host", "127.0.0.1",
    ]  # fmt: skip
    assert option(worker, "--model") == model and "--load-format" not in worker
    assert "--max-num-seqs=8" in worker and "--gpu-memory-utilization=0.45" in worker
    assert daemon.env()["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_memory_share_given_by_the_user_is_kept_and_tensor_parallel_groups_hold_a_daemon(
    tiny_model_dir: Path,
) -> None:
    config = config_of([
        "--model", str(tiny_model_dir), "--worker-profile", "gpu", "--gpus", "0,1,2,3",
        "--tensor-parallel-size", "2", "--weight-owner", "--shadows", "1",
        "--vllm-arg=--gpu-memory-utilization=0.4",
    ])  # fmt: skip
    pool = build_pool(config, httpx.AsyncClient())
    assert isinstance(pool.weights.owner, GpuWeightCache)
    assert sorted(pool.weights.owner.daemons) == [(0, 1), (2, 3)]
    assert pool.weights.owner.daemons[(2, 3)].env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    [m] = [pool.factory.new()]
    assert m.process is not None
    argv = m.process.spec.argv()
    assert [a for a in argv if a.startswith("--gpu-memory-utilization")] == ["--gpu-memory-utilization=0.4"]
    assert option(argv, "--tensor-parallel-size") == "2"


def test_without_a_gpu_weight_cache_nothing_changes(tiny_model_dir: Path) -> None:
    """The gpu profile without --weight-owner: a group per worker and shadow, vLLM's own loading."""
    config = config_of(
        ["--model", str(tiny_model_dir), "--worker-profile", "gpu", "--gpus", "0,1", "--shadows", "1"]
    )
    pool = build_pool(config, httpx.AsyncClient())
    assert pool.weights.owner is None and not pool.settings.colocate
    m = pool.factory.new()
    assert m.process is not None and "--load-format" not in m.process.spec.argv()


async def test_the_daemon_that_died_is_restarted_alone_and_stop_leaves_nothing(tmp_path: Path) -> None:
    spec = WorkerSpec(model="/m", port=1, profile="gpu")
    cache = GpuWeightCache(spec, [(0,), (1,)], tmp_path / "logs", daemon=StandInDaemon)
    base = cache.base
    try:
        await cache.start(timeout=60)
        assert cache.healthy() and cache.down() == []
        first, second = cache.daemons[(0,)], cache.daemons[(1,)]
        kept = second.pid
        assert first.pid is not None
        os.killpg(first.pid, signal.SIGKILL)
        async with asyncio.timeout(30):
            while first.alive():
                await asyncio.sleep(0.05)
        assert cache.down() == [(0,)] and not cache.healthy()
        await cache.restart(timeout=60)
        assert cache.healthy() and cache.restarts == 1
        assert second.pid == kept and first.pid is not None and first.pid != kept
    finally:
        await cache.stop()
    assert not any(d.alive() for d in cache.daemons.values())
    assert not health_ok(first.health_port) and not base.exists()


async def test_the_pool_checks_its_daemons_each_probe_round_and_replacements_map_the_freed_group(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Fake workers (real processes) on 2 GPUs with stand-in daemons: a daemon killed is found down and
    restarted by the probe rounds; a killed active worker's shadow is promoted, and its replacement
    maps the freed group's daemon."""
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=1, shadows=1, log_dir=str(tmp_path / "logs"),
        launch=LaunchConfig(profile="gpu", gpus=[6, 7]), worker_start_timeout=60.0,
    )  # fmt: skip
    events: list[tuple[str, dict[str, object]]] = []
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        assert pool.settings.spec_factory is not None
        cache = GpuWeightCache(pool.settings.spec_factory(), [(6,), (7,)], tmp_path / "logs", daemon=StandInDaemon)
        pool.weights.owner, pool.settings.colocate, pool.settings.probe_interval = cache, True, 0.1
        pool.settings.telemetry.listen(lambda e: events.append((e.kind, e.data)))
        try:
            await pool.start()
            [active] = pool.roster.ready()
            [shadow] = [m for m in pool.roster.members if m.state == SHADOW]
            assert active.process is not None and shadow.process is not None
            assert (active.process.spec.devices, shadow.process.spec.devices) == ((6,), (7,))

            daemon = cache.daemons[(6,)]
            assert daemon.pid is not None
            os.killpg(daemon.pid, signal.SIGKILL)
            async with asyncio.timeout(60):
                while not any(k == "weight_owner" and d.get("state") == "restarted" for k, d in events):
                    await pool.roster.wait_change(0.2)
            assert ("weight_owner", {"state": "down", "why": "probe"}) in events
            assert cache.healthy() and cache.restarts == 1

            assert active.process.pid is not None
            os.killpg(active.process.pid, signal.SIGKILL)
            async with asyncio.timeout(60):
                while not (shadow.state == READY and active.state == DEAD and len(pool.roster.members) == 3
                           and pool.roster.members[2].state == SHADOW):  # fmt: skip
                    await pool.roster.wait_change(1.0)
            replacement = pool.roster.members[2].process
            assert replacement is not None and replacement.spec.devices == (6,)
            argv = replacement.spec.argv()
            assert json.loads(option(argv, "--model-loader-extra-config")) == {
                "socket_dir": cache.socket_dir((6,))
            }
        finally:
            await pool.stop()
    assert not any(d.alive() for d in cache.daemons.values())


def test_a_weight_update_leaves_the_daemons_in_place() -> None:
    """Zero-copy mappers share a daemon's memory, so an update is not followed by a new daemon (a CPU
    owner is replaced by a successor): the pool reports the update as made in place."""
    pool = EnginePool(httpx.AsyncClient())
    pool.weights.owner = GpuWeightCache(
        WorkerSpec(model="/m", port=1), [(0,)], Path("logs"), socket_base="/nonexistent"
    )
    assert pool.weights.follow() == "in_place" and not pool.weights.busy


@pytest.mark.vllm
def test_vllm_preload_takes_the_workers_engine_arguments_and_drops_the_front_ends() -> None:
    from belayer_vllm.preload import split_known

    argv = ["--model", "/m", "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8100",
            "--dtype", "float32", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--max-num-seqs=8", "--seed", "0"]  # fmt: skip
    known, dropped = split_known(argv)
    assert known == ["--model", "/m", "--served-model-name", "policy", "--dtype", "float32",
                     "--max-num-seqs=8", "--seed", "0"]  # fmt: skip
    assert dropped == ["--host", "127.0.0.1", "--port", "8100", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes"]  # fmt: skip


@pytest.mark.vllm
async def test_on_a_cpu_the_real_vllm_preload_refuses_and_says_why(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real daemon (vLLM's preload through belayer_vllm.preload) on this CPU: it exits, and the
    error names vLLM's reason (no CUDA IPC here) and the log to read."""
    spec = WorkerSpec(model=str(tiny_model_dir), port=1, profile="gpu", max_model_len=512)
    cache = GpuWeightCache(spec, [(0,)], tmp_path / "logs")
    try:
        with pytest.raises(EngineUnavailable) as raised:
            await cache.start(timeout=240)
    finally:
        await cache.stop()
    message = str(raised.value)
    assert message.startswith("the weight cache on GPUs (0,) exited with ")
    assert "weight-cache-0.log" in message and "CUDA IPC" in message


@pytest.mark.vllm
def test_the_workers_loader_is_vllms_ipc_cache_that_can_take_a_weight_update(tiny_model_dir: Path) -> None:
    """vLLM's ``ipc_cache`` has no ``get_all_weights``, which ``reload_weights`` from a path needs (so a
    worker mapping a daemon could not be updated): ``belayer_ipc``, registered by Belayer's vLLM plugin,
    is ``ipc_cache`` with it, and reads an update's checkpoint exactly."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.weight_cache.ipc_loader import IpcModelLoader

    from belayer_vllm.ipc import ReloadableIpcLoader
    from belayer_vllm.plugin import register

    register()
    config = LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"socket_dir": "/nonexistent"})
    loader = get_model_loader(config)
    assert isinstance(loader, ReloadableIpcLoader) and isinstance(loader, IpcModelLoader)
    assert loader.socket_dir == "/nonexistent"
    assert not hasattr(IpcModelLoader, "get_all_weights")
    weights = dict(
        loader.get_all_weights(SimpleNamespace(model=str(tiny_model_dir), revision=None), torch.nn.Module())
    )
    expected = load_file(str(tiny_model_dir / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


async def test_a_failed_update_reloads_the_pools_version_on_the_failed_workers_group_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """2 workers and 2 shadows of fake engines on 2 GPUs with stand-in daemons: an update whose weights
    the first worker cannot load is refused, and the workers sharing that worker's device group (whose
    weights it may have half-overwritten) load the pool's version again; the other group's are not
    touched."""
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=2, log_dir=str(tmp_path / "logs"),
        launch=LaunchConfig(profile="gpu", gpus=[6, 7], worker_api_key=WORKER_KEY), worker_start_timeout=60.0,
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        assert pool.settings.spec_factory is not None
        cache = GpuWeightCache(pool.settings.spec_factory(), [(6,), (7,)], tmp_path / "logs", daemon=StandInDaemon)
        pool.weights.owner, pool.settings.colocate, pool.settings.shadows = cache, True, 2  # a shadow beside each worker
        try:
            await pool.start()
            devices = {m.name: m.process.spec.devices for m in pool.roster.members if m.process is not None}
            assert sorted(map(str, devices.values())) == ["(6,)", "(6,)", "(7,)", "(7,)"]
            first = pool.roster.ready()[0]
            with pytest.raises(InvalidRequest, match="could not load the weights"):
                await pool.updater.update("v1", str(tmp_path / "no-such-weights"))
            assert first.state in (DRAINING, DEAD) and pool.versions.version == "base"
            reloaded = {}
            for m in pool.roster.members:
                if m is not first and m.process is not None and m.state in (READY, SHADOW):
                    info = await http.get(f"{m.client.base_url}/weight_info", headers=WORKER_AUTH)
                    reloaded[m.name] = info.json()["weights_path"]
            assert reloaded == {
                name: str(tiny_model_dir) if group == devices[first.name] else None
                for name, group in devices.items()
                if name != first.name
            }
        finally:
            await pool.stop()
