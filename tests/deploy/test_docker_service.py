"""``deploy/docker`` and ``deploy/compose.yaml`` for real (marker ``docker``): no registry is reachable,
so ``deploy/docker/build.sh`` builds the base image from Debian packages and the images from
``deploy/docker/Dockerfile`` with the dependencies' wheels downloaded on the host (kept while their
source hash label matches, so a rerun only checks it).

- The gateway container in front of a fake engine process on the host (the vLLM HTTP API the gateway
  uses): its HEALTHCHECK turns healthy, ``/health`` is green from outside, an episode runs through it with
  the official openai SDK, and the trajectory survives ``docker restart`` and a new container on the same
  volume.
- The compose file with Debian's ``docker-compose``: the gateway, two workers (the gateway image running
  the fake engine instead of vLLM's image; their GPU reservations dropped) and the trainer example,
  which runs an episode and exits 0. Prometheus is left out: its image needs a registry.

Everything a test starts (containers, networks, volumes, processes) is removed by name or pid, on failure
too.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from core.net import free_port
from tests.support import REPO

DEPLOY = REPO / "deploy"
SETUP = DEPLOY / "host" / "setup_sandbox_host.sh"
BUILD = DEPLOY / "docker" / "build.sh"
GATEWAY_IMAGE = "belayer-gateway:local"
TRAINER_IMAGE = "belayer-trainer-example:local"


def sh(*argv: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done.stdout.strip()


def _engine_answers() -> bool:
    return (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "version"], capture_output=True).returncode == 0
    )


@pytest.fixture(scope="module")
def docker_engine() -> Iterator[None]:
    """The running Docker engine, or one started by the setup script for this module."""
    if _engine_answers():
        yield
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Docker tests: run deploy/host/setup_sandbox_host.sh install first")
        pytest.skip("no Docker engine answers and dockerd cannot be started here (needs root + docker.io)")
    sh(str(SETUP), "start", timeout=60)
    try:
        yield
    finally:
        sh(str(SETUP), "stop", timeout=60)


@pytest.fixture(scope="module")
def images(docker_engine: None) -> dict[str, str]:
    """The gateway and trainer-example images, built unless their source hash label matches."""
    env = {**os.environ, "PYTHON": sys.executable, "BELAYER_GATEWAY_IMAGE": GATEWAY_IMAGE,
           "BELAYER_TRAINER_IMAGE": TRAINER_IMAGE}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([str(BUILD), "all"], capture_output=True, text=True, timeout=1500, env=env)
    sys.stderr.write(done.stderr + f"[images] ready in {time.monotonic() - started:.1f}s\n")
    assert done.returncode == 0, f"deploy/docker/build.sh failed:\n{done.stderr[-4000:]}"
    return {"gateway": GATEWAY_IMAGE, "trainer": TRAINER_IMAGE}


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    """Unique names for this test's containers, network and volume; all removed afterwards."""
    sfx = uuid.uuid4().hex[:8]
    made = {
        "net": f"belayer-svc-net-{sfx}",
        "volume": f"belayer-svc-store-{sfx}",
        "gateway": f"belayer-svc-gw-{sfx}",
    }
    yield made
    sh("docker", "rm", "-f", made["gateway"], check=False)
    sh("docker", "volume", "rm", "-f", made["volume"], check=False)
    sh("docker", "network", "rm", made["net"], check=False)


@pytest.fixture
def host_engine(tiny_model_dir: Path) -> Iterator[int]:
    """A fake engine on the host, on every address (the container reaches it over its network's gateway)."""
    port = free_port()
    argv = [sys.executable, "-m", "engine_pool.fake", "--host", "0.0.0.0", "--port", str(port),
            "--words-from", str(tiny_model_dir), "--token-delay", "0"]  # fmt: skip
    proc = subprocess.Popen(
        argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, 60, "the fake engine")
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def wait_until(ok: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} was not ready within {timeout:.0f}s")
        time.sleep(0.3)


def run_gateway(names: dict[str, str], image: str, model: Path, engine_url: str) -> str:
    """Start the gateway container; return its published address once HEALTHCHECK says healthy."""
    port = free_port()
    sh("docker", "run", "-d", "--name", names["gateway"], "--network", names["net"], "-p", f"127.0.0.1:{port}:8000",
       "-v", f"{names['volume']}:/data", "-v", f"{model}:/models/policy:ro",
       "--health-interval", "1s", "--health-start-period", "60s",  # the image's probe, checked sooner
       image, "--engine-url", engine_url,  # --model: the image's BELAYER_MODEL=/models/policy
       "--public-url", f"http://127.0.0.1:{port}")  # fmt: skip
    url = wait_healthy(names["gateway"])
    assert url == f"http://127.0.0.1:{port}"
    return url


def wait_healthy(container: str, timeout: float = 90) -> str:
    def healthy() -> bool:
        state = json.loads(sh("docker", "inspect", "-f", "{{json .State}}", container))
        if not state["Running"]:
            logs = sh("docker", "logs", "--tail", "40", container, check=False)
            raise AssertionError(
                f"{container} stopped ({state['Status']}, exit {state['ExitCode']}):\n{logs}"
            )
        return bool(state.get("Health", {}).get("Status") == "healthy")

    wait_until(healthy, timeout, f"container {container}")
    host_port = sh("docker", "port", container, "8000/tcp").splitlines()[0]
    url = f"http://{host_port}"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    return url


