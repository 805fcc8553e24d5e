"""The dashboard in a real browser: Debian's headless ``chromium`` driven by Playwright (never a
downloaded browser), against a real ``belayer serve`` with fake engine processes (marker ``browser``).

The test opens the dashboard with an API token, kills a worker while streamed chats run on it, and
waits, without reloading, for the page to show the worker dead, the failover in the timeline and the
shadow promoted; then it opens the affected session and finds the failover marker at the failover's
token index. It saves a screenshot of each view under its output folder (and in ``docs/dashboard/``
with ``BELAYER_SAVE_SCREENSHOTS=1``), and fails on any console error or uncaught page error.

Install the browser with ``deploy/host/setup_browser.sh`` (``make test`` does it when root).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from playwright.sync_api import ConsoleMessage, Locator, Page, expect, sync_playwright

from tests.support import REPO, ServerProcess, belayer_server

pytestmark = pytest.mark.browser

CHROMIUM = Path(os.environ.get("BELAYER_CHROMIUM", "/usr/bin/chromium"))
TOKEN = "dashboard-test-token"
SESSIONS = 4
LONG_TOKENS = 400  # about 8 s at the fake worker's 20 ms a token: still streaming when the kill comes
KILL_AFTER = 60  # tokens every first stream has received before the kill
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: no {CHROMIUM}; run deploy/host/setup_browser.sh")
        pytest.skip(f"no Chromium at {CHROMIUM}: run deploy/host/setup_browser.sh (apt-get install chromium)")
    return CHROMIUM


@pytest.fixture
def server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    args = [
        "serve", "--model", str(tiny_model_dir), "--worker-kind", "fake", "--workers", "2", "--shadows", "1",
        "--api-token", TOKEN, "--store", str(tmp_path / "traj.db"), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    with belayer_server(args, tmp_path / "serve.log") as server:
        yield server


class Load:
    """Streamed chats in threads, one session each: a long first turn (in flight when a worker dies)
    and a short second one; `started` lets the test through once every first stream has sent
    ``KILL_AFTER`` tokens (the streams wait there for it, so the kill lands mid-stream on each)."""

    def __init__(self, api: httpx.Client) -> None:
        self.api = api
        self.started = threading.Barrier(SESSIONS + 1)
        self.pool = ThreadPoolExecutor(SESSIONS)

    def start(self) -> list[Future[str]]:
        sessions = [
            self.api.post(
                "/api/sessions", json={"metadata": {"task": f"swe-{i:03d}", "split": "train"}}
            ).json()
            for i in range(SESSIONS)
        ]
        return [self.pool.submit(self.converse, s["id"], s["base_url"]) for s in sessions]

    def converse(self, session_id: str, base_url: str) -> str:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        messages: list[Any] = [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": "Run the tests and fix the first failure."},
        ]
        text = self.stream(client, messages, LONG_TOKENS, first=True)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Tool output: 3 passed."},
        ]
        self.stream(client, messages, 24)
        return session_id

    def stream(self, client: OpenAI, messages: list[Any], max_tokens: int, first: bool = False) -> str:
        chunks = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=max_tokens, stream=True, logprobs=True
        )
        text, tokens = "", 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content is not None:
                text += chunk.choices[0].delta.content
                tokens += 1
                if first and tokens == KILL_AFTER:
                    self.started.wait(WAIT_MS / 1000)
        return text


class Dashboard:
    """The dashboard page in Chromium: what it logged that went wrong, and its screenshots."""

    def __init__(self, page: Page, shots: Path) -> None:
        self.page = page
        self.shots = shots
        self.problems: list[str] = []
        page.set_default_timeout(WAIT_MS)
        page.on("console", self.on_console)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.problems.append(f"console error: {message.text} ({message.location})")

    def worker_state(self, name: str) -> Locator:
        return self.page.locator(f'[data-worker="{name}"] .state')

    def tab(self, view: str) -> None:
        self.page.click(f'.tabs a[data-view="{view}"]')  # a hash route: no reload

    def shot(self, name: str, full_page: bool = True) -> None:
        self.page.screenshot(path=self.shots / f"{name}.png", full_page=full_page)

    def publish_shots(self) -> None:
        """With BELAYER_SAVE_SCREENSHOTS=1, the screenshots also go to docs/dashboard/."""
        if os.environ.get("BELAYER_SAVE_SCREENSHOTS") == "1":
            docs = REPO / "docs" / "dashboard"
            docs.mkdir(parents=True, exist_ok=True)
            for shot in self.shots.iterdir():
                shutil.copy(shot, docs / shot.name)


@pytest.fixture
def dashboard(chromium: Path, server: ServerProcess, tmp_path: Path) -> Iterator[Dashboard]:
    # Needs `server` so that the browser (and its live feed) closes before the gateway stops.
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])
        try:
            yield Dashboard(browser.new_page(viewport={"width": 1400, "height": 900}), shots)
        finally:
            browser.close()


@pytest.fixture
def api(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


def failover_of(api: httpx.Client, session_id: str) -> dict[str, Any]:
    trajectory = api.get(f"/api/sessions/{session_id}/trajectory").json()
    [event] = [e for e in trajectory["events"] if e["kind"] == "failover"]
    return dict(event)


def kill_a_busy_worker(dashboard: Dashboard, api: httpx.Client) -> list[str]:
    """Kill the busiest worker under load; wait for the page to show it dead and the shadow ready.
    Returns the sessions of the load, once every chat has finished."""
    state = api.get("/api/dashboard/state").json()
    shadow = next(w["name"] for w in state["workers"] if w["state"] == "shadow")
    load = Load(api)
    chats = load.start()
    load.started.wait(WAIT_MS / 1000)
    state = api.get("/api/dashboard/state").json()
    victim = max((w for w in state["workers"] if w["state"] == "ready"), key=lambda w: w["outstanding"])
    assert victim["outstanding"] > 0, state["workers"]
    os.kill(victim["pid"], signal.SIGKILL)

    expect(dashboard.worker_state(victim["name"])).to_have_attribute("data-state", "dead")
    expect(dashboard.worker_state(shadow)).to_have_attribute("data-state", "ready")
    sessions = [chat.result(timeout=60) for chat in chats]  # the failover is invisible to clients
    load.pool.shutdown()
    return sessions


def check_session_list(dashboard: Dashboard, api: httpx.Client, sessions: list[str]) -> None:
    """The list pages through the server's sessions; the status filter is applied by the server."""
    for i, sid in enumerate(sessions[:2]):
        api.post(f"/api/sessions/{sid}/reward", json={"reward": 0.5 + i / 4}).raise_for_status()
    closed = api.post("/api/sessions", json={"metadata": {"task": "swe-abandoned"}}).json()["id"]
    api.post(f"/api/sessions/{closed}/close").raise_for_status()
    page = dashboard.page
    dashboard.tab("trajectories")
    rows = page.locator("#sessions tbody tr[data-session]")
    expect(rows).to_have_count(len(sessions) + 1)
    dashboard.shot("trajectories")
    page.select_option('#session-filters select[name="status"]', "closed")
    page.click('#session-filters button[type="submit"]')
    expect(rows).to_have_count(1)
    expect(page.locator(f'#sessions tr[data-session="{closed}"]')).to_be_visible()
    page.click('#session-filters button[type="reset"]')
    expect(rows).to_have_count(len(sessions) + 1)


