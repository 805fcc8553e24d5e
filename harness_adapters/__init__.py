"""Adapters that run real agent harnesses (Claude Code, mini-swe-agent, OpenHands, OpenCode) against a
session's base URL, unchanged. Not built yet: see the harness issue."""
