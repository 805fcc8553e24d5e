"""The recovery benches call launched workers themselves (a replacement's cold start, the weight-owner
figures' warm-ups and prefills), and a launched worker asks the key its gateway gave it
(`core.worker_auth`): each bench gives the gateway it starts a key (`WorkerKey`, in the environment)
and sends it. Scaled down, on launched fake workers (real processes guarded as vLLM workers are). No
timing is asserted: the figures are the benches'."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from belayer.bench import recovery, weight_owner
from belayer.bench.pool import engines
from belayer.bench.stand_up import WORKER_KEY_ENV, WorkerKey, serve_service, start
from belayer.testing.ray_local import LocalRayCluster
from belayer.testing.services import Service, base_url, running
from gateway.config import GatewayConfig


def test_the_key_variable_is_the_one_the_gateway_reads(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setenv(WORKER_KEY_ENV, "k3y")
    assert GatewayConfig(model=str(tiny_model_dir)).launch.worker_api_key == "k3y"
    assert WorkerKey("k3y").headers == {"authorization": "Bearer k3y"} and "k3y" not in repr(WorkerKey("k3y"))


def test_bench_recovery_kills_again_and_again_on_fake_workers(tiny_model_dir: Path) -> None:
    """Scaled down, every figure of the run (the overhead rounds, three kills, each a cold start): the bench
    crashed on a later kill when its wait for the worker serving the stream found none (a StopIteration)."""
    argv = [sys.executable, "-m", "belayer.cli", "bench", "recovery", "--model", str(tiny_model_dir)]
    argv += ["--worker-kind", "fake", "--kills", "3", "--kill-after", "5", "--reply-tokens", "60"]
    argv += ["--baseline", "warm-up", "--baseline", "start-nice"]
    argv += [
        "--workers",
        "1",
        "--shadows",
        "1",
        "--rounds",
        "1",
        "--concurrency",
        "4",
        "--stream-tokens",
        "16",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(
        ["stream_tokens_per_s_failover_on", "stream_tokens_per_s_failover_off", "failover_overhead_pct",
         "target_failover_overhead_le_2pct", "failover_s", "capacity_restored_s", "full_strength_s",
         "cold_start_s", "failover_detect_ms_p50", "failover_resubmitted_ms_p50",
         "failover_new_worker_token_ms_p50", "failover_lost_ms_p50", "failover_teardown_ms_p50", "kills", "worker_recovery_speedup",
         "target_worker_recovery_speedup_ge_50", "target_failover_detect_ms_le_10",
         "target_failover_lost_ms_le_50", "failover_new_worker_token_ms_p50_warm_up_off",
         "failover_lost_ms_p50_warm_up_off", "failover_lost_warm_up_off_over_on",
         "failover_new_worker_token_ms_p50_start_nice_off", "failover_lost_ms_p50_start_nice_off",
         "failover_lost_start_nice_off_over_on", "bench_wall_s"]
    ), done.stdout  # fmt: skip
    assert figures["kills"] == "3"
    assert done.stderr.count("[bench] pool: kill ") == 3
    assert done.stderr.count("[bench] pool-warm-up-off: kill ") == 3
    assert done.stderr.count("[bench] pool-start-nice-off: kill ") == 3
    for timed in ("failover_s", "capacity_restored_s", "full_strength_s", "cold_start_s", "bench_wall_s"):
        assert float(figures[timed]) >= 0, timed
    # the kill → the gateway noticed → resubmitted → the new worker's token → the client's: in that order
    timeline = [float(figures[f"failover_{n}_ms_p50"]) for n in ("detect", "resubmitted", "new_worker_token")]
    assert 0 <= timeline[0] <= timeline[1] <= timeline[2] <= float(figures["failover_lost_ms_p50"])
    assert float(figures["failover_teardown_ms_p50"]) > 0  # NaN (a teardown past 30 s) is not
    for rate in ("stream_tokens_per_s_failover_on", "stream_tokens_per_s_failover_off"):
        assert float(figures[rate]) > 0, rate
    assert figures["target_failover_overhead_le_2pct"] in ("pass", "fail")
    for target in ("worker_recovery_speedup_ge_50", "failover_detect_ms_le_10", "failover_lost_ms_le_50"):
        assert figures[f"target_{target}"] in ("pass", "fail"), target
    for baseline in ("warm_up", "start_nice"):
        assert float(figures[f"failover_lost_{baseline}_off_over_on"]) > 0, baseline


def test_the_weight_owner_figures_warm_and_prefill_the_workers_with_the_key(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    opts = argparse.Namespace(workers=1, shadows=1, kill_after=5, reply_tokens=60, kv_contexts=[16, 32])
    key = WorkerKey()
    extra = ["--workers", "1", "--shadows", "1", "--worker-kind", "fake", "--no-worker-wait", "600"]
    services: list[Service] = []
    with running(services):
        gw = serve_service(
            tmp_path, "pool", str(tiny_model_dir), extra, log_dir=tmp_path / "logs", env=key.env()
        )
        start(services, gw, timeout=600)
        url = base_url(gw)
        worker = asyncio.run(_a_worker(url))
        body = {"model": "policy", "prompt": [1, 2], "max_tokens": 1}
        assert httpx.post(f"{worker}/v1/completions", json=body, timeout=30).status_code == 401  # the door
        figures = asyncio.run(weight_owner._measure(url, opts, None, True, key))
    assert sorted(figures) == sorted(
        ["worker_pss", "worker_uss", "shadow_pss", "shadow_uss", "shadow_mapped_pss", "failover_s",
         "replacement_ready_s", "ttft_16", "ttft_32"]
    )  # fmt: skip
    assert figures["shadow_mapped_pss"] == 0 and all(v >= 0 for v in figures.values())


async def _a_worker(url: str) -> str:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        return str((await engines(http, url))[0]["url"])


@pytest.mark.ray
def test_bench_recovery_ray_loses_a_node_and_prints_its_figures(
    tiny_model_dir: Path, tmp_path: Path, whole_cluster: LocalRayCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--ray``'s measurement, scaled down (one node lost under two streams, on fake workers), on the
    session's Ray cluster (the bench's own three nodes took minutes to start beside it): the node's
    processes are killed and it is started again, and the figures come out."""
    opts = argparse.Namespace(model=str(tiny_model_dir), workers=2, shadows=1, worker_kind="fake", node_kills=1,
                              sessions=2, kill_after=5, reply_tokens=60)  # fmt: skip
    recovery.node_loss_on(whole_cluster, tmp_path, opts)
    out = capsys.readouterr().out.splitlines()  # Ray's own lines among the figures
    figures = dict(line.split(": ", 1) for line in out if line.split(": ", 1)[0].isidentifier())
    assert sorted(figures) == sorted(
        ["node_loss_resumed_s", "node_loss_full_strength_s", "node_losses", "node_loss_interrupted_streams"]
    ), figures
    assert figures["node_losses"] == "1" and int(figures["node_loss_interrupted_streams"]) >= 1
    for timed in ("node_loss_resumed_s", "node_loss_full_strength_s"):
        assert float(figures[timed]) >= 0, timed
    assert all(node.proc is not None for node in whole_cluster.nodes)  # the lost node is back
