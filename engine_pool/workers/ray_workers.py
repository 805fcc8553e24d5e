"""Workers placed on a Ray cluster (``belayer serve --ray auto|ADDRESS``): one more way the pool launches
a worker, beside the local process (``VllmWorker``).

Each launched worker (active or shadow) is a Ray actor (``engine_pool.workers.ray_actor``: `EngineHost`, and the
gateway's handle to it, `RayWorker`) that Ray places on a node with the
resources the worker needs (``--ray-cpus-per-worker`` CPUs, the tensor-parallel size in GPUs with the
gpu profile, and any ``--ray-resource NAME=AMOUNT``). The actor starts the engine server (vLLM, or the
fake engine) through ``engine_pool.workers.reaper`` on its node's IP and a free port there, and the gateway
reaches it over HTTP as it reaches a local worker: health probes, failover, promotion, fencing and
replacement are the pool's own (``engine_pool.pool``). Ray is imported only here and by the actor, and
only once a `RayLauncher` connects: a gateway without ``--ray`` never imports it.

Placement. The launcher picks each worker's node itself and asks Ray for it softly
(``NodeAffinitySchedulingStrategy(soft=True)``: Ray places it elsewhere when that node is full; an
actor still waiting for a node that has left the cluster is dropped and placed again):

- a shadow goes on a node that holds no active worker, and an active worker on one that holds no shadow,
  while such a node has room (so one node's loss cannot take a worker and the shadow that backs it);
- a node where a worker of this pool could not be stopped recently (its actor unreachable: the node may
  be gone, and not declared dead yet) comes last of all; then, among the rest, the node with the fewest
  of this pool's workers, then a node other than the head (it runs the cluster's GCS);
- when no node has room the actor waits in Ray's queue, and Ray places it when a node (re)joins.

When a node that was lost comes back, `RayLauncher.misplaced` names a shadow that shares a node with an
active worker while a node with room holds neither: the pool starts a new shadow (placed there), then
removes the misplaced one (``Supervisor._rebalance``).

Trust. Actors are created with ``max_restarts=0``: Ray never restarts a worker under the same handle.
A worker that dies (its process, its actor, its node) is fenced and replaced by the pool, and a
replacement, wherever Ray puts it, is routed to only after the checks every fresh worker passes
(``/health``, its model listing, its weight version).

The Ray head. Launching talks to the head (the GCS); serving does not: requests go to the engines over
HTTP. While the head does not answer, requests keep flowing to the workers the pool knows, and a launch
waits: each call to the head is tried again with exponential backoff (up to 10 s apart), logged as a
warning, for as long as it takes. (Ray's own limit applies: nodes and this driver give up on a head
that stays away longer than ``RAY_gcs_rpc_server_reconnect_timeout_s``; the gateway raises its own to an
hour unless it is set.)

Example::

    launcher = RayLauncher(RaySettings(address="127.0.0.2:6379", node_ip="127.0.0.2"))
    pool = EnginePool(http, PoolSettings(spec_factory=spec, active=2, shadows=1, launcher=launcher))
    await pool.start()   # three actors, the shadow on a node of its own
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from core.errors import EngineUnavailable
from engine_pool.member import PoolMember
from engine_pool.states import READY, SHADOW, STARTING
from engine_pool.workers.ray_actor import EngineHost, RayWorker
from engine_pool.workers.worker import WorkerSpec

log = logging.getLogger("belayer.engine_pool.ray")

T = TypeVar("T")

SUSPECT_S = 30.0
"""Seconds a node where a worker failed to stop (its actor unreachable) comes last in placement."""
REBALANCE_EVERY_S = 2.0
"""The least time between two looks at the cluster for a misplaced shadow."""
HEAD_RESOURCE = "node:__internal_head__"
HEAD_CALL_TIMEOUT_S = 10.0
"""A call to the Ray head that takes longer has failed (and is tried again, with backoff)."""


@dataclass(frozen=True, slots=True)
class RaySettings:
    """Where the cluster is and what each worker asks of it."""

    address: str = "auto"
    """``auto`` (the cluster this machine's Ray node belongs to) or the head's ``HOST:PORT``."""
    node_ip: str | None = None
    """This machine's Ray node address, when Ray would guess it wrong (e.g. several nodes on one machine)."""
    namespace: str = "belayer"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    """Custom resources each worker needs (``{"engine_node": 1}`` keeps workers on nodes that have it)."""

    def needs(self) -> dict[str, float]:
        """A worker's resources, by Ray's names."""
        need = {"CPU": self.cpus_per_worker, **self.resources}
        if self.gpus_per_worker:
            need["GPU"] = self.gpus_per_worker
        return {k: v for k, v in need.items() if v}


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    ip: str
    alive: bool
    total: Mapping[str, float]

    @property
    def head(self) -> bool:
        """The head node (the GCS's): it comes after the others when they have as much room."""
        return HEAD_RESOURCE in self.total


class RayLauncher:
    """The pool's connection to a Ray cluster: launches `RayWorker` s, picks their nodes, and names a
    shadow to move once a lost node is back (module docstring). One per pool; `close` ends it."""

    def __init__(self, settings: RaySettings) -> None:
        self.settings = settings
        self._ray: Any = None
        self._actor_class: Any = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="belayer-ray")
        self._place_lock = asyncio.Lock()
        self._suspect: dict[str, float] = {}
        self._members: list[PoolMember] = []
        self._placing = 0
        self._next_look = 0.0
        self.head_retries = 0
        """Calls to the head that were tried again."""

    @property
    def ray(self) -> Any:
        if self._ray is None:
            raise EngineUnavailable("not connected to the Ray cluster yet")
        return self._ray

    def worker(
        self, spec: WorkerSpec, log_dir: Path, name: str, shadow: bool, members: list[PoolMember]
    ) -> RayWorker:
        """A new worker for the pool whose members are `members` (placement looks at them)."""
        self._members = members
        # absolute: the engine runs in a Ray worker's directory (every node needs the model at this path)
        spec = dataclasses.replace(spec, model=os.path.abspath(spec.model))
        return RayWorker(spec, log_dir.absolute(), name, self, shadow)

    def suspect(self, node: str) -> None:
        self._suspect[node] = time.monotonic() + SUSPECT_S

    # -- calls to the head, off the event loop, retried while it does not answer ----------------------

    async def _call(self, fn: Callable[[], T], timeout: float = HEAD_CALL_TIMEOUT_S) -> T:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(asyncio.wrap_future(self._executor.submit(fn), loop=loop), timeout)

    async def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        """`fn` in the Ray thread until it succeeds: a head that does not answer is asked again, with
        exponential backoff (0.5 s doubling to 10 s), each try logged."""
        delay = 0.5
        while True:
            try:
                return await self._call(fn)
            except Exception as e:  # a head away times out; any other error is logged and retried alike
                self.head_retries += 1
                log.warning("Ray head %s did not answer (%s: %r); trying again in %.1f s",
                            self.settings.address, what, e, delay)  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(10.0, delay * 2)

    def _connect(self) -> None:
        """``ray.init`` (in the Ray thread): imports Ray, joins the cluster as a driver."""
        if self._ray is not None:
            return
        # A driver whose head stays away longer than this exits (Ray's default: 60 s); the gateway
        # serves on meanwhile, so it waits longer unless told otherwise.
        os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "3600")
        import ray

        kwargs: dict[str, Any] = {"_node_ip_address": self.settings.node_ip} if self.settings.node_ip else {}
        ray.init(
            address=self.settings.address, namespace=self.settings.namespace, log_to_driver=False,
            configure_logging=False, ignore_reinit_error=True, **kwargs,
        )  # fmt: skip
        self._actor_class = ray.remote(EngineHost)
        self._ray = ray
        log.info(
            "joined the Ray cluster at %s (namespace %s)", self.settings.address, self.settings.namespace
        )

    async def connect(self) -> None:
        await self._retrying("connect", self._connect)

    def _nodes(self) -> list[NodeView]:
        return [
            NodeView(
                str(n["NodeID"]),
                str(n["NodeManagerAddress"]),
                bool(n["Alive"]),
                dict(n.get("Resources") or {}),
            )
            for n in self.ray.nodes()
        ]

    # -- placement --------------------------------------------------------------------------------------

    def _ours(self) -> list[RayWorker]:
        return [
            m.process for m in self._members
            if isinstance(m.process, RayWorker) and not m.process.stopped and m.process.node is not None
        ]  # fmt: skip

    def _avoid(self, worker: RayWorker) -> set[str]:
        """Nodes of the other role's workers: a shadow avoids active ones, an active one shadows."""
        avoid = set()
        for m in self._members:
            p = m.process
            if not isinstance(p, RayWorker) or p is worker or p.node is None or p.stopped:
                continue
            shadow = m.state == SHADOW or (m.state == STARTING and p.shadow)
            active = m.state == READY or (m.state == STARTING and not p.shadow)
            if (worker.shadow and active) or (not worker.shadow and shadow):
                avoid.add(p.node)
        return avoid

    def _room(self, nodes: list[NodeView]) -> list[NodeView]:
        """Alive nodes with room for one more worker (their totals, less this pool's workers there)."""
        need, ours = self.settings.needs(), self._ours()
        return [
            n for n in nodes
            if n.alive and all(n.total.get(k, 0.0) - v * sum(w.node == n.id for w in ours) >= v for k, v in need.items())
        ]  # fmt: skip

    def choose(self, nodes: list[NodeView], worker: RayWorker) -> str | None:
        """The node for `worker` (module docstring), or None: no node has room; Ray queues it."""
        room = self._room(nodes)
        if not room:
            return None
        avoid, now, ours = self._avoid(worker), time.monotonic(), self._ours()
        best = min(
            room,
            key=lambda n: (
                self._suspect.get(n.id, 0.0) > now,
                n.id in avoid,
                sum(w.node == n.id for w in ours),
                n.head,
                n.ip,
            ),
        )
        return best.id

    def _create(self, worker: RayWorker, node: str | None) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        s = self.settings
        options: dict[str, Any] = {
            "num_cpus": s.cpus_per_worker, "num_gpus": s.gpus_per_worker, "resources": dict(s.resources),
            "max_restarts": 0, "max_concurrency": 4, "name": f"{worker.name}-{os.getpid()}-{time.time_ns()}",
        }  # fmt: skip
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node, soft=True, _spill_on_unavailable=True
            )
        return self._actor_class.options(**options).remote()

    async def place(self, worker: RayWorker) -> None:
        """Create `worker` 's actor on the node `choose` picks and start its engine; returns once it
        runs. While Ray has not placed it, each 5 s: if the node it was meant for has left the
        cluster, the actor is dropped and placed again; else it waits (logged every 30 s)."""
        self._placing += 1
        try:
            await self.connect()
            while True:
                async with self._place_lock:  # one at a time: each choice sees the nodes taken before it
                    node = self.choose(await self._retrying("list nodes", self._nodes), worker)
                    worker.node = node  # held for the next choice, until Ray says where it went
                    actor = await self._retrying(
                        "create actor", functools.partial(self._create, worker, node)
                    )
                    worker.actor = actor  # from now on, stopping the worker kills it
                    started = actor.start.remote(dataclasses.replace(worker.spec), str(worker.log_path))
                info = await self._started(worker, node, started)
                if info is not None:
                    worker.placed(info, actor)
                    log.info("worker %s placed on Ray node %s (%s)", worker.name, worker.node_ip, worker.node)
                    return
                log.warning("worker %s: not started on node %s (it left the cluster); placing it again",
                            worker.name, node)  # fmt: skip
                await self.kill(actor)
        finally:
            self._placing -= 1

    async def _started(self, worker: RayWorker, node: str | None, started: Any) -> dict[str, Any] | None:
        """The actor's start result; None if the actor ended first, or the node it was meant for is gone."""
        t0 = time.monotonic()
        future = asyncio.wrap_future(started.future())
        warned = t0
        while True:
            done, _ = await asyncio.wait({future}, timeout=5.0)
            if done:
                error = future.exception()
                if error is None:
                    result: dict[str, Any] = future.result()
                    return result
                log.warning("worker %s: its actor ended before the engine started (%s)", worker.name,
                            str(error).splitlines()[0])  # fmt: skip
                if node is not None:
                    self.suspect(node)
                await asyncio.sleep(1.0)
                return None
            if node is not None:
                with contextlib.suppress(Exception):
                    nodes = await self._call(self._nodes, timeout=5.0)
                    if not any(n.id == node and n.alive for n in nodes):
                        self.suspect(node)
                        return None
            if time.monotonic() - warned >= 30.0:
                warned = time.monotonic()
                log.warning("worker %s: Ray has not placed it after %.0f s (it needs %s on one node)",
                            worker.name, warned - t0, self.settings.needs())  # fmt: skip

    async def kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):
            await self._call(lambda: self.ray.kill(actor, no_restart=True))

    async def misplaced(self, members: list[PoolMember]) -> PoolMember | None:
        """A shadow that shares a node with an active worker, while a node with room holds neither
        (a lost node is back): the one to move. At most one look every 2 s; None while the head is
        away or a worker is being placed."""
        now = time.monotonic()
        if self._placing or now < self._next_look or self._ray is None:
            return None
        self._next_look = now + REBALANCE_EVERY_S
        self._members = members
        try:
            nodes = await self._call(self._nodes, timeout=5.0)
        except Exception:
            return None
        alive = {n.id for n in nodes if n.alive}
        up = [
            (m, m.process) for m in members if isinstance(m.process, RayWorker) and m.state in (READY, SHADOW)
        ]
        active_nodes = {p.node for m, p in up if m.state == READY}
        taken = {p.node for _, p in up}
        free = [n for n in self._room(nodes) if n.id not in taken and self._suspect.get(n.id, 0.0) <= now]
        if not free:
            return None
        return next(
            (m for m, p in up if m.state == SHADOW and (p.node in active_nodes or p.node not in alive)), None
        )

    async def close(self) -> None:
        """Leave the cluster (the pool has stopped its workers first)."""
        if self._ray is not None:
            with contextlib.suppress(Exception):
                await self._call(self._ray.shutdown, timeout=15.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
