"""Sandboxes for agent episodes: one ABC (`sandbox.backend.SandboxBackend`) and its implementations.

- `sandbox.backend`: the seam (containers: create, exec, files, checkpoint, restore, destroy, status);
- `sandbox.docker_backend` runs them as Docker containers with CRIU checkpoints (that package is the only
  one that imports `docker`; `sandbox.supervisor` is the in-container half);
- `sandbox.backends.backend_for` builds the backend a `sandbox.config.SandboxConfig` describes;
- `sandbox.fake`: in memory, with a scripted fault queue, for tests of what sits above the seam;
- `sandbox.network`: the seam of the network that ``network="gateway"`` sandboxes join;
- `sandbox.images` builds base images without a registry; `sandbox.workloads` holds programs whose
  state lives in memory, to check that processes survive a restore.
"""

from __future__ import annotations

from core.errors import (
    CheckpointError,
    ImageBuildError,
    PathEscapeError,
    RestoreError,
    SandboxError,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxTimeout,
    SandboxUnavailable,
)
from sandbox.backend import Checkpoint, ExecResult, Sandbox, SandboxBackend, SandboxSpec, SandboxStatus
from sandbox.network import SandboxNetwork

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ExecResult",
    "ImageBuildError",
    "PathEscapeError",
    "RestoreError",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "SandboxFileNotFound",
    "SandboxNetwork",
    "SandboxNotFound",
    "SandboxSpec",
    "SandboxStatus",
    "SandboxTimeout",
    "SandboxUnavailable",
]