def episode(url: str, turns: int = 3) -> str:
    """A session with `turns` chat turns through the official openai SDK (the last streamed)."""
    session = httpx.post(f"{url}/api/sessions", json={"metadata": {"from": "docker-test"}}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"turn {i}"})
        if i < turns - 1:
            text = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=12, temperature=0
            )
            content = text.choices[0].message.content
        else:
            stream = client.chat.completions.create(
                model="policy", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert content
        messages.append({"role": "assistant", "content": content})
    return str(session["id"])


def trajectory(url: str, sid: str) -> list[tuple[list[int], list[int]]]:
    turns = httpx.get(f"{url}/api/sessions/{sid}/trajectory").raise_for_status().json()["turns"]
    return [(t["prompt_ids"], t["output_ids"]) for t in turns]


@pytest.mark.docker
def test_gateway_container_serves_an_episode_and_keeps_its_store(
    images: dict[str, str], names: dict[str, str], host_engine: int, tiny_model_dir: Path
) -> None:
    sh("docker", "network", "create", names["net"])
    host = sh("docker", "network", "inspect", "-f", "{{(index .IPAM.Config 0).Gateway}}", names["net"])
    url = run_gateway(names, images["gateway"], tiny_model_dir, f"http://{host}:{host_engine}")
    assert sh("docker", "exec", names["gateway"], "id", "-un") == "belayer"  # not root

    sid = episode(url)
    turns = trajectory(url, sid)
    assert len(turns) == 3 and all(out for _, out in turns)
    for (prompt, out), (next_prompt, _) in itertools.pairwise(turns):
        assert next_prompt[: len(prompt) + len(out)] == prompt + out  # prefix reuse through the container

    sh("docker", "restart", names["gateway"], timeout=60)
    url = wait_healthy(names["gateway"])
    assert trajectory(url, sid) == turns

    # A new container on the same volume: the store lives on /data, not in the container's layer.
    sh("docker", "stop", names["gateway"], timeout=60)
    sh("docker", "rm", names["gateway"])
    url = run_gateway(names, images["gateway"], tiny_model_dir, f"http://{host}:{host_engine}")
    assert trajectory(url, sid) == turns


def compose_without_gpus(tmp: Path) -> Path:
    """deploy/compose.yaml with the workers' GPU reservations dropped (no GPU here), nothing else changed."""
    spec = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name in ("worker-0", "worker-1"):
        devices = spec["services"][name].pop("deploy")["resources"]["reservations"]["devices"]
        assert [d["capabilities"] for d in devices] == [["gpu"]]
    out = tmp / "compose.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


@pytest.mark.docker
def test_compose_runs_the_gateway_workers_and_the_trainer_example(
    images: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    compose_bin = shutil.which("docker-compose")
    if compose_bin is None:
        pytest.fail("docker-compose is missing: deploy/host/setup_sandbox_host.sh install installs Debian's")
    port = free_port()
    env = {
        **os.environ,
        "BELAYER_GATEWAY_IMAGE": images["gateway"],
        "BELAYER_TRAINER_IMAGE": images["trainer"],
        # vLLM's image needs a registry and a GPU: the gateway image runs the fake engine instead.
        "BELAYER_WORKER_IMAGE": images["gateway"],
        "BELAYER_WORKER_ENTRYPOINT": "python3 -m engine_pool.fake",
        "BELAYER_WORKER_ARGS": "--host 0.0.0.0 --port 8000 --model policy --words-from /models/policy --token-delay 0",
        "BELAYER_MODEL_DIR": str(tiny_model_dir),
        "BELAYER_PUBLISH": f"127.0.0.1:{port}",
    }
    project = f"belayertest{uuid.uuid4().hex[:8]}"
    file = compose_without_gpus(tmp_path)
    base = [compose_bin, "--project-name", project, "--project-directory", str(DEPLOY), "--file"]
    sh(*base, str(DEPLOY / "compose.yaml"), "config", "--quiet", env=env)  # the whole file, Prometheus too
    compose = [*base, str(file)]
    try:
        sh(*compose, "up", "--detach", "--no-build", "gateway", "worker-0", "worker-1", env=env, timeout=180)
        wait_until(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, 90, "the compose gateway")
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert len(health["ready_workers"]) == 2, health
        out = sh(*compose, "run", "--rm", "trainer", env=env, timeout=180)
        summary = json.loads(out.splitlines()[-1].removeprefix("[trainer] "))
        assert summary["ok"] and summary["turns"] == 3 and summary["generated_tokens"] > 0, out
    finally:
        logs = subprocess.run(
            [*compose, "logs", "--no-color", "--tail", "30"], capture_output=True, text=True, env=env
        )
        sys.stderr.write(logs.stdout[-4000:])
        sh(
            *compose,
            "down",
            "--volumes",
            "--remove-orphans",
            "--timeout",
            "5",
            env=env,
            timeout=120,
            check=False,
        )
    left = sh("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={project}")
    assert not left, f"compose left containers: {left}"


def test_compose_prometheus_config_matches_the_observability_one() -> None:
    """deploy/docker/prometheus.yml is deploy/observability/prometheus.yml aimed at the compose service."""
    ours = yaml.safe_load((DEPLOY / "docker" / "prometheus.yml").read_text())
    theirs = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())
    for job in theirs["scrape_configs"]:
        job["static_configs"] = [{"targets": ["gateway:8000"]}]
    assert ours == theirs
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert (
        "./docker/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in compose["services"]["prometheus"]["volumes"]
    )
    assert "gateway" in compose["services"]  # the scrape target's name
