"""The verify stage of an episode: the agent's work, judged somewhere the agent never was.

`VerifyStage.run` takes the session's sandbox (the agent stage) and:

1. copies its working directory out as a tar, with every process in it frozen (`SandboxBackend.archive`);
   the agent's sandbox is then destroyed, or kept for inspection;
2. rewrites that copy: regular files, directories and symbolic links only (no devices, fifos or
   hard links), no ``__pycache__``/``*.pyc`` (bytecode the agent could have forged), and every
   *protected* path back to the task's original content. Each protected path the agent changed, added
   or deleted is a ``protected_path_modified`` event (with the size of the diff);
3. with ``on_tamper="fail"`` and any such change, stops there: not verified;
4. starts a **new** sandbox from the clean image (the task's image: nothing the agent installed or
   planted outside the working directory, and none of its processes), with no network; empties its
   working directory, unpacks the rewritten copy, then the verifier's files under ``/belayer-verify``
   (a directory the agent never had), and runs ``/belayer-verify/verify.sh`` with ``/bin/sh`` under
   ``env -i``: `VERIFY_ENV` only (system ``PATH``, ``PYTHONNOUSERSITE``, ``PYTHONSAFEPATH``...), with a
   time limit;
   Before the copy, what the agent left running (``agent_processes_left``) and what it changed
   outside the working directory (``outside_workspace_modified``) are recorded: neither reaches
   this stage;
5. destroys the verifier's sandbox and returns the verdict and the output, which go to the caller
   (the reward and the report), never to the trajectory.

Example::

    plan = VerifyPlan(files={"verify.sh": (b"exit 0", 0o644)}, protected=("test_*.py",),
                      originals={"test_a.py": (b"...", 0o644)})
    outcome = await manager.verify("ses_1", plan)
    print(outcome.verified, [c.path for c in outcome.changes])
"""

from __future__ import annotations

import difflib
import fnmatch
import io
import posixpath
import shlex
import tarfile
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from core.errors import SandboxError, SandboxTimeout
from gateway.sandboxes.io import SandboxIO
from gateway.sandboxes.records import EventLog
from sandbox.backend import ExecResult, SandboxSpec
from sandbox.supervisor import ROOT as SUPERVISOR_ROOT

VERIFY_DIR = "/belayer-verify"
VERIFY_PYTHON = "/usr/bin/python3"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VERIFY_ENV = {
    "PATH": SYSTEM_PATH,
    "HOME": f"{VERIFY_DIR}/home",
    "LANG": "C.UTF-8",
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",  # no script directory or cwd in front of sys.path
    "PYTHONDONTWRITEBYTECODE": "1",
    "BELAYER_VERIFY": VERIFY_DIR,
    "BELAYER_TESTS": f"{VERIFY_DIR}/tests",
    "BELAYER_PYTHON": VERIFY_PYTHON,
}
OnTamper = Literal["reset", "fail"]
Change = Literal["modified", "deleted", "added"]


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    """What the verify stage needs from the task. Paths are relative: `files` to ``/belayer-verify``
    (``verify.sh`` is required), `originals` and `protected` to the sandbox's working directory."""

    files: dict[str, tuple[bytes, int]]
    originals: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    """The task's original content (and mode) of every file that a `protected` pattern matches."""
    protected: tuple[str, ...] = ()
    """fnmatch patterns (``*`` also crosses ``/``); a pattern also protects everything under it."""
    on_tamper: OnTamper = "reset"
    timeout_s: float = 300.0
    image: str | None = None
    """The clean image to verify in; None: the image the agent's sandbox was created from."""
    keep_agent_sandbox: bool = False
    max_output_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class ProtectedChange:
    path: str
    change: Change
    diff_lines: int
    """Lines added plus lines removed (a unified diff of the two versions, as text)."""
    bytes_before: int
    bytes_after: int

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "change": self.change, "diff_lines": self.diff_lines,
            "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    verified: bool
    exit_code: int | None
    """None: the verifier did not run (tampering with ``on_tamper="fail"``) or ran out of time."""
    output: str
    timed_out: bool
    changes: tuple[ProtectedChange, ...]
    action: Literal["none", "reset", "fail"]
    seconds: float
    agent_sandbox_kept: bool

    def summary(self) -> dict[str, Any]:
        """The verdict without the verifier's output (for the reward)."""
        return {
            "verified": self.verified, "exit_code": self.exit_code, "timed_out": self.timed_out,
            "tamper_action": self.action, "protected_paths_modified": [c.path for c in self.changes],
            "seconds": round(self.seconds, 3),
        }  # fmt: skip


