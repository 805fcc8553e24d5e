"""Sandboxes for agent episodes: one ABC (`sandbox.backend.SandboxBackend`) and its implementations.

`sandbox.docker_backend` (the only module that imports `docker`) runs them as Docker containers with
CRIU checkpoints; `sandbox.images` builds their base images without a registry.
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
from sandbox.backend import Checkpoint, ExecResult, Sandbox, SandboxBackend, SandboxSpec

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
    "SandboxNotFound",
    "SandboxSpec",
    "SandboxTimeout",
    "SandboxUnavailable",
]
