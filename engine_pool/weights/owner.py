"""The weight owner: one process per host (per device) that holds the model's weights apart from any
worker, in shared memory, so that workers and shadows map one copy (``belayer serve --weight-owner``).

The owner process (``python -m engine_pool.weights.owner``) takes the owner's lock (``core.shm_weights``),
has ``belayer_vllm.export`` lay the weights out in ``/dev/shm`` in vLLM's parameter layout (with the
workers' own vLLM arguments; a complete layout a killed owner left is kept), says it is ready, and then
only holds the lock until it is stopped, when it removes the files. Workers launched with
``--load-format belayer_shm`` map the layout while the owner lives, and load from disk otherwise.

The pool drives it through `WeightOwner`: started before the workers, checked (`healthy`: the process,
its lock and its ready mark) whenever a worker fails and on every probe round, and restarted when it
died (workers launched meanwhile load from disk). A shadow promoted meanwhile keeps working: its mappings
outlive the owner. After a weight update the pool starts a `successor` for the update's checkpoint (the
same vLLM arguments, that checkpoint's weights), `publish` es it once it is ready (the pointer workers'
loaders follow, ``shm_weights.current``), and stops the old owner.

Example::

    owner = WeightOwner(spec, base="/dev/shm/belayer-weights", log_dir=Path("logs"))
    await owner.start()           # returns once the weights are in shared memory
    ...
    await owner.stop()            # the shared-memory files are removed
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

from core import shm_weights
from core.errors import ConfigError, EngineUnavailable
from engine_pool.workers.worker import WorkerSpec, launch_group, stop_group

LOAD_FORMAT = "belayer_shm"


def loader_args(base: str, linear: str = "shared") -> tuple[str, ...]:
    """The vLLM arguments that make a worker map the owner's weights (``belayer_vllm.loader``), and
    that let the pool bring it back onto the owner's pages after an update (``belayer_vllm.worker``).

    >>> loader_args("/dev/shm/w")[:4]
    ('--load-format', 'belayer_shm', '--model-loader-extra-config', '{"dir": "/dev/shm/w", "linear": "shared"}')
    >>> loader_args("/dev/shm/w")[4:]
    ('--worker-extension-cls', 'belayer_vllm.worker.SharedWeights')
    """
    extra = json.dumps({"dir": base, "linear": linear})
    return ("--load-format", LOAD_FORMAT, "--model-loader-extra-config", extra,
            "--worker-extension-cls", shm_weights.WORKER_EXTENSION)  # fmt: skip


def maps_owner(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether a worker launched with `argv` loads with ``belayer_shm`` (vLLM takes the last
    ``--load-format``), and so can be re-mapped onto the owner's pages after an update.

    >>> maps_owner(["vllm", *loader_args("/dev/shm/w")]), maps_owner(["--load-format=belayer_shm"])
    (True, True)
    >>> maps_owner([*loader_args("/dev/shm/w"), "--load-format", "auto"]), maps_owner([])
    (False, False)
    """
    value = None
    for i, arg in enumerate(argv):
        if arg == "--load-format":
            value = argv[i + 1] if i + 1 < len(argv) else None
        elif arg.startswith("--load-format="):
            value = arg.partition("=")[2]
    return value == LOAD_FORMAT


