"""A Harbor environment backed by Belayer: each Harbor trial is one Belayer session with a sandbox.

Loaded by Harbor (PyPI ``harbor``, the runner behind Terminal-Bench 2) from its own venv, so it needs
only harbor, httpx and the standard library; Belayer's packages are never imported here::

    PYTHONPATH=harness_adapters/plugins harbor run -p TASK --agent oracle \\
        --env belayer_harbor_env:BelayerEnvironment --ek gateway=http://127.0.0.1:8000

``start`` builds the task's image (``environment/Dockerfile``, with the local ``docker build``, tagged
by the environment's content hash, never pulled) or takes its ``docker_image`` (which must be on the
gateway's Docker engine already), then creates the session with its sandbox in one call
(``POST /api/sessions`` with a sandbox spec: the image, env, cpus, memory, and ``/`` as the sandbox's
workdir, the root of the paths its file API takes: Harbor's files go to /tests, /solution, /logs...).
``exec``, ``upload_*`` and ``download_*`` go through the session's sandbox routes
(``/api/sessions/{id}/sandbox/{exec,files}``): the gateway journals each call, checkpoints the
sandbox in the inference bubbles of the session's model calls, and restores it (replaying the calls
since the checkpoint) when it fails. ``stop`` gives the session the trial's reward (the verifier's
``reward.txt`` or ``reward.json``, which Harbor has downloaded by then) and closes it, which removes
the sandbox; the trajectory stays.

Each ``exec`` runs in a fresh child of the sandbox's shell (``bash -c``, or ``sh -c`` where the image
has no bash), so its ``cd`` and variables do not leak into the next one, as with ``docker exec``; a
``user`` other than root runs it through ``runuser`` (or ``su``).

**The agent's model calls** must go to the session's URLs, which exist only once ``start`` has run:

- an agent installed in the sandbox: the sandbox joins the gateway-only network (``network=gateway``,
  the default), whose containers get ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and
  ``BELAYER_SESSION_URL`` for their session. The variables Harbor passes to an ``exec`` win over the
  container's, so any of their values that starts with the gateway's own URL (give Harbor
  ``--base-url <gateway>/v1``, or ``--ae OPENAI_BASE_URL=<gateway>/v1``) is rewritten to the session's
  in-sandbox URL;
- an agent on the host that calls the model itself (terminus-2): `BelayerTerminus2`, terminus-2 whose
  LiteLLM client is pointed at the trial's ``{gateway}/s/{id}/v1`` before it runs
  (``--agent belayer_harbor_env:BelayerTerminus2 --model openai/policy``). Any other host-side agent can
  read `BelayerEnvironment.openai_base_url` / `anthropic_base_url` in its ``run``.

Options (``--ek key=value``): ``gateway`` (else ``BELAYER_URL``), ``api_token`` (else
``BELAYER_API_TOKEN``; an ``--ek`` value lands in the job's config.json, the variable does not),
``network`` (``none``, ``gateway``, ``full``; default ``gateway``, ``none`` for a task whose
``network_mode`` is ``no-network``), ``recovery`` (``replay`` or ``truncate``: see the sandbox API),
``checkpoint_after_start`` (checkpoint once the sandbox is ready, so a failure before the first model
call restores there instead of failing the trial), ``build_network`` (``docker build --network``),
``memory_mb`` and ``cpus`` (when the task names none: 2048 and 1), ``pids_limit``, ``metadata`` (a
JSON object merged into the session's metadata), ``group`` (the session's routing group; ``{task}`` in it
is the task's name), ``exec_timeout_sec`` (for an exec Harbor gives no
timeout: 3600, the gateway's most). The checkpoint policy itself is the gateway's
(``belayer serve --checkpoint-policy``).

Not supported: docker-compose tasks, host mounts (``--mounts``), GPUs, network allowlists, Windows
images. With a separate verifier environment (``tests/Dockerfile``), the verifier runs in a second
session of its own, and the agent's session is closed before the verdict: it gets no reward.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import tarfile
import uuid
from pathlib import Path
from typing import Any, ClassVar

import httpx
from harbor.agents.terminus_2 import Terminus2
from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import COMPOSE_FILE_NAME, should_use_prebuilt_docker_image
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import NetworkMode

NETWORKS = ("none", "gateway", "full")
MAX_EXEC_S = 3600
"""The gateway's longest exec (``ExecRequest.timeout_s``)."""
TAR_ABOVE = 16
"""A directory of more files than this travels as one tar.gz (needs tar in the sandbox)."""
ROOT_USERS = ("root", "0", 0)
IMAGE_PREFIX = "belayer-harbor"


