"""The containerd under a local Docker engine, reached for the one thing Docker's API cannot do: collect
its garbage now.

Every process dump Docker takes goes through containerd's content store, and containerd drops a dump's
blobs only when its garbage collector runs. Its scheduler spaces runs by 50 times their average length,
so on a busy host a container's last dump can outlive the next one by ten seconds and more; the next dump
then writes the container's spec again (the same bytes, the same digest) and fails with "content
sha256:…: already exists" (moby#42900, dump side). Deleting a throwaway lease with ``--sync`` makes
containerd collect synchronously, after which the dump goes through.

The containerd and its namespace are read from the command line of the container's shim (the parent of
its init process), so this works for a dockerd-managed containerd (``<exec-root>/containerd``) and a system
one alike, and needs only `ctr` (shipped with containerd) and this host's /proc.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path


def shim_address(init_pid: int) -> tuple[str, str] | None:
    """(containerd socket, namespace) from the shim that runs `init_pid`; None if it cannot be read."""
    try:
        stat = Path(f"/proc/{init_pid}/stat").read_text()
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        args = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError, IndexError):
        return None
    flags = dict(itertools.pairwise(args))
    if "-address" not in flags:
        return None
    return flags["-address"], flags.get("-namespace", "moby")


def collect_garbage(init_pid: int, *, timeout_s: float = 30.0) -> bool:
    """Run the garbage collector of the containerd that runs `init_pid`, and wait for it; False if there
    is no way to (no `ctr`, no readable shim, or ctr failed)."""
    ctr = shutil.which("ctr")
    where = shim_address(init_pid)
    if ctr is None or where is None:
        return False
    base = [ctr, "--address", where[0], "--namespace", where[1], "leases"]
    try:
        created = subprocess.run(
            [*base, "create"], capture_output=True, text=True, timeout=timeout_s, check=True
        )
        lease = created.stdout.split()[0]
        subprocess.run([*base, "delete", "--sync", lease], capture_output=True, timeout=timeout_s, check=True)
    except (subprocess.SubprocessError, OSError, IndexError):
        return False
    return True
