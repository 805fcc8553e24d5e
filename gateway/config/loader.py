"""`ConfigLoader`: loads `GatewayConfig` once, from the flags given, ``BELAYER_*`` variables and a config
file, and knows where each setting came from (`ConfigLoader.name`), so that an error names a bad
setting the way it was given: a flag, a variable, or a key of the file.

Example::

    loader = ConfigLoader({"model": "./tiny-model", "port": 8001}, {"model": "--model", "port": "--port"})
    config = loader.load()     # ConfigError names a bad setting the way it was given (flag, variable, key)
    loader.name("port")        # '--port'
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import SettingsError

from core.errors import ConfigError
from gateway.config.schema import ENV_NESTING, ENV_PREFIX, GatewayConfig


class ConfigLoader:
    """Loads `GatewayConfig` once, and names a bad setting the way it was given: a flag, a ``BELAYER_*``
    variable, or a key of the config file.

    ``flags`` holds only the settings given on the command line, by dotted path
    (``{"failover.stall_timeout": 2.0}``); ``flag_names`` maps a dotted path to its flag (``--stall-timeout``)
    for every flag there is, so that an error can say which one to use.
    """

    def __init__(self, flags: Mapping[str, object], flag_names: Mapping[str, str]) -> None:
        self.flags = dict(flags)
        self.flag_names = dict(flag_names)

    def load(self) -> GatewayConfig:
        try:
            return GatewayConfig(**_nest(self.flags))
        except ValidationError as exc:
            raise ConfigError("; ".join(self._describe(e) for e in exc.errors())) from None
        except SettingsError as exc:  # a BELAYER_* list or table that is not JSON
            field = re.search(r'field "(\w+)"', str(exc))
            where = _env_name(field.group(1)) if field else "a BELAYER_* variable"
            raise ConfigError(
                f"{where}: not valid JSON; lists and tables take JSON, e.g. BELAYER_ENGINE_URLS='[\"http://h:8001\"]'"
            ) from None

    def name(self, path: str) -> str:
        """How the setting at ``path`` was given: its flag, its variable, or the file and key; for a
        setting given nowhere, its flag (or the path)."""
        parts = path.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        for prefix in prefixes:
            if prefix in self.flags:
                return self.flag_names.get(prefix, prefix)
        set_vars = {key.upper() for key in os.environ}
        for prefix in prefixes:
            var = _env_name(prefix)
            if var in set_vars:
                return var
        file = self._config_file()
        if file is not None:
            return f"{file}: {path}"
        return self.flag_names.get(path, path)

    # ------------------------------------------------------------------ helpers
    def _config_file(self) -> str | None:
        if "config_file" in self.flags:
            return str(self.flags["config_file"])
        var = _env_name("config_file")
        return next((value for key, value in os.environ.items() if key.upper() == var), None)

    def _describe(self, error: ErrorDetails) -> str:
        path = ".".join(str(part) for part in error["loc"] if isinstance(part, str))
        if error["type"] == "missing":
            flag = f"{self.flag_names[path]}, " if path in self.flag_names else ""
            return f"no {path} given: set {flag}{_env_name(path)} or `{path}` in a config file"
        if error["type"] == "extra_forbidden":
            return f"{self.name(path)}: unknown setting"
        if error["type"] == "value_error":
            return f"{self.name(path)}: {error.get('ctx', {}).get('error', error['msg'])}"
        message = error["msg"][:1].lower() + error["msg"][1:]
        return f"{self.name(path)}: {message} (got {error['input']!r})"


def _env_name(path: str) -> str:
    return ENV_PREFIX + path.replace(".", ENV_NESTING).upper()


def _nest(flat: Mapping[str, object]) -> dict[str, Any]:
    """``{"failover.stall_timeout": 2}`` -> ``{"failover": {"stall_timeout": 2}}``."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested
