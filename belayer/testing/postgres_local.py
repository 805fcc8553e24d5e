"""A throwaway PostgreSQL server: for the tests (marker ``postgres``, one per test session) and for
``belayer bench store --postgres auto``.

Debian's ``postgresql`` package (``deploy/host/setup_postgres.sh install``) gives ``initdb`` and
``postgres``; the server is initialised in a temporary directory and run as an unprivileged user
(``nobody`` when this runs as root: PostgreSQL refuses to run as root), listening on 127.0.0.1 and a
free port. With ``durable=False`` (the tests: they kill gateways, never the server) it runs without
fsync. It is stopped by its PID, and its directory removed. `PostgresServer.new_database` gives each
user a database of its own.

Example::

    with postgres_server() as server:
        store = PostgresStore(server.new_database())
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg

from core.net import free_port


def _bindir() -> Path:
    """The newest installed PostgreSQL's binaries."""
    dirs = sorted(
        (d for d in glob.glob("/usr/lib/postgresql/*/bin") if os.access(f"{d}/initdb", os.X_OK)),
        key=lambda d: int(d.split("/")[-2]),
    )
    if not dirs:
        raise RuntimeError(
            "PostgreSQL's server binaries are missing: run 'sudo deploy/host/setup_postgres.sh install'"
        )
    return Path(dirs[-1])


@dataclass(frozen=True, slots=True)
class PostgresServer:
    url: str
    """The superuser's URL of the ``postgres`` database."""
    proc: subprocess.Popen[bytes]
    data_dir: Path

    def new_database(self) -> str:
        """A new, empty database; its URL."""
        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"


@contextlib.contextmanager
def postgres_server(timeout: float = 60.0, durable: bool = False) -> Iterator[PostgresServer]:
    bindir = _bindir()
    root = Path(tempfile.mkdtemp(prefix="belayer-pg-"))
    data, log = root / "data", root / "server.log"
    user = "nobody" if os.geteuid() == 0 else None
    if user is not None:
        uid, gid = pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid
        os.chown(root, uid, gid)
    run_as = {"user": user, "group": gid} if user is not None else {}
    subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
         "--locale=C", "--no-sync"],
        check=True, capture_output=True, cwd=root, **run_as,  # type: ignore[call-overload]
    )  # fmt: skip
    port = free_port()
    fast = (
        [] if durable else ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
    )
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(root),
             "-c", "listen_addresses=127.0.0.1", "-c", "max_connections=300", *fast],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
            **run_as,  # type: ignore[call-overload]
        )  # fmt: skip
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    server = PostgresServer(url, proc, data)
    try:
        _wait_ready(server, timeout, log)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(server: PostgresServer, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {server.proc.returncode}: {log.read_text()[-2000:]}")
        try:
            psycopg.connect(server.url, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"postgres not ready after {timeout:.0f} s: {log.read_text()[-2000:]}"
                ) from None
            time.sleep(0.1)  # the server is starting: poll it


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT) of the postmaster by its PID; SIGKILL of its group after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def database_url(url: str) -> Iterator[str]:
    """`url`, or (``auto``) a new database on a throwaway local server, durable like a real one (the
    benchmarks' ``--postgres``/``--store`` option)."""
    if url != "auto":
        yield url
        return
    with postgres_server(durable=True) as server:
        yield server.new_database()
