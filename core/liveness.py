"""`Liveness`: one vocabulary for whether a thing that does work for the gateway answers, across the house.

Three kinds of thing are watched, each by its own supervisor, the same way: probe, lose, take back.

- a cluster node that offers sandboxes (`sandbox.cluster.nodes`): its state *is* a `Liveness`;
- an inference worker of the engine pool (`engine_pool.states`): its state also says its role (``ready``
  or ``shadow``, ``draining``), so it maps onto `Liveness` (`engine_pool.states.LIVENESS`);
- a sandbox (`sandbox.backend.SandboxStatus.liveness`): running, stopped with its node, or stopped.

========== ======================================== ================================== ====================
Liveness   a sandbox node                           an engine worker                   a sandbox
========== ======================================== ================================== ====================
starting   (a node is checked as it registers)      ``starting``: launched, not ready  (being created)
alive      ``alive``: checked, answers its pings    ``ready``, ``shadow``, ``draining`` running
lost       ``lost``: stopped answering; swept and   ``unhealthy``: failed probes; back stopped with its node
           checked before it takes sandboxes again  once it passes one                 (``node_lost``)
refused    ``refused``: answers, but cannot hold    (a registered engine is never      —
           sandboxes (no CRIU, say); asked again    refused: it is ``unhealthy``)
dead       —                                        ``dead``: fenced, never back       stopped (exited, oom)
========== ======================================== ================================== ====================

The values are the words that the API's JSON, the dashboard and the metrics' labels already use for
nodes (``alive``, ``lost``, ``refused``) and for the workers' ends (``starting``, ``dead``): a worker's
state keeps its own word where it says more than its liveness.

>>> Liveness("lost") is Liveness.LOST, f"{Liveness.ALIVE}"
(True, 'alive')
"""

from __future__ import annotations

from enum import StrEnum


class Liveness(StrEnum):
    """Whether a node, worker or sandbox answers (module docstring)."""

    STARTING = "starting"
    """Being brought up: nothing is given to it yet."""
    ALIVE = "alive"
    """Answers its probes: takes work."""
    LOST = "lost"
    """Stopped answering; what it held is recovered elsewhere; it may come back, after a probe passes."""
    REFUSED = "refused"
    """Answers, but is unfit to take work (its check failed); checked again at each probe."""
    DEAD = "dead"
    """Gone for good: fenced or stopped, never taken back."""
