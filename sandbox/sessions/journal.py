"""The tool-call journal: the calls since a sandbox's newest checkpoint, for replay after a failure.

A `Call` is one operation on a sandbox (exec, a file read or write), bound to everything but the
sandbox id, so that it can run again on a restored sandbox. Calls that change the sandbox (exec,
write_file) are journaled once they ran; an exec keeps only its exit code and an output digest, so a
replay can tell whether it diverged without holding every output in memory.

What a journal holds is bounded (`Journal.held`, checked against ``sandbox.max_journal_bytes`` by
`sandbox.sessions.recovery`): a file write's content is held once per distinct content (by SHA-256),
however many writes carried it, and the call's recorded arguments (`Call.args`, what goes to the store
as a ``sandbox_call`` event, and from there to the live event feed) carry only its digest and size,
with the bytes inline only up to `INLINE_BYTES`. A restarted gateway therefore rebuilds a larger
write without its bytes (`Call.replayable` is False): its sandbox, adopted alive, needs none; should it
fail later, it is restored without a replay (`recovery`).

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
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from core.errors import SandboxError
from sandbox.backend import ExecResult, SandboxBackend

INLINE_BYTES = 16 << 10
"""A write's content up to this size is recorded in its ``sandbox_call`` event (a restarted gateway can
replay it); a larger one by digest only, so that the store and the live feed never carry file data."""


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
    restarted gateway rebuilds the journal (`bind_call`). A write's carry its content's ``sha256`` and
    ``size``, and the content itself (``data``, base64) only up to `INLINE_BYTES`."""
    blob: bytes | None = None
    """A write's content, shared with the journal's other writes of the same content; None for a write
    rebuilt from the store without it (not replayable)."""

    @property
    def replayable(self) -> bool:
        """Whether the call can run again: False for a write whose content was not kept (see above)."""
        return self.op != "write_file" or self.blob is not None

    @property
    def digest(self) -> str | None:
        """A write's content digest (SHA-256, hex)."""
        return (
            str(self.args["sha256"])
            if self.op == "write_file" and self.args and "sha256" in self.args
            else None
        )

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
    args: dict[str, Any] = {
        "path": path, "mode": mode, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
    }  # fmt: skip
    if len(data) <= INLINE_BYTES:
        args["data"] = base64.b64encode(data).decode()
    return bind_call(backend, "write_file", args, data)


def bind_call(backend: SandboxBackend, op: str, args: dict[str, Any], blob: bytes | None = None) -> Call:
    """The journaled call `op` with recorded `args` (`Call.args`), to run on `backend`'s sandboxes; a
    write's content is `blob`, else its inline ``data`` (else it is not replayable)."""
    if op == "exec":

        def run_exec(box: str) -> ExecResult:
            return backend.exec(
                box, args["command"], timeout_s=args["timeout_s"], cwd=args["cwd"], env=args["env"],
                session=args["session"], max_output_bytes=args["max_output_bytes"],
            )  # fmt: skip

        return Call("exec", run_exec, journaled=True, long=True, args=args)
    if op == "write_file":
        if blob is None and "data" in args:  # recorded inline (and by gateways before digests)
            blob = base64.b64decode(args["data"])
        call = Call("write_file", _unbound, journaled=True, args=args, blob=blob)

        def run_write(box: str) -> None:
            if call.blob is None:
                raise SandboxError(
                    f"the write of {args['path']} cannot be replayed: its content was not kept"
                )
            backend.write_file(box, args["path"], call.blob, mode=args["mode"])

        call.run = run_write
        return call
    raise ValueError(f"not a journaled call: {op!r}")


def _unbound(box: str) -> None:  # replaced as soon as the call exists
    raise AssertionError("unbound call")


def fingerprint(result: ExecResult) -> tuple[int, str]:
    return result.exit_code, hashlib.sha256(result.stdout.encode()).hexdigest()


@dataclass(slots=True)
class Journal:
    """The journaled calls since the newest checkpoint, oldest first, and what they hold (`held`)."""

    calls: list[Call] = field(default_factory=list)
    held: int = 0
    """Bytes the journal holds for replay: each distinct write content once, and each other call's
    arguments (an exec's command and environment)."""
    _contents: dict[str, bytes] = field(default_factory=dict)

    def cost(self, call: Call) -> int:
        """What recording `call` would add to `held`: nothing for a content the journal already holds."""
        if not call.journaled:
            return 0
        if call.op == "write_file":
            digest = call.digest
            if call.blob is None or (digest is not None and digest in self._contents):
                return 0
            return len(call.blob)
        return len(json.dumps(call.args or {}, ensure_ascii=False).encode("utf-8", "surrogatepass"))

    def record(self, call: Call) -> None:
        if not call.journaled:
            return
        self.held += self.cost(call)
        digest = call.digest
        if call.blob is not None and digest is not None:  # one copy per content: this call shares it
            call.blob = self._contents.setdefault(digest, call.blob)
        self.calls.append(call)

    def clear(self) -> None:
        self.calls, self.held, self._contents = [], 0, {}

    @property
    def replayable(self) -> bool:
        """Whether every call can run again (see `Call.replayable`)."""
        return all(call.replayable for call in self.calls)

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(list(self.calls))