# --------------------------------------------------------------------------- protected paths
def is_protected(path: str, patterns: tuple[str, ...]) -> bool:
    """Whether relative `path` is protected by one of `patterns`.

    >>> is_protected("tests/unit/test_a.py", ("tests",)), is_protected("a/test_x.py", ("test_*.py",))
    (True, False)
    >>> is_protected("a/test_x.py", ("*/test_*.py",)), is_protected("test_x.py", ("test_*.py",))
    (True, True)
    """
    for pattern in patterns:
        pattern = pattern.strip("/")
        if fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern + "/"):
            return True
        parts = path.split("/")  # a pattern matching a directory protects what is under it
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
            return True
    return False


@dataclass(slots=True)
class _Entry:
    info: tarfile.TarInfo
    data: bytes = b""


def read_tree(tar: bytes, workdir: str) -> dict[str, _Entry]:
    """The archive of `workdir` as relative path → entry: directories, regular files (hard links
    made regular), symbolic links; nothing else, and no bytecode."""
    out: dict[str, _Entry] = {}
    top = posixpath.basename(workdir.rstrip("/"))
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        for member in archive:
            name = posixpath.normpath(member.name)
            if name == top or not name.startswith(top + "/"):
                continue
            rel = name[len(top) + 1 :]
            if rel.startswith("../") or "/../" in rel or _bytecode(rel):
                continue
            if member.isdir() or member.issym():
                out[rel] = _Entry(member)
            elif member.isfile() or member.islnk():
                stream = archive.extractfile(member)
                if stream is not None:
                    info = tarfile.TarInfo(rel)
                    info.mode, info.mtime, info.uid, info.gid = member.mode, member.mtime, 0, 0
                    out[rel] = _Entry(info, stream.read())
    return out


def protect(
    tree: dict[str, _Entry], originals: dict[str, tuple[bytes, int]], patterns: tuple[str, ...]
) -> list[ProtectedChange]:
    """Reset every protected path in `tree` to `originals` (in place); return what had changed."""
    changes: list[ProtectedChange] = []
    for rel in sorted(set(originals) | {p for p in tree if is_protected(p, patterns)}):
        entry, original = tree.get(rel), originals.get(rel)
        if original is None:
            if entry is not None and not entry.info.isdir():
                after = entry.data if entry.info.isfile() else entry.info.linkname.encode()
                changes.append(ProtectedChange(rel, "added", _diff_lines(b"", after), 0, len(after)))
                del tree[rel]
            continue
        data, mode = original
        if entry is not None and entry.info.isfile() and entry.data == data:
            continue
        if entry is None:
            changes.append(ProtectedChange(rel, "deleted", _diff_lines(data, b""), len(data), 0))
        else:
            after = entry.data if entry.info.isfile() else entry.info.linkname.encode()
            changes.append(ProtectedChange(rel, "modified", _diff_lines(data, after), len(data), len(after)))
        _drop_links_above(tree, rel)
        info = tarfile.TarInfo(rel)
        info.mode, info.mtime = mode, int(time.time())
        tree[rel] = _Entry(info, data)
    return changes


def write_tree(tree: dict[str, _Entry], workdir: str) -> bytes:
    """The tree as a tar to unpack at ``/`` (names under `workdir`)."""
    root = workdir.strip("/")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in sorted(tree):
            entry = tree[rel]
            info = entry.info
            info.name = f"{root}/{rel}"
            info.size = len(entry.data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(entry.data) if info.isfile() else None)
    return buf.getvalue()


