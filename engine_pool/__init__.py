"""Inference workers: launching, supervising and talking to vLLM engines in token ids."""
