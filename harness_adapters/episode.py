"""``belayer run-episode``: one real harness on one task, end to end, through a running gateway.

A task is a directory::

    task/
      instruction.md   what the agent is asked to do
      repo/            the repository snapshot: the sandbox's /workspace
      verify.sh        the verifier (sh, run from /workspace in the verify stage); exit code 0 means solved
      tests/           optional hidden tests (also hidden/): with verify.sh, never in the agent's sandbox
      task.json        optional: {"max_turns": 30, "timeout_s": 600, "image": "belayer-sandbox-python",
                                  "setup": ["pip install -e ."], "protected_paths": ["test_*.py"],
                                  "on_tamper": "reset", "verify_timeout_s": 300,
                                  "setup_network": false, "setup_cap_add": []}

A directory with ``task.toml`` is a Harbor-format task instead (`harness_adapters.harbor_task`, docs/harbor.md):
its image is a ``docker build`` of environment/ (`build_harbor_image`: base images found on this host or
mapped by the operator's ``base_images``, never pulled), its working directory, variables, CPUs, memory
and network come from task.toml, and the verify stage runs tests/test.sh on Harbor's reward files, on a
clean copy (the default) or in the agent's own sandbox (``verify="shared"``, or the task's
``[metadata] belayer_verify``); the report adds ``reward``, ``rewards`` and ``verify_mode``. The
``oracle`` harness runs its solution/solve.sh.

An episode runs in three stages:

- **setup**: the task's image (the base image + repo/ + the ``setup`` commands) is built once and cached
  by content hash (`sandbox.task_images`); an episode starts a sandbox from it (``task_start_s``). The
  setup commands run under a sandbox's limits: no network unless ``setup_network``, no capability but
  ``setup_cap_add``, which holds only Docker's default ones (`sandbox.task_images.SETUP_CAPS`) unless the
  operator allows more by name (``--allow-setup-cap``, `EpisodeRunner`'s ``allow_setup_caps``);
- **agent**: the harness works in that sandbox, which holds the repository and nothing of the verifier;
- **verify**: the gateway copies the agent's /workspace out (its processes frozen), resets the
  ``protected_paths`` (``protected_path_modified`` events; ``on_tamper: fail`` gives reward 0 instead),
  and runs verify.sh with the hidden tests in a new sandbox from the clean task image, with no network
  and a clean environment (`sandbox.sessions.verify`). The verdict goes to the reward (a summary, no
  output) and the report (with the verifier's output); nothing of it to the trajectory.

A harness with ``inside = True`` (Claude Code) runs in the sandbox, on the ``network="gateway"``
network, from an image with its files (`sandbox.images.ensure_harness_image`, built on this host's
Docker, under the task image); the others run here with their commands executed in the sandbox
(mini-swe-agent's `belayer_mini_env`).

**Who holds the token.** The runner is the trainer side: its own calls (sessions, sandbox creation, the
verify stage, reward, close, and the commands that launch and watch a harness inside) go to ``/api/``
with `api_token` (``belayer run-episode`` reads ``BELAYER_API_TOKEN``). A harness gets only its
session's capability URLs: ``/s/{id}/v1`` for the model, ``/s/{id}/sandbox/...`` for its tool calls
(`gateway.api.sandbox`). Its environment is built from scratch (`HarnessAdapter.env`), so the token
never reaches it, nor the sandbox.

**Forking** (``fork_at=K, siblings=N``; ``belayer run-episode --fork-at K --siblings N``), for a harness
inside its sandbox only, since its memory travels in the sandbox's checkpoint (one beside runs in this
process, which a sandbox checkpoint does not hold). The runner launches the harness and polls the
session's sandbox until it has a checkpoint with ``keep_through == K``: one taken in turn K + 1's
inference bubble, with the harness waiting on that LLM call (run the gateway with
``--checkpoint-policy always`` so that every bubble gets one). Then it asks the gateway for N children
(``POST /api/sessions/{id}/fork``) and does nothing else: each child's sandbox is that checkpoint
restored, its harness retries the call with its parent's URL, and the sandbox listener puts it in the
child's own session. The parent runs on untouched. The runner then waits for every harness (the
parent's first), verifies each session in its own sandbox, rewards it, and reports per sibling its
verdict, its turns, and what the fork saved it: the output tokens and the tool calls of turns 0..K
(``reused_output_tokens``, ``reused_tool_calls``). Polling is the whole mechanism: no hook in the
harness or the gateway, and a fork point it cannot reach (the harness finished, or checkpoints already
past K without one at K) is an error that says so.

The report says per episode how the gateway built each prompt: prefix reuse, a fresh prompt, or a
branch, and for every branch the first place where the harness's history differs from what it sent
before (``branch_reasons``).

Example::

    runner = EpisodeRunner("http://127.0.0.1:8000", ClaudeCode(Path(".cache/harness")))
    report = runner.run(Task.load(Path("tasks/fix-greet")))
    print(report["verified"], report["prefix_reuse"], report["branches"])
    forked = runner.run(task, fork_at=3, siblings=4)   # + forked["fork"]["siblings"]: one report each
"""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from core.errors import HarnessError, TaskError
from harness_adapters.base import Episode, HarnessAdapter, Outcome, SandboxRef
from harness_adapters.harbor_task import HarborSpec, VerifyMode, interpreter, load_harbor, resolve_env
from sandbox.sessions.verify import LOGS_DIRS, is_protected
from sandbox.supervisor import BUSYBOX
from sandbox.task_images import TaskImage, ensure_task_image

