"""OpenAI-compatible protocol: wire models, request → internal conversion, and routes."""
