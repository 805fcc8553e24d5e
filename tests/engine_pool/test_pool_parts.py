"""The pool's parts, each alone (``engine_pool.roster``, ``router``, ``versions``, ``weight_update``,
``weight_keeper``, ``worker_factory``, ``supervisor``): built from their narrow collaborators, not from an
``EnginePool``, over scripted engine clients and processes (no engine process is started)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from core.errors import Conflict, EngineError, EngineUnavailable, InvalidRequest, NotFound
from engine_pool.engine.client import EngineClient, ModelInfo
from engine_pool.face import Placement
from engine_pool.fake import FakeEngine
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.router import Router
from engine_pool.settings import PoolSettings
from engine_pool.states import DEAD, DRAINING, READY, SHADOW, STARTING, UNHEALTHY
from engine_pool.supervisor import Supervisor
from engine_pool.weights.cache import GpuWeightCache
from engine_pool.weights.keeper import WeightKeeper
from engine_pool.weights.update import WeightUpdater
from engine_pool.weights.versions import WeightVersions
from engine_pool.workers.factory import WorkerFactory
from engine_pool.workers.worker import VllmWorker, WorkerSpec


def _refuse(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"a scripted client sent {request.method} {request.url}")


class ScriptedClient(EngineClient):
    """An engine client whose answers the test sets; it records the weight loads it was asked for."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "policy", httpx.AsyncClient(transport=httpx.MockTransport(_refuse)))
        self.healthy = True
        self.load_error: Exception | None = None
        self.loads: list[tuple[str, str]] = []
        self.reported_version: str | None = None

    async def health(self, timeout: float = 2.0) -> bool:
        return self.healthy

    async def model_info(self, timeout: float = 5.0) -> ModelInfo:
        return ModelInfo("policy", 4096)

    async def update_weights(self, path: str, version: str, timeout: float = 600.0) -> None:
        self.loads.append((path, version))
        if self.load_error is not None:
            raise self.load_error

    async def weight_version(self, timeout: float = 5.0) -> str | None:
        return self.reported_version


class ScriptedProcess(VllmWorker):
    """A launched worker's process that is never started: it is up until stopped."""

    def __init__(self, spec: WorkerSpec, name: str) -> None:
        super().__init__(spec, Path("/nonexistent"), name)
        self.up = True
        self.stops: list[float] = []

    def launch(self) -> None:
        self.started_at = time.time()

    async def start(self, timeout: float = 300.0) -> None:
        self.launch()

    def alive(self) -> bool:
        return self.up

    async def stop(self, grace: float = 10.0) -> None:
        self.stops.append(grace)
        self.up = False


@dataclass
class ScriptedLauncher:
    """A `WorkerLauncher` that makes scripted processes and records what it was asked."""

    made: list[tuple[str, bool, tuple[int, ...] | None]] = field(default_factory=list)

    def worker(
        self, spec: WorkerSpec, log_dir: Path, name: str, shadow: bool, members: list[PoolMember]
    ) -> VllmWorker:
        self.made.append((name, shadow, spec.devices))
        return ScriptedProcess(spec, name)

    async def misplaced(self, members: list[PoolMember]) -> PoolMember | None:
        return None

    async def close(self) -> None:
        return None


@dataclass
class Parts:
    """The parts of a pool, wired as ``EnginePool`` wires them, with the fences recorded."""

    settings: PoolSettings
    roster: Roster
    versions: WeightVersions
    keeper: WeightKeeper
    updater: WeightUpdater
    router: Router
    factory: WorkerFactory
    supervisor: Supervisor
    fenced: list[tuple[str, str]]

    def add(self, name: str, state: str, standby: bool = False, version: str = "base") -> PoolMember:
        m = PoolMember(
            name, ScriptedClient(f"http://{name}"), state=state, standby=standby, weight_version=version
        )
        self.roster.members.append(m)
        return m

    def events(self, kind: str) -> list[dict[str, object]]:
        return [e.data for e in self.settings.telemetry.recent(kinds=[kind])]


def parts(settings: PoolSettings | None = None, http: httpx.AsyncClient | None = None) -> Parts:
    settings = settings or PoolSettings()
    roster, versions = Roster(settings), WeightVersions()
    fenced: list[tuple[str, str]] = []

    def fence(m: PoolMember, error: Exception) -> None:
        fenced.append((m.name, str(error)))
        supervisor.report_failure(m, error)

    keeper = WeightKeeper(settings, roster, versions, fence)
    updater = WeightUpdater(roster, versions, keeper, fence)
    router = Router(settings, roster, versions)
    factory = WorkerFactory(settings, http or httpx.AsyncClient(), roster, versions, keeper)
    supervisor = Supervisor(settings, roster, versions, router, keeper, updater, factory)
    return Parts(settings, roster, versions, keeper, updater, router, factory, supervisor, fenced)


