"""ATIF trajectories on disk, laid out as Harbor lays out a trial's: ``<trial>/agent/trajectory.json``.

Harbor's agents write each run's ATIF trajectory (Agent Trajectory Interchange Format, RFC 0001) to the
trial's agent log directory as ``trajectory.json``, and its trace tools find trials by that ``agent``
folder (``harbor.utils.traces_utils.iter_trial_dirs``). An ATIF export (``belayer export --format
atif``, ``Belayer.export(..., "atif")``) writes one such file per trajectory, in a folder named by the
trajectory's ``trajectory_id`` (``<session id>-branch-<n>``): ``OUT/<trajectory_id>/agent/trajectory.json``.
The trajectories themselves are built in ``store.atif``; this module is only their layout, shared by the
command line and the trainer client (which imports nothing of Belayer but ``core``).

Example::

    write_trajectories([trajectory], Path("atif"))  # atif/ses_1-branch-0/agent/trajectory.json
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ATIF_VERSION = "ATIF-v1.8"
"""The ATIF schema version an export declares (``schema_version``): Harbor 0.25's newest."""

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def trajectory_path(out: Path, trajectory: dict[str, Any]) -> Path:
    """Where `trajectory` goes under `out`: ``<trajectory_id>/agent/trajectory.json`` (a character that
    is not a letter, digit, ``.``, ``_`` or ``-`` becomes ``_``, so an id never leaves `out`).

    >>> trajectory_path(Path("atif"), {"trajectory_id": "ses_1-branch-0"}).as_posix()
    'atif/ses_1-branch-0/agent/trajectory.json'
    """
    name = _SAFE.sub("_", str(trajectory["trajectory_id"])).lstrip(".") or "_"
    return out / name / "agent" / "trajectory.json"


def write_trajectories(trajectories: Iterable[dict[str, Any]], out: Path) -> int:
    """Write each trajectory to its `trajectory_path` under `out` (made if missing; a file already
    there is replaced); returns how many were written."""
    n = 0
    for trajectory in trajectories:
        path = trajectory_path(out, trajectory)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trajectory, allow_nan=False, ensure_ascii=False) + "\n", encoding="utf-8")
        n += 1
    return n
