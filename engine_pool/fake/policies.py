"""How a fake engine writes: token functions of the whole context (`autoregressive`, resumable after a
failover), readable words (`word_ids`), the logits of a sampled policy (`hashed_policy`), and the query of
death of vLLM 0.32 on the CPU (`seeded_over`)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any


def seeded_over(tokens: int) -> Callable[[dict[str, Any]], bool]:
    """vLLM 0.32's query of death on the CPU: a seeded request with a prompt over `tokens` tokens.

    >>> seeded_over(3)({"prompt": [1, 2, 3, 4], "seed": 7}), seeded_over(3)({"prompt": [1, 2, 3, 4]})
    (True, False)
    """
    return lambda body: body.get("seed") is not None and len(body.get("prompt") or ()) > tokens


def autoregressive(context: list[int]) -> int:
    """A fake engine's next token as a function of the whole context, like greedy decoding: a request
    resumed from prompt + k generated tokens continues with exactly the same tokens."""
    return (context[-1] * 31 + len(context) * 7) % 400 + 10


def word_ids(model_dir: str) -> list[int]:
    """The ids of a model's whole-word tokens (" the", " value", ...): a fake engine that draws from
    them writes text a person can read in a dashboard or a demo."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    words = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha() and len(text) > 2:
            words.append(i)
    return words


POLICY_ENV = "BELAYER_FAKE_POLICY"
"""Set (to anything) in the gateway's environment, its launched fake workers sample from `hashed_policy`
(``FakeEngine.policy``): keyed sampling's draws, or their own RNG's (``belayer bench determinism``)."""
POLICY_FLOOR = -1e9


def hashed_policy(context: list[int]) -> list[float]:
    """Logits over ids 0..399 that depend on the context's last 3 tokens; ids below 100 (the tiny model's
    control tokens among them) are never drawn.

    >>> logits = hashed_policy([5, 6, 7]); len(logits), logits[:100] == [POLICY_FLOOR] * 100
    (400, True)
    """
    h = zlib.crc32(json.dumps(context[-3:]).encode())
    return [POLICY_FLOOR] * 100 + [((h >> (i % 24)) % 97) / 25.0 + (i % 7) * 0.1 for i in range(100, 400)]


def autoregressive_over(vocab: list[int]) -> Callable[[list[int]], int]:
    """`autoregressive`, drawing its tokens from `vocab`."""
    return lambda context: vocab[(context[-1] * 31 + len(context) * 7) % len(vocab)]
