"""Weight versions: ``POST /api/weights`` over fake engines that speak vLLM's weight-update endpoints.

Each worker is its own `FakeEngine` (its own weights), behind a `FaultInjector` that kills or stalls
streams like a real worker. The fake engine's tokens depend on its weight version, so every segment a
turn records can be checked against what that version generates from the turn's prompt plus the tokens
before the segment: a turn that mixed versions without saying so would fail the check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from engine_pool.fake import FakeEngine, Fault, FaultInjector
from engine_pool.pool import EnginePool, PoolSettings
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from gateway.turns.failover import add_tokens

ADMIN = "admin-s3cret"
AUTH = {"authorization": f"Bearer {ADMIN}"}


def step(context: list[int]) -> int:
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


class Hosts(httpx.AsyncBaseTransport):
    """One fake engine per host name: each worker holds its own weights."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.apps = {host: httpx.ASGITransport(engine.app()) for host, engine in engines.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.apps[request.url.host].handle_async_request(request)


class Rig:
    def __init__(
        self, app: Any, client: httpx.AsyncClient, engines: dict[str, FakeEngine], faults: FaultInjector
    ):
        self.app, self.client, self.engines, self.faults = app, client, engines, faults

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    async def session(self) -> str:
        r = await self.client.post("/api/sessions", json={})
        assert r.status_code == 201, r.text
        sid: str = r.json()["id"]
        return sid

    async def chat(self, sid: str, max_tokens: int = 20, content: str = "go") -> dict[str, Any]:
        body = {
            "model": "policy", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True,
        }  # fmt: skip
        r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200 and '"error"' not in r.text, r.text
        return await self.trajectory(sid)

    async def trajectory(self, sid: str) -> dict[str, Any]:
        r = await self.client.get(f"/api/sessions/{sid}/trajectory")
        assert r.status_code == 200, r.text
        traj: dict[str, Any] = r.json()
        return traj

    async def update(
        self, version: str, path: Path | str, drain_s: float = 0.0, **extra: Any
    ) -> httpx.Response:
        body = {"version": version, "path": str(path), "drain_s": drain_s, **extra}
        return await self.client.post("/api/weights", json=body, headers=AUTH)


@contextlib.asynccontextmanager
async def rig_over(
    tmp_path: Path,
    model: Path,
    engines: dict[str, FakeEngine],
    shadows: tuple[str, ...] = (),
    failover: FailoverConfig | None = None,
    store: str = "t.db",
) -> AsyncIterator[Rig]:
    faults = FaultInjector(Hosts(engines))
    config = GatewayConfig(
        model=str(model),
        store_path=str(tmp_path / store),
        failover=failover or FailoverConfig(stall_timeout=30.0, no_worker_wait=20.0, max_failovers=3),
        admin_token=ADMIN,
    )
    async with httpx.AsyncClient(transport=faults, timeout=10) as http:
        pool = EnginePool(http, PoolSettings(probe_interval=0.05, probe_timeout=0.5, catch_up_backoff=0.05))
        for host in engines:
            pool.add_remote(f"http://{host}", shadow=host in shadows)
        app = build_app(config, pool=pool)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=60
            ) as client,
        ):
            yield Rig(app, client, engines, faults)


def weights_dir(tmp_path: Path, model: Path, name: str) -> Path:
    """A checkpoint directory the gateway accepts: the served model's config and a weights file."""
    out = tmp_path / name
    out.mkdir()
    shutil.copy(model / "config.json", out / "config.json")
    (out / "model.safetensors").write_bytes(b"weights")
    return out


def greedy(version: str, context: list[int], n: int) -> list[int]:
    """What a worker on `version` generates after `context` (the pool's ``base`` is the fake's own)."""
    engine = FakeEngine(step=step, weight_version="default" if version == "base" else version)
    return engine.greedy(context, n)


