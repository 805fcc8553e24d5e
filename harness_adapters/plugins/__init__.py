"""Modules loaded into a harness's own environment (on its PYTHONPATH), not imported by Belayer itself:
``belayer_mini_env`` is the mini-swe-agent environment that runs commands in a Belayer sandbox."""
