"""OpenHands (the ``openhands-sdk`` agent with ``openhands-tools``) on one Belayer session, with its
terminal and file editor acting on the session's sandbox through its sandbox routes under the session's
capability URL (``/s/{id}/sandbox/...``: no API token, that session's sandbox only). Run by
`harness_adapters.openhands` with the OpenHands venv's Python (3.12+), so it needs only OpenHands and
the standard library; OpenHands' own agent loop, prompts, tool schemas and observation texts are used
unchanged, only the two tools' executors are Belayer's:

    python belayer_openhands.py --base-url http://127.0.0.1:8000/s/ses_1/v1 --model policy \\
        --gateway http://127.0.0.1:8000 --session ses_1 --task "fix the test" --output report.json

- ``terminal``: each command runs in the sandbox's persistent shell (``POST .../sandbox/exec``, so ``cd``
  and variables carry over, as in OpenHands' own tmux session), followed by a read-only query of the
  shell's directory and Python interpreter for the observation's footer. ``reset`` moves to a fresh
  shell session; a command that is a Python/JSON literal gets OpenHands' own hint. Unlike OpenHands' tmux
  terminal, nothing is left running: a command runs to its end or to its limit (``timeout``, else
  ``--command-timeout``), where it is killed and the observation says so (``is_input`` has no process
  to talk to).
- ``file_editor``: OpenHands' own ``FileEditor`` works on a local mirror of the path: the file (or a
  directory's two levels of names) is fetched from the sandbox before each call, and a file the editor
  changed is written back (``GET``/``PUT .../sandbox/files``) with its mode. Mirror paths are rewritten
  to the sandbox's in what the model sees.
- ``task_tracker`` and the built-in ``finish`` and ``think`` tools are OpenHands' own (no I/O).

The agent is OpenHands' default CLI agent (``get_default_agent(cli_mode=True)``): those tools and its
default condenser, whose summary requests go to the same session URL (``usage_id`` "condenser").

Nothing is fetched at run time: LiteLLM's cost map is the local copy (LITELLM_LOCAL_MODEL_COST_MAP), the
model name is ``openai/<model>`` with ``base_url`` the session URL, and no observability endpoint is set.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openhands.sdk import LLM, Agent, Conversation, TextContent, Tool
from openhands.sdk.context.condenser import default_condenser
from openhands.sdk.tool import ToolExecutor, register_tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.file_editor.definition import FileEditorAction, FileEditorObservation
from openhands.tools.file_editor.editor import FileEditor
from openhands.tools.file_editor.exceptions import ToolError
from openhands.tools.task_tracker import TaskTrackerTool
from openhands.tools.terminal import TerminalTool
from openhands.tools.terminal.definition import (
    _LITERAL_ARG_HINT_TEMPLATE,
    TerminalAction,
    TerminalObservation,
    looks_like_python_literal_argument,
)
from openhands.tools.terminal.metadata import CmdOutputMetadata

RESET_TEXT = (
    "Terminal session has been reset. All previous environment variables and session state have been cleared."
)
PS1_QUERY = 'printf "%s\\n%s" "$PWD" "$(command -v python3 || command -v python || true)"'


class SandboxAPI:
    """One session's sandbox routes, under its capability URL (urllib: this runs in OpenHands' own venv)."""

    def __init__(self, gateway: str, session: str) -> None:
        self.root = f"{gateway.rstrip('/')}/s/{session}/sandbox"

    def call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.root + path, data, {"Content-Type": "application/json"}, method=method
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            result: dict[str, Any] = json.load(response)
        return result

    def exec(
        self, command: str, timeout_s: float, cwd: str | None = None, shell: str = "main"
    ) -> dict[str, Any]:
        body = {"command": command, "timeout_s": timeout_s, "cwd": cwd, "shell_session": shell}
        return self.call("POST", "/exec", body, timeout_s + 120)

    def read(self, path: str) -> bytes:
        query = urllib.parse.urlencode({"path": path})
        result = self.call("GET", f"/files?{query}", None, 120)
        content = str(result["content"])
        if result["encoding"] == "base64":
            import base64

            return base64.b64decode(content)
        return content.encode()

    def write(self, path: str, data: bytes, mode: int) -> None:
        import base64

        body = {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64", "mode": mode}
        self.call("PUT", "/files", body, 120)


def refusal(exc: urllib.error.HTTPError) -> tuple[str, str]:
    """(code, message) of the gateway's error JSON."""
    try:
        error = json.loads(exc.read() or b"{}").get("error", {})
    except ValueError:
        error = {}
    return str(error.get("code") or exc.code), str(error.get("message") or exc)


