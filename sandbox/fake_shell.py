"""The fake sandbox's container: its files, its shell sessions, and a tiny shell that runs commands.

`FakeContainer` is what `sandbox.fake.FakeSandboxBackend` keeps per sandbox; a checkpoint copies its
`ContainerState`. `run_script` splits words like ``sh`` (quotes, ``$NAME``/``${NAME}``/``$?``, also
inside single quotes), runs commands joined by newlines, ``;``, ``&&`` and ``||``, redirects stdout
with ``>`` or ``>>``, and knows ``echo [-n]``, ``cat``, ``cd``, ``pwd``, ``export``, ``NAME=value``,
``touch``, ``rm``, ``mkdir``, ``sleep``, ``true``, ``false`` and ``exit [N]``; any other command runs a
`CommandHandler` registered for its name, or fails with 127.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from core.errors import SandboxArgumentError, SandboxError, SandboxTimeout
from sandbox.backend import SandboxSpec, SandboxStatus

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*)|(\?))")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z", re.DOTALL)


@dataclass(slots=True)
class ShellSession:
    """A persistent shell: what one `exec` leaves for the next in the same session."""

    cwd: str
    env: dict[str, str]


@dataclass(slots=True)
class ContainerState:
    """What a checkpoint copies: the filesystem and the sessions (the "processes")."""

    files: dict[str, bytes]
    sessions: dict[str, ShellSession]
    links: dict[str, str] = field(default_factory=dict)
    """Symbolic links: absolute path → target (absolute, or relative to the link's directory)."""


@dataclass(slots=True)
class FakeContainer:
    """One fake sandbox: its state, and whether it still runs."""

    id: str
    spec: SandboxSpec
    state: ContainerState
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: threading.Event = field(default_factory=threading.Event)
    """Set when the container stops or is destroyed: wakes sleeping and hung calls."""
    exit_code: int | None = None
    oom_killed: bool = False
    destroyed: bool = False
    frozen: bool = False
    """A standby not activated yet (`FakeSandboxBackend.restore_standby`): its commands are refused."""

    @property
    def running(self) -> bool:
        return self.exit_code is None and not self.destroyed

    def stop(self, exit_code: int, oom_killed: bool) -> None:
        if self.running:
            self.exit_code, self.oom_killed = exit_code, oom_killed
        self.ended.set()

    def status(self) -> SandboxStatus:
        if self.running:
            return SandboxStatus(running=True)
        detail = f"container exited, exit code {self.exit_code}"
        if self.oom_killed:
            detail += ", killed for running out of memory (raise memory_mb)"
        return SandboxStatus(False, self.exit_code, self.oom_killed, detail)


class Shell:
    """One command's view of its sandbox and session: what a `CommandHandler` works with."""

    def __init__(self, box: FakeContainer, session: ShellSession, deadline: float, timeout_s: float) -> None:
        self._box = box
        self.session = session
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.status = 0

    @property
    def files(self) -> dict[str, bytes]:
        return self._box.state.files

    def path(self, name: str) -> str:
        return posixpath.normpath(posixpath.join(self.session.cwd, name))

    def print(self, text: str) -> None:
        self.stdout.append(text)

    def error(self, text: str) -> None:
        self.stderr.append(text)

    def kill_sandbox(self, *, oom: bool = False) -> NoReturn:
        """The command takes its sandbox down (kills PID 1, eats the memory): the call fails with it."""
        self._box.stop(137, oom)
        raise SandboxError(f"the exec client died: {self._box.status().detail}")

    def wait(self, event: threading.Event | None, seconds: float | None = None) -> None:
        """Block until `event` is set or `seconds` passed; raise on timeout or a stopped sandbox."""
        left = self.deadline - time.monotonic()
        waited = min(left, seconds) if seconds is not None else left
        if event is not None:
            stopped = wait_any(event, self._box.ended, max(waited, 0.0))
        else:
            stopped = self._box.ended.wait(max(waited, 0.0))
        if self._box.ended.is_set():
            raise SandboxError(f"the sandbox stopped during the command: {self._box.status().detail}")
        if not stopped and (seconds is None or seconds > left):
            raise SandboxTimeout(
                f"command timed out after {self.timeout_s:g}s",
                stdout="".join(self.stdout),
                stderr="".join(self.stderr),
            )


CommandHandler = Callable[[Shell, list[str]], int]
"""Runs a command the fake shell does not know: gets the shell and argv, prints, returns the exit code.

Example: ``backend.commands["wait-go"] = lambda sh, argv: (sh.wait(go), 0)[1]`` blocks on an Event."""


def wait_any(first: threading.Event, second: threading.Event, timeout: float | None) -> bool:
    """Wait until either event is set (True) or `timeout` passed (False)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not (first.is_set() or second.is_set()):
        left = 0.01 if deadline is None else min(0.01, deadline - time.monotonic())
        if left <= 0:
            return False
        first.wait(left)
    return True


# --------------------------------------------------------------------------- the tiny shell
@dataclass(slots=True)
class _Command:
    argv: list[str]
    joiner: str = ";"
    """How it follows the previous command: ``;``, ``&&`` or ``||``."""
    redirect: tuple[str, str] | None = None
    """(``>`` or ``>>``, path) for its stdout."""


class _Exit(Exception):
    """The `exit` builtin: control flow that `run_script` always catches, so never an error of Belayer's."""


def run_script(shell: Shell, script: str, commands: dict[str, CommandHandler]) -> None:
    """Run every command of `script`; `shell.status` is the exit status of the last one run."""
    try:
        for line in script.splitlines():
            for command in _parse(shell, line):
                if command.joiner == "&&" and shell.status != 0:
                    continue
                if command.joiner == "||" and shell.status == 0:
                    continue
                shell.status = _run_one(shell, command, commands)
    except _Exit:
        pass


def _parse(shell: Shell, line: str) -> Iterator[_Command]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|>")
    lexer.whitespace_split = True
    current = _Command([])
    tokens = iter(lexer)
    for token in tokens:
        if token in (";", "&&", "||"):
            if current.argv:
                yield current
            current = _Command([], token)
        elif token in (">", ">>"):
            current.redirect = (token, _expand(shell, next(tokens, "")))
        elif token and all(ch in ";&|>" for ch in token):
            raise SandboxArgumentError(f"the fake shell does not support {token!r}")
        else:
            current.argv.append(_expand(shell, token))
    if current.argv:
        yield current


def _expand(shell: Shell, word: str) -> str:
    def value(match: re.Match[str]) -> str:
        if match.group(3):
            return str(shell.status)
        return shell.session.env.get(match.group(1) or match.group(2), "")

    return _VAR.sub(value, word)


def _run_one(shell: Shell, command: _Command, commands: dict[str, CommandHandler]) -> int:
    if time.monotonic() > shell.deadline:
        shell.wait(None, 0)  # raises SandboxTimeout
    mark = len(shell.stdout)
    name, args = command.argv[0], command.argv[1:]
    builtin = _BUILTINS.get(name)
    if builtin is not None:
        status = builtin(shell, args)
    elif name in commands:
        status = commands[name](shell, command.argv)
    elif _ASSIGNMENT.match(name) and not args:
        status = _export(shell, [name])
    else:
        shell.error(f"sh: {name}: not found\n")
        status = 127
    if command.redirect is not None:
        _redirect(shell, mark, *command.redirect)
    return status


def _redirect(shell: Shell, mark: int, op: str, target: str) -> None:
    text = "".join(shell.stdout[mark:]).encode()
    del shell.stdout[mark:]
    if target == "/dev/null":
        return
    path = shell.path(target)
    shell.files[path] = (shell.files.get(path, b"") if op == ">>" else b"") + text


def _echo(shell: Shell, args: list[str]) -> int:
    newline = args[:1] != ["-n"]
    shell.print(" ".join(args[0 if newline else 1 :]) + ("\n" if newline else ""))
    return 0


def _cat(shell: Shell, args: list[str]) -> int:
    status = 0
    for name in args:
        data = shell.files.get(shell.path(name))
        if data is None:
            shell.error(f"cat: {name}: No such file or directory\n")
            status = 1
        else:
            shell.print(data.decode(errors="replace"))
    return status


def _cd(shell: Shell, args: list[str]) -> int:
    shell.session.cwd = shell.path(args[0] if args else "/root")
    return 0


def _pwd(shell: Shell, args: list[str]) -> int:
    shell.print(shell.session.cwd + "\n")
    return 0


def _export(shell: Shell, args: list[str]) -> int:
    for arg in args:
        match = _ASSIGNMENT.match(arg)
        if match is not None:
            shell.session.env[match.group(1)] = match.group(2)
    return 0


def _touch(shell: Shell, args: list[str]) -> int:
    for name in args:
        shell.files.setdefault(shell.path(name), b"")
    return 0


def _rm(shell: Shell, args: list[str]) -> int:
    for name in (a for a in args if not a.startswith("-")):
        shell.files.pop(shell.path(name), None)
    return 0


def _sleep(shell: Shell, args: list[str]) -> int:
    shell.wait(None, float(args[0]) if args else 0.0)
    return 0


def _exit(shell: Shell, args: list[str]) -> int:
    shell.status = int(args[0]) if args else shell.status
    raise _Exit


_BUILTINS: dict[str, CommandHandler] = {
    "echo": _echo, "cat": _cat, "cd": _cd, "pwd": _pwd, "export": _export, "touch": _touch, "rm": _rm,
    "mkdir": lambda shell, args: 0, "sleep": _sleep, "true": lambda shell, args: 0,
    "false": lambda shell, args: 1, "exit": _exit,
}  # fmt: skip