def check_session_page(dashboard: Dashboard, api: httpx.Client, session_id: str) -> None:
    """The failover's marker sits at its token index, and the open session tails a new turn."""
    event = failover_of(api, session_id)
    index, turn = event["data"]["token_index"], event["turn_index"]
    page = dashboard.page
    strip = page.locator(f'.turn[data-turn-index="{turn}"] .strip-output')
    marker = strip.locator(f'.failover-marker[data-token-index="{index}"]')
    expect(marker).to_be_visible()
    # Placed just before the token the new worker resumed at.
    assert marker.evaluate("m => m.nextElementSibling.dataset.i") == str(index)
    assert event["data"]["to_worker"] in (marker.get_attribute("title") or "")

    turns = page.locator(".turns .turn[data-turn-id]")
    count = turns.count()
    base_url = api.get(f"/api/sessions/{session_id}").json()["base_url"]
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages: list[Any] = [{"role": "user", "content": "One more thing."}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    expect(turns).to_have_count(count + 1)  # the page tailed it, without a reload
    expect(strip).to_have_class(re.compile(r"\bstrip-text\b"))  # each token's text (?token_text=1)
    page.locator('.token-mode [data-mode="ids"]').first.click()  # the fake engine's text is noise
    expect(strip).not_to_have_class(re.compile(r"\bstrip-text\b"))
    expect(marker).to_be_visible()
    page.evaluate("window.scrollTo(0, 0)")  # the session's header, and its marker if that fits too
    marker.scroll_into_view_if_needed()
    dashboard.shot("session", full_page=False)


def test_dashboard_shows_a_failover_live(
    dashboard: Dashboard, server: ServerProcess, api: httpx.Client
) -> None:
    page = dashboard.page
    page.goto(f"{server.url}/dashboard#token={TOKEN}")
    expect(page.locator("#live")).to_have_attribute("data-state", "live")
    for w in api.get("/api/dashboard/state").json()["workers"]:
        expect(dashboard.worker_state(w["name"])).to_have_attribute("data-state", w["state"])
    page.evaluate("window.loadedOnce = true")  # gone if anything reloads the page

    sessions = kill_a_busy_worker(dashboard, api)
    dashboard.shot("health")

    dashboard.tab("recovery")
    failover = page.locator("#timeline .event.failover").first
    expect(failover).to_be_visible()
    expect(page.locator("#timeline .event.shadow_promoted")).to_have_count(1)
    expect(page.locator('[data-total="failovers"] .card-value')).not_to_have_text("0")
    dashboard.shot("recovery")

    check_session_list(dashboard, api, sessions)

    # The affected session, opened from its failover in the timeline.
    dashboard.tab("recovery")
    link = failover.locator(".session-link")
    session_id = link.get_attribute("title") or ""
    assert session_id in sessions
    link.click()
    check_session_page(dashboard, api, session_id)

    assert page.evaluate("window.loadedOnce") is True, "the page reloaded"

    # A link to the session with the token after the route (`#/session/<id>&token=...`), opened in a new
    # tab (which has no token yet), opens it, and the token leaves the address bar with its separator
    tab = page.context.browser.new_page()  # type: ignore[union-attr]
    tab.goto(f"{server.url}/dashboard#/session/{session_id}&token={TOKEN}")
    turn = failover_of(api, session_id)["turn_index"]
    expect(tab.locator(f'.turn[data-turn-index="{turn}"]')).to_be_visible()
    assert tab.evaluate("location.hash") == f"#/session/{session_id}"
    tab.close()
    page.evaluate(f"location.hash = '#/recovery&token={TOKEN}'")  # the same, in a tab already open
    expect(page.locator('.tabs a[data-view="recovery"]')).to_have_class(re.compile(r"\bactive\b"))
    assert page.evaluate("location.hash") == "#/recovery"
    dashboard.publish_shots()
    assert not dashboard.problems, "\n".join(dashboard.problems)
