"""``belayer bench harbor-task``: a Harbor task run by the ``oracle`` harness through run-episode's
`EpisodeRunner`, from a cold start (its image built) and a warm one (its image cached), verified
Belayer's way (clean: a copy of the working directory in a new sandbox) and Harbor's (shared: in the
agent's own sandbox).

A gateway with sandboxes (``belayer serve --sandboxes`` in front of a fake engine: the oracle asks no
model) runs ``--repeat`` rounds of three episodes on the task, each round in the order
cold, then warm clean and warm shared (those two swapped every other round):

- **cold** (verified clean): the task image removed first, so ``docker build`` of environment/Dockerfile
  runs again; ``harbor_task_start_s_cold`` is the episode's ``task_start_s`` (the build, the sandbox's
  start, Harbor's log directories made in it);
- **warm clean**: the image found by its content hash (``harbor_task_start_s_warm``), verified
  Belayer's way (``harbor_verify_s_clean``); ``harbor_episode_s_warm`` is the whole episode's wall time
  (start, solve.sh, verification, reward, trajectory, close);
- **warm shared**: the same with ``--verify shared`` (``harbor_verify_s_shared``,
  ``harbor_episode_s_warm_shared``): test.sh in the agent's sandbox, as Harbor runs it.

A verify time is the gateway's verify route as the runner waits for it (`TimedRunner`): in both modes
it ends with the agent's sandbox removed; clean adds the copy out (the agent frozen), a new sandbox from
the clean image and the copy written into it. ``harbor_verify_reported_s_*`` are run-episode's own
``verify_s`` for comparison: the stage's time inside the gateway (since the copy out is counted in it
too, the difference is the route's HTTP and the runner's side).

Figures, as ``name: value`` lines on stdout (progress on stderr): the medians over the rounds (the warm
start over both warm episodes of each round), ``harbor_start_cold_over_warm`` and
``harbor_verify_clean_over_shared``, and per kind the lowest reward seen (``harbor_reward_cold``,
``harbor_reward_clean``, ``harbor_reward_shared``), each of which must be 1.0, else the bench fails after
printing its figures. The ratios are the figures to compare across runs: the machine is noisy, and both
sides of each ratio ran in the same rounds.

Without ``--task``, the bench writes its own task (`write_task`): environment/Dockerfile ``FROM`` the
project's python sandbox image (built offline, ``belayer sandbox build-image python``), a working
directory /app with a Python script and ``--workspace-mib`` MiB of data made at build time, tests/test.sh
writing /logs/verifier/reward.txt, and solution/solve.sh. Its Dockerfile carries a label unique to the
run, so that no image on the engine shares its layers and every cold start builds each step (Docker's
layer cache would otherwise answer); its image is removed at the end. With ``--task DIR`` (a Harbor task
with solution/solve.sh; ``--base-image NAME=LOCAL`` as for run-episode), a cold build may take layers
another image on the engine shares from Docker's cache, and the task's image stays cached.

Example::

    belayer bench harbor-task --repeat 5
    belayer bench harbor-task --task datasets/hello-world --base-image ubuntu:24.04=belayer-sandbox-python
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from belayer.bench import emit
from belayer.bench.stand_up import bench_workdir, ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.testing.services import Service, base_url, fake_engine_service, progress, running
from core.errors import BenchError
from harness_adapters.episode import EpisodeRunner
from harness_adapters.harbor_task import VerifyMode
from harness_adapters.oracle import Oracle
from harness_adapters.task import Task, build_harbor_image
from sandbox.backends import backend_for
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import ensure_python_image

TASK_NAME = "harbor-bench"
WORKDIR = "/app"
GREET = 'print("hello")\n'
TEST = """\
#!/bin/bash
# Harbor's contract: the reward in /logs/verifier/reward.txt (test.sh's exit code does not count)
got="$(python3 greet.py)"
if [ "$got" = "hello, world" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
echo "greet.py said: $got"
"""
SOLVE = """\
#!/bin/bash
printf 'print("hello, world")\\n' > greet.py
"""
TOML = """\
schema_version = "1.1"

[task]
name = "belayer/harbor-bench"

[metadata]
difficulty = "easy"

[agent]
timeout_sec = 300.0

[verifier]
timeout_sec = 300.0

[environment]
network_mode = "no-network"
build_timeout_sec = 600.0
"""
REMOVE_WAIT_S = 60.0
"""How long a cold start waits for the last episode's sandboxes to go (they hold the image) before failing."""


def write_task(root: Path, base: str, run_id: str, workspace_mib: int) -> Path:
    """The bench's own Harbor task at `root` (see the module docstring); `run_id` labels its image."""
    for d in ("environment/app", "tests", "solution"):
        (root / d).mkdir(parents=True, exist_ok=True)
    data = f" && head -c {workspace_mib << 20} /dev/urandom > {WORKDIR}/data.bin" if workspace_mib else ""
    (root / "environment" / "Dockerfile").write_text(
        f"FROM {base}\nLABEL belayer.bench.run={run_id}\nWORKDIR {WORKDIR}\nCOPY app/ {WORKDIR}/\n"
        f"RUN python3 -m compileall -q {WORKDIR}{data}\n"
    )
    (root / "environment" / "app" / "greet.py").write_text(GREET)
    (root / "task.toml").write_text(TOML)
    (root / "instruction.md").write_text("Make greet.py in /app print `hello, world`.\n")
    for path, text in (("tests/test.sh", TEST), ("solution/solve.sh", SOLVE)):
        (root / path).write_text(text)
        (root / path).chmod(0o755)
    return root


@dataclass(frozen=True, slots=True)
class Episode:
    """One oracle episode's figures, from run-episode's report and `TimedRunner`."""

    kind: str
    """cold, clean or shared."""
    start_s: float
    verify_s: float
    """The gateway's verify route, as the runner waits for it (`TimedRunner`)."""
    reported_verify_s: float
    """The report's ``verify_s``: the verdict's own time, which leaves the copy out (clean) and the agent
    sandbox's removal out."""
    episode_s: float
    reward: float
    image: str
    output: str
    """The verifier's output (the end of it), for a reward that is not 1.0."""


class TimedRunner(EpisodeRunner):
    """run-episode's runner, timing its verify stage as an episode pays for it: the gateway's verify route,
    whole (clean: the working directory copied out with the agent frozen, the agent's sandbox removed, the
    copy judged in a new sandbox; shared: test.sh in the agent's sandbox, then that sandbox removed)."""

    verify_wall_s = 0.0

    def _verify(self, sid: str, task: Task, keep: bool) -> dict[str, Any]:
        started = time.monotonic()
        try:
            return super()._verify(sid, task, keep)
        finally:
            self.verify_wall_s = time.monotonic() - started


def episode(runner: TimedRunner, task: Task, kind: str) -> Episode:
    """One episode of `task` by `runner` (its ``verify`` the mode), checked to have found its image cached
    (or not, for a cold one) and verified in the mode asked."""
    runner.verify_wall_s = 0.0
    started = time.monotonic()
    report: dict[str, Any] = runner.run(task)
    seconds = time.monotonic() - started
    if runner.verify_wall_s == 0.0:
        raise BenchError("the verify stage was not timed: EpisodeRunner no longer verifies through _verify")
    cold = kind == "cold"
    if report["task_image_cached"] == cold:
        state = "found it cached" if cold else "built it"
        raise BenchError(f"the {kind} episode {state}: image {report['task_image']}")
    if report["verify_mode"] != runner.verify:
        raise BenchError(f"the {kind} episode was verified {report['verify_mode']}, not {runner.verify}")
    return Episode(
        kind, float(report["task_start_s"]), runner.verify_wall_s, float(report["verify_s"]), seconds,
        float(report["reward"]), str(report["task_image"]), str(report["verifier_output"]),
    )  # fmt: skip


def remove_image(backend: DockerSandboxBackend, name: str) -> None:
    """Remove image `name` (and its untagged layers), waiting for closed sessions' sandboxes to go."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    while not backend.remove_image(name):
        if time.monotonic() > deadline:
            raise BenchError(
                f"image {name} is still used by a container after {REMOVE_WAIT_S:g} s; "
                f"`docker ps -a --filter ancestor={name}` shows which"
            )
        time.sleep(0.2)  # a closed session's sandbox is removed in the background: poll, with a deadline


def rounds(
    runners: dict[VerifyMode, TimedRunner],
    task: Task,
    image: str | None,
    repeat: int,
    backend: DockerSandboxBackend,
    out: list[Episode],
) -> list[Episode]:
    """`repeat` rounds of cold, warm clean and warm shared episodes (see the module docstring), appended to
    `out` as they end. `image`: the task's image, removed before each cold episode; None: not built yet
    (the first cold episode builds it)."""
    for i in range(repeat):
        if image is not None:
            remove_image(backend, image)
        plan: list[tuple[str, VerifyMode]] = [("cold", "clean"), ("clean", "clean"), ("shared", "shared")]
        if i % 2:
            plan = [plan[0], plan[2], plan[1]]
        for kind, mode in plan:
            ep = episode(runners[mode], task, kind)
            progress(
                f"round {i + 1}/{repeat} {kind}: start {ep.start_s:.2f} s, verify {ep.verify_s:.2f} s ({mode}), "
                f"episode {ep.episode_s:.2f} s, reward {ep.reward:g}"
            )
            out.append(ep)
            image = ep.image
    return out


def figures(episodes: list[Episode]) -> dict[str, float]:
    """The medians, ratios and lowest rewards of `episodes` (module docstring)."""

    def of(*kinds: str) -> list[Episode]:
        return [e for e in episodes if e.kind in kinds]

    cold = statistics.median(e.start_s for e in of("cold"))
    warm = statistics.median(e.start_s for e in of("clean", "shared"))
    clean = statistics.median(e.verify_s for e in of("clean"))
    shared = statistics.median(e.verify_s for e in of("shared"))
    reported = {k: statistics.median(e.reported_verify_s for e in of(k)) for k in ("clean", "shared")}
    return {
        "harbor_task_start_s_cold": cold,
        "harbor_task_start_s_warm": warm,
        "harbor_start_cold_over_warm": cold / warm,
        "harbor_verify_s_clean": clean,
        "harbor_verify_s_shared": shared,
        "harbor_verify_clean_over_shared": clean / shared,
        **{f"harbor_verify_reported_s_{k}": v for k, v in reported.items()},
        "harbor_episode_s_warm": statistics.median(e.episode_s for e in of("clean")),
        "harbor_episode_s_warm_shared": statistics.median(e.episode_s for e in of("shared")),
        **{f"harbor_reward_{k}": min(e.reward for e in of(k)) for k in ("cold", "clean", "shared")},
    }


def load_task(opts: argparse.Namespace, workdir: Path, backend: DockerSandboxBackend) -> Task:
    """``--task``, checked to be a Harbor task the oracle can run; else the bench's own, written now."""
    if not opts.task:
        base = ensure_python_image(backend)
        return Task.load(write_task(workdir / TASK_NAME, base, uuid.uuid4().hex, opts.workspace_mib))
    task = Task.load(Path(opts.task))
    if task.harbor is None or not (task.root / "solution" / "solve.sh").is_file():
        raise BenchError(f"{opts.task} is not a Harbor task with solution/solve.sh (which the oracle runs)")
    return task


def measure(
    opts: argparse.Namespace, task: Task, workdir: Path, backend: DockerSandboxBackend
) -> list[Episode]:
    """Stand the gateway up (a fake engine behind it) and run the rounds; the bench's own task's image
    is removed at the end."""
    base_images = dict(opts.base_image)
    image = None
    if opts.task:  # it may be cached already: built (or found) once here, to know the name to remove
        progress(f"building (or finding) the image of task {task.name}")
        image = build_harbor_image(task, base_images).name
    services: list[Service] = []
    runners: dict[VerifyMode, TimedRunner] = {}
    episodes: list[Episode] = []
    try:
        with running(services):
            engine = fake_engine_service(workdir, 16)
            start(services, engine, timeout=120)
            extra = ["--engine-url", base_url(engine), "--sandboxes", "--checkpoint-policy", "never",
                     "--checkpoint-dir", str(workdir / "checkpoints")]  # fmt: skip
            gw = serve_service(workdir, "gateway", opts.model, extra)
            gw.stop_grace = 60.0  # it removes its sandboxes on the way out
            start(services, gw, timeout=300)
            oracle = Oracle(workdir / "harness")
            for mode in ("clean", "shared"):
                runners[mode] = TimedRunner(base_url(gw), oracle, base_images=base_images, verify=mode)
            episodes = rounds(runners, task, image, opts.repeat, backend, episodes)
    finally:
        for runner in runners.values():
            runner.http.close()
        if not opts.task and episodes:
            remove_image(backend, episodes[-1].image)
    return episodes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench harbor-task", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", help="a Harbor task directory with solution/solve.sh (default: the bench's own)")
    p.add_argument(
        "--repeat", type=int, default=5, help="rounds of cold, warm clean and warm shared episodes"
    )
    p.add_argument(
        "--workspace-mib", type=int, default=0,
        help="the bench's own task: MiB of data its image puts in /app (what a clean verification copies)",
    )  # fmt: skip
    p.add_argument(
        "--base-image", action="append", default=[], metavar="NAME=LOCAL", type=_base_image,
        help="as run-episode's: build the task's Dockerfile FROM LOCAL where it says FROM NAME (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--model", default=".cache/tiny-model", help="the gateway's model directory (built if missing)"
    )
    p.add_argument("--dir", help="where the task, stores and logs go (default: a temporary directory)")
    opts = p.parse_args(argv)
    if opts.repeat < 1 or opts.workspace_mib < 0:
        p.error("--repeat must be at least 1 and --workspace-mib at least 0")
    if opts.task and opts.workspace_mib:
        p.error("--workspace-mib shapes the bench's own task; not with --task")
    return opts


def _base_image(text: str) -> tuple[str, str]:
    name, sep, local = text.partition("=")
    if not sep or not name.strip() or not local.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=LOCAL (e.g. ubuntu:24.04=belayer-sandbox-python)"
        )
    return name.strip(), local.strip()


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    interrupt_on_sigterm()
    ensure_model(opts.model)
    workdir = bench_workdir(opts.dir, "belayer-harbor-bench-")
    with backend_for() as backend:  # Docker down: SandboxUnavailable, before any work
        task = load_task(opts, workdir, backend)
        episodes = measure(opts, task, workdir, backend)
    emit("task", f"{task.name} ({opts.repeat} rounds)")
    if not opts.task:
        emit("workspace_mib", opts.workspace_mib)
    for key, value in figures(episodes).items():
        emit(key, value, digits=2 if "_over_" in key else 3)
    unsolved = [e for e in episodes if e.reward != 1.0]
    if unsolved:
        raise BenchError(
            f"the oracle did not solve task {task.name} in {len(unsolved)} episode(s) (the first: {unsolved[0].kind}, "
            f"reward {unsolved[0].reward:g}); its verifier said:\n{unsolved[0].output}"
        )
    return 0
