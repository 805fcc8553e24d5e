"""`GatewayConfig` from defaults < a TOML file < BELAYER_* variables < flags, and errors that name the
setting the way it was given."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from gateway.config import FailoverConfig, GatewayConfig, InflightConfig
from gateway.config.loader import ConfigLoader
from gateway.config.preflight import preflight
from sandbox.config import PolicySettings

NAMES = {"port": "--port", "workers": "--workers", "model": "--model", "config_file": "--config"}
TOML = """
model = "from-file"
workers = 3
port = 9000
[failover]
stall_timeout = 9.0
max_failovers = 7
[sandbox]
sandbox_port = -1
[sandbox.policy]
mode = "never"
"""


def _file(tmp_path: Path, text: str = TOML) -> str:
    path = tmp_path / "belayer.toml"
    path.write_text(text)
    return str(path)


def test_flags_beat_environment_beat_file_beat_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BELAYER_FAILOVER__STALL_TIMEOUT", "2")
    monkeypatch.setenv("BELAYER_PORT", "9001")
    monkeypatch.setenv("BELAYER_SANDBOX__POLICY__MARGIN", "2.5")
    flags = {"config_file": _file(tmp_path), "port": 9002}
    config = ConfigLoader(flags, NAMES).load()
    assert config.port == 9002  # flag over variable over file
    assert config.failover.stall_timeout == 2.0  # variable over file
    assert config.failover.max_failovers == 7  # file; a variable for a sibling key keeps it
    assert config.workers == 3 and config.model == "from-file"  # file over default
    assert config.failover.no_worker_wait == 120.0  # default
    assert config.sandbox.sandbox_port is None  # -1 in a file: no listener
    assert config.sandbox.policy == PolicySettings(mode="never", margin=2.5)


def test_the_file_can_be_named_by_a_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BELAYER_CONFIG_FILE", _file(tmp_path))
    assert ConfigLoader({}, NAMES).load().workers == 3


def test_admin_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BELAYER_ADMIN_TOKEN", "t0k")
    assert ConfigLoader({"model": "m"}, NAMES).load().admin_token == "t0k"
    assert ConfigLoader({"model": "m", "admin_token": "flag"}, NAMES).load().admin_token == "flag"


def test_direct_construction_and_unrelated_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BELAYER_TINY_MODEL", "/elsewhere")  # set by the Makefile: not a setting
    monkeypatch.setenv("BELAYER_AUX_API_KEY", "k")
    config = GatewayConfig(model="m", failover=FailoverConfig(enabled=False), store_path="x.db")
    assert (config.model, config.store_path, config.port) == ("m", "x.db", 8000)
    assert config.failover.enabled is False
    assert config.log_level == "INFO" and config.sandbox.sandbox_port == 0


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"model": "m", "workers": -1}, {}, "--workers: input should be greater than or equal to 0 (got -1)"),
        (
            {"model": "m"},
            {"BELAYER_FAILOVER__STALL_TIMEOUT": "soon"},
            "BELAYER_FAILOVER__STALL_TIMEOUT: input should be a valid number, unable to parse string as a "
            "number (got 'soon')",
        ),
        (
            {"model": "m"},
            {"BELAYER_ENGINE_URLS": "http://h:8001"},
            "BELAYER_ENGINE_URLS: not valid JSON; lists and tables take JSON, e.g. "
            "BELAYER_ENGINE_URLS='[\"http://h:8001\"]'",
        ),
        (
            {"model": "m"},
            {"BELAYER_FAILOVER__START_NICE": "20"},
            "BELAYER_FAILOVER__START_NICE: input should be less than or equal to 19 (got '20')",
        ),
        (
            {"model": "m"},
            {"BELAYER_SANDBOX__STANDBY": "perhaps"},
            "BELAYER_SANDBOX__STANDBY: input should be a valid boolean, unable to interpret input (got 'perhaps')",
        ),
        ({}, {}, "no model given: set --model, BELAYER_MODEL or `model` in a config file"),
        (
            {"model": "m", "engine_urls": ["http://ok:1", "localhost:8001"]},
            {},
            "engine_urls: 'localhost:8001' has no scheme; write it as http://localhost:8001",
        ),
    ],
)
def test_a_bad_setting_is_named_as_given(
    flags: dict[str, object], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        ConfigLoader(flags, NAMES).load()
    assert str(info.value) == message


def test_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = _file(tmp_path, 'model = "m"\nprot = 1\n[failover]\nstall_timeout = 0\n')
    with pytest.raises(ConfigError) as info:
        ConfigLoader({"config_file": path}, NAMES).load()
    assert str(info.value) == (
        f"{path}: failover.stall_timeout: input should be greater than 0 (got 0); {path}: prot: unknown setting"
    )


def test_a_missing_or_broken_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file /nonexistent/b.toml: no such file$"):
        ConfigLoader({"config_file": "/nonexistent/b.toml"}, NAMES).load()
    path = _file(tmp_path, "model =\n")
    with pytest.raises(ConfigError) as info:
        ConfigLoader({"config_file": path}, NAMES).load()
    assert str(info.value) == f"config file {path}: not valid TOML (Invalid value (at line 1, column 8))"


def test_the_gateway_id_is_given_or_this_host_and_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from gateway.config import gateway_identity

    assert gateway_identity(GatewayConfig(model="m", port=8123)) == f"{socket.gethostname()}:8123"
    assert (
        gateway_identity(ConfigLoader({"model": "m", "gateway_id": "replica-a"}, NAMES).load()) == "replica-a"
    )
    monkeypatch.setenv("BELAYER_GATEWAY_ID", "replica-b")
    assert gateway_identity(ConfigLoader({"model": "m"}, NAMES).load()) == "replica-b"
    with pytest.raises(ConfigError, match="gateway_id"):
        ConfigLoader({"model": "m", "gateway_id": ""}, NAMES).load()
    assert InflightConfig().sweep_interval_s == 5.0
    path = _file(tmp_path, 'model = "m"\n[inflight]\nsweep_interval_s = 0.5\n')
    assert ConfigLoader({"config_file": path}, NAMES).load().inflight.sweep_interval_s == 0.5


def test_sandboxes_follow_ray_onto_the_cluster_and_need_a_checkpoint_store(tiny_model_dir: Path) -> None:
    names = {"model": "--model", "ray.address": "--ray", "sandbox.checkpoint_store": "--checkpoint-store"}
    given = {"model": str(tiny_model_dir), "ray.address": "127.0.0.2:6379", "ray.node_ip": "127.0.0.2",
             "sandbox.enabled": True, "port": 0}  # fmt: skip
    loader = ConfigLoader(given, names)
    config = loader.load()
    assert (config.sandbox.ray, config.sandbox.ray_node_ip, config.sandbox.on_ray) == (
        "127.0.0.2:6379", "127.0.0.2", True,
    )  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"^--checkpoint-store: sandboxes on the Ray cluster at 127.0.0.2:6379 need"
    ):
        preflight(config, loader)
    local = ConfigLoader({**given, "sandbox.ray": "off"}, names).load()
    assert (local.sandbox.ray, local.sandbox.on_ray) == ("off", False)  # the pool on Ray, sandboxes here
    other = ConfigLoader(
        {**given, "sandbox.ray": "10.0.0.9:6379", "sandbox.checkpoint_store": "s3://b/p"}, names
    )
    assert (other.load().sandbox.ray, other.load().sandbox.checkpoint_store) == ("10.0.0.9:6379", "s3://b/p")
    assert (
        not ConfigLoader({"model": "m", "sandbox.enabled": True}, names).load().sandbox.on_ray
    )  # no Ray: here
