"""Harness tests use the sandbox tests' Docker fixtures (a real engine with CRIU)."""

from tests.sandbox.conftest import backend, docker_config, docker_engine, python_image

__all__ = ["backend", "docker_config", "docker_engine", "python_image"]
