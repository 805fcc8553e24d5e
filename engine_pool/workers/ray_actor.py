"""One engine on a Ray node (``engine_pool.workers.ray_workers`` places them): the Ray actor that runs it there
(`EngineHost`), and the gateway's handle to it (`RayWorker`), which the pool drives as it drives a local
process (``engine_pool.workers.worker.VllmWorker``).

Example::

    worker = launcher.worker(spec, Path("logs"), "worker-0", shadow=False, members=[])  # a RayWorker
    worker.launch()                # the launcher places its actor, which starts the engine
    await worker.wait_ready(300)   # placed, and answering ``/health``
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.net import free_port
from engine_pool.workers.exits import OnExit
from engine_pool.workers.worker import VllmWorker, WorkerSpec, _group_alive, _signal_group

if TYPE_CHECKING:
    from engine_pool.workers.ray_workers import RayLauncher

log = logging.getLogger("belayer.engine_pool.ray")


# -- the actor (runs on a Ray node) -----------------------------------------------------------------------


class EngineHost:
    """The Ray actor that runs one engine server on its node (in the node's Ray worker process).

    ``start`` launches ``python -m engine_pool.workers.reaper <engine argv>`` in a new process group on the
    node's IP and a free port; ``wait`` returns when it exits; ``stop`` ends the whole group. The reaper
    kills the engine's group if this actor's process dies, so a killed actor leaves no engine behind."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, spec: WorkerSpec, log_path: str) -> dict[str, Any]:
        import ray

        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        spec = dataclasses.replace(spec, host=host, port=free_port(host), python=sys.executable)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(
                [spec.python, "-m", "engine_pool.workers.reaper", *spec.argv()], stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, **spec.env()}, start_new_session=True,
            )  # fmt: skip
        node = ray.get_runtime_context().get_node_id()
        return {"host": host, "port": spec.port, "pid": self._proc.pid, "node": node}

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def stop(self, grace: float) -> None:
        if self._proc is None:
            return
        pgid = self._proc.pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _group_alive(pgid) and time.monotonic() < deadline:
            self._proc.poll()
            time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)
        while _group_alive(pgid):
            self._proc.poll()
            time.sleep(0.02)
        self._proc.wait()


# -- the gateway's side -----------------------------------------------------------------------------------


class RayWorker(VllmWorker):
    """A pool member's engine on a Ray node: the `VllmWorker` interface the pool drives (launch,
    wait_ready, alive, stop), over an `EngineHost` actor. Its URL, pid and node are known once Ray
    has placed it."""

    def __init__(
        self, spec: WorkerSpec, log_dir: Path, name: str, launcher: RayLauncher, shadow: bool
    ) -> None:
        super().__init__(spec, log_dir, name)
        self.launcher = launcher
        self.shadow = shadow
        """Launched to be a shadow (placement keeps it off active workers' nodes)."""
        self.node: str | None = None
        self.node_ip: str | None = None
        self.remote_pid: int | None = None
        self.actor: Any = None
        self._exit: Any = None  # the ObjectRef of EngineHost.wait: ready once the engine (or actor) is gone
        self._placing: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def pid(self) -> int | None:
        """The engine's process group on its node (the reaper's pid there)."""
        return self.remote_pid

    @property
    def stopped(self) -> bool:
        """`stop` was called (it leaves placement's count of the pool's workers at once)."""
        return self._stopped

    def launch(self) -> None:
        """Ask Ray for a place and start the engine there; does not wait (`wait_ready` does)."""
        self.started_at = time.time()
        self._placing = asyncio.get_running_loop().create_task(
            self.launcher.place(self), name=f"ray-place-{self.name}"
        )

    def placed(self, info: Mapping[str, Any], actor: Any) -> None:
        self.actor = actor
        self.node, self.node_ip, self.remote_pid = str(info["node"]), str(info["host"]), int(info["pid"])
        self.spec = dataclasses.replace(self.spec, host=self.node_ip, port=int(info["port"]))
        self._exit = actor.wait.remote()

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """Until Ray has placed the worker (as long as that takes: the cluster may be full, or its head
        away), then until ``/health`` answers within `timeout`."""
        if self._placing is None:
            self.launch()
        assert self._placing is not None
        await self._placing
        await self._poll_health(timeout)

    def _start_failure(self) -> str | None:
        if self.alive():
            return None
        return (
            f"{self._where()} exited during start-up; see its log {self.log_path} on that node:\n"
            f"{self.log_tail()}"
        )

    def _where(self) -> str:
        return f"worker {self.name} on Ray node {self.node_ip}"

    def watch(self, on_exit: OnExit) -> bool:
        """Not watched: its processes are on a Ray node (probes and broken connections notice its loss)."""
        return False

    def alive(self) -> bool:
        """Placed, and neither the engine nor its actor has ended (a local check: no call to the head)."""
        if self._exit is None or self._stopped:
            return False
        ready, _ = self.launcher.ray.wait([self._exit], timeout=0)
        return not ready

    async def stop(self, grace: float = 10.0) -> None:
        """End the engine's process group (through its actor), then the actor. An actor that does not
        answer (its node lost) is killed through the head; its node comes last in placement a while."""
        if self._stopped:
            return
        self._stopped = True
        if self._placing is not None and not self._placing.done():
            self._placing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._placing
        if self.actor is None:
            return
        if self._exit is None:  # never started (still waiting for a node): nothing to stop but the actor
            await self.launcher.kill(self.actor)
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.actor.stop.remote(grace).future()), grace + 3.0)
        except Exception as e:  # the actor is gone, or unreachable: its node may be lost
            log.warning(
                "worker %s: its actor on node %s did not stop the engine (%r)", self.name, self.node_ip, e
            )
            if self.node is not None:
                self.launcher.suspect(self.node)
        await self.launcher.kill(self.actor)
