"""The session-aware sandbox layer: one sandbox per session, checkpoints in the session's inference
bubbles, and recovery that keeps environment and trajectory on the same prefix.

It sits beside the backends it drives (``sandbox.backend`` and its implementations, their configuration
in ``sandbox.config``), so everything about sandboxes has one home. Everything this layer decides is
about a *session*: it reads turns (the bubble starts and ends with a turn), writes trajectory events,
and truncates the trajectory on a restore, through the trajectory store (``store``), which sits below
it. The backends themselves know nothing of sessions or trajectories, and imports flow one way:
``sandbox.sessions`` → ``sandbox`` backends → ``store`` → ``core``. The HTTP routes are with the
gateway's other routes (``gateway.api.sandbox``, ``gateway.api.sandbox_listener``).

- `manager`: `SandboxManager`, the face the gateway holds; `state`: its per-session slots;
- `bubbles` and `policy`: checkpoints in inference bubbles, and when one is worth taking;
- `checkpoints`: taking, tagging and retiring them; `journal`: the tool calls since the newest one;
- `recovery`: a tool call that survives its sandbox (restore, then replay or truncate); `watcher`: a
  sandbox that stops between calls is restored at once; `standby`: a checkpoint restored ahead of time
  and frozen, for a recovery to unfreeze;
- `lifecycle`: start, replace, remove; `forks`: a sandbox copied into child sessions at a turn;
  `adoption`: a new gateway takes back its store's sandboxes;
- `verify`: the verify stage, in a clean sandbox; `io`: the blocking backend on bounded thread pools;
  `records`: what the manager hands out and records.
"""