# --------------------------------------------------------------------------- terminal
class SandboxTerminalExecutor(ToolExecutor):  # type: ignore[misc]
    """OpenHands' terminal, its commands run in the sandbox's persistent shell."""

    def __init__(self, api: SandboxAPI, cwd: str, default_timeout_s: float) -> None:
        self.api = api
        self.cwd = cwd
        self.default_timeout_s = default_timeout_s
        self.started = False
        self.resets = 0

    @property
    def shell(self) -> str:
        """The sandbox shell session in use: a reset starts a fresh one (the old one stays idle)."""
        return "main" if self.resets == 0 else f"openhands-{self.resets}"

    def __call__(self, action: TerminalAction, conversation: Any = None) -> TerminalObservation:
        if action.reset and action.is_input:
            raise ValueError("Cannot use reset=True with is_input=True")  # as OpenHands' own executor
        literal = None if action.is_input else looks_like_python_literal_argument(action.command)
        if literal is not None:
            head = action.command.lstrip()[:60]
            text = _LITERAL_ARG_HINT_TEMPLATE.format(literal_kind=literal, head=head)
            return TerminalObservation.from_text(text, is_error=True, command=action.command, exit_code=None)
        if action.reset:
            self.resets += 1
            self.started = False
            reset = TerminalObservation.from_text(RESET_TEXT, command="[RESET]", exit_code=0)
            if not action.command.strip():
                return reset
            ran = self.run(action)
            text = f"{RESET_TEXT}\n\n{ran.text}"
            return ran.model_copy(
                update={"content": [TextContent(text=text)], "command": f"[RESET] {action.command}"}
            )
        return self.run(action)

    def run(self, action: TerminalAction) -> TerminalObservation:
        if action.is_input:
            return TerminalObservation.from_text(
                "ERROR: No previous running command to interact with.",
                is_error=True,
                command=action.command,
                exit_code=None,
            )
        if not action.command.strip():
            return TerminalObservation.from_text(
                "ERROR: No previous running command to retrieve logs from.",
                is_error=True,
                command=action.command,
                exit_code=None,
            )
        timeout_s = float(action.timeout) if action.timeout else self.default_timeout_s
        cwd = None if self.started else self.cwd  # the shell starts in the workspace, then keeps its own
        self.started = True
        try:
            result = self.api.exec(action.command, max(timeout_s, 1.0), cwd, self.shell)
        except urllib.error.HTTPError as exc:
            code, message = refusal(exc)
            if code == "command_timeout":  # killed: the sandbox runs each command to its end
                metadata = CmdOutputMetadata(exit_code=-1)
                metadata.suffix = (
                    f"\n[The command was killed after {timeout_s:g} seconds. Set the `timeout` parameter "
                    "for a command that takes longer.]"
                )
                return TerminalObservation.from_text(
                    message, command=action.command, exit_code=-1, timeout=True, metadata=metadata
                )
            return TerminalObservation.from_text(
                f"The sandbox refused the command: {message}", is_error=True, command=action.command
            )
        output = result["stdout"] + result["stderr"]
        metadata = CmdOutputMetadata(exit_code=int(result["exit_code"]))
        metadata.suffix = f"\n[The command completed with exit code {metadata.exit_code}.]"
        try:
            where = self.api.exec(PS1_QUERY, 30, shell=self.shell)["stdout"].split("\n")
            metadata.working_dir = where[0] or None
            metadata.py_interpreter_path = (where[1] if len(where) > 1 else "") or None
        except (urllib.error.URLError, KeyError):
            pass
        return TerminalObservation.from_text(
            output.rstrip("\n"), command=action.command, exit_code=metadata.exit_code, metadata=metadata
        )