def check_segments(turn: dict[str, Any]) -> list[tuple[int, int, str]]:
    """The turn's segments cover its output in order, and each holds exactly what its version generates."""
    segments = [(s["start"], s["end"], s["version"]) for s in turn["weight_segments"]]
    assert turn["weight_versions"] == [v for _, _, v in segments]  # as in the export: the same names, shapes
    edges = [0, *(end for _, end, _ in segments)]
    assert [start for start, _, _ in segments] == edges[:-1] and edges[-1] == len(turn["output_ids"]), (
        segments
    )
    for start, end, version in segments:
        context = turn["prompt_ids"] + turn["output_ids"][:start]
        assert turn["output_ids"][start:end] == greedy(version, context, end - start), (start, end, version)
    return segments


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def kinds(traj: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["data"] for e in traj["events"] if e["kind"] == kind]


# --- segment bookkeeping --------------------------------------------------------------------------


def test_segments_grow_within_a_submission_and_split_at_each_new_one() -> None:
    segments: list[tuple[int, int, str]] = []
    add_tokens(segments, 0, 1, "v1", True)
    add_tokens(segments, 1, 4, "v1", False)
    add_tokens(segments, 4, 4 + 2, "v1", True)  # a failover: same version, a new submission
    add_tokens(segments, 6, 7, "v2", True)  # cut by an update, resumed on the new weights
    add_tokens(segments, 7, 9, "v2", False)
    assert segments == [(0, 4, "v1"), (4, 6, "v1"), (6, 9, "v2")]
    later: list[tuple[int, int, str]] = []
    add_tokens(later, 3, 5, "v3", False)  # the first tokens recorded open a segment whatever `first` says
    assert later == [(3, 5, "v3")]


def test_fake_engine_tokens_depend_on_the_weight_version() -> None:
    context = [1, 2, 3]
    assert greedy("base", context, 8) == FakeEngine(step=step).greedy(context, 8)
    assert greedy("v2", context, 8) != greedy("base", context, 8) != greedy("v3", context, 8)


# --- an update under load ---------------------------------------------------------------------------