def client(m: PoolMember) -> ScriptedClient:
    assert isinstance(m.client, ScriptedClient)
    return m.client


# -- roster ----------------------------------------------------------------------------------------


async def test_a_state_change_is_recorded_published_and_wakes_every_waiter() -> None:
    p = parts()
    m = p.add("a", STARTING)
    waiters = [asyncio.create_task(p.roster.wait_change(30.0)) for _ in range(3)]
    await asyncio.sleep(0)
    p.roster.set(m, READY, "started")
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=5.0)
    p.roster.set(m, READY, "again")  # no change: nothing recorded
    assert m.state == READY and [s for _, s in m.history] == [READY]
    assert m.last_transition is not None and m.last_transition["why"] == "started"
    assert p.events("worker_state") == [
        {"worker": "a", "from": STARTING, "to": READY, "why": "started", "url": "http://a", "pid": None,
         "launched": False}
    ]  # fmt: skip


# -- router ----------------------------------------------------------------------------------------


async def test_the_router_prefers_the_sessions_worker_then_the_least_loaded() -> None:
    p = parts()
    a, b, _ = p.add("a", READY), p.add("b", READY), p.add("s", SHADOW)
    a.outstanding = 2
    assert p.router.pick(Placement()) is b
    assert await p.router.acquire(Placement("s1", exclude=frozenset({"b"}))) is a  # remembered for s1
    assert p.router.pick(Placement("s1")) is a
    assert p.router.pick(Placement("s1", exclude=frozenset({"a"}))) is b
    b.weight_version = "old"  # not on the pool's version: never routed to
    assert p.router.routable() == [a] and p.router.pick(Placement()) is a


def test_during_an_update_only_requests_pinned_to_the_version_run_and_none_once_it_switches() -> None:
    p = parts()
    p.add("a", READY)
    p.versions.updating = True
    assert p.router.pick(Placement()) is None
    assert p.router.pick(Placement(version="base")) is not None  # a failover's tokens are on "base": drain time
    p.versions.switching = True
    assert p.router.pick(Placement(version="base")) is None


async def test_the_affinity_map_is_bounded_and_forgets_sessions_and_workers() -> None:
    p = parts(PoolSettings(max_affinity=2))
    p.add("a", READY)
    for sid in ["x", "y", "x", "z"]:
        await p.router.acquire(Placement(sid))
    assert p.router.sessions == ["x", "z"] and p.router.remembered_sessions == 2
    p.router.forget("x")
    assert p.router.sessions == ["z"]
    p.router.forget_worker("a")
    assert p.router.sessions == []


async def test_acquire_gives_up_at_its_deadline_naming_every_workers_state() -> None:
    p = parts()
    p.add("a", UNHEALTHY)
    p.add("b", READY, version="old")
    p.versions.updating = True
    with pytest.raises(EngineUnavailable) as e:
        await p.router.acquire(Placement("s", wait=0.05))
    assert str(e.value) == (
        "no healthy inference worker became available within 0s (workers: a=unhealthy, b=ready (weights old); "
        "a weight update to 'base' is running); check the workers' logs in the gateway's --log-dir"
    )


async def test_a_lease_counts_its_request_and_its_end_wakes_a_drain() -> None:
    p = parts()
    a = p.add("a", READY)
    async with p.router.lease(Placement("s")) as member:
        assert member is a and a.outstanding == 1
        a.state = DRAINING
        drained = asyncio.create_task(p.roster.wait_change(30.0))
        await asyncio.sleep(0)
    await asyncio.wait_for(drained, timeout=5.0)
    assert (a.outstanding, a.served) == (0, 1)


# -- versions --------------------------------------------------------------------------------------


async def test_adopted_versions_reach_registered_engines_and_a_restarted_one_reports_the_launch_weights() -> (
    None
):
    p = parts()
    registered = p.add("r", READY)
    launched = p.add("w", READY)
    launched.process = ScriptedProcess(WorkerSpec(model="/m", port=1), "w")
    p.updater.adopt("v3", "/w/v3")
    assert (p.versions.version, p.versions.path) == ("v3", "/w/v3")
    assert (registered.weight_version, launched.weight_version) == ("v3", "base")
    client(registered).reported_version = "default"
    await p.versions.observe(registered)
    assert registered.weight_version == p.versions.base == "base"


# -- weight updates --------------------------------------------------------------------------------


