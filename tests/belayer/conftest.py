"""Each test sees only the BELAYER_* variables it sets (a developer's shell may hold some)."""

from __future__ import annotations

import os

import pytest

from tests.sandbox.conftest import backend, busybox_image, docker_config, docker_engine, python_image
from tests.sandbox_cluster.conftest import node_engines, whole_engines  # bench sandbox-node-loss's

__all__ = [
    "backend",
    "busybox_image",
    "docker_config",
    "docker_engine",
    "node_engines",
    "python_image",
    "whole_engines",
]


@pytest.fixture(autouse=True)
def _no_belayer_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("BELAYER_") and name.upper() != "BELAYER_TINY_MODEL":
            monkeypatch.delenv(name)
