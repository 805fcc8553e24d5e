"""A service (`belayer.testing.services.Service`) does not outlive whoever started it: a bench killed
from outside (a test's timeout SIGKILLs it) used to leave its gateway, and the gateway's workers, running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STARTER = """
import sys, time
from pathlib import Path
from belayer.testing.services import Service
s = Service("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"], "http://127.0.0.1:9/",
            Path(sys.argv[1]))
s.start()
print(s.proc.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """No such process, or a zombie (its parent, init here, reaps it when it gets to it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_service_gets_a_sigterm_when_its_starter_is_killed(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "sleeper.log")], stdout=subprocess.PIPE, text=True
    )
    assert starter.stdout is not None
    service = int(starter.stdout.readline())
    try:
        assert not gone(service)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 30
        while not gone(service):  # the kernel's signal is asynchronous: bounded poll
            assert time.monotonic() < deadline, f"service {service} outlived its starter"
            time.sleep(0.01)
    finally:
        if not gone(service):
            os.killpg(service, signal.SIGKILL)
