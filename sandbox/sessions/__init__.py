"""The gateway's session-aware sandbox layer: one sandbox per session, checkpoints in the session's
inference bubbles, and recovery that keeps environment and trajectory on the same prefix.

Why here and not in ``sandbox/``: everything this layer decides is about a *session*. It reads turns
(the bubble starts and ends with a turn), writes trajectory events, and truncates the trajectory on a
restore. ``sandbox/`` stays a container library that knows nothing of sessions or trajectories (the
backend ABC, Docker with CRIU, images, the gateway network), so it can be used and tested alone, and
imports flow one way: ``sandbox.sessions`` → ``sandbox`` → ``core``. An interface for the store
owned by ``sandbox/`` would have kept the manager down there, but only by re-declaring the store's
turn and event records one layer lower for a single user.
"""
