"""What the Docker backend's parts share: the engine's API client, the configuration, what is known of
each sandbox (its spec, its lock), and the one place where Docker's errors become `SandboxError`s.

Methods other than `docker_errors` let Docker's own exceptions through: their callers translate them, in
one `docker_errors` block around each operation.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import docker
import docker.errors
import requests

from core.errors import SandboxError, SandboxFileNotFound, SandboxNotFound, SandboxUnavailable
from sandbox.backend import SandboxSpec
from sandbox.config import DockerBackendConfig

SPEC_LABEL = "belayer.spec"
"""Every sandbox container carries its `SandboxSpec` as this label (another backend instance reads it)."""


@contextlib.contextmanager
def docker_errors(wrap: type[SandboxError] = SandboxError, *, file_op: bool = False) -> Iterator[None]:
    """The one place where Docker and transport errors become `SandboxError`s."""
    try:
        yield
    except docker.errors.NotFound as exc:
        text = str(exc.explanation or exc)
        if file_op and "no such container" not in text.lower():
            raise SandboxFileNotFound(text) from exc
        raise SandboxNotFound(text) from exc
    except (requests.ConnectionError, requests.Timeout) as exc:
        raise SandboxUnavailable(f"docker engine unreachable: {exc}") from exc
    except requests.RequestException as exc:  # e.g. a stream cut halfway
        raise wrap(f"docker engine transfer failed: {exc}") from exc
    except docker.errors.DockerException as exc:
        raise wrap(str(exc)) from exc


def raise_for_status(response: requests.Response) -> None:
    """An engine's error answer as docker-py's exception (`docker_errors` translates it)."""
    try:
        response.raise_for_status()
    except requests.HTTPError as exc:
        raise docker.errors.create_api_error_from_http_exception(exc) from exc


class DockerEngine:
    """The engine connection and the per-sandbox records the backend's parts share."""

    def __init__(self, config: DockerBackendConfig, client: docker.DockerClient | None = None) -> None:
        self.config = config
        with docker_errors(SandboxUnavailable):
            self.client = client or _make_client(config)
        self.api: docker.APIClient = self.client.api
        self._specs: dict[str, SandboxSpec] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._data_root: Path | None = None

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------------------ sandboxes
    def spec(self, sandbox_id: str) -> SandboxSpec:
        """The sandbox's spec (translated errors); read from its label when another instance made it."""
        spec = self._specs.get(sandbox_id)
        if spec is None:  # created by another backend instance: the spec travels as a label
            with docker_errors():
                labels = self.api.inspect_container(sandbox_id)["Config"].get("Labels") or {}
            if SPEC_LABEL not in labels:
                raise SandboxNotFound(f"{sandbox_id} is not a Belayer sandbox")
            spec = SandboxSpec.model_validate_json(labels[SPEC_LABEL])
            self._specs[sandbox_id] = spec
        return spec

    def remember(self, sandbox_id: str, spec: SandboxSpec, *, replace: bool = True) -> None:
        if replace:
            self._specs[sandbox_id] = spec
        else:
            self._specs.setdefault(sandbox_id, spec)

    def forget(self, sandbox_id: str) -> None:
        with self._guard:
            self._specs.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)

    def lock(self, sandbox_id: str) -> threading.Lock:
        """The lock that serialises calls on one sandbox."""
        with self._guard:
            return self._locks.setdefault(sandbox_id, threading.Lock())

    def new_name(self) -> str:
        return f"{self.config.name_prefix}-{uuid.uuid4().hex[:12]}"

    # ------------------------------------------------------------------ raw engine calls
    def url(self, path: str) -> str:
        """The engine's URL of `path` (e.g. ``/containers/{id}/json``), for calls docker-py lacks."""
        return f"{self.api.base_url}/v{self.api.api_version}{path}"

    def container_url(self, sandbox_id: str, what: str) -> str:
        return self.url(f"/containers/{quote(sandbox_id)}/{what}")

    def post(
        self, path: str, *, json_body: dict[str, Any] | None = None, params: dict[str, str] | None = None
    ) -> None:
        """A raw engine call for what docker-py lacks (checkpoints); errors become DockerExceptions."""
        response = self.api.post(
            self.url(path), json=json_body, params=params, timeout=self.config.api_timeout_s
        )
        raise_for_status(response)

    @contextlib.contextmanager
    def paused(self, container_id: str) -> Iterator[None]:
        self.api.pause(container_id)
        try:
            yield
        finally:
            self.api.unpause(container_id)

    def inspect_image(self, name: str) -> dict[str, Any]:
        image: dict[str, Any] = self.api.inspect_image(name)  # type: ignore[no-untyped-call,unused-ignore]
        return image

    def data_root(self) -> Path:
        """Docker's data-root on this host (asked once)."""
        if self._data_root is None:
            self._data_root = Path(self.api.info()["DockerRootDir"])
        return self._data_root


def _make_client(config: DockerBackendConfig) -> docker.DockerClient:
    if config.base_url is None:
        return docker.from_env(timeout=int(config.api_timeout_s))
    return docker.DockerClient(base_url=config.base_url, timeout=int(config.api_timeout_s))
