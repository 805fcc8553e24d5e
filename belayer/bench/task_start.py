"""``belayer bench task-start``: how long an episode's sandbox takes to be ready, from a cached task image
versus building it (a cache miss) versus the old way (the base image, then the repository uploaded
file by file).

Each mode runs ``--repeat`` times on the task (default ``tasks/fix-greet``) and reports its median:

- ``task_start_s_cold``: remove the task image, build it (repository + setup steps), start a sandbox
  from it and run a first command;
- ``task_start_s_cached``: find the image by its content hash, start a sandbox, run a first command;
- ``task_start_s_upload``: start a sandbox from the base image, upload every repository file, run the
  setup steps, run a first command (what run-episode did before task images).

``--setup CMD`` adds setup steps (e.g. a dependency install) to see what a cache hit saves on a
heavier task. Figures go to stdout as ``name: value`` lines, progress to stderr. Needs a Docker engine and the
python sandbox image (``belayer sandbox build-image python``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from belayer.bench import emit
from harness_adapters.task import Task
from sandbox.backend import SandboxSpec
from sandbox.backends import backend_for
from sandbox.images import ensure_python_image
from sandbox.task_images import ensure_task_image, task_image_key, task_image_name


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench task-start", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="tasks/fix-greet")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--setup", action="append", default=[], help="an extra setup step (repeatable)")
    args = p.parse_args(argv)
    task = Task.load(Path(args.task))
    with backend_for() as backend:
        base = task.image or ensure_python_image(backend)
        files, setup = task.files(), [*task.setup, *args.setup]
        name = task_image_name(task.name, task_image_key(backend.image_id(base), "/workspace", files, setup))

        def start(image: str, upload: bool) -> float:
            started = time.monotonic()
            box = backend.create(SandboxSpec(image=image))
            try:
                if upload:
                    for path, data, mode in files:
                        backend.write_file(box.id, path, data, mode=mode)
                    for step in setup:
                        backend.exec(box.id, step, timeout_s=1800)
                backend.exec(box.id, "ls >/dev/null", timeout_s=30)
                return time.monotonic() - started
            finally:
                backend.destroy(box.id)

        def cold() -> float:
            backend.remove_image(name)
            started = time.monotonic()
            image = ensure_task_image(backend, task.name, base, files, setup)
            return time.monotonic() - started + start(image.name, False)

        def cached() -> float:
            started = time.monotonic()
            image = ensure_task_image(backend, task.name, base, files, setup)
            assert image.cached
            return time.monotonic() - started + start(image.name, False)

        figures: dict[str, float] = {}
        for label, run in (("cold", cold), ("cached", cached), ("upload", lambda: start(base, True))):
            times = []
            for i in range(args.repeat):
                times.append(run())
                sys.stderr.write(f"[bench] {label} {i + 1}/{args.repeat}: {times[-1]:.3f}s\n")
            figures[f"task_start_s_{label}"] = statistics.median(times)
    emit("task", f"{task.name} ({len(files)} files, {len(setup)} setup steps)")
    for key, value in figures.items():
        emit(key, value)
    emit("cold_over_cached", figures["task_start_s_cold"] / figures["task_start_s_cached"], digits=2)
    return 0
