"""Belayer: a fault-tolerant rollout gateway for agentic reinforcement learning."""

__version__ = "0.1.0"