class BelayerError(RuntimeError):
    """The gateway refused a call; the message is its own (an OpenAI-style error's)."""


class BelayerEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor: its own venv
    """One Harbor trial's environment: a Belayer session and its sandbox (module docstring)."""

    _builds: ClassVar[dict[str, asyncio.Lock]] = {}
    """One build per image tag at a time: concurrent trials of a task wait for the first one's."""

    def __init__(
        self,
        *args: Any,
        gateway: str | None = None,
        api_token: str | None = None,
        network: str | None = None,
        recovery: str = "replay",
        checkpoint_after_start: bool = False,
        build_network: str | None = None,
        memory_mb: int = 2048,
        cpus: float = 1.0,
        pids_limit: int = 1024,
        metadata: dict[str, Any] | None = None,
        group: str | None = None,
        exec_timeout_sec: float = MAX_EXEC_S,
        **kwargs: Any,
    ) -> None:
        url = gateway or os.environ.get("BELAYER_URL")
        if not url:
            raise ValueError(
                "BelayerEnvironment needs the gateway's URL: --ek gateway=http://HOST:PORT (or BELAYER_URL)"
            )
        if network is not None and network not in NETWORKS:
            raise ValueError(f"--ek network={network!r}: use one of {', '.join(NETWORKS)}")
        if recovery not in ("replay", "truncate"):
            raise ValueError(f"--ek recovery={recovery!r}: use replay or truncate")
        self.gateway = url.rstrip("/")
        self._token = api_token or os.environ.get("BELAYER_API_TOKEN")
        self._network = network
        self._recovery = recovery
        self._checkpoint_after_start = checkpoint_after_start
        self._build_network = build_network
        self._defaults = {"memory_mb": memory_mb, "cpus": cpus, "pids_limit": pids_limit}
        self._metadata = metadata or {}
        self._group = group
        self._exec_timeout = min(float(exec_timeout_sec), MAX_EXEC_S)
        self._workdir = "/"
        """Where commands start: the task's workdir, else its image's WORKDIR."""
        self.belayer_session: str | None = None
        """The Belayer session's id, once `start` has created it."""
        self.sandbox_session_url: str | None = None
        """The session's URL as its sandbox reaches it (``network=gateway`` only)."""
        self._client: httpx.AsyncClient | None = None
        super().__init__(*args, **kwargs)
        if self._host_mounts:
            raise ValueError("a Belayer sandbox mounts nothing from the host: drop --mounts")

    # ------------------------------------------------------------------ what Harbor asks of a provider
    @staticmethod
    def type() -> str:
        return "belayer"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists():
            raise ValueError(
                f"{self.environment_dir / COMPOSE_FILE_NAME}: docker-compose tasks do not run in a Belayer "
                "sandbox (one container per session); give the task an environment/Dockerfile"
            )
        dockerfile = self.environment_dir / "Dockerfile"
        if not self.task_env_config.docker_image and not dockerfile.exists():
            raise FileNotFoundError(f"{dockerfile} not found, and the task names no docker_image")

    # ------------------------------------------------------------------ the session's URLs
    @property
    def session_url(self) -> str:
        """``{gateway}/s/{id}``: the session's capability root, from this host."""
        if self.belayer_session is None:
            raise RuntimeError("the Belayer session does not exist before the environment has started")
        return f"{self.gateway}/s/{self.belayer_session}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.session_url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.session_url  # the Anthropic SDK adds /v1 itself

    # ------------------------------------------------------------------ lifecycle
    async def start(self, force_build: bool) -> None:
        image = await self._image(force_build)
        self._workdir = self.task_env_config.workdir or await _image_workdir(image)
        spec: dict[str, Any] = {
            "image": image,
            "workdir": "/",  # where the file API may reach: anywhere
            "env": self._startup_env(),
            "memory_mb": self._effective_memory_mb or self._defaults["memory_mb"],
            "cpus": self._effective_cpus or self._defaults["cpus"],
            "pids_limit": self._defaults["pids_limit"],
            "network": self._sandbox_network(),
            "recovery": self._recovery,
        }
        metadata = {
            "harbor": {
                "environment": self.session_id,
                "task": self.environment_name,
                "trial_id": str(self.context_id) if self.context_id else None,
                "environment_id": self.environment_id,
            },
            **self._metadata,
        }
        self._client = httpx.AsyncClient(
            base_url=self.gateway,
            headers={"Authorization": f"Bearer {self._token}"} if self._token else {},
            timeout=httpx.Timeout(120.0, connect=10.0),
        )
        body: dict[str, Any] = {"metadata": metadata, "sandbox": spec}
        if (
            self._group
        ):  # e.g. {task}: a task's attempts share a worker, whose prefix cache holds their prompt
            body["group"] = self._group.replace("{task}", self.environment_name)
        session = await self._call("POST", "/api/sessions", body)
        self.belayer_session = session["id"]
        self.sandbox_session_url = session["sandbox"].get("gateway_url")
        self.logger.info("Belayer session %s (%s)", session["id"], session["base_url"])
        await self._check(f"mkdir -p {shlex.quote(self._workdir)}", f"make the workdir {self._workdir}")
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()
        if self._checkpoint_after_start:
            await self._call("POST", self._sandbox("checkpoints"))

    async def stop(self, delete: bool) -> None:
        """Reward the session (when the verifier left a reward) and close it, unless ``--no-delete``:
        then it stays open with its sandbox, for a look with the sandbox API."""
        if self._client is None:
            return
        try:
            if self.belayer_session is not None:
                reward = self._reward()
                if reward is not None:
                    await self._call("POST", f"/api/sessions/{self.belayer_session}/reward", reward)
                if delete:
                    await self._call("POST", f"/api/sessions/{self.belayer_session}/close")
                else:
                    self.logger.info("Belayer session %s left open (--no-delete)", self.belayer_session)
        finally:
            await self._client.aclose()
            self._client = None

    def _reward(self) -> dict[str, Any] | None:
        """The verifier's reward from the trial's directory on this host: ``reward.json`` (its
        ``reward`` key, or its one value; all of it goes to ``info``) or ``reward.txt``."""
        json_path, text_path = self.trial_paths.reward_json_path, self.trial_paths.reward_text_path
        try:
            if json_path.exists():
                rewards = json.loads(json_path.read_text())
                if not isinstance(rewards, dict):
                    return {"reward": float(rewards)}
                value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
                return (
                    None if value is None else {"reward": float(value), "info": {"harbor_rewards": rewards}}
                )
            if text_path.exists():
                return {"reward": float(text_path.read_text())}
        except (ValueError, TypeError) as exc:
            self.logger.warning("the verifier's reward could not be read for the Belayer session: %s", exc)
        return None

    def _sandbox_network(self) -> str:
        if self._network is not None:
            return self._network
        if self.network_policy.network_mode == NetworkMode.NO_NETWORK:
            return "none"
        return "gateway"

    # ------------------------------------------------------------------ the image
    async def _image(self, force_build: bool) -> str:
        """The task's image on the gateway's Docker engine: its docker_image, or its Dockerfile built
        here under a content-hash tag (once: a later trial of the same task finds it)."""
        docker_image: str | None = self.task_env_config.docker_image
        if should_use_prebuilt_docker_image(
            self.environment_dir, docker_image=docker_image, force_build=force_build
        ):
            if docker_image is None or not await _has_image(docker_image):
                raise RuntimeError(
                    f"the task's docker_image {docker_image!r} is not on this Docker engine, and Belayer "
                    "never pulls: load or build it first (docker load / docker build -t)"
                )
            return docker_image
        name = re.sub(r"[^a-z0-9_.-]+", "-", self.environment_name.lower()).strip("-.") or "task"
        tag = f"{IMAGE_PREFIX}-{name}:{str(self.environment_id)[:16]}"
        async with self._builds.setdefault(tag, asyncio.Lock()):
            if force_build or not await _has_image(tag):
                await self._build(tag)
        return tag

    async def _build(self, tag: str) -> None:
        dockerfile = self.environment_dir / "Dockerfile"
        for base in base_images(dockerfile.read_text()):
            if not await _has_image(base):
                raise RuntimeError(
                    f"{dockerfile}: its base image {base!r} is not on this Docker engine, and Belayer never "
                    "pulls: build or load it first"
                )
        argv = ["docker", "build", "-t", tag, "-f", str(dockerfile)]
        if self._build_network:
            argv += ["--network", self._build_network]
        self.logger.info("building %s from %s", tag, dockerfile)
        code, output = await _run(*argv, str(self.environment_dir))
        if code != 0:
            raise RuntimeError(f"docker build of {dockerfile} failed (exit {code}):\n{output[-4000:]}")

    # ------------------------------------------------------------------ commands and files
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        timeout = min(float(timeout_sec), MAX_EXEC_S) if timeout_sec else self._exec_timeout
        script = exec_script(command, cwd or self._workdir, self._session_env(env), self._resolve_user(user))
        body = {"command": script, "timeout_s": timeout, "max_output_bytes": 16 << 20}
        try:
            r = await self._call("POST", self._sandbox("exec"), body, timeout=timeout + 600)
        except BelayerError as exc:
            if "command_timeout" in str(exc):
                raise RuntimeError(f"Command timed out after {timeout:g} seconds") from exc
            raise
        return ExecResult(stdout=r["stdout"], stderr=r["stderr"], return_code=r["exit_code"])

    def _session_env(self, env: dict[str, str] | None) -> dict[str, str]:
        """Harbor's variables for an exec, any that points at the gateway pointed at this session."""
        merged = dict(self._merge_env(env) or {})
        inside = self.sandbox_session_url
        if inside is not None:
            for key, value in merged.items():
                if value == self.gateway or value.startswith(f"{self.gateway}/"):
                    rest = value[len(self.gateway) :]
                    merged[key] = inside + rest if not rest.startswith("/s/") else value
        return merged

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        mode = Path(source_path).stat().st_mode & 0o7777
        await self._write(target_path, data, mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        root = Path(source_dir)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if len(files) <= TAR_ABOVE:
            for path in files:
                await self.upload_file(path, f"{target_dir.rstrip('/')}/{path.relative_to(root).as_posix()}")
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(root).as_posix())
        remote = f"/tmp/.belayer-upload-{uuid.uuid4().hex}.tar.gz"
        await self._write(remote, buf.getvalue(), 0o600)
        q = shlex.quote
        await self._check(
            f"mkdir -p {q(target_dir)} && tar xzf {q(remote)} -C {q(target_dir)}; rc=$?; rm -f {q(remote)}; "
            "exit $rc",
            f"unpack {source_dir} into {target_dir}",
        )

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await self._read(source_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        q = shlex.quote
        listing = await self._check(f"cd {q(source_dir)} && find . -type f", f"list {source_dir}")
        names = [line[2:] for line in (listing.stdout or "").splitlines() if line.startswith("./")]
        if len(names) <= TAR_ABOVE:
            for name in names:
                dest = (target / name).resolve()
                if not dest.is_relative_to(target.resolve()):
                    raise RuntimeError(f"{source_dir}/{name} would land outside {target}")
                await self.download_file(f"{source_dir.rstrip('/')}/{name}", dest)
            return
        remote = f"/tmp/.belayer-download-{uuid.uuid4().hex}.tar.gz"
        await self._check(f"tar czf {q(remote)} -C {q(source_dir)} .", f"pack {source_dir}")
        try:
            data = await self._read(remote)
        finally:
            await self.exec(f"rm -f {q(remote)}", user="root")
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(target, filter=transfer_tar_filter)

    async def _check(self, command: str, what: str) -> ExecResult:
        result = await self.exec(command, cwd="/", user="root")
        if result.return_code != 0:
            raise RuntimeError(
                f"could not {what} (exit {result.return_code}): {result.stderr or result.stdout}"
            )
        return result

    async def _write(self, path: str, data: bytes, mode: int) -> None:
        body = {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64", "mode": mode}
        await self._call("PUT", self._sandbox("files"), body)

    async def _read(self, path: str) -> bytes:
        r = await self._call("GET", self._sandbox("files"), params={"path": path})
        content: str = r["content"]
        return base64.b64decode(content) if r["encoding"] == "base64" else content.encode()

    # ------------------------------------------------------------------ HTTP
    def _sandbox(self, route: str) -> str:
        return f"/api/sessions/{self.belayer_session}/sandbox/{route}"

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        if self._client is None:
            raise RuntimeError("the Belayer environment has not been started (or was stopped)")
        limit = httpx.Timeout(timeout, connect=10.0) if timeout else httpx.USE_CLIENT_DEFAULT
        try:
            r = await self._client.request(method, path, json=body, params=params, timeout=limit)
        except httpx.HTTPError as exc:
            raise BelayerError(f"{method} {self.gateway}{path}: {exc!r}") from exc
        if r.status_code >= 400:
            try:
                error = r.json().get("error", {})
                detail = f"{error.get('code') or error.get('type')}: {error.get('message')}"
            except ValueError:
                detail = r.text[:2000]
            raise BelayerError(f"{method} {path} answered {r.status_code} ({detail})")
        answer: dict[str, Any] = r.json()
        return answer


class BelayerTerminus2(Terminus2):  # type: ignore[misc]
    """terminus-2 (Harbor's own agent, on the host) with its model calls in the trial's Belayer session:
    ``--agent belayer_harbor_env:BelayerTerminus2 --model openai/<served name>``."""

    async def run(self, instruction: str, environment: BaseEnvironment, context: AgentContext) -> None:
        if not isinstance(environment, BelayerEnvironment):
            raise TypeError(
                "BelayerTerminus2 runs in a BelayerEnvironment (--env belayer_harbor_env:BelayerEnvironment)"
            )
        if not hasattr(self._llm, "_api_base"):
            raise TypeError(
                f"terminus-2's LLM client {type(self._llm).__name__} has no api_base to point at Belayer"
            )
        self._llm._api_base = environment.openai_base_url
        await super().run(instruction, environment, context)


# ---------------------------------------------------------------------- helpers
def exec_script(command: str, cwd: str | None, env: dict[str, str], user: str | int | None) -> str:
    """The script the sandbox's shell runs for one Harbor exec: a subshell (nothing it changes stays),
    in `cwd`, with `env`, running `command` under bash (sh without) as `user`.

    >>> print(exec_script("echo hi", "/app", {"A": "1"}, None))
    (
    cd -- /app || exit 1
    export A=1
    sh=$(command -v bash || echo sh)
    exec "$sh" -c 'echo hi'
    )
    """
    lines = ["("]
    if cwd:
        lines.append(f"cd -- {shlex.quote(cwd)} || exit 1")
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items() if key.isidentifier()]
    lines.append("sh=$(command -v bash || echo sh)")
    run = f'"$sh" -c {shlex.quote(command)}'
    if user is None or user in ROOT_USERS:
        lines.append(f"exec {run}")
    else:
        who = shlex.quote(str(user))
        lines += [
            f"u=$(getent passwd {who} | cut -d: -f1); [ -n \"$u\" ] || {{ echo 'no user {who}' >&2; exit 1; }}",
            'export HOME="$(getent passwd "$u" | cut -d: -f6)" USER="$u" LOGNAME="$u"',
            f'if command -v runuser >/dev/null; then exec runuser -u "$u" -- {run}; fi',
            f'exec su -p -s "$sh" "$u" -c {shlex.quote(command)}',
        ]
    lines.append(")")
    return "\n".join(lines)


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's stages start from, less ``scratch``, its own stages and names built
    from ARGs (which cannot be known here).

    >>> base_images("FROM belayer-sandbox-python AS base\\nRUN true\\nFROM base\\nFROM --platform=x scratch")
    ['belayer-sandbox-python']
    """
    images, stages = [], set()
    for line in dockerfile.splitlines():
        words = line.split()
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        rest = [w for w in words[1:] if not w.startswith("--")]
        if not rest:
            continue
        image = rest[0]
        if len(rest) >= 3 and rest[1].upper() == "AS":
            stages.add(rest[2].lower())
        if image.lower() not in stages and image != "scratch" and "$" not in image and image not in images:
            images.append(image)
    return images


async def _run(*argv: str) -> tuple[int, str]:
    """Run a command here; its exit code and its output (stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = await proc.communicate()
    except asyncio.CancelledError:  # Harbor's build timeout
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def _has_image(name: str) -> bool:
    code, _ = await _run("docker", "image", "inspect", "--format", "{{.Id}}", name)
    return code == 0


async def _image_workdir(image: str) -> str:
    """The image's WORKDIR (``/`` when it sets none), where Harbor's commands start without a task workdir."""
    code, out = await _run("docker", "image", "inspect", "--format", "{{.Config.WorkingDir}}", image)
    return (out.strip() or "/") if code == 0 else "/"


__all__ = ["BelayerEnvironment", "BelayerTerminus2", "base_images", "exec_script"]
