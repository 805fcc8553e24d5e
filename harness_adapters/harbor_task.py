"""Harbor-format tasks (PyPI ``harbor``): ``task.toml`` read against what Belayer supports, refused by name
for the rest.

A Harbor task is a directory::

    task/
      task.toml          the schema below
      instruction.md     what the agent is asked to do (leading "canary" comment lines dropped, as Harbor does)
      environment/       Dockerfile and its build context (unless [environment].docker_image names an image)
      tests/test.sh      run after the agent; writes /logs/verifier/reward.txt or reward.json
      solution/solve.sh  the reference solution (the ``oracle`` harness runs it)

`load_harbor` reads ``task.toml`` with `tomllib` and walks `SCHEMA`: every key is either read (and
type-checked), accepted as metadata, or refused with the reason (``task.toml: environment.gpus is not
supported by Belayer (...)``); a key the schema does not name is refused too, never ignored. What is read:

================================  ==================================================================
``[agent].timeout_sec``           the episode's time limit (`Task.timeout_s`)
``[verifier].timeout_sec, env``   the verifier's time limit and variables (``${VAR}`` from this host)
``[solution].env``                the oracle's variables
``[environment]``                 ``docker_image`` or environment/Dockerfile (``build_timeout_sec``),
                                  ``workdir`` (else the image's ``WORKDIR``), ``env``, ``cpus``,
                                  ``memory_mb`` (or legacy ``memory = "2G"``), ``storage_mb`` (reported:
                                  Belayer's disk limit is the gateway's, per sandbox),
                                  ``network_mode`` / legacy ``allow_internet``
``[metadata].belayer_verify``     Belayer's own key: ``"clean"`` (default) or ``"shared"`` verification
================================  ==================================================================

Network: Harbor's default is ``public`` because its agents call model providers from the container;
a Belayer agent reaches its model through the gateway, so an unset mode gets Belayer's default (no
network beside; the gateway-only network for a harness inside) and only an explicit ``public`` (or
``allow_internet = true``) gives the sandbox the network (``"full"``), for a harness beside it.

Example::

    task = Task.load(Path("datasets/hello-world"))   # a task.toml: read here
    task.harbor.docker_image, task.harbor.verify, task.timeout_s
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.errors import TaskError

VerifyMode = Literal["clean", "shared"]
Network = Literal["unset", "none", "public"]
MAX_VERIFY_S = 3600.0
"""The gateway's verify route takes at most this (``timeout_s``)."""
RESERVED = ("/tests", "/logs", "/solution", "/belayer-verify", "/.belayer", "/proc", "/sys", "/dev")
"""Directories that cannot be the working directory (or hold it): Harbor's and Belayer's own."""
_TEMPLATE = re.compile(r"\$\{([^}:]+)(?::-(.*))?\}")


@dataclass(frozen=True, slots=True)
class HarborSpec:
    """What Belayer takes from a Harbor ``task.toml`` (the module docstring's table)."""

    name: str | None = None
    """``[task].name`` (``org/name``), when the task has one."""
    agent_timeout_s: float | None = None
    verifier_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    build_timeout_s: float = 600.0
    docker_image: str | None = None
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network: Network = "unset"
    verify: VerifyMode | None = None
    """``[metadata].belayer_verify``; None: Belayer's default (clean), unless the operator says."""


# --------------------------------------------------------------------------- the schema
Check = Callable[[str, Any], Any]
"""Checks the value at a dotted path; returns it as Belayer keeps it (or raises `TaskError`)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A Harbor key Belayer cannot honour; refused unless its value is one of `harmless` (its default)."""

    why: str
    harmless: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Table:
    keys: Mapping[str, Check | Refused | Table]


def _fail(path: str, what: str) -> TaskError:
    return TaskError(f"task.toml: {path} {what}")


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(path, f"must be a string, not {value!r}")
    return value


def _anything(path: str, value: Any) -> Any:
    return value


