"""Anthropic Messages protocol: wire models, request → internal conversion, and routes."""
