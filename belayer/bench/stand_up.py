"""What several benches repeat to stand things up: the tiny model, SIGTERM as Ctrl-C (so that the
servers are stopped on the way out), a ``belayer serve`` process and its start. (The streamed-throughput
comparison of gateways in front of one fake engine is `belayer.bench.gateway.streaming_rates`.)

Example::

    interrupt_on_sigterm()
    ensure_model(opts.model)
    services: list[Service] = []
    with running(services):
        start(services, serve_service(workdir, "pool", opts.model, ["--workers", "2"]), timeout=900)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from belayer.testing.services import Service, progress
from core.net import free_port

if TYPE_CHECKING:
    from belayer.testing.postgres_local import PostgresServer


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
