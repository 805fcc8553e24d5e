"""The pool's settings (`PoolSettings`): how many workers, where they run, how they are probed.

`EnginePool` holds them (``pool.settings``; they may be changed before it starts, and some while it
runs), and each of its parts is given them and reads the ones it needs, live::

    settings = PoolSettings(probe_interval=0.1, probe_failures=2)
    pool = EnginePool(http, settings)
    settings.probe_interval = 0.05  # read at the next probe round
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from core.telemetry import Telemetry
from engine_pool.member import WorkerLauncher
from engine_pool.workers.worker import WorkerSpec

RoutingPolicy = Literal["affinity", "group", "round-robin", "least-loaded"]
"""How the router places requests (``engine_pool.router``)."""
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("affinity", "group", "round-robin", "least-loaded")


@dataclass(slots=True, kw_only=True)
class PoolSettings:
    """What the pool is asked to be; the parts of ``EnginePool`` are given these and read them live."""

    log_dir: str = "logs"
    spec_factory: Callable[[], WorkerSpec] | None = None
    active: int = 1
    """Active launched workers (with a ``spec_factory``); registered engines add to the target."""
    shadows: int = 0
    probe_interval: float = 0.5
    probe_timeout: float = 2.0
    probe_failures: int = 3  # consecutive failed probes before a live worker counts as hung
    start_timeout: float = 300.0
    device_groups: tuple[tuple[int, ...], ...] = ()
    """Devices for launched workers, a group each (``engine_pool.workers.launch.device_groups``); a new worker
    gets a group no live worker holds (or, with `colocate`, the group fewest live workers hold)."""
    colocate: bool = False
    """Shadows share the active workers' device groups: they map the group's weight cache over CUDA
    IPC, which works only on the device the memory is on (``engine_pool.weights.cache``)."""
    max_affinity: int = 65536
    """Sessions whose last worker is remembered (least recently used forgotten first); also the most
    groups whose first worker is remembered."""
    routing: RoutingPolicy = "affinity"
    """How requests are placed (``engine_pool.router``): ``affinity`` (a session's last worker, else the
    fewest outstanding tokens), ``group`` (affinity, a group's sessions on the group's first worker,
    and spill under load), ``round-robin``, ``least-loaded``."""
    routing_spill_factor: float = 2.0
    """Under ``group``: a session (or group) leaves its worker when that worker's outstanding tokens
    exceed ``routing_spill_factor`` × the least-loaded routable worker's + ``routing_spill_floor``."""
    routing_spill_floor: int = 8192
    """The absolute part of the spill threshold, in tokens (about one agent turn's prompt and answer),
    so that one request against none does not move a session."""
    telemetry: Telemetry = field(default_factory=Telemetry)
    """Where state changes, promotions, replacements and cold starts are published."""
    catch_up_backoff: float = 0.5
    """Seconds before a failed catch-up (a worker brought up to the version) is tried again; doubles
    after each failure, up to 30 s."""
    launcher: WorkerLauncher | None = None
    """Launches workers elsewhere (a Ray cluster: ``belayer serve --ray``); None: local processes."""
    watch_exits: bool = True
    """Watch each launched local worker's vital processes (``engine_pool.workers.exits``): its death is noticed
    when it happens, not when its connections break or a probe fails."""
    start_nice: int = 10
    """Launched local workers start this much lower in CPU priority, and get the gateway's back once
    ready and warmed up (``VllmWorker.serving``): a replacement's start (seconds of imports and
    compilation) then yields the CPUs to the streams that just failed over. 0: off; off too where the
    gateway may not raise a priority again (``may_raise_priority``: no ``CAP_SYS_NICE``)."""
    warm_up: bool = True
    """Send each launched worker a few short requests before it takes traffic or stands as a shadow
    (``engine_pool.workers.warm_up``): a stream resumed on it then does not pay its first requests' one-off costs."""