async def test_an_update_under_load_with_failovers_records_every_version_switch(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engines = {h: FakeEngine(step=step, max_model_len=4096) for h in ("e0", "e1")}
    v2 = weights_dir(tmp_path, tiny_model_dir, "step-2")
    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        # Turn A: e0 dies after 3 tokens, the failover to e1 (same version) stalls after 4 more; the
        # update then cuts it at exactly 7 tokens and it resumes on the new weights.
        rig.faults.faults["e0"] = [Fault("drop_after", 3)]
        rig.faults.faults["e1"] = [Fault("stall_after", 4)]
        a = await rig.session()
        turn_a = asyncio.create_task(rig.chat(a, max_tokens=20))

        async def seven_tokens() -> bool:
            turns = (await rig.trajectory(a))["turns"]
            return bool(turns) and len(turns[0]["output_ids"]) == 7

        await until(seven_tokens, "turn A's 7 tokens before the stall")
        # Load: four more turns in flight, each stalled after k tokens on whichever worker took it.
        cuts = [2, 5, 8, 11]
        for host in ("e0", "e1"):
            rig.faults.faults[host] = [Fault("stall_after", k) for k in cuts]
        others = [await rig.session() for _ in cuts]
        load = [
            asyncio.create_task(rig.chat(sid, max_tokens=30, content=f"task {i}"))
            for i, sid in enumerate(others)
        ]

        async def all_stalled() -> bool:
            trajs = [await rig.trajectory(sid) for sid in others]
            return all(t["turns"] and len(t["turns"][0]["output_ids"]) in cuts for t in trajs)

        await until(all_stalled, "the load turns stalled mid-stream")
        rig.faults.faults.clear()  # what is resubmitted after the update streams normally
        r = await rig.update("step-2", v2, drain_s=0)
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["version"] == "step-2" and result["previous"] == "base" and result["path"] == str(v2)
        assert result["preempted"] == 5  # turn A and the four stalled ones
        assert {e.weight_version for e in engines.values() if e.weights_path == str(v2)} == {"step-2"}

        traj_a = await turn_a
        [turn] = traj_a["turns"]
        assert turn["status"] == "complete" and len(turn["output_ids"]) == 20
        assert check_segments(turn) == [(0, 3, "base"), (3, 7, "base"), (7, 20, "step-2")]
        [failover] = kinds(traj_a, "failover")
        assert (failover["token_index"], failover["from_version"], failover["to_version"]) == (
            3,
            "base",
            "base",
        )
        [switch] = kinds(traj_a, "weight_switch")
        assert (switch["token_index"], switch["from_version"], switch["to_version"]) == (7, "base", "step-2")
        assert switch["cause"] == "weights"

        seen = []
        for traj in await asyncio.gather(*load):
            [t] = traj["turns"]
            assert t["status"] == "complete" and len(t["output_ids"]) == 30
            k = check_segments(t)[0][1]
            assert check_segments(t) == [(0, k, "base"), (k, 30, "step-2")]
            [switch] = kinds(traj, "weight_switch")
            assert (switch["token_index"], switch["from_version"], switch["to_version"]) == (
                k,
                "base",
                "step-2",
            )
            seen.append(k)
        assert set(seen) <= set(cuts) and len(seen) == 4

        # After the update: one segment on the new version, and the record says so.
        later = await rig.chat(await rig.session(), max_tokens=10)
        assert check_segments(later["turns"][0]) == [(0, 10, "step-2")]
        info = (await rig.client.get("/api/weights")).json()
        assert info["version"] == "step-2" and info["path"] == str(v2)
        assert {w["weight_version"] for w in info["workers"]} == {"step-2"}
        [update] = info["updates"]
        assert update["kind"] == "weights_updated" and update["version"] == "step-2"
        metrics = (await rig.client.get("/metrics")).text
        assert 'belayer_weight_version_info{version="step-2"} 1.0' in metrics
        assert 'belayer_weight_updates_total{result="ok"} 1.0' in metrics
        assert "belayer_workers_stale_weights 0.0" in metrics

        # Export: the row carries the segments, in response coordinates, and slime's version list.
        rows = [
            json.loads(line) for line in (await rig.client.get("/api/export?format=jsonl")).text.splitlines()
        ]
        [row] = [row for row in rows if row["session_id"] == a]
        [span] = row["turn_spans"]
        assert row["weight_segments"] == [
            {"start": span["start"] + s, "end": span["start"] + e, "version": v}
            for s, e, v in [(0, 3, "base"), (3, 7, "base"), (7, 20, "step-2")]
        ]
        assert row["weight_versions"] == ["base", "base", "step-2"]


async def test_in_flight_turns_that_finish_within_drain_s_keep_one_version(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engines = {"e0": FakeEngine(step=step, max_model_len=4096, token_delay=0.002)}
    v2 = weights_dir(tmp_path, tiny_model_dir, "v2")
    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        sids = [await rig.session() for _ in range(3)]
        turns = [asyncio.create_task(rig.chat(sid, max_tokens=40)) for sid in sids]
        await until(lambda: _running(rig), "turns in flight")
        r = await rig.update("v2", v2, drain_s=60)
        assert r.status_code == 200 and r.json()["preempted"] == 0, r.text
        for traj in await asyncio.gather(*turns):
            assert check_segments(traj["turns"][0]) == [(0, 40, "base")] and not kinds(traj, "weight_switch")


async def _running(rig: Rig) -> bool:
    return any(m.outstanding for m in rig.gw.pool.roster.members)


# --- a shadow that missed an update -------------------------------------------------------------------


async def test_a_shadow_that_missed_an_update_is_promoted_only_once_brought_up(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engines = {h: FakeEngine(step=step, max_model_len=4096) for h in ("e0", "e1")}
    engines["e1"].update_error = "No space left on device"  # the shadow cannot load the new weights
    v2 = weights_dir(tmp_path, tiny_model_dir, "v2")
    async with rig_over(tmp_path, tiny_model_dir, engines, shadows=("e1",)) as rig:
        pool = rig.gw.pool
        r = await rig.update("v2", v2)
        assert r.status_code == 200, r.text
        assert (r.json()["updated"], r.json()["stale"]) == (["remote-0"], ["remote-1"])
        shadow = next(m for m in pool.roster.members if m.name == "remote-1")
        assert (shadow.state, shadow.weight_version) == ("shadow", "base")

        rig.faults.down.add("e0")  # the active worker dies
        sid = await rig.session()
        waiting = asyncio.create_task(rig.chat(sid, max_tokens=12))

        async def active_fenced() -> bool:
            return next(m for m in pool.roster.members if m.name == "remote-0").state == "unhealthy"

        await until(active_fenced, "the dead worker fenced")
        for _ in range(20):  # probe rounds pass; the stale shadow is tried again and again, never promoted
            await asyncio.sleep(0.05)
            assert (shadow.state, shadow.weight_version) == ("shadow", "base") and not waiting.done()
        assert pool.router.routable() == []
        metrics = (await rig.client.get("/metrics")).text
        assert "belayer_workers_stale_weights 1.0" in metrics

        engines["e1"].update_error = None  # its disk has room again: the next catch-up works
        traj = await waiting
        assert (shadow.state, shadow.weight_version, engines["e1"].weight_version) == ("ready", "v2", "v2")
        assert shadow.last_transition is not None and "weight version 'v2'" in str(
            shadow.last_transition["why"]
        )
        [turn] = traj["turns"]
        assert turn["worker"] == "remote-1" and check_segments(turn) == [(0, 12, "v2")]


# --- bad input ---------------------------------------------------------------------------------------


async def test_bad_updates_get_a_clear_4xx_and_change_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    engines = {h: FakeEngine(step=step, max_model_len=4096) for h in ("e0", "e1")}
    good = weights_dir(tmp_path, tiny_model_dir, "good")
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir / "config.json", no_weights / "config.json")
    other_shape = weights_dir(tmp_path, tiny_model_dir, "other-shape")
    config = json.loads((other_shape / "config.json").read_text())
    (other_shape / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))

    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        post = rig.client.post

        async def refused(
            r: httpx.Response, status: int, param: str | None, code: str | None, says: str
        ) -> None:
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert (error["param"], error["code"]) == (param, code) and says in error["message"], error

        body = {"version": "v2", "path": str(good)}
        await refused(await post("/api/weights", json=body), 403, None, "forbidden", "admin token")
        wrong = {"authorization": "Bearer nope"}
        await refused(
            await post("/api/weights", json=body, headers=wrong), 403, None, "forbidden", "admin token"
        )
        await refused(await post("/api/weights", json={"path": str(good)}, headers=AUTH), 400, "version",
                      "invalid_value", "Field required")  # fmt: skip
        await refused(await post("/api/weights", json={"version": "v2"}, headers=AUTH), 400, "path",
                      "invalid_value", "Field required")  # fmt: skip
        await refused(await rig.update("v2", good, extra=1), 400, "extra", "invalid_value", "Extra inputs")
        await refused(await rig.update("v2", good, drain_s=-1), 400, "drain_s", "invalid_value", "0")
        await refused(await rig.update("v 2", good), 400, "version", "invalid_value", "not a plain name")
        await refused(await rig.update("v2", "relative/dir"), 400, "path", "weights_not_loadable", "absolute")
        await refused(
            await rig.update("v2", tmp_path / "missing"),
            400,
            "path",
            "weights_not_loadable",
            "not a directory",
        )
        await refused(await rig.update("v2", empty), 400, "path", "weights_not_loadable", "config.json")
        await refused(
            await rig.update("v2", no_weights), 400, "path", "weights_not_loadable", "no weight files"
        )
        await refused(await rig.update("v2", other_shape), 400, "path", "weights_not_loadable",
                      "hidden_size=256, the served model's 128")  # fmt: skip
        await refused(await rig.update("base", good), 409, "version", "weight_version_exists", "already")
        # Weights that pass the checks but that the first worker cannot load: nothing else is touched.
        engines["e0"].update_error = "size mismatch for lm_head.weight"
        await refused(await rig.update("v2", good), 400, "path", "weights_not_loadable", "size mismatch")
        assert [e.weight_version for e in engines.values()] == ["default", "default"]
        assert engines["e1"].weights_path is None and not engines["e1"].paused
        info = (await rig.client.get("/api/weights")).json()
        assert info["version"] == "base" and [u["kind"] for u in info["updates"]] == ["weights_update_failed"]
        engines["e0"].update_error = None

        # The pool still serves the old version, and a good update then goes through. (The worker that
        # failed the load was fenced, as vLLM's engine may be dead after one; its probe brings it back.)
        async def both_ready() -> bool:
            return len(rig.gw.pool.router.routable()) == 2

        await until(both_ready, "the fenced worker back")
        traj = await rig.chat(await rig.session(), max_tokens=6)
        assert check_segments(traj["turns"][0]) == [(0, 6, "base")]
        r = await rig.update("v2", good)
        assert r.status_code == 200 and sorted(r.json()["updated"]) == ["remote-0", "remote-1"], r.text


async def test_a_restarted_gateway_knows_the_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    engines = {"e0": FakeEngine(step=step, max_model_len=4096)}
    v2 = weights_dir(tmp_path, tiny_model_dir, "v2")
    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        assert (await rig.update("v2", v2)).status_code == 200
    async with rig_over(tmp_path, tiny_model_dir, engines) as again:  # the same store, the engine outlived it
        info = (await again.client.get("/api/weights")).json()
        assert (info["version"], info["path"], info["workers"][0]["weight_version"]) == ("v2", str(v2), "v2")
        traj = await again.chat(await again.session(), max_tokens=5)
        assert check_segments(traj["turns"][0]) == [(0, 5, "v2")]


async def test_a_second_update_while_one_runs_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    engines = {"e0": FakeEngine(step=step, max_model_len=4096)}
    v2, v3 = weights_dir(tmp_path, tiny_model_dir, "v2"), weights_dir(tmp_path, tiny_model_dir, "v3")
    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        rig.faults.faults["e0"] = [Fault("stall_after", 2)]  # a turn holds the worker: the update drains
        sid = await rig.session()
        turn = asyncio.create_task(rig.chat(sid, max_tokens=8))
        await until(lambda: _running(rig), "a turn in flight")
        first = asyncio.create_task(rig.update("v2", v2, drain_s=3))
        await until(lambda: _updating(rig), "the update draining")
        second = await rig.update("v3", v3)
        assert second.status_code == 409 and second.json()["error"]["code"] == "weight_update_in_progress"
        r = await first
        assert r.status_code == 200 and r.json()["preempted"] == 1 and r.json()["drain_s"] >= 3, r.text
        assert check_segments((await turn)["turns"][0]) == [(0, 2, "base"), (2, 8, "v2")]


async def _updating(rig: Rig) -> bool:
    return rig.gw.pool.versions.lock.locked()


async def test_a_worker_lost_during_an_update_is_brought_up_when_it_returns(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engines = {h: FakeEngine(step=step, max_model_len=4096) for h in ("e0", "e1")}
    v2 = weights_dir(tmp_path, tiny_model_dir, "v2")
    async with rig_over(tmp_path, tiny_model_dir, engines) as rig:
        pool = rig.gw.pool
        rig.faults.down.add("e0")  # gone when the update comes (fenced then, or by a probe before)
        r = await rig.update("v2", v2)
        assert r.status_code == 200 and (r.json()["updated"], r.json()["stale"]) == (
            ["remote-1"],
            ["remote-0"],
        )
        lost = next(m for m in pool.roster.members if m.name == "remote-0")
        assert lost.weight_version == "base" and engines["e0"].weight_version == "default"

        rig.faults.down.discard("e0")  # back, still on its old weights: brought up before it is routed to

        async def caught_up() -> bool:
            return lost in pool.router.routable()

        await until(caught_up, "the returning worker on v2")
        assert (lost.weight_version, engines["e0"].weight_version, engines["e0"].weights_path) == (
            "v2",
            "v2",
            str(v2),
        )
        for sid in [await rig.session() for _ in range(4)]:
            traj = await rig.chat(sid, max_tokens=5)
            assert check_segments(traj["turns"][0]) == [(0, 5, "v2")]
