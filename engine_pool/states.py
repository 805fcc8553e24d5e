"""A pool member's states (``engine_pool.pool``): launched workers go starting -> ready or shadow ->
draining -> dead; a registered worker that failed is unhealthy until a probe passes."""

STARTING = "starting"
READY = "ready"
SHADOW = "shadow"
UNHEALTHY = "unhealthy"  # a registered worker that failed; routed to again once it passes a probe
DRAINING = "draining"
DEAD = "dead"
