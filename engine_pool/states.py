"""A pool member's states (``engine_pool.pool``): launched workers go starting -> ready or shadow ->
draining -> dead; a registered worker that failed is unhealthy until a probe passes.

A state says a worker's role as well as whether it answers; `LIVENESS` gives the latter in the words the
house uses for every watched thing (`core.liveness`: a sandbox node's state, a sandbox's status)."""

from core.liveness import Liveness

STARTING = Liveness.STARTING.value  # the same words as a node's, where they mean the same
READY = "ready"
SHADOW = "shadow"
UNHEALTHY = "unhealthy"  # a registered worker that failed; routed to again once it passes a probe
DRAINING = "draining"
DEAD = Liveness.DEAD.value

LIVENESS: dict[str, Liveness] = {
    STARTING: Liveness.STARTING,
    READY: Liveness.ALIVE,
    SHADOW: Liveness.ALIVE,
    DRAINING: Liveness.ALIVE,  # finishes what it runs, takes nothing new
    UNHEALTHY: Liveness.LOST,
    DEAD: Liveness.DEAD,
}
"""Each state's `Liveness` (the table in `core.liveness`)."""
