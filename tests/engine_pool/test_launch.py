"""Launched workers' exact command and environment per profile, vLLM arguments and devices; each bad
combination's start-up error; and a real launch through the pool that hands a fenced worker's devices
to its replacement."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_pool.pool import DEAD, READY, SHADOW, EnginePool, PoolMember
from engine_pool.workers.launch import model_context_length
from engine_pool.workers.worker import VllmWorker, WorkerSpec
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig
from tests.belayer.test_cli import _fails, _root_logging_restored  # noqa: F401  (an autouse fixture)
from tests.support import serve_config

PY = sys.executable
SERVER = [PY, "-m", "vllm.entrypoints.openai.api_server"]
CPU_ENV = {
    "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
    "TORCH_COMPILE_DISABLE": "1", "VLLM_SERVER_DEV_MODE": "1",
}  # fmt: skip
GPU_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_SERVER_DEV_MODE": "1",
}


KEYED = ["--logits-processors", "belayer_vllm.keyed:KeyedSampler"]
"""A launched vLLM worker's keyed sampler (core.keyed), with --sampling keyed only."""


def test_the_keyed_sampler_is_loaded_with_keyed_sampling_only() -> None:
    assert KEYED[1] in WorkerSpec(model="/m", port=8100, keyed_sampler=True).argv()
    assert "--logits-processors" not in WorkerSpec(model="/m", port=8100).argv()