OUT_DIR = "/tmp/belayer-harness"
HOME = "/root"


TASK_KEYS = {
    "max_turns", "timeout_s", "image", "setup", "protected_paths", "on_tamper", "verify_timeout_s",
    "setup_network", "setup_cap_add",
}  # fmt: skip
HIDDEN_DIRS = ("tests", "hidden")


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    root: Path
    instruction: str
    repo: Path
    verifier: Path
    max_turns: int = 30
    timeout_s: float = 600.0
    image: str | None = None
    setup: tuple[str, ...] = ()
    protected_paths: tuple[str, ...] = ()
    on_tamper: Literal["reset", "fail"] = "reset"
    verify_timeout_s: float = 300.0
    setup_network: bool = False
    setup_cap_add: tuple[str, ...] = ()
    workdir: str = "/workspace"
    """The agent's working directory: what a clean verification copies."""
    harbor: HarborSpec | None = None
    """A Harbor-format task's ``task.toml`` (`harness_adapters.harbor_task`); None: Belayer's format."""

    @classmethod
    def load(cls, root: Path) -> Task:
        """The task at `root`: Harbor's format when it holds ``task.toml``, else Belayer's."""
        root = root.resolve()
        if (root / "task.toml").is_file():
            return cls.load_harbor(root)
        need = {
            "instruction.md": root / "instruction.md",
            "repo/": root / "repo",
            "verify.sh": root / "verify.sh",
        }
        missing = [name for name, path in need.items() if not path.exists()]
        if missing:
            raise TaskError(
                f"task {root} lacks {', '.join(missing)} (a task has instruction.md, repo/, verify.sh)"
            )
        options = _options(root / "task.json")
        return cls(
            name=root.name,
            root=root,
            instruction=(root / "instruction.md").read_text().strip(),
            repo=root / "repo",
            verifier=root / "verify.sh",
            **options,
        )

    @classmethod
    def load_harbor(cls, root: Path) -> Task:
        """A Harbor task (`harness_adapters.harbor_task`): its image is its own, its repository in it."""
        spec, instruction = load_harbor(root)
        return cls(
            name=root.name, root=root, instruction=instruction, repo=root / "environment",
            verifier=root / "tests" / "test.sh", timeout_s=spec.agent_timeout_s or 600.0,
            verify_timeout_s=spec.verifier_timeout_s, workdir=spec.workdir or "", harbor=spec,
        )  # fmt: skip

    def files(self) -> list[tuple[str, bytes, int]]:
        """The repository's files: (relative path, content, mode); none for a Harbor task (its image holds
        them)."""
        return [] if self.harbor is not None else _tree(self.repo)

    def verifier_files(self) -> list[tuple[str, bytes, int]]:
        """What the verify stage gets and the agent never sees: verify.sh and the hidden directories (a
        Harbor task's tests/, relative to it)."""
        if self.harbor is not None:
            return _tree(self.root / "tests")
        files = [("verify.sh", self.verifier.read_bytes(), 0o644)]
        for name in HIDDEN_DIRS:
            files += [(f"{name}/{path}", data, mode) for path, data, mode in _tree(self.root / name)]
        return files

    def originals(self) -> list[tuple[str, bytes, int]]:
        """The repository's own versions of the protected files."""
        return [f for f in self.files() if is_protected(f[0], self.protected_paths)]