def _positive(path: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _fail(path, f"must be a positive number of seconds, not {value!r}")
    return float(value)


def _megabytes(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(path, f"must be a positive whole number of megabytes, not {value!r}")
    return value


def _size(path: str, value: Any) -> int:
    """Harbor's legacy ``memory = "2G"`` / ``storage = "512M"``, in megabytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([GgMmKk])\s*", value) if isinstance(value, str) else None
    if match is None:
        raise _fail(path, f"must be a size such as '2G' or '512M', not {value!r}")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024) if unit == "G" else int(number) if unit == "M" else int(number / 1024)


def _cpus(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 64:
        raise _fail(path, f"must be a number of CPUs above 0 and at most 64, not {value!r}")
    return float(value)


def _env(path: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail(path, f"must be a table of variables, not {value!r}")
    for name, text in value.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise _fail(f"{path}.{name}", "is not a valid environment variable name")
        if not isinstance(text, str) or "\0" in text:
            raise _fail(f"{path}.{name}", f"must be a string, not {text!r}")
    return dict(value)


def _workdir(path: str, value: Any) -> str:
    text = _string(path, value)
    clean = posixpath.normpath(text) if text.startswith("/") else ""
    if not clean or clean == "/" or any(clean == r or clean.startswith(r + "/") for r in RESERVED):
        raise _fail(
            path,
            f"must be an absolute directory other than / and outside {', '.join(RESERVED)}, not {value!r} "
            "(a clean verification copies it whole)",
        )
    return clean


def _network(path: str, value: Any) -> str:
    if value not in ("no-network", "public"):
        raise _fail(path, f"= {value!r} is not supported by Belayer (it takes 'no-network' or 'public')")
    return str(value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(path, f"must be true or false, not {value!r}")
    return value


def _verify_mode(path: str, value: Any) -> str:
    if value not in ("clean", "shared"):
        raise _fail(path, f"must be 'clean' or 'shared', not {value!r}")
    return str(value)


def _metadata(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(path, f"must be a table, not {value!r}")
    if "belayer_verify" in value:
        _verify_mode(f"{path}.belayer_verify", value["belayer_verify"])
    return dict(value)


GPU = "its sandboxes have no GPUs or TPUs"
PHASE_NETWORK = (
    "a network policy per phase; Belayer's agent sandbox has the [environment] one and its clean "
    "verification none"
)
USER = "Belayer runs the agent and the verifier as root in the sandbox"
SCHEMA = Table({
    "schema_version": _string,
    "version": _string,
    "source": _string,
    "task": Table({
        "name": _string, "version": _string, "description": _string, "authors": _anything,
        "keywords": _anything,
    }),
    "metadata": _metadata,
    "agent": Table({
        "timeout_sec": _positive,
        "user": Refused(USER),
        "network_mode": Refused(PHASE_NETWORK),
        "allowed_hosts": Refused(PHASE_NETWORK),
    }),
    "verifier": Table({
        "timeout_sec": _positive,
        "env": _env,
        "user": Refused(USER),
        "network_mode": Refused(PHASE_NETWORK),
        "allowed_hosts": Refused(PHASE_NETWORK),
        "environment_mode": Refused(
            "a verifier environment of its own; Belayer verifies a copy of the agent's working directory in "
            "a clean sandbox of the task's image ([metadata] belayer_verify = 'clean') or in the agent's "
            "own sandbox ('shared')", ("shared",),
        ),
        "environment": Refused("a separate verifier image; the verifier runs on the task's image"),
        "collect": Refused("collect hooks run in compose services, which Belayer has none of", ([],)),
    }),
    "environment": Table({
        "build_timeout_sec": _positive,
        "docker_image": _string,
        "os": Refused("its sandboxes are Linux containers", ("linux", "LINUX", "Linux")),
        "cpus": _cpus,
        "memory_mb": _megabytes,
        "memory": _size,
        "storage_mb": _megabytes,
        "storage": _size,
        "gpus": Refused(GPU, (0,)),
        "gpu_types": Refused(GPU, ([],)),
        "tpu": Refused(GPU),
        "mcp_servers": Refused("MCP servers are not wired into Belayer's harnesses", ([],)),
        "env": _env,
        "skills_dir": Refused("skills are not copied into Belayer's harnesses"),
        "healthcheck": Refused("there is no readiness check before the agent starts"),
        "workdir": _workdir,
        "network_mode": _network,
        "allowed_hosts": Refused("no allowlist network: a sandbox has no network, the gateway only, or all"),
        "allow_internet": _bool,
    }),
    "solution": Table({"env": _env}),
    "steps": Refused("multi-step tasks (one agent phase and verifier per step) are not run", ([],)),
    "multi_step_reward_strategy": Refused("multi-step tasks are not run"),
    "artifacts": Refused("artifacts are not collected from the sandbox", ([],)),
})  # fmt: skip


def read_schema(table: Table, data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`data` checked against `table`: each value as its check returns it, under its dotted path.

    >>> read_schema(SCHEMA, {"environment": {"cpus": 2, "gpus": 0}, "metadata": {"x": 1}})
    {'environment.cpus': 2.0, 'environment.gpus': 0, 'metadata': {'x': 1}}
    >>> read_schema(SCHEMA, {"environment": {"gpus": 1}})
    Traceback (most recent call last):
    ...
    core.errors.TaskError: task.toml: environment.gpus is not supported by Belayer (its sandboxes have no GPUs or TPUs)
    """
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        rule = table.keys.get(key)
        if rule is None:
            known = ", ".join(sorted(table.keys))
            raise _fail(
                path, f"is not a field Belayer knows (here it reads: {known}); remove it or rename it"
            )
        if isinstance(rule, Refused):
            if not any(value == ok and type(value) is type(ok) for ok in rule.harmless):
                raise _fail(path, f"is not supported by Belayer ({rule.why})")
            out[path] = value
        elif isinstance(rule, Table):
            if not isinstance(value, dict):
                raise _fail(path, f"must be a table ([{path}]), not {value!r}")
            out |= read_schema(rule, value, f"{path}.")
        else:
            out[path] = rule(path, value)
    return out


# --------------------------------------------------------------------------- the task
def load_harbor(root: Path) -> tuple[HarborSpec, str]:
    """The Harbor task at `root`: its spec, and its instruction (canary lines dropped)."""
    try:
        data = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"{root / 'task.toml'} is not valid TOML: {exc}") from exc
    values = read_schema(SCHEMA, data)
    missing = [name for name in ("instruction.md", "tests/test.sh") if not (root / name).is_file()]
    if missing:
        raise TaskError(f"Harbor task {root} lacks {', '.join(missing)}")
    image = values.get("environment.docker_image")
    if image is None and not (root / "environment" / "Dockerfile").is_file():
        raise TaskError(
            f"Harbor task {root}: no environment/Dockerfile and no [environment].docker_image "
            "(a docker-compose.yaml environment is not supported by Belayer: one container per sandbox)"
        )
    verify_timeout = values.get("verifier.timeout_sec", 600.0)
    if verify_timeout > MAX_VERIFY_S:
        raise _fail(
            "verifier.timeout_sec", f"= {verify_timeout:g} is over Belayer's {MAX_VERIFY_S:g} s limit"
        )
    spec = HarborSpec(
        name=values.get("task.name"),
        agent_timeout_s=values.get("agent.timeout_sec"),
        verifier_timeout_s=verify_timeout,
        verifier_env=values.get("verifier.env", {}),
        solution_env=values.get("solution.env", {}),
        build_timeout_s=values.get("environment.build_timeout_sec", 600.0),
        docker_image=image,
        workdir=values.get("environment.workdir"),
        env=values.get("environment.env", {}),
        cpus=values.get("environment.cpus"),
        memory_mb=_one_of(values, "environment.memory_mb", "environment.memory"),
        storage_mb=_one_of(values, "environment.storage_mb", "environment.storage"),
        network=_network_of(values),
        verify=values.get("metadata", {}).get("belayer_verify"),
    )
    return spec, strip_canary((root / "instruction.md").read_text()).strip()


def _one_of(values: Mapping[str, Any], key: str, legacy: str) -> int | None:
    if key in values and legacy in values and values[key] != values[legacy]:
        raise _fail(legacy, f"({values[legacy]} MB) contradicts {key} ({values[key]} MB)")
    found = values.get(key, values.get(legacy))
    return int(found) if found is not None else None


def _network_of(values: Mapping[str, Any]) -> Network:
    mode = values.get("environment.network_mode")
    if mode is None and "environment.allow_internet" in values:
        mode = "public" if values["environment.allow_internet"] else "no-network"
    return "unset" if mode is None else "public" if mode == "public" else "none"


def strip_canary(text: str) -> str:
    """`text` without its leading canary comment lines (``<!-- ... canary ... -->``, ``# ... canary``) and
    the blank lines after them, as Harbor shows an instruction to its agents.

    >>> strip_canary("<!-- BENCHMARK DATA canary GUID 1 -->\\n\\nDo it.\\n")
    'Do it.\\n'
    """
    lines = text.split("\n")
    i = 0
    while i < len(lines) and re.fullmatch(
        r"(<!--.*canary.*-->|#.*canary.*)", lines[i].strip(), re.IGNORECASE
    ):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def resolve_env(env: Mapping[str, str], where: str, host: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` with Harbor's templates filled from this host's environment: a value that is all
    ``${VAR}`` or ``${VAR:-default}`` takes VAR's value (or the default); others stay as written.

    >>> resolve_env({"A": "${HOME_X:-none}", "B": "x"}, "environment.env", host={})
    {'A': 'none', 'B': 'x'}
    """
    host = os.environ if host is None else host
    out = {}
    for name, value in env.items():
        match = _TEMPLATE.fullmatch(value)
        if match is None:
            out[name] = value
        elif match.group(1) in host:
            out[name] = host[match.group(1)]
        elif match.group(2) is not None:
            out[name] = match.group(2)
        else:
            raise TaskError(
                f"task.toml: {where}.{name} = {value!r} needs {match.group(1)} in this host's environment; "
                "set it, or give a default (${VAR:-default})"
            )
    return out


def interpreter(script: bytes) -> tuple[str, ...]:
    """The paths that must be in the image for `script` to run as Harbor runs it (by its path: its
    ``#!`` line's interpreter, and for ``#!/usr/bin/env NAME`` NAME on the usual PATH; without one, sh).

    >>> interpreter(b"#!/bin/bash\\necho"), interpreter(b"#!/usr/bin/env python3\\n")[:2], interpreter(b"echo")
    (('/bin/bash',), ('/usr/local/bin/python3', '/usr/bin/python3'), ('/bin/sh',))
    """
    first = script.split(b"\n", 1)[0].decode(errors="replace")
    if not first.startswith("#!"):
        return ("/bin/sh",)
    words = first[2:].split()
    if not words:
        return ("/bin/sh",)
    if posixpath.basename(words[0]) == "env" and len(words) > 1:
        name = next((w for w in words[1:] if not w.startswith("-")), "sh")
        return tuple(
            f"{d}/{name}" for d in ("/usr/local/bin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/sbin")
        )
    return (words[0],)
