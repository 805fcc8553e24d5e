"""Throwaway Docker engines on this one machine, each standing for one node of a cluster: for the tests of
sandboxes across a Ray cluster (marker ``sandbox_cluster``), next to `belayer.testing.ray_local`.

Each `LocalDockerEngine` is a ``dockerd --experimental`` of its own, in its own session, with

- its own data-root (``<workdir>/data``: images, containers, their layers), pidfile, ``daemon.json`` and
  log (``<workdir>/dockerd.log``);
- its own exec-root under /run (``/run/belayer-<name>-<tag>``, short: containerd's sockets live in it and a
  unix socket path has at most 108 bytes) and its API socket next to it (``….sock``); the tag comes from
  the workdir, so two test sessions (two checkouts) never share one;
- its own containerd, which dockerd starts under that exec-root (``<exec-root>/containerd/containerd.sock``);
  containerd's shims name that address on their command line (``-address``);
- a default bridge of its own (`LocalDockerEngine.bridge`, made before dockerd starts and removed by
  `stop`), and no iptables rules and no masquerading (``--iptables=false --ip-masq=false``): it leaves
  the machine's main engine's docker0 and firewall chains alone. (``--bridge=none`` would not: dockerd
  then deletes the machine's docker0.) Its sandboxes use network ``none`` (`SandboxSpec`'s default).

A process belongs to an engine when it is a dockerd, containerd or containerd shim whose command line
names the engine's exec-root, or when it descends from such a process (the containers' processes, under
their shims). Shims are re-parented away from dockerd (to init), so a walk down from dockerd alone misses
them and everything inside the containers.

`LocalDockerEngine.kill` is a lost machine: every process of the engine, stopped (SIGSTOP, so none forks
or reaps in between) and then SIGKILLed at once. What a killed engine leaves is left (its mounts: the
data-root's bind mount, the containers' layers, their network namespaces; containerd's task state and
pidfiles), as a lost machine's disk would be, except the dead shims' sockets, which containerd keeps in a
directory every engine shares. `LocalDockerEngine.restart` starts dockerd again on the same data-root: it
cleans up after the killed one itself and finds its containers' tasks gone, so they come back existing
but not running, and `restart` checks that none runs. `LocalDockerEngine.stop` undoes the mounts and
removes the exec-root. Nothing here touches another engine's processes, mounts or files.

Example::

    with local_docker_engines(["b", "c"], Path("/tmp/engines")) as (b, c):
        ensure_busybox(b)                 # 'belayer-sandbox-busybox'
        backend = DockerSandboxBackend(b.backend_config())
        b.kill()                          # dockerd, containerd, shims and containers: SIGKILLed
        b.restart()
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import ensure_busybox_image

RUN_DIR = Path("/run")
SHIM_SOCKETS = Path("/run/containerd/s")


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over the engine's unix socket (the standard library's client, pointed at a path)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def read_procs() -> dict[int, tuple[int, bool, list[str]]]:
    """Every process now: pid → (parent pid, alive (not a zombie), command line)."""
    procs: dict[int, tuple[int, bool, list[str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError):
            continue  # gone meanwhile
        procs[int(entry)] = (int(fields[1]), fields[0] != "Z", [a for a in argv if a])
    return procs


def alive(pid: int) -> bool:
    """`pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@dataclass(slots=True)
class LocalDockerEngine:
    """One throwaway dockerd (module docstring); `start` it, then reach it at `url`."""

    name: str
    workdir: Path
    start_timeout: float = 60.0
    stop_timeout: float = 30.0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ where things are
    @property
    def exec_root(self) -> Path:
        tag = hashlib.sha1(str(self.workdir.resolve()).encode()).hexdigest()[:8]
        return RUN_DIR / f"belayer-{self.name}-{tag}"

    @property
    def bridge(self) -> str:
        """The engine's own default bridge (made by `start`): with ``--bridge=none`` dockerd would delete
        the machine's ``docker0``, which the main engine's containers need."""
        return f"bel-{self.name[:3]}-{self.exec_root.name[-6:]}"

    @property
    def socket_path(self) -> Path:
        return self.exec_root.with_name(self.exec_root.name + ".sock")

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def data_root(self) -> Path:
        return self.workdir / "data"

    @property
    def log(self) -> Path:
        return self.workdir / "dockerd.log"

    @property
    def containerd_address(self) -> str:
        return str(self.exec_root / "containerd" / "containerd.sock")

    def backend_config(self, **overrides: Any) -> DockerBackendConfig:
        """A `DockerSandboxBackend` configuration for this engine (checkpoints under the workdir)."""
        return DockerBackendConfig(
            **{"base_url": self.url, "checkpoint_dir": self.workdir / "checkpoints", **overrides}
        )

    # ------------------------------------------------------------------ lifecycle
    def argv(self) -> list[str]:
        return [
            "dockerd", "--experimental", "-H", self.url,
            "--data-root", str(self.data_root), "--exec-root", str(self.exec_root),
            "--pidfile", str(self.workdir / "dockerd.pid"), "--config-file", str(self.workdir / "daemon.json"),
            "--iptables=false", "--ip-masq=false", "--bridge", self.bridge,
            # networks it makes (the gateway network) from a range of its own: engines on one machine
            # must not give two bridges one subnet
            "--default-address-pool", f"base=10.215.{self.subnet}.0/24,size=28",
        ]  # fmt: skip

    @property
    def subnet(self) -> int:
        """This engine's third octet: its bridge is 10.213.N.1/24, its networks are cut from 10.215.N.0/24.
        Engines of one set (one workdir) named by neighbouring letters (b, c) get neighbouring numbers."""
        base = int(hashlib.sha1(str(self.workdir.resolve().parent).encode()).hexdigest(), 16) % 120 * 2
        return base + sum(map(ord, self.name)) % 2 + 1

    def _make_bridge(self) -> None:
        """The engine's bridge, if missing: a Linux bridge with an address of its own (10.213.N.1/24)."""
        if Path(f"/sys/class/net/{self.bridge}").exists():
            return
        for argv in (
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"10.213.{self.subnet}.1/24", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ):
            subprocess.run(argv, check=True, capture_output=True)

    def start(self) -> None:
        """Start dockerd and wait until it answers (its log's tail in the error if it does not)."""
        if self.running():
            raise RuntimeError(f"docker engine {self.name} is already running (pid {self.proc_pid()})")
        if self.answers():
            raise RuntimeError(f"another engine already answers on {self.socket_path}")
        if shutil.which("dockerd") is None:
            raise RuntimeError("dockerd is not installed (deploy/host/setup_sandbox_host.sh install)")
        if leftovers := self.pids():
            raise RuntimeError(f"processes of an earlier engine {self.name} still run: {leftovers}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A killed engine leaves its pidfiles. dockerd refuses to start while the pid in its own is alive,
        # and takes containerd's for a containerd still running (it waits for it, then gives up); `kill -0`
        # answers for a zombie not reaped yet, and by now either pid may be another process's.
        (self.workdir / "dockerd.pid").unlink(missing_ok=True)
        (self.exec_root / "containerd" / "containerd.pid").unlink(missing_ok=True)
        (self.workdir / "daemon.json").write_text("{}\n")  # not the machine's /etc/docker/daemon.json
        self._make_bridge()
        # Its networks, forgotten: a dockerd that finds its default network from a run before deletes it
        # again, and with it the machine's docker0 (not its own bridge), which the main engine needs.
        # Networks it needs (the gateway network) are made again on demand.
        (self.data_root / "network" / "files" / "local-kv.db").unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.workdir,
            )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        while not self.answers():
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                self._reap_leftovers()
                raise RuntimeError(f"dockerd {self.name} exited with {code}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"dockerd {self.name} did not answer within {self.start_timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def kill(self) -> list[int]:
        """A lost machine: every process of the engine (dockerd, containerd, shims, the containers'
        processes) SIGKILLed at once, and waited for (until none runs); their pids. The engine's files
        and mounts stay as they are."""
        stopped: list[int] = []
        while True:  # stop them all first: a stopped process neither forks nor reaps
            new = [pid for pid in self.pids() if pid not in stopped]
            if not new:
                break
            for pid in new:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped += new
        sockets = self._shim_sockets(stopped)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
            self.proc = None
        self._wait_gone(stopped, "SIGKILL")
        for path in sockets:  # in containerd's directory that every engine's shims share: nobody else's
            path.unlink(missing_ok=True)
        return stopped

    def restart(self) -> None:
        """Start again on the same data-root (stopped first if running); the containers from before are
        there, and none may be running."""
        if self.running():
            self.stop()
        self.start()
        running = [name for name, state in self.container_states().items() if state == "running"]
        if running:
            raise RuntimeError(f"docker engine {self.name} restarted with containers running: {running}")

    def stop(self) -> None:
        """Gracefully: the containers killed through the API (a sandbox's PID 1 ignores SIGTERM, which
        would cost dockerd's 10 s per container), dockerd SIGTERMed and waited for, then whatever is left
        of the engine SIGKILLed. Its mounts are undone and its exec-root and socket removed; the data-root
        stays (the caller owns the workdir)."""
        if self.proc is not None:
            with contextlib.suppress(OSError, http.client.HTTPException):
                for name, state in self.container_states().items():
                    if state == "running":
                        self._call("POST", f"/containers/{name}/kill")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.stop_timeout)
        self.kill()  # leftovers (or all of it, if dockerd did not stop in time)
        self._reap_leftovers()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    # ------------------------------------------------------------------ looking at it
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def proc_pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def owns(self, argv: list[str]) -> bool:
        """Whether a command line is this engine's dockerd, containerd or one of its shims: the program
        is one of those, and an argument names the engine's exec-root."""
        root = str(self.exec_root)
        program = os.path.basename(argv[0]) if argv else ""
        if program not in ("dockerd", "containerd") and not program.startswith("containerd-shim"):
            return False
        return any(arg == root or arg.startswith(root + "/") for arg in argv)

    def pids(self) -> list[int]:
        """Every live process of this engine now (module docstring), parents first."""
        procs = read_procs()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        roots = [pid for pid, (_, _, argv) in procs.items() if self.owns(argv)]
        if self.proc is not None and self.proc.pid in procs and self.proc.pid not in roots:
            roots.insert(0, self.proc.pid)
        found: list[int] = []
        queue = sorted(roots)
        while queue:
            pid = queue.pop(0)
            if pid not in found:
                found.append(pid)
                queue += children.get(pid, [])
        return [pid for pid in found if procs[pid][1]]

    def answers(self) -> bool:
        """Whether an engine answers ``/_ping`` on this engine's socket."""
        try:
            status, body = self._call("GET", "/_ping", timeout=2.0)
        except (OSError, http.client.HTTPException):
            return False
        return status == 200 and body == b"OK"

    def container_states(self) -> dict[str, str]:
        """Every container of the engine, running or not: name → state (``running``, ``exited``, …)."""
        status, body = self._call("GET", "/containers/json?all=1")
        if status != 200:
            raise RuntimeError(
                f"docker engine {self.name}: listing containers answered {status}: {body[:500]!r}"
            )
        return {c["Names"][0].lstrip("/"): c["State"] for c in json.loads(body)}

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ helpers
    def _call(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = _UnixHTTPConnection(str(self.socket_path), timeout)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _shim_sockets(self, pids: list[int]) -> list[Path]:
        """The sockets of this engine's shims among `pids`. containerd 1.6 puts every shim's socket in
        /run/containerd/s (whatever its state dir), named by a hash of the containerd address, namespace
        and container id; a shim removes it when it exits, but a SIGKILLed one leaves it there."""
        procs = read_procs()
        sockets = []
        for pid in pids:
            argv = procs.get(pid, (0, False, []))[2]
            if not argv or not os.path.basename(argv[0]).startswith("containerd-shim") or not self.owns(argv):
                continue
            flags = dict(itertools.pairwise(argv))
            key = os.path.join(
                flags.get("-address", ""), flags.get("-namespace", "moby"), flags.get("-id", "")
            )
            sockets.append(SHIM_SOCKETS / hashlib.sha256(key.encode()).hexdigest())
        return sockets

    def _wait_gone(self, pids: list[int], what: str) -> None:
        """Until none of `pids` runs. Zombies count as gone: init reaps the orphans (containerd, the shims,
        the containers' processes) when it gets to it, about 1.2 s later on this machine's init."""
        deadline = time.monotonic() + self.stop_timeout
        while left := [pid for pid in pids if alive(pid)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"docker engine {self.name}: pids {left} outlived {what}")
            time.sleep(0.02)

    def _mounts(self) -> list[str]:
        """This engine's mount points (its data-root's bind mount, layers, shm, network namespaces)."""
        mine = (str(self.data_root), str(self.exec_root))
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        return [p for p in points if any(p == root or p.startswith(root + "/") for root in mine)]

    def _reap_leftovers(self) -> None:
        """Undo the mounts dockerd left (a killed one leaves all of them; a stopped one its data-root's
        bind mount) and remove the exec-root and socket: /run is not a temporary directory."""
        for _ in range(10):  # stacked mounts come off one layer at a time
            points = self._mounts()
            if not points:
                break
            for point in sorted(set(points), key=len, reverse=True):
                subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
        if points := self._mounts():
            raise RuntimeError(f"docker engine {self.name}: could not unmount {points}")
        shutil.rmtree(self.exec_root, ignore_errors=True)
        self.socket_path.unlink(missing_ok=True)


@contextlib.contextmanager
def local_docker_engines(names: Sequence[str], workdir: Path) -> Iterator[list[LocalDockerEngine]]:
    """Engines `names`, each in ``workdir/<name>``, started; all stopped afterwards."""
    engines = [LocalDockerEngine(name, workdir / name) for name in names]
    with contextlib.ExitStack() as stack:  # every engine stopped, even when another's stop fails
        for engine in engines:
            stack.callback(engine.stop)
            engine.start()
        yield engines


def ensure_busybox(engine: LocalDockerEngine) -> str:
    """The busybox sandbox image on `engine` (imported unless it is there); its name."""
    with DockerSandboxBackend(engine.backend_config()) as backend:
        return ensure_busybox_image(backend)
