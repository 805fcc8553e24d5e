"""``belayer run-episode``: one real harness on one task, end to end, through a running gateway.

A task is a directory::

    task/
      instruction.md   what the agent is asked to do
      repo/            the repository snapshot, copied to the sandbox's /workspace
      verify.sh        run in /workspace after the episode (sh); exit code 0 means solved
      task.json        optional: {"max_turns": 30, "timeout_s": 600, "image": "belayer-sandbox-python"}

The runner creates a session with a sandbox, uploads the repository, runs the harness, runs the
verifier in the sandbox, posts the reward (1.0 solved, 0.0 not), reads the trajectory back, and
closes the session (which removes the sandbox). A harness with ``inside = True`` (Claude Code) runs in
the sandbox, on the ``network="gateway"`` network, from an image with its files
(`sandbox.images.ensure_harness_image`, built on this host's Docker); the others run here with their
commands executed in the sandbox (mini-swe-agent's `belayer_mini_env`).

The report says per episode how the gateway built each prompt: prefix reuse, a fresh prompt, or a
branch, and for every branch the first place where the harness's history differs from what it sent
before (``branch_reasons``).

Example::

    runner = EpisodeRunner("http://127.0.0.1:8000", ClaudeCode(Path(".cache/harness")))
    report = runner.run(Task.load(Path("tasks/fix-greet")))
    print(report["verified"], report["prefix_reuse"], report["branches"])
"""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from core.errors import HarnessError, TaskError
from harness_adapters.base import Episode, HarnessAdapter, Outcome, SandboxRef

OUT_DIR = "/tmp/belayer-harness"
HOME = "/root"


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

    @classmethod
    def load(cls, root: Path) -> Task:
        root = root.resolve()
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
        options: dict[str, Any] = {}
        if (root / "task.json").exists():
            try:
                options = json.loads((root / "task.json").read_text())
            except json.JSONDecodeError as exc:
                raise TaskError(f"{root / 'task.json'} is not valid JSON: {exc}") from exc
            unknown = set(options) - {"max_turns", "timeout_s", "image"}
            if unknown:
                raise TaskError(f"{root / 'task.json'}: unknown keys {sorted(unknown)}")
        return cls(
            name=root.name,
            root=root,
            instruction=(root / "instruction.md").read_text().strip(),
            repo=root / "repo",
            verifier=root / "verify.sh",
            **options,
        )

    def files(self) -> list[tuple[str, bytes, int]]:
        """The repository's files: (relative path, content, mode)."""
        return [
            (str(p.relative_to(self.repo)), p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(self.repo.rglob("*"))
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
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.adapter = adapter
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
    ) -> dict[str, Any]:
        inside = self.adapter.inside if inside is None else inside
        self.progress(f"{self.adapter.name}: installing (cached after the first time)")
        self.adapter.install()
        image = self._image(task, inside)
        sid, base_url, sandbox = self._session(task, image, inside, metadata or {})
        started = time.monotonic()
        try:
            self._upload(sid, task)
            self.progress(
                f"{self.adapter.name}: episode {sid} on task {task.name} ({'inside' if inside else 'beside'})"
            )
            if inside:
                outcome = self._run_inside(sid, task, sandbox)
            else:
                outcome = self._run_beside(sid, task, base_url)
            self.progress(f"{self.adapter.name}: harness ended (exit {outcome.returncode}); verifying")
            verified, verifier_output = self._verify(sid, task)
            reward = {"reward": 1.0 if verified else 0.0, "info": {"verifier": verifier_output[-2000:]}}
            self._ok(self.http.post(f"{self.gateway}/api/sessions/{sid}/reward", json=reward))
            trajectory = self._ok(self.http.get(f"{self.gateway}/api/sessions/{sid}/trajectory")).json()
        finally:
            if not keep:
                self.http.post(f"{self.gateway}/api/sessions/{sid}/close")
        return {
            "harness": self.adapter.name,
            "task": task.name,
            "session_id": sid,
            "inside": inside,
            "verified": verified,
            "verifier_output": verifier_output[-2000:],
            "harness_ok": outcome.ok,
            "harness_returncode": outcome.returncode,
            "harness_report": {k: v for k, v in outcome.report.items() if k != "messages"},
            "harness_stderr_tail": outcome.stderr[-2000:],
            "duration_s": round(time.monotonic() - started, 2),
            **summarize(trajectory),
        }

    def _image(self, task: Task, inside: bool) -> str:
        from sandbox.docker_backend import DockerBackendConfig, DockerSandboxBackend
        from sandbox.images import ensure_harness_image, ensure_python_image

        with DockerSandboxBackend(DockerBackendConfig()) as backend:
            if inside:
                version = getattr(self.adapter, "installed_version", lambda: None)() or "latest"
                return ensure_harness_image(backend, self.adapter.name, version, self.adapter.image_files())
            return task.image or ensure_python_image(backend)

    def _session(
        self, task: Task, image: str, inside: bool, metadata: dict[str, Any]
    ) -> tuple[str, str, dict[str, Any]]:
        spec = {
            "image": image,
            "network": "gateway" if inside else "none",
            "harness_inside": inside,
            "memory_mb": 2048 if inside else 1024,
            "pids_limit": 1024,
        }
        meta = {"harness": self.adapter.name, "task": task.name, **metadata}
        body = self._ok(
            self.http.post(f"{self.gateway}/api/sessions", json={"metadata": meta, "sandbox": spec})
        ).json()
        return str(body["id"]), str(body["base_url"]), dict(body["sandbox"])

    def _upload(self, sid: str, task: Task) -> None:
        for path, data, mode in task.files():
            body = {
                "path": path,
                "content": base64.b64encode(data).decode(),
                "encoding": "base64",
                "mode": mode,
            }
            self._ok(self.http.put(f"{self.gateway}/api/sessions/{sid}/sandbox/files", json=body))

    def _run_inside(self, sid: str, task: Task, sandbox: dict[str, Any]) -> Outcome:
        if not sandbox.get("gateway_url"):
            raise HarnessError("the gateway has no sandbox listener; start it with --sandboxes as root")
        base_url = f"{sandbox['gateway_url']}/v1"
        episode = Episode(task.instruction, Path("/workspace"), task.max_turns, task.timeout_s)
        script = self.adapter.inside_script(episode, base_url, HOME, OUT_DIR)
        started = time.monotonic()
        launch = f"rm -rf {OUT_DIR}; mkdir -p {OUT_DIR}; setsid sh -c {shlex.quote(script)} >/dev/null 2>&1 &"
        self._sh(sid, f"{launch} echo $! > {OUT_DIR}/pid")
        deadline = started + task.timeout_s
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
            sandbox = SandboxRef(self.gateway, sid)
            episode = Episode(task.instruction, Path(tmp), task.max_turns, task.timeout_s, sandbox=sandbox)
            return self.adapter.run(episode, base_url)

    def _verify(self, sid: str, task: Task) -> tuple[bool, str]:
        script = base64.b64encode(task.verifier.read_bytes()).decode()
        command = f"echo {script} | base64 -d > /tmp/belayer-verify.sh && cd /workspace && sh /tmp/belayer-verify.sh 2>&1"
        result = self._sh(sid, command, timeout_s=300)
        return result["exit_code"] == 0, str(result["stdout"])

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
