"""The ``vllm.general_plugins`` entry point: registers the ``belayer_shm`` load format with vLLM.

vLLM calls `register` in each of its processes, possibly more than once; registering again replaces the
same class, so it is harmless.
"""

from __future__ import annotations


def register() -> None:
    """Make ``--load-format belayer_shm`` and ``belayer_ipc`` known to vLLM (import the loaders: their
    decorators register them)."""
    from belayer_vllm import ipc, loader  # noqa: F401  # the imports register the load formats
