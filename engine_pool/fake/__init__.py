"""A scripted fake vLLM engine (ASGI): replays chosen token ids, for unit tests and gateway benchmarks.

It speaks the subset of vLLM's API the gateway uses: ``/v1/completions`` with token-id prompts,
``return_token_ids``, ``return_tokens_as_token_ids`` and ``logprobs`` (streamed or not), ``/v1/models``
and ``/health``. Logprobs are a deterministic function of position and token id. ``/metrics`` serves a
few of vLLM's Prometheus metrics under vLLM's names, counted from the requests it served (`FakeStats`).

Weight updates speak vLLM's development endpoints as ``EngineClient.update_weights`` calls them:
``/pause``, ``/resume``, ``/collective_rpc`` (only ``reload_weights``: the path must be a directory with
a ``config.json``, else HTTP 500 as vLLM answers a failed load), ``/update_weight_version`` and
``/weight_info``. Generated tokens depend on the version (`versioned_context`), so a test can tell
which version produced each token; under vLLM's initial version (``default``) they are as before.

``/v1/chat/completions`` answers any messages with a fixed text, one word per token and as many tokens
(stream chunks) as ``/v1/completions`` would produce, so that chat clients (a LiteLLM proxy, a direct
client in ``belayer bench gateway``) can call the same engine as the gateway.

The package's parts: the engine (``engine_pool.fake.engine``), its metrics (``.stats``), the faults a test
puts in front of it (``.faults``), how it writes (``.policies``) and its server (``.serve``,
``python -m engine_pool.fake``). The names below are its public face: tests, benches and the harness
adapters import them from ``engine_pool.fake``.
"""

from engine_pool.fake.engine import CHAT_WORDS, FakeEngine, Script, fake_logprob, versioned_context
from engine_pool.fake.faults import Fault, FaultInjector, LatentEngine
from engine_pool.fake.policies import (
    POLICY_ENV,
    POLICY_FLOOR,
    autoregressive,
    autoregressive_over,
    hashed_policy,
    seeded_over,
    word_ids,
)
from engine_pool.fake.serve import (
    DIE_OVER_ENV,
    ENGINE_CORE_ENV,
    ENGINE_CORE_TITLE,
    TOKEN_DELAY_ENV,
    engine_core,
    main,
    serve,
)
from engine_pool.fake.stats import FakeStats

__all__ = [
    "CHAT_WORDS", "DIE_OVER_ENV", "ENGINE_CORE_ENV", "ENGINE_CORE_TITLE", "POLICY_ENV", "POLICY_FLOOR",
    "TOKEN_DELAY_ENV", "FakeEngine", "FakeStats", "Fault", "FaultInjector", "LatentEngine", "Script",
    "autoregressive", "autoregressive_over", "engine_core", "fake_logprob", "hashed_policy", "main",
    "seeded_over", "serve", "versioned_context", "word_ids",
]  # fmt: skip