class BelayerTerminalTool(TerminalTool):  # type: ignore[misc]
    name = "terminal"  # what the model sees: OpenHands' own tool

    @classmethod
    def create(
        cls, conv_state: Any, gateway: str, session: str, cwd: str, timeout_s: float = 120.0
    ) -> Sequence[TerminalTool]:
        executor = SandboxTerminalExecutor(SandboxAPI(gateway, session), cwd, timeout_s)
        return list(super().create(conv_state, executor=executor))


# --------------------------------------------------------------------------- file editor
class SandboxFileEditorExecutor(ToolExecutor):  # type: ignore[misc]
    """OpenHands' FileEditor on a local mirror of each path it touches, synced with the sandbox."""

    def __init__(self, api: SandboxAPI, cwd: str, mirror: Path) -> None:
        self.api = api
        self.cwd = cwd
        self.mirror = mirror.resolve()
        self.editor = FileEditor(workspace_root=str(self.local(cwd)))

    def local(self, path: str) -> Path:
        return self.mirror / path.lstrip("/")

    def __call__(self, action: FileEditorAction, conversation: Any = None) -> FileEditorObservation:
        path = action.path if action.path.startswith("/") else f"{self.cwd.rstrip('/')}/{action.path}"
        try:
            before = self.fetch(path)
            local = self.local(path)
            arg = str(local) if action.path.startswith("/") else action.path
            try:
                result = self.editor(
                    command=action.command, path=arg, file_text=action.file_text,
                    view_range=action.view_range, old_str=action.old_str, new_str=action.new_str,
                    insert_line=action.insert_line,
                )  # fmt: skip
            except ToolError as exc:
                result = FileEditorObservation.from_text(
                    text=exc.message, command=action.command, is_error=True
                )
            if local.is_file() and (before is None or local.read_bytes() != before[0]):
                self.api.write(path, local.read_bytes(), before[1] if before else 0o644)
        except urllib.error.HTTPError as exc:
            _code, message = refusal(exc)
            return FileEditorObservation.from_text(
                text=f"The sandbox refused the operation: {message}", command=action.command, is_error=True
            )
        return self.unmirror(result)

    def fetch(self, path: str) -> tuple[bytes, int] | None:
        """Make the mirror of `path` what the sandbox has: (content, mode) of a file, else None."""
        local = self.local(path)
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local)
        elif local.exists() or local.is_symlink():
            local.unlink()
        q = shlex.quote(path)
        probe = (
            f"if [ -d {q} ]; then echo d; find {q} -mindepth 1 -maxdepth 2 -type d | sed 's/^/d /'; "
            f"find {q} -mindepth 1 -maxdepth 2 ! -type d | sed 's/^/f /'; "
            f'elif [ -f {q} ]; then echo "f $(stat -c %a {q})"; else echo n; fi'
        )
        lines = self.api.exec(probe, 60)["stdout"].splitlines()
        kind = lines[0].split(" ") if lines else ["n"]
        if kind[0] == "d":
            local.mkdir(parents=True, exist_ok=True)
            for line in lines[1:]:
                entry = self.local(line[2:])
                if line.startswith("d "):
                    entry.mkdir(parents=True, exist_ok=True)
                else:
                    entry.parent.mkdir(parents=True, exist_ok=True)
                    entry.touch()
            return None
        local.parent.mkdir(parents=True, exist_ok=True)
        if kind[0] != "f":
            return None
        data = self.api.read(path)
        mode = int(kind[1], 8) if len(kind) > 1 and kind[1].isdigit() else 0o644
        local.write_bytes(data)
        return data, mode

    def unmirror(self, result: FileEditorObservation) -> FileEditorObservation:
        prefix = str(self.mirror)
        content = [c.model_copy(update={"text": c.text.replace(prefix, "")}) for c in result.content]
        path = result.path.replace(prefix, "") if result.path else result.path
        return result.model_copy(update={"content": content, "path": path})


