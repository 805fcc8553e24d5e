"""`preflight`: what ``belayer serve`` checks before it launches anything, with I/O the configuration
itself never does: the model directory and its tokenizer, the launched workers' devices, that the
gateway's address can be bound, and (with sandboxes on this host) that Docker answers.

Example::

    loader = ConfigLoader({"model": "./tiny-model"}, {"model": "--model"})
    config = loader.load()
    preflight(config, loader)   # ConfigError: "--port: 127.0.0.1:8000 is already in use; ..."
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from pathlib import Path

from core.errors import ConfigError
from gateway.config.loader import ConfigLoader
from gateway.config.schema import GatewayConfig, launch_devices
from gateway.policy.tokenization import ChatTokenizer

Names = Callable[[str], str]
"""How the setting at a dotted path was given (`ConfigLoader.name`)."""


def preflight(config: GatewayConfig, loader: ConfigLoader) -> None:
    """What ``belayer serve`` checks before it launches anything: the model directory, that the
    gateway's address is free, and (with sandboxes) that Docker answers; a `ConfigError` names the
    setting to change the way `loader` was given it."""
    name = loader.name
    _check_model(config.model, name)
    _check_launch(config, name)
    _check_listen(config.host, config.port, name)
    if config.sandbox.enabled and config.sandbox.on_ray and not config.sandbox.checkpoint_store:
        raise ConfigError(
            f"{name('sandbox.checkpoint_store')}: sandboxes on the Ray cluster at {config.sandbox.ray} "
            "need a checkpoint store that every node reads: a shared directory or s3://BUCKET/PREFIX; or "
            "--sandbox-ray off to keep them on this host"
        )
    if config.sandbox.enabled and not config.sandbox.on_ray:
        from sandbox.backends import backend_for

        # Raises SandboxUnavailable when Docker does not answer; the CLI says how to start it.
        backend_for(config.sandbox).close()


def _check_model(model: str, name: Names) -> None:
    root = Path(model)
    where = name("model")
    if not root.exists():
        raise ConfigError(f"{where}: {model} does not exist; give the directory that holds the model")
    if not root.is_dir():
        raise ConfigError(f"{where}: {model} is not a directory; give the directory that holds the model")
    if not (root / "tokenizer.json").is_file():
        raise ConfigError(f"{where}: {model} holds no tokenizer.json; is it a Hugging Face model directory?")
    try:
        ChatTokenizer.load(root)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_launch(config: GatewayConfig, name: Names) -> None:
    """What launched workers need that no single setting can check: a device group each, and vLLM
    arguments only where vLLM runs."""
    try:
        launch_devices(config)
    except ConfigError as exc:
        raise ConfigError(f"{name('launch.gpus')}: {exc}") from None
    if config.ray.address and config.launch.weight_owner:
        raise ConfigError(
            f"{name('launch.weight_owner')}: with --ray the workers are on other hosts than the "
            "gateway, and the weight owner holds one host's weights; drop --weight-owner"
        )
    if config.ray.address and config.launch.gpus:
        raise ConfigError(
            f"{name('launch.gpus')}: with --ray, Ray assigns each worker its GPUs (the "
            "tensor-parallel size, with the gpu profile); drop --gpus"
        )
    if config.launch.vllm_args and config.worker_kind != "vllm" and not config.engine_urls:
        raise ConfigError(
            f"{name('launch.vllm_args')}: {config.worker_kind} workers take no vLLM arguments; "
            "drop them, or launch vllm workers"
        )


def _check_listen(host: str, port: int, name: Names) -> None:
    """Bind-test the gateway's address: uvicorn binds it only after the lifespan launched workers."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"{name('host')}: cannot resolve {host!r} ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{name('port')}: {host}:{port} is already in use; stop what listens there "
                    "or choose another port"
                ) from None
            raise ConfigError(f"{name('host')}: cannot listen on {host}:{port} ({exc.strerror})") from None
