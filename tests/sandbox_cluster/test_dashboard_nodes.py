"""The dashboard's Health view with sandboxes on a Ray cluster, in Debian's headless Chromium against a real
``belayer serve --sandboxes --sandbox-ray``: each sandbox node's state and count, each sandbox's node, and
a node lost (its sandboxes restored on the other one, the node shown lost with why).

``BELAYER_SAVE_SCREENSHOTS=1`` also writes ``docs/dashboard/health-sandbox-nodes.png``."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from belayer.testing.docker_local import LocalDockerEngine
from belayer.testing.ray_local import LocalRayCluster
from tests.sandbox_cluster.conftest import sandboxes_on
from tests.support import REPO, ServerProcess, belayer_server

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.browser, pytest.mark.docker, pytest.mark.ray]

CHROMIUM = Path(os.environ.get("BELAYER_CHROMIUM", "/usr/bin/chromium"))
TOKEN = "dashboard-nodes-token"
WAIT_MS = 60_000


@pytest.fixture
def server(
    tmp_path: Path,
    tiny_model_dir: Path,
    docker_engine: None,
    whole_cluster: LocalRayCluster,
    whole_engines: dict[str, LocalDockerEngine],
) -> Iterator[ServerProcess]:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: no {CHROMIUM}; run deploy/host/setup_browser.sh")
        pytest.skip(f"no Chromium at {CHROMIUM}: run deploy/host/setup_browser.sh")
    args = [
        "serve", "--model", str(tiny_model_dir), "--worker-kind", "fake", "--workers", "1", "--sandboxes",
        "--api-token", TOKEN, "--store", str(tmp_path / "traj.db"), "--log-dir", str(tmp_path / "logs"),
        "--sandbox-ray", whole_cluster.address, "--sandbox-ray-node-ip", whole_cluster.head.ip,
        "--checkpoint-store", f"file://{tmp_path / 'store'}", "--sandbox-node-timeout", "2",
    ]  # fmt: skip
    for name, engine in whole_engines.items():
        args += ["--sandbox-docker-url", f"{whole_cluster.node(name).ip}={engine.url}"]
    with belayer_server(args, tmp_path / "serve.log", timeout=120) as server:
        yield server


def test_the_health_view_shows_each_sandbox_node_and_a_lost_one(
    server: ServerProcess,
    whole_cluster: LocalRayCluster,
    whole_engines: dict[str, LocalDockerEngine],
    tmp_path: Path,
) -> None:
    b, c = whole_cluster.node("b").ip, whole_cluster.node("c").ip
    before = sandboxes_on(whole_engines["c"])  # what an earlier test may have left there
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as api:
        deadline = time.monotonic() + 120
        while {n["node"]: n["state"] for n in api.get("/api/dashboard/state").json()["sandbox_nodes"]} != {
            b: "alive",
            c: "alive",
        }:  # the gateway checks each node as it joins (a Ray actor started on it: a while on a busy machine)
            assert time.monotonic() < deadline, api.get("/api/dashboard/state").json()["sandbox_nodes"]
            time.sleep(0.2)
        sessions = []
        for _ in range(3):
            r = api.post("/api/sessions", json={"sandbox": {"image": "belayer-sandbox-busybox"}})
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert (
                api.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": "echo x > a"}).status_code
                == 200
            )
            assert api.post(f"/api/sessions/{sid}/sandbox/checkpoints").status_code == 201
            sessions.append(sid)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(WAIT_MS)
                page.goto(f"{server.url}/dashboard#token={TOKEN}")
                expect(page.locator(f'[data-node="{b}"] .state')).to_have_text("alive", timeout=WAIT_MS)
                expect(page.locator(f'[data-node="{c}"] .state')).to_have_text("alive", timeout=WAIT_MS)
                expect(page.locator("#sandboxes td.sandbox-node")).to_have_count(3, timeout=WAIT_MS)
                whole_cluster.kill_node("c")  # node c lost: its Ray processes, its engine and containers
                whole_engines["c"].kill()
                expect(page.locator(f'[data-node="{c}"] .state')).to_have_text("lost", timeout=WAIT_MS)
                expect(page.locator(f'[data-node="{c}"] .why')).not_to_have_text("—", timeout=WAIT_MS)
                # every sandbox restored on b (the watcher restores a lost one without waiting for a call)
                expect(page.locator("#sandboxes td.sandbox-node")).to_have_text([b, b, b], timeout=WAIT_MS)
                expect(page.locator("#sandbox-nodes-summary")).to_contain_text(
                    "1 of 2 nodes alive", timeout=WAIT_MS
                )
                page.screenshot(path=tmp_path / "health-sandbox-nodes.png", full_page=True)
                whole_engines["c"].restart()  # node c back: swept, then alive again with nothing on it
                whole_cluster.restart_node("c")
                expect(page.locator(f'[data-node="{c}"] .state')).to_have_text("alive", timeout=WAIT_MS)
                assert sandboxes_on(whole_engines["c"]) <= before
            finally:
                browser.close()
        metrics = api.get("/metrics").text
        assert f'belayer_sandbox_node_sandboxes{{node="{b}",state="alive"}} 3.0' in metrics
        assert "belayer_node_loss_restores_total" in metrics
    if os.environ.get("BELAYER_SAVE_SCREENSHOTS") == "1":
        shutil.copy(
            tmp_path / "health-sandbox-nodes.png", REPO / "docs" / "dashboard" / "health-sandbox-nodes.png"
        )