def verifier_tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    """The verifier's files under ``/belayer-verify`` (and its empty HOME)."""
    buf = io.BytesIO()
    root = VERIFY_DIR.strip("/")
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in (root, f"{root}/home"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for rel, (data, mode) in sorted(files.items()):
            clean = posixpath.normpath(rel)
            if clean.startswith(("/", "..")):
                raise SandboxError(f"verifier file {rel!r} is not a relative path inside the task")
            info = tarfile.TarInfo(f"{root}/{clean}")
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def verify_command(workdir: str) -> str:
    """The verifier, run from `workdir` with nothing of the sandbox shell's environment."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in VERIFY_ENV.items())
    return (
        f"cd {shlex.quote(workdir)} && "
        f"/usr/bin/env -i {env} BELAYER_WORKSPACE={shlex.quote(workdir)} /bin/sh {VERIFY_DIR}/verify.sh"
    )


def outside_changes(changes: list[tuple[str, str]], workdir: str) -> list[tuple[str, str]]:
    """The changes outside `workdir` and the supervisor's directory, without the directories that
    are only listed because something under them changed.

    >>> outside_changes([("modified", "/usr"), ("added", "/usr/bin/x"), ("added", "/workspace/a"),
    ...                  ("added", "/.belayer/ctl"), ("deleted", "/etc/motd")], "/workspace")
    [('added', '/usr/bin/x'), ('deleted', '/etc/motd')]
    """
    skip = (workdir.rstrip("/"), SUPERVISOR_ROOT)
    kept = [(k, p) for k, p in changes if not any(p == s or p.startswith(s + "/") for s in skip)]
    paths = {p for _, p in kept}
    return [(k, p) for k, p in kept if not any(q.startswith(p.rstrip("/") + "/") for q in paths)]


def _bytecode(rel: str) -> bool:
    return rel.endswith((".pyc", ".pyo")) or "__pycache__" in rel.split("/")


def _drop_links_above(tree: dict[str, _Entry], rel: str) -> None:
    """A parent of a reset path that the agent turned into a link or a file goes, so the original is
    written where the verifier will read it."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        parent = "/".join(parts[:i])
        entry = tree.get(parent)
        if entry is not None and not entry.info.isdir():
            del tree[parent]


def _diff_lines(before: bytes, after: bytes) -> int:
    a = before.decode(errors="replace").splitlines()
    b = after.decode(errors="replace").splitlines()
    return sum(
        1
        for line in difflib.unified_diff(a, b, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    )


# --------------------------------------------------------------------------- the stage
class VerifyStage:
    """Runs `VerifyPlan`s for the sandbox manager (it holds the session's slot lock meanwhile)."""

    def __init__(self, io: SandboxIO, events: EventLog, labels: dict[str, str] | None = None) -> None:
        self.io = io
        self.events = events
        self.labels = labels or {}
        """Labels of the verify sandboxes too (the store's identity: one leaked by a crash is removed)."""

    async def copy_out(self, session_id: str, agent_box: str, workdir: str) -> bytes:
        """The agent's working directory, copied with its processes frozen. What the agent left
        running, and what it changed outside the working directory (neither reaches the verify
        stage), are events."""
        backend = self.io.backend
        left = await self.io.op(backend.processes, agent_box)
        if left:
            self.events.add(
                session_id, None, "agent_processes_left", {"count": len(left), "commands": left[:20]}
            )
        outside = outside_changes(await self.io.op(backend.changed_paths, agent_box), workdir)
        if outside:
            data = {"count": len(outside), "paths": [f"{kind} {path}" for kind, path in outside[:50]]}
            self.events.add(session_id, None, "outside_workspace_modified", data)
        return await self.io.op(backend.archive, agent_box, workdir)

    async def judge(
        self, session_id: str, spec: SandboxSpec, plan: VerifyPlan, agent_tar: bytes, kept: bool
    ) -> VerifyOutcome:
        started = time.monotonic()
        tree = read_tree(agent_tar, spec.workdir)
        changes = protect(tree, plan.originals, plan.protected)
        action: Literal["none", "reset", "fail"] = "none" if not changes else plan.on_tamper
        for change in changes:
            self.events.add(
                session_id, None, "protected_path_modified", {**change.as_json(), "action": plan.on_tamper}
            )
        if action == "fail":
            return VerifyOutcome(
                False, None, "", False, tuple(changes), action, time.monotonic() - started, kept
            )
        verified, code, output, timed_out = await self._run(spec, plan, write_tree(tree, spec.workdir))
        return VerifyOutcome(
            verified, code, output, timed_out, tuple(changes), action, time.monotonic() - started, kept
        )

    async def _run(
        self, agent_spec: SandboxSpec, plan: VerifyPlan, workspace: bytes
    ) -> tuple[bool, int | None, str, bool]:
        backend = self.io.backend
        spec = SandboxSpec(
            image=plan.image or agent_spec.image, workdir=agent_spec.workdir, network="none",
            memory_bytes=agent_spec.memory_bytes, pids_limit=agent_spec.pids_limit, cpus=agent_spec.cpus,
            labels={**self.labels, "belayer.stage": "verify"},
        )  # fmt: skip
        box = await self.io.op(backend.create, spec)
        try:
            clear = f"find {shlex.quote(spec.workdir)} -mindepth 1 -delete"
            await self.io.op(backend.exec, box.id, clear, timeout_s=120)
            await self.io.op(backend.extract, box.id, workspace)
            await self.io.op(backend.extract, box.id, verifier_tar(plan.files))
            command = verify_command(spec.workdir)

            def run(sandbox_id: str) -> ExecResult:
                return backend.exec(
                    sandbox_id, command, timeout_s=plan.timeout_s, session="verify",
                    max_output_bytes=plan.max_output_bytes,
                )  # fmt: skip

            try:
                result = await self.io.call(run, box.id, long=True, deadline=plan.timeout_s + 60)
            except (SandboxTimeout, TimeoutError) as exc:
                note = f"\n[belayer] the verifier ran over its time limit ({plan.timeout_s:g}s)"
                return False, None, getattr(exc, "stdout", "") + note, True
            return result.exit_code == 0, result.exit_code, result.stdout + result.stderr, False
        finally:
            await self.io.op(backend.destroy, box.id)