def _options(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        options: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TaskError(f"{path} is not valid JSON: {exc}") from exc
    unknown = set(options) - TASK_KEYS
    if unknown:
        raise TaskError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(TASK_KEYS)})")
    if options.get("on_tamper", "reset") not in ("reset", "fail"):
        raise TaskError(f"{path}: on_tamper must be 'reset' or 'fail', not {options['on_tamper']!r}")
    if not isinstance(options.get("setup_network", False), bool):
        raise TaskError(f"{path}: setup_network must be true or false")
    for key in ("setup", "protected_paths", "setup_cap_add"):
        value = options.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise TaskError(f"{path}: {key} must be a list of strings")
        options[key] = tuple(value)
    return options


def _tree(root: Path) -> list[tuple[str, bytes, int]]:
    return [
        (str(p.relative_to(root)), p.read_bytes(), p.stat().st_mode & 0o777)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]


class EpisodeRunner:
    """Runs episodes against the gateway at `gateway` (its root URL). See the module docstring."""

    def __init__(
        self,
        gateway: str,
        adapter: HarnessAdapter,
        *,
        client: httpx.Client | None = None,
        progress: Callable[[str], None] | None = None,
        poll_s: float = 1.0,
        api_token: str | None = None,
        allow_setup_caps: tuple[str, ...] = (),
        base_images: Mapping[str, str] | None = None,
        verify: VerifyMode | None = None,
        build_network: bool = False,
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.adapter = adapter
        self.allow_setup_caps = allow_setup_caps  # the operator's word, never the task's
        self.base_images = dict(base_images or {})  # a Harbor Dockerfile's FROM NAME -> a local image
        self.verify = verify  # clean | shared: over the task's [metadata] belayer_verify
        self.build_network = build_network  # a Harbor Dockerfile's RUN steps get the network
        auth = {"authorization": f"Bearer {api_token}"} if api_token else {}
        self.http = client or httpx.Client(timeout=600, headers=auth)  # the sessions API (trainer side)
        self.progress = progress or (lambda _m: None)
        self.poll_s = poll_s

    # ------------------------------------------------------------------ the episode
    def run(
        self,
        task: Task,
        *,
        inside: bool | None = None,
        keep: bool = False,
        metadata: dict[str, Any] | None = None,
        fork_at: int | None = None,
        siblings: int = 2,
    ) -> dict[str, Any]:
        """One episode; with `fork_at`, forked into `siblings` children at that turn (module docstring)."""
        inside = self.adapter.inside if inside is None else inside
        if fork_at is not None and not inside:
            raise HarnessError(
                f"forking needs a harness inside its sandbox (its memory is in the checkpoint); "
                f"{self.adapter.name} runs beside it here"
            )
        self.progress(f"{self.adapter.name}: installing (cached after the first time)")
        self.adapter.install()
        setup_started = time.monotonic()
        image = self.task_image(task, inside)
        task = harbor_workdir(task, image.name)
        sid, base_url, sandbox = self._session(task, image.name, inside, metadata or {})
        task_start_s = time.monotonic() - setup_started
        started = time.monotonic()
        children: list[str] = []
        fork: dict[str, Any] = {}
        try:
            self.progress(
                f"{self.adapter.name}: episode {sid} on task {task.name} ({'inside' if inside else 'beside'}; "
                f"image {image.name}, {'cached' if image.cached else 'built'}, started in {task_start_s:.2f}s)"
            )
            if inside:
                deadline = self._launch(sid, task, sandbox)
                if fork_at is not None:
                    children, fork = self._fork(sid, fork_at, siblings, deadline)
                outcome = self._wait(sid, task, deadline)
            else:
                outcome = self._run_beside(sid, task, base_url)
            agent_s = time.monotonic() - started
            self.progress(f"{self.adapter.name}: harness ended (exit {outcome.returncode}); verifying")
            verdict, trajectory = self._finish(sid, task, keep)
            if fork_at is not None:
                fork["siblings"] = [
                    self._sibling(c, task, keep, deadline, trajectory, fork_at) for c in children
                ]
        finally:
            if not keep:
                for session in [sid, *children]:
                    self.http.post(f"{self.gateway}/api/sessions/{session}/close")
        return {
            "harness": self.adapter.name,
            "task": task.name,
            "session_id": sid,
            "inside": inside,
            **_verdict_report(verdict),
            **_harbor_report(task),
            "task_image": image.name,
            "task_image_cached": image.cached,
            "task_start_s": round(task_start_s, 3),
            "agent_s": round(agent_s, 2),
            "verify_s": verdict["seconds"],
            **_outcome_report(outcome),
            "duration_s": round(time.monotonic() - started, 2),
            **summarize(trajectory),
            **({"fork": fork} if fork_at is not None else {}),
        }

    def _finish(self, sid: str, task: Task, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The verify stage, the reward from its verdict, and the session's trajectory."""
        verdict = self._verify(sid, task, keep)
        reward = {"reward": verdict["reward"], "info": _reward_info(verdict)}
        self._ok(self.http.post(f"{self.gateway}/api/sessions/{sid}/reward", json=reward))
        trajectory = self._ok(self.http.get(f"{self.gateway}/api/sessions/{sid}/trajectory")).json()
        return verdict, dict(trajectory)

    # ------------------------------------------------------------------ forks
    def _fork(self, sid: str, at_turn: int, n: int, deadline: float) -> tuple[list[str], dict[str, Any]]:
        """Once the sandbox has a checkpoint at turn `at_turn` (taken in turn at_turn + 1's bubble, the
        harness waiting on that call), fork the session into `n` children; their harnesses run on."""
        started = time.monotonic()
        while not self._forkable(sid, at_turn):
            if time.monotonic() > deadline:
                raise HarnessError(f"no checkpoint at turn {at_turn} to fork from within the task's timeout")
            time.sleep(min(self.poll_s, 0.2))  # the harness runs in its sandbox: poll the gateway's view
        waited_s = time.monotonic() - started
        body = {"at_turn": at_turn, "n": n, "metadata": {"fork_of": sid}}
        forked = self._ok(self.http.post(f"{self.gateway}/api/sessions/{sid}/fork", json=body)).json()
        children = [str(c["id"]) for c in forked["data"]]
        self.progress(f"{self.adapter.name}: forked {sid} at turn {at_turn} into {', '.join(children)}")
        fork_s = time.monotonic() - started - waited_s
        return children, {"at_turn": at_turn, "waited_s": round(waited_s, 2), "fork_s": round(fork_s, 2)}

    def _forkable(self, sid: str, at_turn: int) -> bool:
        """Whether the sandbox has a checkpoint at turn `at_turn`; an error once it never will."""
        state = self._ok(self.http.get(f"{self.gateway}/api/sessions/{sid}/sandbox")).json()
        kept = [int(c["keep_through"]) for c in state.get("checkpoints", [])]
        if at_turn in kept:
            return True
        if any(k > at_turn for k in kept) or self._sh(sid, f"cat {OUT_DIR}/rc 2>/dev/null || true")["stdout"]:
            raise HarnessError(
                f"the episode went past turn {at_turn} without a checkpoint there (checkpoints at {kept}); "
                "run the gateway with --checkpoint-policy always to fork at any turn"
            )
        return False

    def _sibling(
        self, sid: str, task: Task, keep: bool, deadline: float, parent: dict[str, Any], at_turn: int
    ) -> dict[str, Any]:
        """Wait for a fork child's harness, verify and reward it: its report."""
        outcome = self._wait(sid, task, deadline)
        verdict, trajectory = self._finish(sid, task, keep)
        shared = [t for t in parent["turns"] if t["index"] <= at_turn and t["status"] == "complete"]
        own = [t for t in trajectory["turns"] if t["index"] > at_turn and t["status"] == "complete"]
        return {
            "session_id": sid,
            **_verdict_report(verdict),
            **_outcome_report(outcome),
            "turns": sum(1 for t in trajectory["turns"] if t["status"] == "complete"),
            "own_turns": len(own),
            "reused_turns": len(shared),
            "reused_output_tokens": sum(len(t["output_ids"]) for t in shared),
            "reused_tool_calls": sum(
                len(((t.get("response") or {}).get("message") or {}).get("tool_calls") or []) for t in shared
            ),
        }

    def task_image(self, task: Task, inside: bool) -> TaskImage:
        """The setup stage: the task's image, from the cache or built now (`sandbox.task_images`); on
        the harness's image for a harness inside the sandbox (a Harbor task's image: with the harness's
        files added on top)."""
        if task.harbor is not None:
            image = build_harbor_image(task, self.base_images, network=self.build_network)
            return self._harness_layer(task, image) if inside else image
        if not inside:
            return build_task_image(task, allow_caps=self.allow_setup_caps)
        from sandbox.backends import backend_for
        from sandbox.images import ensure_harness_image

        with backend_for() as backend:
            version = getattr(self.adapter, "installed_version", lambda: None)() or "latest"
            base = ensure_harness_image(backend, self.adapter.name, version, self.adapter.image_files())
        return build_task_image(task, base, allow_caps=self.allow_setup_caps)

    def _harness_layer(self, task: Task, image: TaskImage) -> TaskImage:
        from sandbox.backends import backend_for
        from sandbox.task_images import ensure_harness_layer

        with backend_for() as backend:
            version = getattr(self.adapter, "installed_version", lambda: None)() or "latest"
            files = self.adapter.image_files()
            layer = ensure_harness_layer(backend, task.name, image.name, self.adapter.name, version, files)
        return TaskImage(
            layer.name, image.cached and layer.cached, image.seconds + layer.seconds, image.setup_output
        )

    def _session(
        self, task: Task, image: str, inside: bool, metadata: dict[str, Any]
    ) -> tuple[str, str, dict[str, Any]]:
        spec: dict[str, Any] = {
            "image": image,
            "network": "gateway" if inside else "none",
            "harness_inside": inside,
            "memory_mb": 2048 if inside else 1024,
            "pids_limit": 1024,
        }
        if task.harbor is not None:
            spec |= harbor_sandbox(task, task.harbor, inside)
        meta = {"harness": self.adapter.name, "task": task.name, **metadata}
        body = self._ok(
            self.http.post(f"{self.gateway}/api/sessions", json={"metadata": meta, "sandbox": spec})
        ).json()
        sid = str(body["id"])
        if task.harbor is not None:  # Harbor's scripts write their logs there
            self._sh(
                sid, f"{BUSYBOX} mkdir -p {' '.join(LOGS_DIRS)} && {BUSYBOX} chmod 777 {' '.join(LOGS_DIRS)}"
            )
        return sid, str(body["base_url"]), dict(body["sandbox"])

    def _launch(self, sid: str, task: Task, sandbox: dict[str, Any]) -> float:
        """Start the harness in its sandbox, detached; return the episode's deadline."""
        if not sandbox.get("gateway_url"):
            raise HarnessError("the gateway has no sandbox listener; start it with --sandboxes as root")
        base_url = f"{sandbox['gateway_url']}/v1"
        episode = Episode(
            task.instruction, Path(task.workdir), task.max_turns, task.timeout_s, task_dir=task.root
        )
        script = self.adapter.inside_script(episode, base_url, HOME, OUT_DIR)
        started = time.monotonic()
        launch = f"rm -rf {OUT_DIR}; mkdir -p {OUT_DIR}; setsid sh -c {shlex.quote(script)} >/dev/null 2>&1 &"
        self._sh(sid, f"{launch} echo $! > {OUT_DIR}/pid")
        return started + task.timeout_s

    def _wait(self, sid: str, task: Task, deadline: float) -> Outcome:
        """Wait for the harness in `sid`'s sandbox to exit (a fork child's too: it was restored running)."""
        started = deadline - task.timeout_s
        while True:
            rc = self._sh(sid, f"cat {OUT_DIR}/rc 2>/dev/null || true")["stdout"].strip()
            if rc:
                break
            if time.monotonic() > deadline:
                self._sh(sid, f'kill -9 -- -"$(cat {OUT_DIR}/pid)" 2>/dev/null || true')
                raise HarnessError(f"{self.adapter.name} did not finish within {task.timeout_s:g}s")
            time.sleep(self.poll_s)  # the harness is a separate process in the sandbox: poll its exit file
        out = self._sh(sid, f"cat {OUT_DIR}/stdout", max_output_bytes=16 << 20)["stdout"]
        err = self._sh(sid, f"cat {OUT_DIR}/stderr", max_output_bytes=16 << 20)["stdout"]
        proc = subprocess.CompletedProcess(["(inside)"], int(rc), out, err)
        return self.adapter.collect(proc, Path(HOME), time.monotonic() - started)

    def _run_beside(self, sid: str, task: Task, base_url: str) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="belayer-episode-") as tmp:
            sandbox = SandboxRef(self.gateway, sid, task.workdir)
            episode = Episode(
                task.instruction,
                Path(tmp),
                task.max_turns,
                task.timeout_s,
                sandbox=sandbox,
                task_dir=task.root,
            )
            return self.adapter.run(episode, base_url)

    def _verify(self, sid: str, task: Task, keep: bool) -> dict[str, Any]:
        """The verify stage, run by the gateway (`sandbox.sessions.verify`)."""
        body: dict[str, Any] = {
            "files": [_file(p, d, m) for p, d, m in task.verifier_files()],
            "originals": [_file(p, d, m) for p, d, m in task.originals()],
            "protected_paths": list(task.protected_paths),
            "on_tamper": task.on_tamper,
            "timeout_s": task.verify_timeout_s,
            "keep_sandbox": keep,
            "mode": self.verify or (task.harbor.verify if task.harbor else None) or "clean",
        }
        if task.harbor is not None:
            env = resolve_env(task.harbor.verifier_env, "verifier.env")
            body |= {"format": "harbor", "env": env}
        response = self.http.post(
            f"{self.gateway}/api/sessions/{sid}/sandbox/verify",
            json=body,
            timeout=task.verify_timeout_s + 300,
        )
        return dict(self._ok(response).json())

    def _sh(
        self, sid: str, command: str, timeout_s: float = 60, max_output_bytes: int = 1 << 20
    ) -> dict[str, Any]:
        body = {"command": command, "timeout_s": timeout_s, "max_output_bytes": max_output_bytes}
        url = f"{self.gateway}/api/sessions/{sid}/sandbox/exec"
        response = self.http.post(url, json=body)
        if response.status_code == 409 and response.json()["error"]["code"] == "sandbox_restored":
            # The sandbox failed during this call and was restored (a harness inside comes back with
            # it and carries on by itself): the runner's own command simply runs again.
            self.progress(f"sandbox restored: {response.json()['error']['message']}")
            response = self.http.post(url, json=body)
        return dict(self._ok(response).json())

    @staticmethod
    def _ok(response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise HarnessError(
                f"{response.request.method} {response.request.url.path}: {response.status_code} {message}"
            )
        return response


def build_task_image(task: Task, base: str | None = None, allow_caps: tuple[str, ...] = ()) -> TaskImage:
    """`task`'s image on `base` (default: task.json's ``image``, else the python sandbox image), from
    the cache or built now, on this host's Docker engine; setup capabilities beyond Docker's defaults
    only when the operator allows them (`allow_caps`, checked before anything is built)."""
    from sandbox.task_images import check_setup_caps

    if task.harbor is not None:
        return build_harbor_image(task, {})
    check_setup_caps(task.name, task.setup_cap_add, allow_caps)
    from sandbox.backends import backend_for
    from sandbox.images import ensure_python_image

    with backend_for() as backend:
        base = base or task.image or ensure_python_image(backend)
        return ensure_task_image(
            backend, task.name, base, task.files(), list(task.setup), setup_network=task.setup_network,
            setup_cap_add=task.setup_cap_add, allow_caps=allow_caps,
        )  # fmt: skip


def build_harbor_image(task: Task, base_images: Mapping[str, str], *, network: bool = False) -> TaskImage:
    """A Harbor task's image: ``docker build`` of environment/ (or of ``FROM [environment].docker_image``),
    its base images mapped by `base_images` and found on this host's engine first (never pulled), cached
    by content hash (`sandbox.task_images.ensure_dockerfile_image`); refused when it lacks what the sandbox
    runs from it (/bin/sh, find, tests/test.sh's interpreter)."""
    from sandbox.backends import backend_for
    from sandbox.task_images import SANDBOX_NEEDS, ensure_dockerfile_image

    spec = task.harbor
    if spec is None:
        raise TaskError(f"task {task.name} is not a Harbor task")
    if spec.docker_image is not None:
        context, where = (
            [("Dockerfile", f"FROM {spec.docker_image}\n".encode(), 0o644)],
            "[environment].docker_image",
        )
    else:
        context, where = _tree(task.root / "environment"), "environment/Dockerfile"
    needs = (*SANDBOX_NEEDS, *script_needs("tests/test.sh", task.verifier.read_bytes()))
    with backend_for() as backend:
        return ensure_dockerfile_image(
            backend, task.name, context, where=where, base_images=base_images, timeout_s=spec.build_timeout_s,
            network=network, needs=needs,
        )  # fmt: skip


def script_needs(name: str, script: bytes) -> list[tuple[str, tuple[str, ...]]]:
    """What an image needs to run `script` by its path, as Harbor runs it: its ``#!`` interpreter (for
    ``#!/usr/bin/env X``: env, and X on the usual PATH).

    >>> script_needs("tests/test.sh", b"#!/usr/bin/env bash\\n")[0]
    ('/usr/bin/env (tests/test.sh runs with it)', ('/usr/bin/env',))
    """
    paths = interpreter(script)
    first = script.split(b"\n", 1)[0].decode(errors="replace")
    if first.startswith("#!") and first[2:].split()[:1] == ["/usr/bin/env"] and len(paths) > 1:
        name_of = paths[0].rsplit("/", 1)[-1]
        return [
            (f"/usr/bin/env ({name} runs with it)", ("/usr/bin/env",)),
            (f"{name_of} on PATH ({name}'s interpreter)", paths),
        ]
    return [(f"{paths[0]} ({name}'s interpreter)", paths)]


def harbor_workdir(task: Task, image: str) -> Task:
    """`task` with its working directory: ``[environment].workdir``, else the image's ``WORKDIR``."""
    if task.harbor is None or task.workdir:
        return task
    from sandbox.backends import backend_for

    with backend_for() as backend:
        workdir = backend.image_workdir(image)
    if workdir in ("", "/"):
        raise TaskError(
            f"task {task.name}: its image sets no WORKDIR (or /) and task.toml no [environment].workdir; set "
            "one: the agent works there, and a clean verification copies it"
        )
    return replace(task, workdir=workdir)


def harbor_sandbox(task: Task, spec: HarborSpec, inside: bool) -> dict[str, Any]:
    """A Harbor task's sandbox fields: working directory, variables, CPUs, memory and network."""
    out: dict[str, Any] = {"workdir": task.workdir, "env": resolve_env(spec.env, "environment.env")}
    if spec.cpus is not None:
        out["cpus"] = spec.cpus
    if spec.memory_mb is not None:
        out["memory_mb"] = spec.memory_mb
    if spec.network == "public":
        if inside:
            raise TaskError(
                f"task {task.name}: environment.network_mode = 'public' gives the sandbox the network, but a "
                "harness inside its sandbox needs the gateway-only network; run a harness beside it (--beside, "
                "mini-swe-agent, openhands, oracle) or set network_mode = 'no-network'"
            )
        out["network"] = "full"
    return out


def _harbor_report(task: Task) -> dict[str, Any]:
    if task.harbor is None:
        return {}
    spec = task.harbor
    storage = None
    if spec.storage_mb is not None:
        storage = {
            "asked_mb": spec.storage_mb,
            "enforced": False,
            "why": "the gateway's sandbox disk quota applies",
        }
    return {
        "harbor": {
            "name": spec.name, "workdir": task.workdir, "network": spec.network, "storage_mb": storage,
        }
    }  # fmt: skip


def _verdict_report(verdict: dict[str, Any]) -> dict[str, Any]:
    return {
        "reward": verdict["reward"],
        "rewards": verdict.get("rewards"),
        "verify_mode": verdict.get("mode"),
        "verify_format": verdict.get("format"),
        "verified": verdict["verified"],
        "verifier_output": verdict["output"][-2000:],
        "verifier_exit_code": verdict["exit_code"],
        "verifier_timed_out": verdict["timed_out"],
        "protected_path_changes": verdict["changes"],
        "tamper_action": verdict["tamper_action"],
        "verify_reason": verdict.get("reason"),  # why there is no verdict: workspace_too_large
    }


def _outcome_report(outcome: Outcome) -> dict[str, Any]:
    return {
        "harness_ok": outcome.ok,
        "harness_returncode": outcome.returncode,
        "harness_report": {k: v for k, v in outcome.report.items() if k != "messages"},
        "harness_stderr_tail": outcome.stderr[-2000:],
    }


def _file(path: str, data: bytes, mode: int) -> dict[str, Any]:
    return {"path": path, "content": base64.b64encode(data).decode(), "mode": mode}


def _reward_info(verdict: dict[str, Any]) -> dict[str, Any]:
    """The verdict without the verifier's output (the reward is part of what a trainer reads back)."""
    keys = ("verified", "exit_code", "timed_out", "tamper_action", "protected_paths_modified", "seconds")
    extra = {"verify_reason": verdict.get("reason"), "verify_mode": verdict.get("mode")}
    if verdict.get("rewards") is not None:
        extra["rewards"] = verdict["rewards"]
    return {**{f"verify_{k}": verdict[k] for k in keys}, **extra}


# --------------------------------------------------------------------------- the report
def summarize(trajectory: dict[str, Any]) -> dict[str, Any]:
    """How the gateway built each prompt (prefix reuse, fresh, branch) and why each branch happened."""
    turns = trajectory["turns"]
    events = trajectory["events"]
    first: dict[int, str] = {}
    for e in events:
        if e["kind"] in ("prefix_reuse", "fresh_prompt", "branch") and e["turn_index"] is not None:
            first.setdefault(e["turn_index"], e["kind"])
    by_index = {t["index"]: t for t in turns}
    reasons = []
    for index, kind in sorted(first.items()):
        if kind == "prefix_reuse" or index == 0:
            continue
        previous = by_index.get(index - 1)
        turn = by_index[index]
        reasons.append({"turn": index, "kind": kind, **_first_difference(previous, turn)})
    statuses = Counter(t["status"] for t in turns)
    kinds = Counter(e["kind"] for e in events)
    return {
        "turns": len(turns),
        "statuses": dict(statuses),
        "prefix_reuse": sum(1 for k in first.values() if k == "prefix_reuse"),
        "fresh_prompts": sum(1 for k in first.values() if k == "fresh_prompt"),
        "branches": sum(1 for k in first.values() if k == "branch"),
        "branch_reasons": reasons,
        "failovers": kinds.get("failover", 0),
        "sandbox_checkpoints": kinds.get("sandbox_checkpoint", 0),
        "sandbox_checkpoint_failures": kinds.get("sandbox_checkpoint_failed", 0),
        "sandbox_restores": kinds.get("sandbox_restored", 0),
        "prompt_tokens": [len(t["prompt_ids"]) for t in turns],
        "output_tokens": [len(t["output_ids"]) for t in turns],
    }


def _first_difference(previous: dict[str, Any] | None, turn: dict[str, Any]) -> dict[str, Any]:
    """Where `turn`'s messages stop extending the previous turn's (request messages, then its reply)."""
    if previous is None:
        return {"difference": "no previous turn"}
    before, after = _messages(previous), _messages(turn)
    for i, (a, b) in enumerate(zip(before, after, strict=False)):
        if _norm(a) != _norm(b):
            return {"message_index": i, "before": _norm(a)[:400], "after": _norm(b)[:400]}
    if len(after) <= len(before):
        return {"difference": f"history went from {len(before)} to {len(after)} messages"}
    reply = (previous.get("response") or {}).get("message")
    return {
        "message_index": len(before),
        "difference": "the harness sent back the reply differently from how the gateway gave it",
        "before": _norm(reply)[:400],
        "after": _norm(after[len(before)])[:400],
    }


def _messages(turn: dict[str, Any]) -> list[Any]:
    request = turn.get("request") or {}
    return list(request.get("messages") or [])


def _norm(message: Any) -> str:
    return json.dumps(_strip(message), sort_keys=True, ensure_ascii=False)


def _strip(value: Any) -> Any:
    """Drop what does not render into the prompt (Anthropic's cache_control moves between requests)."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value
