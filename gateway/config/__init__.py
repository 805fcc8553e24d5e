"""Configuration: `GatewayConfig` is the one source of every setting and its default. Three parts:

- `gateway.config.schema`: `GatewayConfig`, where each setting comes from in what precedence, and what
  follows from a config (`launch_devices`, `gpu_weight_cache`, `gateway_identity`, `engine_allowed`);
  its tables in `gateway.config.sections` (``[failover]``, ``[server]``, ``[launch]``, ...);
- `gateway.config.loader`: `ConfigLoader`, which loads it once and names a bad setting the way it was
  given (a flag, a ``BELAYER_*`` variable, a key of the config file);
- `gateway.config.preflight`: `preflight`, the checks with I/O before ``belayer serve`` launches anything
  (the model directory, binding the address, Docker).

Configuration is loaded once, in `ConfigLoader`, and passed down explicitly. This package's names are
the schema's: the public API by which code builds a config itself (``GatewayConfig(model="./tiny-model")``)
and the parts read theirs (``FailoverConfig``, ``ServerConfig``, ...).

Example::

    loader = ConfigLoader({"model": "./tiny-model", "port": 8001}, {"model": "--model", "port": "--port"})
    config = loader.load()       # ConfigError names a bad setting the way it was given (flag, variable, key)
    preflight(config, loader)    # the model directory, the listening address, Docker: before any launch
"""

from gateway.config.schema import (
    ENV_NESTING,
    ENV_PREFIX,
    GatewayConfig,
    engine_allowed,
    gateway_identity,
    gpu_weight_cache,
    launch_devices,
)
from gateway.config.sections import (
    FailoverConfig,
    InflightConfig,
    LaunchConfig,
    QuarantineConfig,
    RayConfig,
    ServerConfig,
)

__all__ = [
    "ENV_NESTING", "ENV_PREFIX", "FailoverConfig", "GatewayConfig", "InflightConfig", "LaunchConfig",
    "QuarantineConfig", "RayConfig", "ServerConfig", "engine_allowed", "gateway_identity", "gpu_weight_cache",
    "launch_devices",
]  # fmt: skip
