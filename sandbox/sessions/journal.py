"""The tool-call journal: the calls since a sandbox's newest checkpoint, for replay after a failure.

A `Call` is one operation on a sandbox (exec, a file read or write), bound to everything but the
sandbox id, so that it can run again on a restored sandbox. Calls that change the sandbox (exec,
write_file) are journaled once they ran; an exec keeps only its exit code and an output digest, so a
replay can tell whether it diverged without holding every output in memory.

Example::

    call = Call("exec", lambda box: backend.exec(box, "make"), journaled=True, long=True)
    call.result = call.run(box_id)
    journal.record(call)
    result = call.take()          # handed to the caller; the journal keeps its fingerprint
    for again in journal: diverged += not again.same_as(again.run(new_box))
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sandbox.backend import ExecResult, SandboxBackend


@dataclass(slots=True)
class Call:
    """One operation on a sandbox; exec and write_file are journaled for replay."""

    op: str
    run: Callable[[str], Any]
    journaled: bool
    long: bool = False
    """Runs for as long as its command does (exec): it takes a thread of the long-call pool."""
    result: Any = None
    fingerprint: tuple[int, str] | None = None
    """Exit code and output digest of an exec, kept in the journal instead of the output itself."""
    turn: int = -1
    """The session's newest turn when the call ran: a harness outside runs turn k's tool calls after
    turn k's answer, so a fork at turn k replays the calls of the turns before k (`fork`)."""
    args: dict[str, Any] | None = None
    """A journaled call's arguments as JSON values: recorded in the store (``sandbox_call``), so that a
    restarted gateway rebuilds the journal (`bind_call`)."""

    def take(self) -> Any:
        """The result, handed to the caller once (the journal keeps only the fingerprint)."""
        if isinstance(self.result, ExecResult):
            self.fingerprint = fingerprint(self.result)
        result, self.result = self.result, None
        return result

    def diverged(self, again: Any) -> bool:
        """Whether a replay's result differs from the first run's (only execs can tell)."""
        return isinstance(again, ExecResult) and self.fingerprint != fingerprint(again)


def exec_call(
    backend: SandboxBackend,
    command: str,
    *,
    timeout_s: float,
    cwd: str | None,
    env: dict[str, str] | None,
    session: str,
    max_output_bytes: int,
) -> Call:
    """A journaled exec (see `SandboxBackend.exec`)."""
    args = {
        "command": command, "timeout_s": timeout_s, "cwd": cwd, "env": env, "session": session,
        "max_output_bytes": max_output_bytes,
    }  # fmt: skip
    return bind_call(backend, "exec", args)


def write_call(backend: SandboxBackend, path: str, data: bytes, mode: int) -> Call:
    """A journaled file write (see `SandboxBackend.write_file`)."""
    return bind_call(
        backend, "write_file", {"path": path, "data": base64.b64encode(data).decode(), "mode": mode}
    )


def bind_call(backend: SandboxBackend, op: str, args: dict[str, Any]) -> Call:
    """The journaled call `op` with recorded `args` (`Call.args`), to run on `backend`'s sandboxes."""
    if op == "exec":

        def run_exec(box: str) -> ExecResult:
            return backend.exec(
                box, args["command"], timeout_s=args["timeout_s"], cwd=args["cwd"], env=args["env"],
                session=args["session"], max_output_bytes=args["max_output_bytes"],
            )  # fmt: skip

        return Call("exec", run_exec, journaled=True, long=True, args=args)
    if op == "write_file":
        data = base64.b64decode(args["data"])

        def run_write(box: str) -> None:
            backend.write_file(box, args["path"], data, mode=args["mode"])

        return Call("write_file", run_write, journaled=True, args=args)
    raise ValueError(f"not a journaled call: {op!r}")


def fingerprint(result: ExecResult) -> tuple[int, str]:
    return result.exit_code, hashlib.sha256(result.stdout.encode()).hexdigest()


@dataclass(slots=True)
class Journal:
    """The journaled calls since the newest checkpoint, oldest first."""

    calls: list[Call] = field(default_factory=list)

    def record(self, call: Call) -> None:
        if call.journaled:
            self.calls.append(call)

    def clear(self) -> None:
        self.calls = []

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(list(self.calls))
