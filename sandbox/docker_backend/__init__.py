"""`SandboxBackend` on a local Docker engine, with CRIU checkpoints (`dockerd --experimental`).

`DockerSandboxBackend` (`backend`) composes one part per concern, each over the shared `DockerEngine`:

- `engine`: the API client, each sandbox's spec and lock, and `docker_errors`, where Docker's and the
  transport's errors become `SandboxError`s;
- `containers`: a sandbox's container, its isolation and disk quota, and what is seen of it from outside
  (state, processes, changed paths);
- `exec`: commands through the in-container supervisor (`sandbox.supervisor`) and its persistent shells;
- `files`: files in and out, and trees as streamed tars;
- `checkpoints`: snapshot image plus CRIU dump, and restore from them;
- `images`: what image building uses (import, derive, build, list, remove);
- `network`: the internal network of ``network="gateway"`` sandboxes and its firewall chain
  (`DockerNetwork`, the Docker side of `sandbox.network.SandboxNetwork`).

This package is the only part of Belayer that imports `docker`. Build it with `sandbox.backends.backend_for`.

Example::

    backend = DockerSandboxBackend(DockerBackendConfig())
    box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
    print(backend.exec(box.id, "uname -a").stdout)
"""

from __future__ import annotations

from sandbox.docker_backend.backend import DockerSandboxBackend
from sandbox.docker_backend.network import DockerNetwork

__all__ = ["DockerNetwork", "DockerSandboxBackend"]
