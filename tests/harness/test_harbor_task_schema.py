"""Harbor's ``task.toml`` as Belayer reads it (`harness_adapters.harbor_task`): what is honoured, what is
accepted as metadata, what is refused by name; and every field of the installed Harbor's own schema is one
of those (none falls through unread). No Docker here: `tests/harness/test_harbor_tasks.py` runs them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from core.errors import TaskError
from harness_adapters.harbor_task import SCHEMA, Refused, Table, read_schema, resolve_env
from harness_adapters.task import Task, harbor_sandbox, script_needs

FULL = """
schema_version = "1.4"
source = "terminal-bench"

[task]
name = "acme/hello"
version = "1.0"
description = "say hello"
authors = [{ name = "A. Author", email = "a@example.com" }]
keywords = ["demo"]

[metadata]
difficulty = "easy"
belayer_verify = "shared"

[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 90
env = { MODE = "strict", TOKEN = "${BELAYER_TEST_TOKEN:-none}" }
environment_mode = "shared"

[environment]
build_timeout_sec = 300.0
docker_image = "belayer-sandbox-busybox"
workdir = "/app/"
env = { GREETING = "hi" }
cpus = 2
memory = "2G"
storage_mb = 4096
gpus = 0
network_mode = "no-network"
os = "linux"

[solution]
env = { SECRET = "s" }
"""


def write_task(tmp: Path, toml: str, *, dockerfile: bool = False) -> Path:
    root = tmp / "hello"
    (root / "tests").mkdir(parents=True)
    (root / "task.toml").write_text(toml)
    (root / "instruction.md").write_text("<!-- canary GUID 26b5c67b -->\n\nSay hello.\n")
    (root / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    if dockerfile:
        (root / "environment").mkdir()
        (root / "environment" / "Dockerfile").write_text("FROM belayer-sandbox-busybox\n")
    return root


def test_every_supported_field_is_read(tmp_path: Path) -> None:
    task = Task.load(write_task(tmp_path, FULL))
    spec = task.harbor
    assert spec is not None
    assert (task.name, task.instruction, task.timeout_s, task.verify_timeout_s) == (
        "hello",
        "Say hello.",
        120.0,
        90.0,
    )
    assert (task.workdir, task.files(), task.protected_paths) == ("/app", [], ())
    assert [p for p, _, _ in task.verifier_files()] == ["test.sh"]
    assert (spec.name, spec.docker_image, spec.build_timeout_s, spec.verify) == (
        "acme/hello", "belayer-sandbox-busybox", 300.0, "shared",
    )  # fmt: skip
    assert (spec.cpus, spec.memory_mb, spec.storage_mb, spec.network) == (2.0, 2048, 4096, "none")
    assert spec.verifier_env == {"MODE": "strict", "TOKEN": "${BELAYER_TEST_TOKEN:-none}"}
    assert spec.solution_env == {"SECRET": "s"}
    sandbox = harbor_sandbox(task, spec, inside=False)
    assert sandbox == {"workdir": "/app", "env": {"GREETING": "hi"}, "cpus": 2.0, "memory_mb": 2048}


def test_harbor_s_defaults_and_belayer_s_own(tmp_path: Path) -> None:
    task = Task.load(write_task(tmp_path, 'version = "1.0"\n', dockerfile=True))
    spec = task.harbor
    assert spec is not None
    assert (task.timeout_s, task.verify_timeout_s, spec.build_timeout_s, task.workdir) == (
        600.0,
        600.0,
        600.0,
        "",
    )
    assert (spec.network, spec.verify, spec.docker_image, spec.memory_mb) == ("unset", None, None, None)
    assert "network" not in harbor_sandbox(task, spec, inside=True)  # Belayer's default: not Harbor's public


@pytest.mark.parametrize(
    ("section", "line", "field", "why"),
    [
        ("environment", "gpus = 1", "environment.gpus", "no GPUs"),
        ("environment", 'gpu_types = ["H100"]', "environment.gpu_types", "no GPUs"),
        ("environment.tpu", 'type = "v6e"\ntopology = "2x2"', "environment.tpu", "no GPUs or TPUs"),
        ("environment", 'os = "windows"', "environment.os", "Linux containers"),
        ("environment", 'network_mode = "allowlist"', "environment.network_mode", "'no-network' or 'public'"),
        ("environment", 'allowed_hosts = ["pypi.org"]', "environment.allowed_hosts", "no allowlist"),
        ("environment", 'skills_dir = "/skills"', "environment.skills_dir", "skills"),
        ("environment.healthcheck", 'command = "true"', "environment.healthcheck", "readiness"),
        ("[environment.mcp_servers]]\n#", 'name = "m"\nurl = "http://x"', "environment.mcp_servers", "MCP"),
        ("environment", "workdir = '/'", "environment.workdir", "other than /"),
        ("environment", "workdir = '/tests/app'", "environment.workdir", "outside /tests"),
        ("environment", "storage_mb = 'big'", "environment.storage_mb", "whole number"),
        ("verifier", 'environment_mode = "separate"', "verifier.environment_mode", "verifier environment"),
        ("verifier.environment", 'docker_image = "x"', "verifier.environment", "separate verifier image"),
        ("verifier", "timeout_sec = 7200", "verifier.timeout_sec", "3600 s limit"),
        ("verifier", 'user = "tester"', "verifier.user", "as root"),
        ("agent", 'network_mode = "public"', "agent.network_mode", "per phase"),
        ("agent", "timeout_sec = -1", "agent.timeout_sec", "positive number"),
        ("metadata", 'belayer_verify = "sometimes"', "metadata.belayer_verify", "'clean' or 'shared'"),
        ("[steps]]\n#", 'name = "one"', "steps", "multi-step"),
        ("environment", "colour = 'red'", "environment.colour", "not a field Belayer knows"),
    ],
)
def test_an_unsupported_field_is_refused_by_name(
    tmp_path: Path, section: str, line: str, field: str, why: str
) -> None:
    root = write_task(tmp_path, f"[{section}]\n{line}\n", dockerfile=True)
    with pytest.raises(TaskError) as refused:
        Task.load(root)
    assert str(refused.value).startswith(f"task.toml: {field} ")
    assert why in str(refused.value)


def test_top_level_and_legacy_fields(tmp_path: Path) -> None:
    for toml, message in [
        ('artifacts = ["/app/out"]', "task.toml: artifacts is not supported by Belayer"),
        ('multi_step_reward_strategy = "mean"', "task.toml: multi_step_reward_strategy is not supported"),
        (
            "[environment]\nmemory = '1G'\nmemory_mb = 512",
            "task.toml: environment.memory (1024 MB) contradicts",
        ),
        ("nonsense = 1", "task.toml: nonsense is not a field Belayer knows"),
        ("[task]\nlicence = 'MIT'", "task.toml: task.licence is not a field Belayer knows"),
        (
            "[environment]\nallow_internet = 'yes'",
            "task.toml: environment.allow_internet must be true or false",
        ),
        ("[environment]\nenv = { 'A-B' = 'x' }", "task.toml: environment.env.A-B is not a valid environment"),
        ("[agent", "is not valid TOML"),
    ]:
        root = write_task(tmp_path / str(abs(hash(toml))), toml, dockerfile=True)
        with pytest.raises(TaskError, match=None) as refused:
            Task.load(root)
        assert message in str(refused.value), (toml, str(refused.value))
    harmless = (
        "artifacts = []\nsteps = []\n[environment]\ngpus = 0\nmcp_servers = []\nallow_internet = true\n"
    )
    task = Task.load(write_task(tmp_path / "ok", harmless, dockerfile=True))
    assert task.harbor is not None and task.harbor.network == "public"
    with pytest.raises(TaskError, match="harness inside its sandbox needs the gateway-only network"):
        harbor_sandbox(task, task.harbor, inside=True)
    assert harbor_sandbox(task, task.harbor, inside=False)["network"] == "full"


def test_a_task_without_an_environment_or_tests_is_refused(tmp_path: Path) -> None:
    root = write_task(tmp_path, "")
    with pytest.raises(
        TaskError, match=re.escape("no environment/Dockerfile and no [environment].docker_image")
    ):
        Task.load(root)
    (root / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=re.escape("lacks tests/test.sh")):
        Task.load(root)


def test_env_templates_come_from_this_host() -> None:
    env = {"A": "${X}", "B": "${Y:-dflt}", "C": "plain ${X}"}
    assert resolve_env(env, "verifier.env", host={"X": "1"}) == {"A": "1", "B": "dflt", "C": "plain ${X}"}
    with pytest.raises(
        TaskError, match=re.escape("verifier.env.A = '${X}' needs X in this host's environment")
    ):
        resolve_env(env, "verifier.env", host={})


def test_script_needs_follow_the_shebang() -> None:
    assert script_needs("tests/test.sh", b"#!/bin/bash\nexit 0\n") == [
        ("/bin/bash (tests/test.sh's interpreter)", ("/bin/bash",))
    ]
    assert script_needs("tests/test.sh", b"echo no shebang\n") == [
        ("/bin/sh (tests/test.sh's interpreter)", ("/bin/sh",))
    ]
    env, python = script_needs("s", b"#!/usr/bin/env -S python3 -u\n")
    assert env == ("/usr/bin/env (s runs with it)", ("/usr/bin/env",))
    assert python[0] == "python3 on PATH (s's interpreter)" and "/usr/bin/python3" in python[1]


HARBOR_FIELDS = """
import json
from harbor.models.task.config import TaskConfig, EnvironmentConfig, VerifierConfig, AgentConfig, SolutionConfig, PackageInfo
tables = {"": TaskConfig, "environment": EnvironmentConfig, "verifier": VerifierConfig, "agent": AgentConfig,
          "solution": SolutionConfig, "task": PackageInfo}
print(json.dumps({k: sorted(m.model_fields) for k, m in tables.items()}))
"""


@pytest.mark.external
def test_every_field_of_harbor_s_own_schema_is_read_or_refused() -> None:
    """Harbor's pydantic models (the installed release) against `SCHEMA`: a field Harbor adds in a new
    release fails here until Belayer reads or refuses it."""
    from belayer.testing.services import ensure_harbor_venv

    python = ensure_harbor_venv()
    out = subprocess.run(
        [str(python), "-c", HARBOR_FIELDS], capture_output=True, text=True, check=True, timeout=120
    )
    fields: dict[str, list[str]] = json.loads(out.stdout)
    for table, names in fields.items():
        rule = SCHEMA if not table else SCHEMA.keys[table]
        assert isinstance(rule, Table), table
        unknown = sorted(set(names) - set(rule.keys))
        assert unknown == [], f"[{table}] fields Belayer neither reads nor refuses: {unknown}"
    refused = {k for k, v in SCHEMA.keys.items() if isinstance(v, Refused)}
    assert refused == {"steps", "multi_step_reward_strategy", "artifacts"}


@pytest.mark.external
def test_harbor_s_own_template_task_loads(tmp_path: Path) -> None:
    """The task ``harbor tasks init`` writes (its template, from the installed package) is accepted."""
    from belayer.testing.services import ensure_harbor_venv

    site = ensure_harbor_venv().parent.parent / "lib"
    [template] = list(site.glob("python3*/site-packages/harbor/cli/template-task"))
    root = tmp_path / "template"
    root.mkdir()
    for name in ("task.toml", "instruction.md"):
        (root / name).write_text((template / name).read_text())
    (root / "tests").mkdir()
    (root / "tests" / "test.sh").write_text((template / "tests" / "test.sh").read_text())
    (root / "environment").mkdir()
    (root / "environment" / "Dockerfile").write_text((template / "environment" / "Dockerfile").read_text())
    task = Task.load(root)
    assert task.harbor is not None and (task.timeout_s, task.verify_timeout_s) == (900.0, 900.0)
    assert read_schema(SCHEMA, {"metadata": {}}) == {"metadata": {}}