async def test_an_update_loads_every_up_worker_cuts_the_stragglers_and_names_the_missing() -> None:
    p = parts()
    a, b, s, starting = p.add("a", READY), p.add("b", READY), p.add("s", SHADOW), p.add("n", STARTING)
    a.outstanding = 1  # a stream that runs past the drain time
    preemption, cut = p.versions.preemption, asyncio.Event()
    preemption.watch(cut)

    async def stream() -> None:
        await cut.wait()
        a.outstanding = 0
        p.roster.wake()

    task = asyncio.create_task(stream())
    result = await p.updater.update("v1", "/w/v1", drain_s=0.05)
    await task
    assert (result.version, result.previous, result.updated, result.stale) == (
        "v1",
        "base",
        ["a", "b", "s"],
        ["n"],
    )
    assert result.preempted == 1 and result.owner is None
    assert (result.kind, list(result.data())) == ("weights_updated", [
        "version", "previous", "path", "updated", "stale", "preempted", "drain_s", "seconds", "owner",
    ])  # fmt: skip  # the update is its event: what the weight log stores and POST /api/weights answers
    assert 0.05 <= result.drain_s == round(result.drain_s, 3) <= result.seconds == round(result.seconds, 3)
    assert [client(m).loads for m in (a, b, s, starting)] == [[("/w/v1", "v1")]] * 3 + [[]]
    assert (p.versions.version, p.versions.path, p.versions.updating) == ("v1", "/w/v1", False)
    assert preemption.triggered and p.versions.preemption is not preemption
    with pytest.raises(Conflict, match="serves weight version 'v1' already"):
        await p.updater.update("v1", "/w/v1")


async def test_weights_the_first_worker_cannot_load_reach_no_other() -> None:
    p = parts()
    a, b = p.add("a", READY), p.add("b", READY)
    client(a).load_error = EngineError("bad checkpoint")
    with pytest.raises(InvalidRequest, match="could not load the weights at '/w/bad'"):
        await p.updater.update("v1", "/w/bad", drain_s=0.0)
    assert p.fenced == [("a", "bad checkpoint")] and a.state == UNHEALTHY
    assert client(b).loads == [] and p.versions.version == "base" and not p.versions.updating


async def test_sync_brings_one_worker_up_to_the_version_where_its_weights_are_known() -> None:
    p = parts()
    behind, unknown = p.add("a", SHADOW), p.add("b", SHADOW)
    p.versions.version, p.versions.path = "v2", "/w/v2"
    assert await p.updater.sync(behind) and (behind.weight_version, behind.synced) == ("v2", 1)
    assert p.events("worker_weights") == [{"worker": "a", "version": "v2", "source": "disk"}]
    p.versions.path = None  # a registered engine, and the version is the launch weights'
    assert not await p.updater.sync(unknown) and client(unknown).loads == []


# -- weight keeper ---------------------------------------------------------------------------------


async def test_a_failed_load_on_a_gpu_cache_reloads_its_device_groups_other_workers() -> None:
    p = parts()
    p.keeper.owner = GpuWeightCache(
        WorkerSpec(model="/m", port=1), [(0,), (1,)], Path("logs"), socket_base="/nonexistent"
    )
    members = {}
    for name, devices, state in [("f", (0,), DRAINING), ("peer", (0,), READY), ("bad", (0,), SHADOW),
                                 ("other", (1,), READY), ("down", (0,), STARTING)]:  # fmt: skip
        m = members[name] = p.add(name, state)
        m.process = ScriptedProcess(WorkerSpec(model="/m", port=1, devices=devices), name)
    client(members["bad"]).load_error = EngineError("engine dead")
    await p.keeper.restore_shared(members["f"])
    assert {n: client(m).loads for n, m in members.items()} == {
        "f": [], "peer": [("/m", "base")], "bad": [("/m", "base")], "other": [], "down": []
    }  # fmt: skip
    assert p.fenced == [("bad", "engine dead")]
    assert p.events("worker_weights") == [{"worker": "peer", "version": "base", "source": "restored"}]


def test_without_an_owner_the_keeper_has_nothing_to_check_or_follow() -> None:
    p = parts()
    assert p.keeper.check("probe") and p.keeper.follow() is None and not p.keeper.busy


# -- worker factory --------------------------------------------------------------------------------


def test_the_factory_names_places_and_launches_through_the_launcher() -> None:
    launcher = ScriptedLauncher()
    settings = PoolSettings(
        spec_factory=lambda: WorkerSpec(model="/m", port=1), device_groups=((0,), (1,)), launcher=launcher
    )
    p = parts(settings)
    p.versions.base = "launch"
    made = [p.factory.new(), p.factory.new(shadow=True)]
    assert [(m.name, m.state, m.weight_version) for m in made] == [
        ("worker-0", STARTING, "launch"), ("worker-1", STARTING, "launch")
    ]  # fmt: skip
    assert launcher.made == [("worker-0", False, (0,)), ("worker-1", True, (1,))]
    assert p.roster.members == made
    with pytest.raises(EngineUnavailable, match="no free device group"):
        p.factory.new()
    made[0].state = DEAD  # its group is free again
    assert p.factory.free_devices() == (0,)
    settings.colocate = True  # the least used group, the first of equals
    assert p.factory.free_devices() == (0,)


