"""A throwaway Ray cluster of several nodes on this one machine: for the tests (marker ``ray``, one
cluster per test session) and ``belayer bench recovery --ray``.

Each node is a ``ray start --block`` of its own, in its own process group, on its own loopback address
(127.0.0.2, .3, ...: with 127.0.0.1 Ray swaps in the machine's interface address), with a custom
resource named after it (``{"node_b": 1}``) that tests can steer by, and any others it is given
(`RayNode.resources`, e.g. ``{"belayer_sandbox_slots": 8}``). ``--block`` keeps ``ray start`` in the
foreground as the parent of the node's daemons (raylet, agents; on the head the GCS too), and the node's
workers (actors) descend from its raylet: so a node's processes are the process tree under the pid
recorded here. `LocalRayCluster.kill_node` SIGKILLs that whole tree at once (a machine lost), and
`restart_node` brings the node back on the same address. Nothing here runs ``ray stop``: that kills
every Ray process on the machine by name.

Example::

    with local_ray_cluster(["a", "b", "c"], Path("/tmp/rc")) as cluster:
        cluster.address          # '127.0.0.2:PORT': give it to `belayer serve --ray`
        cluster.kill_node("c")   # every process of node c, SIGKILLed
        cluster.restart_node("c")
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.net import free_port

# Ray's GCS marks a node dead after health_check_failure_threshold missed checks, one every
# health_check_period_ms (3 s x 5 by default): shorter here, so a lost node is noticed in ~3 s.
QUERY_MARK = "belayer-ray-query: "
"""Marks the answer line of a `LocalRayCluster.query` among what Ray prints."""
NODE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_enable_worker_prestart": "0",  # no idle Python workers started ahead on a 2-core machine
}


def ray_executable() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass(slots=True)
class RayNode:
    name: str
    ip: str
    cpus: int
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources the node declares besides `resource` (e.g. ``{"belayer_sandbox_slots": 8}``)."""

    @property
    def resource(self) -> str:
        return f"node_{self.name}"


def process_tree(root: int) -> list[int]:
    """`root` and every process descending from it (read from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue += children.get(pid, [])
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass(slots=True)
class LocalRayCluster:
    """Nodes ``a``, ``b``, ... on 127.0.0.2, .3, ...; the first is the head."""

    workdir: Path
    nodes: list[RayNode] = field(default_factory=list)
    port: int = 0
    start_timeout: float = 120.0

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{self.port}"

    def node(self, name: str) -> RayNode:
        return next(n for n in self.nodes if n.name == name)

    def _argv(self, node: RayNode) -> list[str]:
        argv = [ray_executable(), "start", "--block", "--node-ip-address", node.ip,
                "--num-cpus", str(node.cpus), "--resources", json.dumps({node.resource: 1, **node.resources}),
                "--disable-usage-stats"]  # fmt: skip
        if node is self.head:
            return [*argv, "--head", "--port", str(self.port), "--include-dashboard", "false",
                    "--temp-dir", str(self.workdir / "ray")]  # fmt: skip
        return [*argv, "--address", self.address]

    def start_node(self, node: RayNode) -> None:
        """Start `node` and wait until the cluster lists it alive."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        node.log = self.workdir / f"node-{node.name}.log"
        with open(node.log, "ab") as log:
            node.proc = subprocess.Popen(
                self._argv(node), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **NODE_ENV}, cwd=self.workdir,
            )  # fmt: skip
        self.wait_nodes({n.ip for n in self.nodes if n.proc is not None})

    def query(self, expression: str) -> object:
        """`expression` (JSON-able; ``ray`` and ``state`` = ``ray._private.state`` in scope) evaluated by
        a short-lived driver of the cluster, in a process of its own (the caller never imports Ray)."""
        code = (
            "import json, ray, ray._private.state as state;"
            f"ray.init(address={self.address!r}, _node_ip_address={self.head.ip!r}, "
            "log_to_driver=False, configure_logging=False);"
            f"print({QUERY_MARK!r} + json.dumps({expression}), flush=True)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=60,
            env={**os.environ, **NODE_ENV}, cwd=self.workdir,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"query {expression!r} failed: {out.stderr.decode(errors='replace')[-2000:]}")
        # Ray writes warnings of its own to stdout too ("raylet has lagging heartbeats ..."), before or
        # after the answer: the answer is the marked line.
        answers = [line for line in out.stdout.decode().splitlines() if line.startswith(QUERY_MARK)]
        if not answers:
            raise RuntimeError(f"query {expression!r} printed no answer: {out.stdout.decode()[-2000:]!r}")
        return json.loads(answers[-1].removeprefix(QUERY_MARK))

    def alive_node_ips(self) -> set[str]:
        """The addresses of the nodes the GCS lists alive."""
        try:
            ips = self.query("[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]")
        except (RuntimeError, subprocess.TimeoutExpired):
            return set()
        assert isinstance(ips, list)
        return {str(ip) for ip in ips}

    def live_actors(self) -> list[str]:
        """The names (or ids) of the cluster's actors that are not dead."""
        names = self.query(
            "[a.get('Name') or a['ActorID'] for a in state.actors().values() if a['State'] != 'DEAD']"
        )
        assert isinstance(names, list)
        return [str(n) for n in names]

    def wait_nodes(self, ips: set[str]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            for node in self.nodes:
                if node.proc is not None and node.proc.poll() is not None:
                    tail = node.log.read_text(errors="replace")[-3000:] if node.log else ""
                    raise RuntimeError(f"ray node {node.name} exited with {node.proc.returncode}:\n{tail}")
            if self.alive_node_ips() == ips:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray cluster did not list nodes {sorted(ips)} within {self.start_timeout:.0f}s"
                )
            time.sleep(0.5)

    def pids(self, name: str) -> list[int]:
        """Every process of node `name` now: its ``ray start`` and all its descendants."""
        node = self.node(name)
        return [] if node.proc is None else process_tree(node.proc.pid)

    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of node `name` at once (the tree under its recorded pid); the pids."""
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node = self.node(name)
        if node.proc is not None:
            node.proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        node.proc = None
        return pids

    def restart_node(self, name: str) -> None:
        self.start_node(self.node(name))

    def stop(self) -> None:
        """Non-head nodes first, then the head: SIGTERM each tree (``ray start --block`` stops its
        daemons), SIGKILL what is left after a grace period."""
        for node in [*self.nodes[1:], self.head]:
            if node.proc is None:
                continue
            pids = process_tree(node.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while any(_alive(p) for p in pids) and time.monotonic() < deadline:
                node.proc.poll()
                time.sleep(0.1)
            for pid in process_tree(node.proc.pid) + pids:
                if _alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            node.proc.wait()
            node.proc = None


@contextlib.contextmanager
def local_ray_cluster(
    names: Sequence[str],
    workdir: Path,
    cpus: int = 2,
    first_ip: int = 2,
    resources: Mapping[str, Mapping[str, float]] | None = None,
) -> Iterator[LocalRayCluster]:
    """Nodes `names` (the first is the head), each with `cpus` CPUs, on 127.0.0.`first_ip` and up; a node
    named in `resources` declares those custom resources too (``{"b": {"belayer_sandbox_slots": 8}}``)."""
    extra = resources or {}
    nodes = [
        RayNode(n, f"127.0.0.{first_ip + i}", cpus, resources=dict(extra.get(n, {})))
        for i, n in enumerate(names)
    ]
    cluster = LocalRayCluster(workdir, nodes, free_port())
    try:
        for node in cluster.nodes:
            cluster.start_node(node)
        yield cluster
    finally:
        cluster.stop()
