"""The Docker backend's containers: how a sandbox's container is made, isolated, started, looked at and
removed, and the disk quota its writable layer gets where the storage driver takes one.

Every container (sandboxes, the verify stage's, task-image builds) gets the same isolation
(`Containers.host_config`): capabilities dropped, no-new-privileges, memory, process and CPU limits,
IPv6 off (`NO_IPV6`; the gateway network's firewall is IPv4's), and
`DockerBackendConfig.disk_quota_bytes` as ``--storage-opt size`` where the storage driver takes one
(`DiskQuota` asks once).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import docker.errors

from core.errors import SandboxError
from sandbox import supervisor
from sandbox.backend import Sandbox, SandboxSpec, SandboxStatus
from sandbox.docker_backend.engine import SPEC_LABEL, DockerEngine, docker_errors, raise_for_status
from sandbox.docker_backend.network import GATEWAY_HOST, DockerNetwork

NO_IPV6 = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
"""Every sandbox's sysctls, on a kernel with IPv6: no address, not even a link-local one, by which a
sandbox could reach the host's services past the gateway network's IPv4 firewall."""


class DiskQuota:
    """Whether the storage driver enforces `DockerBackendConfig.disk_quota_bytes`, asked once."""

    def __init__(self, engine: DockerEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._answer: tuple[bool, str] | None = None

    @property
    def limit(self) -> int | None:
        return self._engine.config.disk_quota_bytes

    def storage_opt(self) -> dict[str, str] | None:
        """The ``--storage-opt`` a container gets: the quota where it is enforced, else none."""
        quota = self.limit
        return {"size": str(quota)} if quota is not None and self.answer()[0] else None

    def answer(self) -> tuple[bool, str]:
        """Whether the quota is enforced, and why (or why not). ``docker info`` names the driver and its
        backing file system; overlay2 takes a size only over xfs mounted with project quotas, which only
        trying tells, so one container is created with the option from an image at hand (never started)
        and removed. An answer that may change (no image to probe with yet) is asked again next time."""
        with self._lock:
            if self._answer is not None:
                return self._answer
        answer, final = self._probe()
        if final:
            with self._lock:
                self._answer = answer
        return answer

    def _probe(self) -> tuple[tuple[bool, str], bool]:
        if self.limit is None:
            return (False, "no disk quota is configured"), True
        api = self._engine.api
        with docker_errors():
            info = api.info()
            images = api.images(quiet=True)
        driver = str(info.get("Driver", "?"))
        status = {str(k): str(v) for k, v in info.get("DriverStatus") or []}
        backing = status.get("Backing Filesystem", "")
        where = f"storage driver {driver}" + (f" on {backing}" if backing else "")
        if driver == "overlay2" and backing != "xfs":
            return (False, f"{where}: overlay2 takes a size only over xfs with project quotas"), True
        if driver not in ("overlay2", "devicemapper", "btrfs", "zfs"):
            return (False, f"{where}: this driver takes no size"), True
        if not images:
            return (False, f"{where}: not probed yet (no image to probe with)"), False
        try:
            with docker_errors():
                host = api.create_host_config(storage_opt={"size": str(self.limit)})
                probe = api.create_container(
                    images[0], command=["true"], labels={"belayer": "quota-probe"}, host_config=host
                )
                api.remove_container(probe["Id"], force=True)
        except SandboxError as exc:
            return (False, f"{where}: the engine refused a size ({str(exc)[:300]})"), True
        return (True, f"{where}: each sandbox's writable layer is limited"), True


class Containers:
    """Sandbox containers: created with the supervisor as PID 1 and the sandbox's isolation; inspected
    from outside (state, processes, changes); removed."""

    def __init__(self, engine: DockerEngine, network: DockerNetwork, quota: DiskQuota) -> None:
        self._engine = engine
        self._api = engine.api
        self._network = network
        self._quota = quota
        # a sandbox has no IPv6: the gateway network's firewall is IPv4's (`docker_backend.network`). A
        # kernel without IPv6 has no such sysctl (and no IPv6 to turn off): runc would refuse to set it
        self._sysctls = NO_IPV6 if os.path.exists("/proc/sys/net/ipv6") else None

    # ------------------------------------------------------------------ making and removing
    def create_for(self, spec: SandboxSpec) -> str:
        """A new sandbox's container from `spec.image` (created, not started); its name."""
        name = self._engine.new_name()
        with docker_errors():
            image_env = self._engine.inspect_image(spec.image)["Config"].get("Env") or []
            env = [*image_env, *(f"{k}={v}" for k, v in spec.env.items())]
            self.create(name, spec, spec.image, env)
        return name

    def start(self, name: str, spec: SandboxSpec, bundle: bytes) -> None:
        """Put the supervisor `bundle` in and start the container (the supervisor is PID 1)."""
        with docker_errors():
            self._api.put_archive(name, "/", bundle)  # before start: the supervisor is PID 1
            self._api.start(name)
        self._engine.remember(name, spec)

    def create(self, name: str, spec: SandboxSpec, image: str, env: list[str]) -> str:
        """Create container `name` from `image` (Docker errors untranslated); its id."""
        created = self._api.create_container(
            image,
            name=name,
            entrypoint=[supervisor.BUSYBOX, "sh", supervisor.SUPERVISOR, spec.workdir],
            environment=env,
            user="0:0",
            working_dir="/",
            labels={**spec.labels, SPEC_LABEL: spec.model_dump_json()},
            host_config=self.host_config(spec),
        )
        return str(created["Id"])

    def host_config(self, spec: SandboxSpec) -> dict[str, Any]:
        """A sandbox's isolation: `spec`'s network, capabilities and limits, and the disk quota."""
        extra_hosts = None
        if spec.network == "gateway":  # the gateway by name: on a cluster, each node's own address
            extra_hosts = {GATEWAY_HOST: self._network.ensure()}
        config = self._engine.config
        network_mode = {"none": "none", "full": "bridge", "gateway": config.gateway_network}
        host_config: dict[str, Any] = self._api.create_host_config(
            network_mode=network_mode[spec.network],
            cap_drop=["ALL"],
            cap_add=list(spec.cap_add) or None,
            security_opt=["no-new-privileges"],
            mem_limit=spec.memory_bytes,
            memswap_limit=spec.memory_bytes,
            pids_limit=spec.pids_limit,
            nano_cpus=int(spec.cpus * 1e9),
            storage_opt=self._quota.storage_opt(),
            extra_hosts=extra_hosts,
            sysctls=self._sysctls,
        )
        return host_config

    def remove(self, sandbox_id: str) -> str:
        """Remove the container and its volumes (Docker errors untranslated); the image it ran ("" when
        the container was already gone)."""
        try:
            image = str(self._api.inspect_container(sandbox_id)["Config"]["Image"])
        except docker.errors.NotFound:
            image = ""
        self._api.remove_container(sandbox_id, force=True, v=True)
        return image

    def kill(self, sandbox_id: str) -> None:
        with docker_errors():
            self._api.kill(sandbox_id)

    # ------------------------------------------------------------------ looking from outside
    def status(self, sandbox_id: str) -> SandboxStatus:
        with docker_errors():
            state = self._api.inspect_container(sandbox_id)["State"]
        if state.get("Running"):
            return SandboxStatus(running=True)
        detail = f"container {state.get('Status', 'stopped')}, exit code {state.get('ExitCode')}"
        if state.get("OOMKilled"):
            detail += ", killed for running out of memory (raise memory_mb)"
        if state.get("Error"):
            detail += f": {state['Error']}"
        return SandboxStatus(
            running=False, exit_code=state.get("ExitCode"), oom_killed=bool(state.get("OOMKilled")),
            detail=detail,
        )  # fmt: skip

    def find(self, labels: Mapping[str, str]) -> list[Sandbox]:
        """Belayer's containers (they carry the spec label) with every one of `labels`, running or not."""
        filters = {"label": [SPEC_LABEL, *(f"{k}={v}" for k, v in labels.items())]}
        with docker_errors():
            found = self._api.containers(all=True, filters=filters)
        boxes = []
        for container in found:
            names = [str(n).lstrip("/") for n in container.get("Names") or []]
            own = (container.get("Labels") or {}).get(SPEC_LABEL)
            if not names or own is None:
                continue
            spec = SandboxSpec.model_validate_json(own)
            if any(spec.labels.get(k) != v for k, v in labels.items()):
                continue  # the filter matched a label set outside the spec: not one of ours
            self._engine.remember(names[0], spec, replace=False)
            boxes.append(Sandbox(id=names[0], spec=spec))
        return boxes

    def processes(self, sandbox_id: str) -> list[str]:
        shell = self._engine.spec(sandbox_id).shell
        with docker_errors():
            top = self._api.top(sandbox_id)
        column = (top.get("Titles") or []).index("CMD") if "CMD" in (top.get("Titles") or []) else -1
        commands = [str(row[column]) for row in top.get("Processes") or []]
        return [c for c in commands if supervisor.ROOT + "/" not in c and c != shell]

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        kinds = {0: "modified", 1: "added", 2: "deleted"}
        with docker_errors():
            changes = self._api.diff(sandbox_id) or []
        return [(kinds.get(c["Kind"], "modified"), str(c["Path"])) for c in changes]

    def writable_bytes(self, sandbox_id: str) -> int:
        """The container's writable layer (``SizeRw``: the engine walks it, so it takes a while on a
        large one)."""
        url = self._engine.container_url(sandbox_id, "json")
        with docker_errors():
            response = self._api.get(url, params={"size": "1"}, timeout=self._engine.config.api_timeout_s)
            raise_for_status(response)
        return int(response.json().get("SizeRw") or 0)