def served(port: int, model: str = "/m") -> list[str]:
    return [
        *SERVER,
        "--model",
        model,
        "--served-model-name",
        "policy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


# --- the command builder -------------------------------------------------------------------------


def test_cpu_profile_is_todays_vllm_cpu_settings() -> None:
    spec = WorkerSpec(model="/m", port=8100)
    assert spec.argv() == [
        *served(8100), "--tensor-parallel-size", "1", "--dtype", "float32", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    assert spec.env() == CPU_ENV


def test_gpu_profile_forces_nothing_and_sees_its_devices() -> None:
    spec = WorkerSpec(model="/m", port=8100, profile="gpu", devices=(2, 3), tensor_parallel_size=2)
    assert spec.argv() == [*served(8100), "--tensor-parallel-size", "2", "--seed", "0"]
    assert spec.env() == {**GPU_ENV, "CUDA_VISIBLE_DEVICES": "2,3"}
    assert "CUDA_VISIBLE_DEVICES" not in WorkerSpec(model="/m", port=1, profile="gpu").env()


def test_vllm_args_come_last_and_replace_the_profiles_own() -> None:
    args = ("--dtype=bfloat16", "--no-enforce-eager", "--seed", "7", "--max-num-seqs=8")
    spec = WorkerSpec(model="/m", port=8100, extra_args=args, max_model_len=4096)
    assert spec.argv() == [*served(8100), "--max-model-len", "4096", "--tensor-parallel-size", "1", *args]
    spec = WorkerSpec(model="/m", port=8100, extra_args=("--max_num_seqs", "8"))  # vLLM's underscores
    assert spec.argv()[-7:] == ["--dtype", "float32", "--enforce-eager", "--seed", "0", "--max_num_seqs", "8"]


def test_a_fake_worker_gets_the_context_length_from_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert model_context_length(tiny_model_dir) == 65536  # max_position_embeddings
    (tmp_path / "config.json").write_text(
        '{"text_config": {"max_position_embeddings": 32768}, "n_positions": 9}'
    )
    assert model_context_length(tmp_path) == 32768  # the text model's, as vLLM reads it
    assert model_context_length(tmp_path / "nothing") is None
    model = str(tiny_model_dir)
    [fake] = launched(GatewayConfig(model=model, worker_kind="fake"), 1)
    assert fake.process is not None
    assert after(fake.process.spec.argv(), "--max-model-len") == "65536"
    [vllm] = launched(GatewayConfig(model=model), 1)
    assert vllm.process is not None
    assert "--max-model-len" not in vllm.process.spec.argv()  # vLLM reads it from config.json itself
    [explicit] = launched(GatewayConfig(model=model, max_model_len=2048), 1)
    assert explicit.process is not None
    assert after(explicit.process.spec.argv(), "--max-model-len") == "2048"


def after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# --- from the command line, a config file and the environment, through the pool ---------------------


def config_of(argv: list[str]) -> GatewayConfig:
    return serve_config(*argv)


def launched(config: GatewayConfig, n: int) -> list[PoolMember]:
    """The pool's first `n` launched members (made, not started)."""
    pool = build_pool(config, httpx.AsyncClient())
    return [pool.factory.new() for _ in range(n)]


def test_gpus_are_split_into_a_group_per_worker_and_shadow(tiny_model_dir: Path) -> None:
    config = config_of([
        "--model", str(tiny_model_dir), "--worker-profile", "gpu", "--gpus", "0,1,2,3",
        "--tensor-parallel-size", "2", "--workers", "1", "--shadows", "1",
        "--vllm-arg=--max-num-seqs=8", "--vllm-arg", "--gpu-memory-utilization 0.85",
    ])  # fmt: skip
    members = launched(config, 2)
    model = str(tiny_model_dir)
    for member, devices in zip(members, ("0,1", "2,3"), strict=True):
        assert member.process is not None
        spec = member.process.spec
        assert spec.argv() == [
            *served(spec.port, model), "--middleware", "core.worker_auth.RequireApiKey",
            "--tensor-parallel-size", "2", "--seed", "0", "--max-num-seqs=8", "--gpu-memory-utilization", "0.85",
        ]  # fmt: skip
        assert spec.api_key is not None and len(spec.api_key) == 43  # the gateway's, 256 random bits
        ties = {"BELAYER_NEAR_TIES_DIR": str(Path(config.log_dir).resolve())}  # keyed sampling's near ties
        assert spec.env() == {
            **GPU_ENV,
            "CUDA_VISIBLE_DEVICES": devices,
            "VLLM_API_KEY": spec.api_key,
            **ties,
        }


def test_launch_settings_from_a_config_file_and_the_environment(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "belayer.toml"
    toml.write_text(
        '[launch]\nprofile = "gpu"\ngpus = [4, 5]\nvllm_args = ["--max-num-seqs=16", "--enable-prefix-caching"]\n'
    )
    config = config_of(["--model", str(tiny_model_dir), "--config", str(toml)])
    [member] = launched(config, 1)
    assert member.process is not None
    assert member.process.spec.argv()[-4:] == ["--seed", "0", "--max-num-seqs=16", "--enable-prefix-caching"]
    assert member.process.spec.env()["CUDA_VISIBLE_DEVICES"] == "4"
    monkeypatch.setenv("BELAYER_LAUNCH__VLLM_ARGS", '["--max-num-seqs=2"]')  # a variable beats the file
    [member] = launched(config_of(["--model", str(tiny_model_dir), "--config", str(toml)]), 1)
    assert member.process is not None and member.process.spec.argv()[-1] == "--max-num-seqs=2"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--worker-profile", "gpu", "--gpus", "0,1,2", "--tensor-parallel-size", "2"],
         "--gpus: 3 GPUs (0,1,2) do not split into groups of 2 (the tensor-parallel size); give a multiple of 2 devices"),
        (["--worker-profile", "gpu", "--gpus", "0,1", "--workers", "2", "--shadows", "1"],
         "--gpus: 2 workers + 1 shadows need 3 device groups, and the GPUs make 2 (0, 1); give more GPUs, a "
         "smaller tensor-parallel size, or fewer workers or shadows"),
        (["--worker-profile", "gpu", "--gpus", "0,1,2,3", "--tensor-parallel-size", "2", "--shadows", "2"],
         "--gpus: 1 workers + 2 shadows need 3 device groups, and the GPUs make 2 (0,1, 2,3); give more GPUs, "
         "a smaller tensor-parallel size, or fewer workers or shadows"),
        (["--worker-profile", "gpu", "--gpus", "0,1", "--workers", "3", "--weight-owner"],
         "--gpus: 3 workers need 3 device groups (their shadows share them, to map the groups' weight caches), "
         "and the GPUs make 2 (0, 1); give more GPUs, a smaller tensor-parallel size, or fewer workers"),
        (["--worker-profile", "gpu", "--weight-owner"],
         "--weight-owner: on GPUs the weight owner is one vLLM weight cache per device group: name the devices "
         "(--gpus 0,1,...)"),
        (["--ray", "auto", "--weight-owner"],
         "--weight-owner: with --ray the workers are on other hosts than the gateway, and the weight owner "
         "holds one host's weights; drop --weight-owner"),
        (["--gpus", "0"], "--gpus: GPUs are for the gpu profile; add --worker-profile gpu, or drop the GPUs"),
        (["--worker-profile", "gpu", "--gpus", "0,0"], "--gpus: GPUs 0,0 name a device twice; list each device once"),
        (["--worker-profile", "gpu", "--gpus", "a"], "--gpus: input should be a valid integer, unable to parse string as an integer (got 'a')"),
        (["--vllm-arg=--port=9000"],
         "--vllm-arg: vLLM argument '--port=9000': Belayer sets --port itself; Belayer gives each worker a free port"),
        (["--vllm-arg=--max_model_len=100"],
         "--vllm-arg: vLLM argument '--max_model_len=100': Belayer sets --max-model-len itself; use belayer's --max-model-len"),
        (["--vllm-arg=-tp=2"],
         "--vllm-arg: vLLM argument '-tp=2': Belayer sets --tensor-parallel-size itself; use belayer's "
         "--tensor-parallel-size (it also groups --gpus)"),
        (["--vllm-arg", "--model /elsewhere"],
         "--vllm-arg: vLLM argument '--model': Belayer sets --model itself; give the model directory with belayer's --model"),
        (["--vllm-arg=8"],
         "--vllm-arg: vLLM argument '8' is not an option; give each with its option and an '=', e.g. --vllm-arg=--max-num-seqs=8"),
        (["--worker-kind", "fake", "--vllm-arg=--max-num-seqs=8"],
         "--vllm-arg: fake workers take no vLLM arguments; drop them, or launch vllm workers"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size: input should be greater than or equal to 1 (got 0)"),
    ],
)  # fmt: skip
def test_a_bad_combination_is_one_line_that_says_what_to_do(
    args: list[str], message: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    argv = ["serve", "--model", str(tiny_model_dir), "--port", "0", "--log-dir", str(logs), *args]
    assert _fails(capsys, argv) == f"belayer serve: {message}"
    assert not logs.exists()  # nothing was launched


def test_a_config_file_error_names_the_file_and_key(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "belayer.toml"
    toml.write_text('[launch]\nvllm_args = ["--host=0.0.0.0"]\n')
    assert _fails(capsys, ["serve", "--model", str(tiny_model_dir), "--config", str(toml)]) == (
        f"belayer serve: {toml}: launch.vllm_args: vLLM argument '--host=0.0.0.0': Belayer sets --host "
        "itself; Belayer gives each worker its own address"
    )


# --- a real launch -----------------------------------------------------------------------------------


def server_pid(reaper: int) -> int:
    """The worker's server: the one child of its reaper (the pid the pool holds)."""
    deadline = time.monotonic() + 30
    while True:
        children = Path(f"/proc/{reaper}/task/{reaper}/children").read_text().split()
        if children:
            return int(children[0])
        assert time.monotonic() < deadline, f"reaper {reaper} started no server"
        time.sleep(0.05)  # a process starting in another process: poll, bounded


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def until(pool: EnginePool, done: object, timeout: float = 60.0) -> None:
    """Wait, on the pool's state changes, until ``done()`` holds."""
    assert callable(done)
    async with asyncio.timeout(timeout):
        while not done():
            await pool.roster.wait_change(1.0)


async def test_launched_workers_get_their_devices_and_a_replacement_gets_the_fenced_ones(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Fake workers (real processes) on the gpu profile with 2 GPUs: the active and the shadow each see
    one device; a kill -9 of the active promotes the shadow, and the replacement sees the freed device."""
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=1, shadows=1, log_dir=str(tmp_path / "logs"),
        launch=LaunchConfig(profile="gpu", gpus=[6, 7]), worker_start_timeout=60.0,
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        pool.settings.probe_interval = 0.1
        try:
            await pool.start()
            [active] = pool.roster.ready()
            [shadow] = [m for m in pool.roster.members if m.state == SHADOW]
            seen = {}
            for m in (active, shadow):
                assert m.process is not None and m.process.pid is not None
                pid = server_pid(m.process.pid)
                seen[m.name] = environ(pid)["CUDA_VISIBLE_DEVICES"]
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert b"engine_pool.fake" in cmdline and b"65536" in cmdline  # the model's context length
            assert sorted(seen.values()) == ["6", "7"]
            assert (await active.client.model_info()).max_model_len == 65536

            assert active.process is not None and active.process.pid is not None
            os.killpg(active.process.pid, signal.SIGKILL)
            await until(pool, lambda: shadow.state == READY and active.state == DEAD)
            await until(
                pool, lambda: len(pool.roster.members) == 3 and pool.roster.members[2].state == SHADOW
            )
            replacement = pool.roster.members[2].process
            assert replacement is not None and replacement.pid is not None
            assert environ(server_pid(replacement.pid))["CUDA_VISIBLE_DEVICES"] == seen[active.name]
        finally:
            await pool.stop()


async def test_a_launched_worker_starts_below_the_gateways_priority_and_serves_at_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A launched worker's group starts `failover.start_nice` lower in CPU priority (so a replacement's
    start yields to the streams that failed over), and every process of it gets the gateway's priority
    back once it is ready and warmed up: by `serving`, which the pool calls (`Supervisor.launched`)."""
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=1, log_dir=str(tmp_path / "logs"),
        worker_start_timeout=60.0,
    )  # fmt: skip
    assert config.failover.start_nice == 10
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    [member] = launched(config, 1)
    worker = member.process
    assert worker is not None
    worker.launch()
    try:
        assert worker.pid is not None
        server = server_pid(worker.pid)  # started by the reaper once it had lowered its own priority
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in (worker.pid, server)] == [min(mine + 10, 19)] * 2
        assert "BELAYER_REAPER_NICE" not in environ(server)
        await worker.wait_ready(60)
        worker.serving()
        assert [os.getpriority(os.PRIO_PROCESS, p) for p in (worker.pid, server)] == [mine, mine]
    finally:
        await worker.stop()

    calls: list[str] = []
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        serving = VllmWorker.serving

        def counted(w: VllmWorker) -> None:
            calls.append(w.name)
            serving(w)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(VllmWorker, "serving", counted)
            try:
                await pool.start()
            finally:
                await pool.stop()
    assert calls == ["worker-0"]


def test_a_gateway_that_could_not_raise_a_priority_again_starts_its_workers_at_its_own(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without CAP_SYS_NICE (Docker's default) a niced worker would keep its start priority for good."""
    config = GatewayConfig(model=str(tiny_model_dir), worker_kind="fake", workers=1, log_dir=str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr("engine_pool.workers.factory.may_raise_priority", lambda: False)
        [unniced] = launched(config, 1)
    [niced] = launched(config, 1)
    assert unniced.process is not None and niced.process is not None
    assert (unniced.process.start_nice, niced.process.start_nice) == (0, 10)
