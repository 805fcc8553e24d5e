"""A mini-swe-agent environment whose commands run in a Belayer sandbox, through the session's sandbox
routes under its capability URL (``POST /s/{id}/sandbox/exec``: no API token, that session's sandbox
only). Loaded by mini-swe-agent from its own venv, so it needs only mini-swe-agent and the standard
library; mini-swe-agent itself is unchanged:

    mini ... -c environment.environment_class=belayer_mini_env.BelayerEnvironment \\
             -c environment.gateway=http://127.0.0.1:8000 -c environment.session=ses_1

A sandbox failure during a call is handled by the gateway (restore + replay, see ``sandbox.sessions.manager``);
a refused call (422, 409, 408 timeout) comes back to the agent as the command's output.
"""

from __future__ import annotations

import json
import platform
import urllib.error
import urllib.request
from typing import Any

from minisweagent.environments.local import LocalEnvironment
from pydantic import BaseModel


class BelayerEnvironmentConfig(BaseModel):
    gateway: str
    session: str
    cwd: str = "/workspace"
    env: dict[str, str] = {}
    timeout: int = 60


class BelayerEnvironment(LocalEnvironment):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=BelayerEnvironmentConfig, **kwargs)

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        seconds = timeout or self.config.timeout
        body = {
            "command": action.get("command", ""),
            "cwd": cwd or self.config.cwd,
            "timeout_s": seconds,
            "env": self.config.env or None,
        }
        url = f"{self.config.gateway.rstrip('/')}/s/{self.config.session}/sandbox/exec"
        request = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=seconds + 120) as response:
                result = json.load(response)
            output = {
                "output": result["stdout"] + result["stderr"],
                "returncode": result["exit_code"],
                "exception_info": "",
            }
        except urllib.error.HTTPError as exc:
            error = json.loads(exc.read() or b"{}").get("error", {})
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"The sandbox refused the command: {error.get('message', exc)}",
                "extra": {"exception_type": error.get("code") or "HTTPError", "exception": str(exc)},
            }
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # A container shares the host's kernel, so its uname is the host's; the host's environment
        # variables are not the sandbox's and are left out.
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}
