"""``belayer run-episode``: one real harness on one task, end to end, through a running gateway.

The task (`harness_adapters.task`) is a directory in Belayer's format (instruction.md, repo/, verify.sh,
an optional task.json) or Harbor's (``task.toml``: its own image, and a verify stage on Harbor's reward
files, on a clean copy or in the agent's own sandbox); for a Harbor task the report adds ``reward``,
``rewards`` and ``verify_mode``. The ``oracle`` harness runs a Harbor task's solution/solve.sh.

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
before (``branch_reasons``, `harness_adapters.episode_report`).

Example::

    runner = EpisodeRunner("http://127.0.0.1:8000", ClaudeCode(Path(".cache/harness")))
    report = runner.run(Task.load(Path("tasks/fix-greet")))
    print(report["verified"], report["prefix_reuse"], report["branches"])
    forked = runner.run(task, fork_at=3, siblings=4)   # + forked["fork"]["siblings"]: one report each
"""

from __future__ import annotations

import base64
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from core.errors import HarnessError
from harness_adapters.base import Episode, HarnessAdapter, Outcome, SandboxRef
from harness_adapters.episode_report import (
    harbor_report,
    outcome_report,
    reward_info,
    summarize,
    verdict_report,
)
from harness_adapters.harbor_task import VerifyMode, resolve_env
from harness_adapters.task import (
    Task,
    build_harbor_image,
    build_task_image,
    harbor_sandbox,
    harbor_workdir,
    harness_image,
    harness_layer,
)
from sandbox.sessions.verify_harbor import LOGS_DIRS
from sandbox.supervisor import BUSYBOX
from sandbox.task_images import TaskImage

OUT_DIR = "/tmp/belayer-harness"
HOME = "/root"


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
            **verdict_report(verdict),
            **harbor_report(task),
            "task_image": image.name,
            "task_image_cached": image.cached,
            "task_start_s": round(task_start_s, 3),
            "agent_s": round(agent_s, 2),
            "verify_s": verdict["seconds"],
            **outcome_report(outcome),
            "duration_s": round(time.monotonic() - started, 2),
            **summarize(trajectory),
            **({"fork": fork} if fork_at is not None else {}),
        }

    def _finish(self, sid: str, task: Task, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """The verify stage, the reward from its verdict, and the session's trajectory."""
        verdict = self._verify(sid, task, keep)
        reward = {"reward": verdict["reward"], "info": reward_info(verdict)}
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
            **verdict_report(verdict),
            **outcome_report(outcome),
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
            return harness_layer(task, image, self.adapter) if inside else image
        if not inside:
            return build_task_image(task, allow_caps=self.allow_setup_caps)
        return build_task_image(task, harness_image(self.adapter), allow_caps=self.allow_setup_caps)

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


def _file(path: str, data: bytes, mode: int) -> dict[str, Any]:
    return {"path": path, "content": base64.b64encode(data).decode(), "mode": mode}
