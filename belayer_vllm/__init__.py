"""Belayer's code that runs inside vLLM processes (it imports vLLM and torch; nothing else of Belayer
imports it): the ``belayer_shm`` model loader, which maps the weights a host's weight owner holds in
shared memory (``core.shm_weights``), and the exporter the owner runs to lay them out.

vLLM finds the loader through the ``vllm.general_plugins`` entry point (``plugin:register``), in every
process it starts, the engine core included.
"""
