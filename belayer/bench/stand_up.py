"""What several benches repeat to stand things up: the tiny model, SIGTERM as Ctrl-C (so that the
servers are stopped on the way out), a ``belayer serve`` process and its start, and the key its launched
workers ask (`WorkerKey`), for a bench that calls a worker itself. (The streamed-throughput comparison of
gateways in front of one fake engine is `belayer.bench.gateway.streaming_rates`.)

Example::

    interrupt_on_sigterm()
    ensure_model(opts.model)
    services: list[Service] = []
    key = WorkerKey()  # only for a bench that calls the workers themselves
    with running(services):
        gw = serve_service(workdir, "pool", opts.model, ["--workers", "2"], env=key.env())
        start(services, gw, timeout=900)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from belayer.testing.services import Service, progress
from core.net import free_port
from core.worker_auth import new_worker_key
from gateway.config import ENV_NESTING, ENV_PREFIX

if TYPE_CHECKING:
    from belayer.testing.postgres_local import PostgresServer


WORKER_KEY_ENV = f"{ENV_PREFIX}LAUNCH{ENV_NESTING}WORKER_API_KEY"
"""Where a ``belayer serve`` process reads ``launch.worker_api_key``, the key its launched workers ask."""


@dataclass(frozen=True, slots=True)
class WorkerKey:
    """The key a bench gives the gateway it starts for that gateway's launched workers (`core.worker_auth`),
    held to call a worker itself (a cold start's first request, a warm-up, a prefill): a launched worker
    answers 401 without it on every route but ``GET /health`` and ``GET /metrics``. Given through the
    environment (`env`), never a flag, which every local user sees in ``ps``.

    Example::

        key = WorkerKey()
        gw = serve_service(workdir, "pool", model, ["--workers", "2"], env=key.env())
        await http.post(f"{worker_url}/v1/completions", json=body, headers=key.headers)
    """

    value: str = field(default_factory=new_worker_key, repr=False)

    def env(self) -> dict[str, str | None]:
        """The gateway process's environment for it (`serve_service`'s ``env``)."""
        return {WORKER_KEY_ENV: self.value}

    @property
    def headers(self) -> dict[str, str]:
        """What a request to one of the gateway's workers sends."""
        return {"authorization": f"Bearer {self.value}"}


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # so that SIGTERM, like Ctrl-C, stops the servers on the way out


def interrupt_on_sigterm() -> Callable[[int, FrameType | None], object] | int | None:
    """SIGTERM raises KeyboardInterrupt from now on, as Ctrl-C does; the handler it replaced."""
    return signal.signal(signal.SIGTERM, raise_interrupt)


def ensure_model(model_dir: str) -> None:
    """The tiny model in `model_dir`, built (by ``belayer model build-tiny``) unless it is there."""
    if not (Path(model_dir) / "tokenizer.json").exists():
        progress(f"building the tiny model in {model_dir}")
        build = [sys.executable, "-m", "belayer.cli", "model", "build-tiny", model_dir]
        subprocess.run(build, check=True, stdout=sys.stderr)


def bench_workdir(directory: str | None, prefix: str) -> Path:
    """Where a bench's stores and logs go: `directory` (its ``--dir``, made if missing), else a new
    temporary directory named with `prefix`."""
    workdir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


@contextlib.contextmanager
def optional_postgres(wanted: bool) -> Iterator[PostgresServer | None]:
    """A throwaway PostgreSQL server when `wanted` (its binaries are needed only then), else None."""
    if not wanted:
        yield None
        return
    from belayer.testing.postgres_local import postgres_server

    with postgres_server() as server:
        yield server


def serve_service(
    workdir: Path,
    name: str,
    model: str,
    extra: list[str],
    *,
    port: int | None = None,
    store: str | None = None,
    log_dir: Path | None = None,
    env: dict[str, str | None] | None = None,
) -> Service:
    """``belayer serve`` on `port` (a free one by default) with `extra` flags, logging warnings only
    (and its workers' logs in `log_dir`, given one): its own SQLite file in `workdir` (named after it),
    or `store`."""
    port = port or free_port()
    argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", model, "--port", str(port)]
    argv += ["--store", store or str(workdir / f"{name}.db"), "--log-level", "WARNING", *extra]
    argv += ["--log-dir", str(log_dir)] if log_dir is not None else []
    return Service(name, argv, f"http://127.0.0.1:{port}/health", workdir / f"{name}.log", env or {})


def start(services: list[Service], *new: Service, timeout: float) -> None:
    """Start each of `new` (recorded in `services`, which `running` stops), then wait until all are ready."""
    for service in new:
        services.append(service)
        service.start()
    for service in new:
        service.wait_ready(timeout)
