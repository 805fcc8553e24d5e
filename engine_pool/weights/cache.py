"""The weight owner on GPUs: vLLM's own weight-cache daemon (``vllm preload``), one per device group,
with the group's workers and shadows mapping its tensors over CUDA IPC (``--load-format belayer_ipc``:
vLLM's ``ipc_cache`` loader, able to take weight updates, ``belayer_vllm.ipc``).

``belayer serve --worker-profile gpu --gpus 0,1 --weight-owner`` starts, before any worker, one daemon
per device group (``belayer_vllm.preload``: vLLM's ``vllm preload`` with the workers' own vLLM arguments,
``CUDA_VISIBLE_DEVICES`` the group). It loads the weights onto the group's devices once and serves CUDA
IPC handles on a Unix socket in its own directory. Every worker and shadow launched on the group runs
``--load-format belayer_ipc`` with that directory and maps the daemon's memory, zero-copy: a shadow costs
its KV cache and runtime state, not a second copy of the weights, and a replacement starts without
reading the weights from disk.

CUDA IPC maps memory only on the device it lives on, so the pool places shadows on the active workers'
device groups (``PoolSettings.colocate``): the groups must number at least the active workers, not the
workers plus shadows. Processes sharing a group share its memory: unless ``--gpu-memory-utilization``
is given, each gets ``launch.colocated_utilization`` (the usual 0.9 split between them; vLLM counts the
daemon's weights in each process's budget once, ``get_external_weight_memory``).

Health. The daemon's parent answers ``GET /health`` on a loopback port: 200 once every rank holds its
weights, 503 when one has exited. The pool checks it each probe round and whenever a worker fails, and
restarts a daemon that is down. vLLM's loader falls back to a disk load when the daemon does not answer
(its ``fallback``, on by default), so workers launched meanwhile still start.

Weight updates. Zero-copy mappers share the daemon's memory, so the daemon must outlive them: it is not
replaced after an update (a CPU owner is: ``engine_pool.weights.owner``). An update's reload on a mapping
worker writes the new weights into the shared memory in place, which is consistent because the pool
drains every worker before an update and then loads the same weights on every worker; a catch-up
later writes the same bits again. Workers launched after an update are recorded at the launch version
and caught up (``WeightUpdater.sync``) before they are routed to: the daemon's fingerprint names the launch
checkpoint, and the pool cannot see whether a worker mapped the daemon or fell back to disk.

Nothing here has run on a GPU yet: CI has none, and ``deploy/gpu/cuda_ipc_check.py`` checks the CUDA IPC
protocol this rests on (a consumer killed, the owner's tensors intact, mapped again) on a GPU machine.
On a CPU machine ``vllm preload`` refuses to start (vLLM: "does not support CUDA IPC"); the pool then
says so once and workers load from disk.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from core.errors import EngineUnavailable
from core.net import free_port
from engine_pool.workers.worker import WorkerSpec, launch_group, stop_group

LOAD_FORMAT = "belayer_ipc"
HEALTH_TIMEOUT = 0.25  # seconds a loopback /health may take before the daemon counts as down


def loader_args(socket_dir: str) -> tuple[str, ...]:
    """The vLLM arguments that make a worker map its group's daemon (``belayer_vllm.ipc``).

    >>> loader_args("/tmp/belayer-wc-x/0")
    ('--load-format', 'belayer_ipc', '--model-loader-extra-config', '{"socket_dir": "/tmp/belayer-wc-x/0"}')
    """
    return (
        "--load-format",
        LOAD_FORMAT,
        "--model-loader-extra-config",
        json.dumps({"socket_dir": socket_dir}),
    )


class CacheDaemon:
    """One ``vllm preload`` for one device group, in its own process group (via the reaper)."""

    def __init__(self, spec: WorkerSpec, devices: tuple[int, ...], socket_dir: Path, log_dir: Path) -> None:
        self.spec = spec
        self.devices = devices
        self.socket_dir = socket_dir
        self.log_path = log_dir / f"weight-cache-{'-'.join(map(str, devices))}.log"
        self.health_port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def argv(self) -> list[str]:
        """``belayer_vllm.preload`` with the daemon's own options, then the group's worker arguments (the
        spec's: the pool adds the loader's to each worker's, `GpuWeightCache.worker_args`; the daemon
        itself loads from disk)."""
        worker = self.spec.argv()[3:]  # after python -m MODULE
        own = [
            "--weight-cache-socket-dir", str(self.socket_dir),
            "--weight-cache-health-port", str(self.health_port),
            "--weight-cache-health-host", "127.0.0.1",
        ]  # fmt: skip
        return [self.spec.python, "-m", "belayer_vllm.preload", *own, "--", *worker]

    def env(self) -> dict[str, str]:
        return {**self.spec.env(), "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.devices))}

    def launch(self) -> None:
        self.socket_dir.parent.mkdir(mode=0o700, exist_ok=True)
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        self._proc = launch_group(self.spec.python, self.argv(), self.env(), self.log_path)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        """Its process lives and its ``/health`` answers 200 (every rank holds its weights)."""
        return self.alive() and health_ok(self.health_port)

    async def wait_ready(self, timeout: float) -> None:
        assert self._proc is not None, "launch() first"
        started, deadline = time.monotonic(), time.monotonic() + timeout
        while not await asyncio.to_thread(health_ok, self.health_port):
            if self._proc.poll() is not None:
                raise EngineUnavailable(
                    f"the weight cache on GPUs {self.devices} exited with {self._proc.returncode} during "
                    f"start-up; see {self.log_path}{_last_error(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the weight cache on GPUs {self.devices} was not ready within {timeout:.0f}s; "
                    f"see {self.log_path}"
                )
            await asyncio.sleep(0.2)
        self.ready_s = time.monotonic() - started

    async def stop(self, grace: float = 10.0) -> None:
        if self._proc is not None:
            await stop_group(self._proc, grace)


class GpuWeightCache:
    """The pool's handle on its daemons, one per device group; the same duties as a CPU
    ``WeightOwner`` (start before the workers, health, restart), but it is not replaced after an
    update (`follows_updates`): the module docstring says why."""

    follows_updates = False

    def __init__(
        self,
        spec: WorkerSpec,
        groups: Sequence[tuple[int, ...]],
        log_dir: Path,
        socket_base: str | None = None,
        daemon: type[CacheDaemon] | None = None,
    ) -> None:
        """`daemon`: the class of each group's daemon (`CacheDaemon`; tests give a stand-in)."""
        # AF_UNIX paths are short (~108 bytes): a short private directory, not the log directory
        # (made when a daemon starts, private to this user: vLLM checks the sockets' owner)
        self.base = Path(socket_base or Path(tempfile.gettempdir()) / f"belayer-wc-{uuid.uuid4().hex[:12]}")
        make = daemon or CacheDaemon
        self.daemons = {g: make(spec, g, self.base / "-".join(map(str, g)), log_dir) for g in groups}
        self.version: str | None = None
        self.restarts = 0
        self.ready_s: float | None = None

    def socket_dir(self, devices: tuple[int, ...] | None) -> str:
        """The socket directory a worker on `devices` maps its weights from."""
        if devices not in self.daemons:
            raise KeyError(f"no weight cache on GPUs {devices}: the groups are {sorted(self.daemons)}")
        return str(self.daemons[devices].socket_dir)

    def worker_args(self, devices: tuple[int, ...] | None) -> tuple[str, ...]:
        return loader_args(self.socket_dir(devices))

    def publish(self, version: str) -> None:
        self.version = version

    def unpublish(self) -> None:
        """Nothing is published outside the process: the sockets go with `stop`."""

    def healthy(self) -> bool:
        return all(d.healthy() for d in self.daemons.values())

    def down(self) -> list[tuple[int, ...]]:
        """The device groups whose daemon is not healthy."""
        return [g for g, d in self.daemons.items() if not d.healthy()]

    async def start(self, timeout: float = 600.0) -> None:
        """Launch every daemon at once and wait for all; `EngineUnavailable` names the first failure
        (the others keep running: their groups' workers map them)."""
        started = time.monotonic()
        for d in self.daemons.values():
            d.launch()
        results = await asyncio.gather(
            *(d.wait_ready(timeout) for d in self.daemons.values()), return_exceptions=True
        )
        self.ready_s = time.monotonic() - started
        for outcome in results:
            if isinstance(outcome, BaseException):
                raise outcome

    async def restart(self, timeout: float = 600.0) -> None:
        """Restart the daemons that are down (what is left of each process group is killed first)."""
        down = [self.daemons[g] for g in self.down()]
        for d in down:
            await d.stop(grace=0.0)
        self.restarts += 1
        started = time.monotonic()
        for d in down:
            d.launch()
        await asyncio.gather(*(d.wait_ready(timeout) for d in down))
        self.ready_s = time.monotonic() - started

    async def stop(self) -> None:
        await asyncio.gather(*(d.stop() for d in self.daemons.values()))
        shutil.rmtree(self.base, ignore_errors=True)


def health_ok(port: int) -> bool:
    """Does a daemon's ``/health`` on the loopback answer 200 (within `HEALTH_TIMEOUT`)?"""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HEALTH_TIMEOUT)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _last_error(log_path: Path) -> str:
    """The log's last line naming an error, as ``: <line>``; empty when none (or no log)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), None)
    return f": {found.strip()[-300:]}" if found else ""
