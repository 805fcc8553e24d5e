"""Shared fixtures: the tiny model (built once, cached), a gateway over a scripted fake engine, and the one
Ray cluster that every test needing one shares.

The Ray cluster (marker ``ray``): three nodes on 127.0.0.2-4 (``belayer.testing.ray_local``), started once
per test session on first use and stopped by the pids it recorded. Node a is the head; nodes b and c also
declare sandbox slots (`SANDBOX_SLOTS`), for the sandboxes across the cluster (``tests/sandbox_cluster``).
A test that kills a node brings it back before it ends (`whole_cluster`), so the next test finds the
cluster whole.

Shared helpers (not fixtures) live in ``tests/support.py``."""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from belayer.testing.ray_local import LocalRayCluster, local_ray_cluster
from engine_pool.fake import FakeEngine
from gateway.config import FailoverConfig, GatewayConfig
from gateway.policy.tokenization import ChatTokenizer
from tests.store_backends import postgres, sql_store_backend, store_backend  # noqa: F401  (fixtures: every store)
from tests.support import REPO, GatewayHarness, asgi_gateway

RAY_NODES = ("a", "b", "c")  # a is the head
SANDBOX_SLOTS = "belayer_sandbox_slots"
"""The custom resource a Ray node declares for each sandbox it can hold."""
RAY_NODE_RESOURCES = {"b": {SANDBOX_SLOTS: 8.0}, "c": {SANDBOX_SLOTS: 8.0}}


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model, built by `belayer model build-tiny` (cached under .cache/ like `make` does)."""
    # absolute: server processes the tests start run in the repository, whatever pytest's cwd
    path = Path(os.environ.get("BELAYER_TINY_MODEL", REPO / ".cache" / "tiny-model")).resolve()
    if not (path / "model.safetensors").exists():
        from belayer.testing.tiny_model import build_tiny

        build_tiny(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(tiny_model_dir)


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096)


@pytest.fixture
async def gateway(
    tmp_path: Path, tiny_model_dir: Path, fake_engine: FakeEngine
) -> AsyncIterator[GatewayHarness]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        max_body_bytes=256 * 1024,
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
        allowed_hosts=["gw"],  # the test client's host: checked, and session base_urls are built from it
    )
    async with asgi_gateway(config, httpx.ASGITransport(fake_engine.app())) as (app, client):
        yield GatewayHarness(app, client, fake_engine)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    with (
        tempfile.TemporaryDirectory(prefix="belayer-ray-", dir="/tmp") as tmp,
        local_ray_cluster(
            RAY_NODES,
            Path(tmp),
            cpus=2,
            resources=RAY_NODE_RESOURCES,
            first_ip=int(
                os.environ.get("BELAYER_TEST_RAY_FIRST_IP", "2")
            ),  # another run beside: another range
        ) as cluster,
    ):
        yield cluster


@pytest.fixture
def whole_cluster(ray_cluster: LocalRayCluster) -> Iterator[LocalRayCluster]:
    """The shared cluster, with every node it lost during the test started again afterwards."""
    yield ray_cluster
    lost = [n for n in ray_cluster.nodes if n.proc is None]
    for node in lost:
        ray_cluster.start_node(node)


# -- the suite's own time ------------------------------------------------------------------------------

SUITE_BUDGET_S = 35 * 60
"""The tests' share of a fresh machine's `make test` (under 45 minutes with its ~10 minutes of set-up:
the venv, Docker and CRIU, Chromium, PostgreSQL, lint)."""
_started = time.monotonic()
_file_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The suite's time against its budget, and the files that take most of it."""
    total = time.monotonic() - _started
    tr = terminalreporter
    tr.section("the suite's time")
    verdict = "within" if total <= SUITE_BUDGET_S else "OVER"
    tr.write_line(f"suite_s: {total:.0f} ({verdict} its budget of {SUITE_BUDGET_S} s; tests/conftest.py)")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])[:25]:
        tr.write_line(f"{seconds:8.1f} s {100 * seconds / max(total, 1e-9):5.1f}%  {path}")
