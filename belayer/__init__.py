"""Belayer: a fault-tolerant rollout gateway for agentic reinforcement learning."""

from core import __version__

__all__ = ["__version__"]