# -- supervisor ------------------------------------------------------------------------------------


def test_a_failed_registered_worker_is_fenced_and_a_shadow_on_the_version_takes_its_place() -> None:
    p = parts()
    a, old, s = (
        p.add("a", READY),
        p.add("old", SHADOW, standby=True, version="v0"),
        p.add("s", SHADOW, standby=True),
    )
    assert p.supervisor.target() == 1 and p.supervisor.role() == SHADOW
    p.supervisor.report_failure(a, EngineUnavailable("stream cut"))
    assert (a.state, old.state, s.state) == (UNHEALTHY, SHADOW, READY)
    assert a.last_transition is not None
    assert a.last_transition["why"] == "failed: stream cut; fenced until a health probe passes"
    assert p.events("shadow_promoted") == [{"worker": "s"}]
    p.supervisor.report_failure(a, EngineUnavailable("again"))  # fenced already: nothing changes
    assert len(p.events("worker_state")) == 2


async def test_probes_fence_a_hung_worker_and_take_it_back_once_it_answers() -> None:
    p = parts(PoolSettings(probe_failures=2))
    a = p.add("a", READY)
    client(a).healthy = False
    await p.supervisor.probe()
    assert (a.state, a.probe_failures) == (READY, 1)
    await p.supervisor.probe()
    assert a.state == UNHEALTHY
    assert a.last_transition is not None and a.last_transition["why"].startswith(
        "failed: 2 health probes failed"
    )
    client(a).healthy, client(a).reported_version, a.weight_version = True, "default", "v9"
    await p.supervisor.probe()
    assert (a.state, a.probe_failures, a.weight_version) == (READY, 0, "base")


async def test_a_shadow_behind_the_version_is_caught_up_then_promoted_and_a_failed_one_waits() -> None:
    p = parts(PoolSettings(catch_up_backoff=60.0))
    behind, failing = p.add("s", SHADOW, standby=True), p.add("t", SHADOW, standby=True)
    p.add("r", STARTING)  # a registered engine not given as a shadow: the target is one active worker
    client(failing).load_error = EngineError("disk full")
    p.versions.version, p.versions.path = "v2", "/w/v2"
    await p.supervisor.probe()
    await p.roster.tasks.join()
    assert (behind.state, behind.weight_version) == (READY, "v2")
    assert p.events("shadow_promoted") == [{"worker": "s"}]
    await p.supervisor.probe()  # within the failed catch-up's backoff: not tried again
    await p.roster.tasks.join()
    assert client(failing).loads == [("/w/v2", "v2")] and failing.state == SHADOW


async def test_a_failed_launched_worker_is_killed_and_replaced_at_full_strength() -> None:
    launcher = ScriptedLauncher()
    settings = PoolSettings(spec_factory=lambda: WorkerSpec(model="/m", port=1), launcher=launcher)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine(max_model_len=4096).app())) as http:
        p = parts(settings, http)
        first = p.factory.new()
        p.roster.set(first, READY, "started")
        p.supervisor.report_failure(first, EngineUnavailable("process exited"))
        assert first.state == DRAINING
        await p.roster.tasks.join()
    assert first.process is not None and isinstance(first.process, ScriptedProcess)
    assert first.state == DEAD and first.process.stops == [0.0]
    replacement = p.roster.members[-1]
    assert (replacement.name, replacement.state) == ("worker-1", READY)
    assert launcher.made == [("worker-0", False, None), ("worker-1", False, None)]
    assert p.events("replacement_started") == [{"worker": "worker-1"}]
    assert [e["worker"] for e in p.events("worker_cold_start")] == ["worker-1"]


async def test_a_removed_worker_is_drained_dropped_and_forgotten_and_a_shadow_replaces_it() -> None:
    p = parts()
    a, s = p.add("a", READY), p.add("s", SHADOW)
    await p.router.acquire(Placement("session"))
    removed = await p.supervisor.remove("a", drain_timeout=0.0)
    assert removed is a and a.state == DEAD and p.roster.members == [s] and s.state == READY
    assert p.router.sessions == [] and a.last_transition is not None and a.last_transition["why"] == "removed"
    with pytest.raises(NotFound) as e:
        await p.supervisor.remove("a")
    assert str(e.value) == "no engine named 'a' in the pool (engines: s)"