class WeightOwner:
    """The pool's handle on the owner process (launched in its own process group, via the reaper)."""

    follows_updates = True
    """After an update the pool replaces it with a `successor` holding the new weights."""

    def __init__(
        self,
        spec: WorkerSpec,
        base: str,
        log_dir: Path,
        name: str = "weight-owner",
        weights: str | None = None,
        version: str | None = None,
    ) -> None:
        self.spec = spec
        self.base = base
        self.weights = weights or spec.model
        """The checkpoint it lays out: the workers' own (`spec.model`), or an update's."""
        self.version = version
        """The weight version it holds, once the pool has said (`publish`)."""
        try:
            self.launch_checkpoint = shm_weights.checkpoint_hash(spec.model)
            checkpoint = self.launch_checkpoint if weights is None else shm_weights.weights_id(weights)
        except FileNotFoundError as e:
            raise ConfigError(f"the weight owner shares safetensors weights: {e}") from None
        shm_weights.check_dir(base)  # UnsafeStore (a ConfigError) before anything is launched
        self.checkpoint = checkpoint
        """Its directory's name under `base`."""
        self.dir = shm_weights.owner_dir(base, checkpoint)
        self.log_dir = log_dir
        self.log_path = log_dir / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.ready_s: float | None = None
        """Seconds the latest start took (to the weights in shared memory)."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def successor(self, weights: str, version: str, name: str) -> WeightOwner:
        """An owner for the same workers holding the weights at `weights` (an update's checkpoint)."""
        return WeightOwner(self.spec, self.base, self.log_dir, name, weights, version)

    def publish(self, version: str) -> None:
        """Make it the current owner: workers launched from now on map its weights, named `version`."""
        self.version = version
        shm_weights.publish(self.base, self.launch_checkpoint, self.checkpoint, version, self.weights)

    def unpublish(self) -> None:
        """No current owner any more (the pool stopped): the pointer goes, and the base if empty."""
        shm_weights.unpublish(self.base, self.launch_checkpoint)

    def argv(self) -> list[str]:
        # the worker's own vLLM arguments (after python -m MODULE), for this owner's weights: an
        # update's directory may lack a tokenizer, so the workers' own is named (vLLM reads only its
        # config here); arguments given by the user come later and win
        vllm_argv = dataclasses.replace(self.spec, model=self.weights).argv()[3:]
        if self.weights != self.spec.model:
            vllm_argv[2:2] = ["--tokenizer", self.spec.model]
        return [self.spec.python, "-m", "engine_pool.weights.owner", "--dir", self.base,
                "--model", self.weights, "--checkpoint", self.checkpoint, "--", *vllm_argv]  # fmt: skip

    def launch(self) -> None:
        self._proc = launch_group(self.spec.python, self.argv(), self.spec.env(), self.log_path)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def healthy(self) -> bool:
        """The process lives, holds the owner's lock, and has its weights in place."""
        return self.alive() and shm_weights.owner_ready(self.dir)

    async def wait_ready(self, timeout: float) -> None:
        assert self._proc is not None, "launch() first"
        started, deadline = time.monotonic(), time.monotonic() + timeout
        while not shm_weights.owner_ready(self.dir):
            if self._proc.poll() is not None:
                raise EngineUnavailable(
                    f"the weight owner exited with {self._proc.returncode} during start-up; see {self.log_path}"
                )
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"the weight owner was not ready within {timeout:.0f}s; see {self.log_path}"
                )
            await asyncio.sleep(0.1)
        self.ready_s = time.monotonic() - started

    async def start(self, timeout: float = 600.0) -> None:
        self.launch()
        await self.wait_ready(timeout)

    async def restart(self, timeout: float = 600.0) -> None:
        """Stop what is left of the old process group (its files are kept: the new owner reuses a
        complete layout) and start a new owner."""
        await self._stop_group(remove=False)
        self.restarts += 1
        await self.start(timeout)

    async def stop(self) -> None:
        await self._stop_group(remove=True)

    async def _stop_group(self, remove: bool, grace: float = 10.0) -> None:
        if self._proc is not None:
            await stop_group(self._proc, grace, signal.SIGTERM if remove else signal.SIGKILL)
        if remove and not shm_weights.owner_alive(self.dir):  # a SIGKILLed owner could not clean up
            shutil.rmtree(self.dir, ignore_errors=True)


# -- the owner process ------------------------------------------------------------------------------


def serve(base: str, model: str, vllm_argv: list[str], checkpoint: str | None = None) -> int:
    """Take the lock, lay the weights out, say ready, hold until SIGTERM, then remove the files.
    `checkpoint`: the directory's name (default: the model's ``checkpoint_hash``)."""
    directory = shm_weights.owner_dir(base, checkpoint or shm_weights.checkpoint_hash(model))
    try:
        lock = shm_weights.hold_lock(directory)
    except BlockingIOError:
        sys.stderr.write(f"weight owner: another live owner holds {directory}\n")
        return 3
    except shm_weights.UnsafeStore as e:
        sys.stderr.write(f"weight owner: refused: {e}\n")
        return 4
    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / shm_weights.OWNER)
    export = subprocess.run(
        [sys.executable, "-m", "belayer_vllm.export", "--dir", base, "--checkpoint", directory.name,
         "--", *vllm_argv],
        stdout=subprocess.PIPE, check=False,
    )  # fmt: skip
    if stopping:  # stopped while laying out: nothing half-written is left behind
        shutil.rmtree(directory, ignore_errors=True)
        return 0
    if export.returncode != 0:
        sys.stderr.write(f"weight owner: laying the weights out failed ({export.returncode})\n")
        return 1
    result = json.loads(export.stdout.decode().strip().splitlines()[-1])
    shm_weights.write_json(directory / shm_weights.OWNER, {"pid": os.getpid(), "ready": True, **result})
    sys.stderr.write(f"weight owner: ready, {json.dumps(result)}\n")
    while not stopping:  # a short sleep, not signal.pause(): a signal just before the pause is not lost
        time.sleep(0.2)
    shutil.rmtree(directory, ignore_errors=True)  # still holding the lock: no new owner is writing here
    os.close(lock)
    return 0


def main(argv: list[str]) -> int:
    if "--" not in argv:
        sys.stderr.write(
            "usage: python -m engine_pool.weights.owner --dir BASE --model DIR [--checkpoint NAME] -- VLLM_ARGS...\n"
        )
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m engine_pool.weights.owner")
    p.add_argument("--dir", default=shm_weights.DEFAULT_BASE)
    p.add_argument("--model", required=True)
    p.add_argument("--checkpoint", default=None)
    opts = p.parse_args(argv[:split])
    return serve(opts.dir, opts.model, argv[split + 1 :], opts.checkpoint)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
