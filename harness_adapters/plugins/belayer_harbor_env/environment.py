"""`BelayerEnvironment`: one Harbor trial as a Belayer session with a sandbox, and `BelayerTerminus2`,
terminus-2 with its model calls in that session (the package's docstring says what each call does).

Example::

    harbor run -p TASK --env belayer_harbor_env:BelayerEnvironment --ek gateway=http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import shlex
import tarfile
import uuid
from pathlib import Path
from typing import Any, ClassVar

from harbor.agents.terminus_2 import Terminus2
from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import COMPOSE_FILE_NAME, should_use_prebuilt_docker_image
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import NetworkMode

from .gateway import BelayerError, GatewayClient
from .images import build_image, has_image, image_tag, image_workdir, prebuilt_image

NETWORKS = ("none", "gateway", "full")
MAX_EXEC_S = 3600
"""The gateway's longest exec (``ExecRequest.timeout_s``)."""
TAR_ABOVE = 16
"""A directory of more files than this travels as one tar.gz (needs tar in the sandbox)."""
ROOT_USERS = ("root", "0", 0)


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
        self._client: GatewayClient | None = None
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
        self._workdir = self.task_env_config.workdir or await image_workdir(image)
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
        self._client = GatewayClient(self.gateway, self._token)
        body: dict[str, Any] = {"metadata": metadata, "sandbox": spec}
        if (
            self._group
        ):  # e.g. {task}: a task's attempts share a worker, whose prefix cache holds their prompt
            body["group"] = self._group.replace("{task}", self.environment_name)
        session = await self._api.call("POST", "/api/sessions", body)
        self.belayer_session = session["id"]
        self.sandbox_session_url = session["sandbox"].get("gateway_url")
        self.logger.info("Belayer session %s (%s)", session["id"], session["base_url"])
        await self._check(f"mkdir -p {shlex.quote(self._workdir)}", f"make the workdir {self._workdir}")
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()
        if self._checkpoint_after_start:
            await self._api.call("POST", self._sandbox("checkpoints"))

    async def stop(self, delete: bool) -> None:
        """Reward the session (when the verifier left a reward) and close it, unless ``--no-delete``:
        then it stays open with its sandbox, for a look with the sandbox API."""
        if self._client is None:
            return
        try:
            if self.belayer_session is not None:
                paths = self.trial_paths
                reward = trial_reward(paths.reward_json_path, paths.reward_text_path, self.logger)
                if reward is not None:
                    await self._api.call("POST", f"/api/sessions/{self.belayer_session}/reward", reward)
                if delete:
                    await self._api.call("POST", f"/api/sessions/{self.belayer_session}/close")
                else:
                    self.logger.info("Belayer session %s left open (--no-delete)", self.belayer_session)
        finally:
            await self._client.aclose()
            self._client = None

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
            return await prebuilt_image(docker_image)
        tag = image_tag(self.environment_name, str(self.environment_id))
        async with self._builds.setdefault(tag, asyncio.Lock()):
            if force_build or not await has_image(tag):
                await build_image(tag, self.environment_dir, self._build_network, self.logger)
        return tag

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
            r = await self._api.call("POST", self._sandbox("exec"), body, timeout=timeout + 600)
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
        await self._api.call("PUT", self._sandbox("files"), body)

    async def _read(self, path: str) -> bytes:
        r = await self._api.call("GET", self._sandbox("files"), params={"path": path})
        content: str = r["content"]
        return base64.b64decode(content) if r["encoding"] == "base64" else content.encode()

    # ------------------------------------------------------------------ HTTP
    def _sandbox(self, route: str) -> str:
        return f"/api/sessions/{self.belayer_session}/sandbox/{route}"

    @property
    def _api(self) -> GatewayClient:
        if self._client is None:
            raise RuntimeError("the Belayer environment has not been started (or was stopped)")
        return self._client


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


def trial_reward(json_path: Path, text_path: Path, logger: logging.Logger) -> dict[str, Any] | None:
    """The verifier's reward from the trial's directory on this host: ``reward.json`` (its ``reward``
    key, or its one value; all of it goes to ``info``) or ``reward.txt``; None when there is none, or
    when it holds no number (a warning)."""
    try:
        if json_path.exists():
            rewards = json.loads(json_path.read_text())
            if not isinstance(rewards, dict):
                return {"reward": float(rewards)}
            value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
            return None if value is None else {"reward": float(value), "info": {"harbor_rewards": rewards}}
        if text_path.exists():
            return {"reward": float(text_path.read_text())}
    except (ValueError, TypeError) as exc:
        logger.warning("the verifier's reward could not be read for the Belayer session: %s", exc)
    return None