class BelayerFileEditorTool(FileEditorTool):  # type: ignore[misc]
    name = "file_editor"

    @classmethod
    def create(
        cls, conv_state: Any, gateway: str, session: str, cwd: str, mirror: str
    ) -> Sequence[FileEditorTool]:
        executor = SandboxFileEditorExecutor(SandboxAPI(gateway, session), cwd, Path(mirror))
        local_dir = str(conv_state.workspace.working_dir)
        return [
            tool.model_copy(update={"description": tool.description.replace(local_dir, cwd)}).set_executor(
                executor
            )
            for tool in super().create(conv_state)
        ]


register_tool(BelayerTerminalTool.__name__, BelayerTerminalTool)
register_tool(BelayerFileEditorTool.__name__, BelayerFileEditorTool)


# --------------------------------------------------------------------------- the episode
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run OpenHands on a Belayer session and its sandbox")
    p.add_argument("--base-url", required=True, help="the session's OpenAI base URL (…/s/{id}/v1)")
    p.add_argument("--model", default="policy")
    p.add_argument("--gateway", required=True, help="the gateway's root URL (its sandbox API)")
    p.add_argument("--session", required=True)
    p.add_argument("--cwd", default="/workspace", help="the sandbox's working directory")
    p.add_argument("--task", required=True)
    p.add_argument("--max-iterations", type=int, default=30)
    p.add_argument("--command-timeout", type=float, default=120.0)
    p.add_argument("--output", required=True, help="where the report (JSON) goes")
    args = p.parse_args(argv)

    llm = LLM(
        model=f"openai/{args.model}",
        base_url=args.base_url,
        api_key="dummy",
        api_mode="chat",  # the session's chat completions route
        usage_id="agent",
        input_cost_per_token=0.0,  # the policy has no price (and no entry in LiteLLM's cost map)
        output_cost_per_token=0.0,
    )
    sandbox = {"gateway": args.gateway, "session": args.session, "cwd": args.cwd}
    with tempfile.TemporaryDirectory(prefix="belayer-openhands-") as tmp:
        local = Path(tmp) / "workspace"  # OpenHands' own files (none of the repository's)
        local.mkdir()
        tools = [
            Tool(name=BelayerTerminalTool.__name__, params={**sandbox, "timeout_s": args.command_timeout}),
            Tool(
                name=BelayerFileEditorTool.__name__, params={**sandbox, "mirror": str(Path(tmp) / "mirror")}
            ),
            Tool(name=TaskTrackerTool.name),
        ]
        condenser = default_condenser(llm.model_copy(update={"usage_id": "condenser"}))
        agent = Agent(llm=llm, tools=tools, system_prompt_kwargs={"cli_mode": True}, condenser=condenser)
        conversation = Conversation(
            agent=agent, workspace=str(local), max_iteration_per_run=args.max_iterations, visualizer=None
        )
        error = ""
        try:
            conversation.send_message(args.task)
            conversation.run()
        except Exception as exc:  # reported, and the exit code says it
            error = f"{type(exc).__name__}: {exc}"
        report = _report(conversation, error)
        conversation.close()
    Path(args.output).write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["status"] == "finished" and not error else 1


def _report(conversation: Any, error: str) -> dict[str, Any]:
    from openhands.sdk.event import ActionEvent, AgentErrorEvent, MessageEvent

    state = conversation.state
    events = list(state.events)
    actions = [e for e in events if isinstance(e, ActionEvent)]
    finish = [a for a in actions if a.tool_name == "finish" and a.action is not None]
    replies = [e for e in events if isinstance(e, MessageEvent) and e.source == "agent"]
    result = ""
    if finish:
        result = str(getattr(finish[-1].action, "message", ""))
    elif replies:
        result = "".join(getattr(c, "text", "") for c in replies[-1].llm_message.content)
    metrics = conversation.conversation_stats.get_combined_metrics()
    return {
        "status": str(getattr(state.execution_status, "value", state.execution_status)),
        "tools": [a.tool_name for a in actions],
        "errors": [e.error for e in events if isinstance(e, AgentErrorEvent)],
        "exception": error,
        "result": result,
        "llm_calls": len(metrics.response_latencies),
    }


if __name__ == "__main__":
    sys.exit(main())
