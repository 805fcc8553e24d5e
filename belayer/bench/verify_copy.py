"""``belayer bench verify-copy``: what the verify stage's copy of /workspace costs the gateway, on a real
Docker engine: the agent's sandbox writes ``--mib`` MiB of random bytes, then the sandbox manager
verifies it (copy out with the sandbox frozen, rewrite, copy into a new sandbox, run a verifier that
checks the size).

Figures, as ``name: value`` lines on stdout (progress on stderr):

- ``verify_copy_peak_traced_mib``: the most Python memory allocated at once during the verify stage
  (tracemalloc), and ``verify_copy_peak_per_workspace``: that over the workspace's size;
- ``verify_copy_rss_growth_mib``: how much the process's peak resident size grew during it;
- ``verify_copy_s``: how long the verify stage took (with tracemalloc on: slower than without).

Needs a Docker engine and the busybox sandbox image (``belayer sandbox build-image busybox``).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from belayer.bench import emit
from sandbox.backend import SandboxSpec
from sandbox.backends import backend_for
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import ensure_busybox_image
from sandbox.sessions.manager import SandboxManager
from sandbox.sessions.verify import VerifyPlan
from store import SessionRecord, SqliteStore

IMAGE = "belayer-bench-verify:busybox"


async def measure(backend: DockerSandboxBackend, store: SqliteStore, mib: int) -> dict[str, float]:
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
    manager = SandboxManager(backend, store, settings)
    try:
        store.create_session(SessionRecord("bench", time.time(), {}))
        await manager.create("bench", SandboxSpec(image=IMAGE))
        size = mib << 20
        await manager.exec("bench", f"head -c {size} /dev/urandom > /workspace/data.bin", timeout_s=600)
        check = f'test "$(wc -c < data.bin)" -eq {size}'.encode()
        plan = VerifyPlan(files={"verify.sh": (check, 0o644)}, timeout_s=600)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sys.stderr.write(f"[bench] verifying a {mib} MiB workspace\n")
        tracemalloc.start()
        started = time.monotonic()
        try:
            outcome = await manager.verify("bench", plan)
            seconds = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        if not outcome.verified:
            raise SystemExit(f"the verifier did not see the workspace: {outcome.output}")
        rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before  # KiB on Linux
        return {
            "workspace_mib": mib,
            "verify_copy_peak_traced_mib": peak / (1 << 20),
            "verify_copy_peak_per_workspace": peak / size,
            "verify_copy_rss_growth_mib": rss_growth / 1024,
            "verify_copy_s": seconds,
        }
    finally:
        await manager.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench verify-copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=200, help="the workspace's size (default 200)")
    args = p.parse_args(argv)
    with backend_for() as backend, tempfile.TemporaryDirectory() as tmp:
        if not backend.has_image(IMAGE):  # the verifier is started with /usr/bin/env
            backend.derive_image(IMAGE, ensure_busybox_image(backend), {"/usr/bin/env": Path("/bin/busybox")})
        store = SqliteStore(Path(tmp) / "traj.db")
        try:
            figures = asyncio.run(measure(backend, store, args.mib))
        finally:
            store.close()
    for key, value in figures.items():
        emit(key, value)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
