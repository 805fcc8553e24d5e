"""Position-keyed sampling: a sampled token that is a function of the policy's distribution, a key and
the token's position, never of the worker, the batch, the time or a crash.

vLLM's sampler draws from a random generator whose state is the worker's: after a failover the rest of a
turn is re-drawn on another worker, so a sampled trajectory depends on which worker died when. Keyed
sampling draws token *i* of a turn by the Gumbel-max trick with noise that is a pure function of
``(key, i, token id)``: the token is ``argmax_t (logits_t / T + G(key, i, t))`` over the tokens top-k and
top-p keep, where ``G`` is standard Gumbel noise from a counter-based hash (splitmix64). That is an exact
sample of ``softmax(logits / T)`` restricted to the kept tokens, and a resubmission that carries the same
key and the position it resumes at draws the very same tokens (``belayer_vllm.keyed`` does it inside
vLLM; the fake engine uses `choose` below).

The only way two runs can differ is a *near tie*: two candidates whose perturbed scores are closer than
the logits' numerical noise (`NEAR_TIE`), where another batch's kernels may round the other way. They are
counted and reported, never hidden.

A turn's key (`turn_key`): from the request's own ``seed`` (it keeps its meaning: the same seed draws the
same tokens), else from the session's seed and the turn's index (``POST /api/sessions {"seed": ...}``:
re-running an episode reproduces it), else from the session's id and the turn's index.

>>> logits = [0.0, 1.0, 2.0, 0.5]
>>> [choose(logits, key=7, position=i)[0] for i in range(8)] == [choose(logits, 7, i)[0] for i in range(8)]
True
>>> choose(logits, 7, 0, temperature=0.0)[0]        # temperature 0: the argmax, no noise
2
>>> choose(logits, 7, 3, top_k=1)[0]                 # top-k 1: the argmax too
2
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""2^64 / golden ratio: the splitmix64 increment."""
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
KEY_BITS = 63
"""Keys are 63-bit, so that they fit a signed 64-bit integer (JSON, torch, SQL) as they are."""
NEAR_TIE = 1e-3
"""Perturbed scores closer than this (in units of logits / T) are a near tie: kernels that add in
another order (another batch's shape) may pick the other token."""
SAMPLING_MODES = ("engine", "keyed")
"""``engine``: the engine's own sampler (vLLM's seeded RNG); ``keyed``: this module's."""


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers whose outputs look independent.

    >>> hex(mix64(0)), hex(mix64(1))
    ('0x0', '0x5692161d100b05e5')
    """
    x &= MASK
    x = ((x ^ (x >> 30)) * M1) & MASK
    x = ((x ^ (x >> 27)) * M2) & MASK
    return x ^ (x >> 31)


def row_seed(key: int, position: int) -> int:
    """The 64-bit seed of a turn's token `position` under `key`: each token's noise derives from it."""
    return mix64(mix64(key ^ GOLDEN) + (position + 1) * GOLDEN)


def token_bits(seed: int, token: int) -> int:
    """64 random bits for `token` at the position whose `row_seed` is `seed`."""
    return mix64(seed + (token + 1) * GOLDEN)


def gumbel(bits: int) -> float:
    """Standard Gumbel noise from 64 random bits (their top 53 make a uniform in (0, 1))."""
    u = ((bits >> 11) + 0.5) * 2.0**-53
    return -math.log(-math.log(u))


def kept(scores: Sequence[float], top_p: float = 1.0, top_k: int | None = None) -> list[int]:
    """The token ids top-k and top-p keep of `scores` (logits / T): the `top_k` largest, then the
    fewest largest whose probability reaches `top_p` (the largest always; ties by token id).

    >>> kept([0.0, 3.0, 1.0, 2.0], top_k=2), kept([0.0, 9.0, 1.0, 2.0], top_p=0.5)
    ([1, 3], [1])
    """
    order = sorted(range(len(scores)), key=lambda t: (-scores[t], t))
    if top_k is not None and top_k > 0:
        order = order[:top_k]
    if top_p >= 1.0:
        return sorted(order)
    top = scores[order[0]]
    weights = [math.exp(scores[t] - top) for t in order]
    total, mass, out = sum(weights), 0.0, list[int]()
    for t, w in zip(order, weights, strict=True):
        if out and mass >= top_p * total:
            break
        out.append(t)
        mass += w
    return sorted(out)


def choose(
    logits: Sequence[float],
    key: int,
    position: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
) -> tuple[int, float]:
    """Token `position`'s draw from ``softmax(logits / temperature)`` (top-k and top-p applied) under
    `key`, and the gap between its perturbed score and the runner-up's (`NEAR_TIE`: a near tie; inf
    when there was no other candidate). The reference the vLLM logits processor is tested against."""
    if temperature < 1e-5:  # greedy, as vLLM's own sampler: the argmax
        best = max(range(len(logits)), key=lambda t: (logits[t], -t))
        return best, math.inf
    scores = [x / temperature for x in logits]
    seed = row_seed(key, position)
    perturbed = sorted(((scores[t] + gumbel(token_bits(seed, t)), t) for t in kept(scores, top_p, top_k)),
                       reverse=True)  # fmt: skip
    gap = perturbed[0][0] - perturbed[1][0] if len(perturbed) > 1 else math.inf
    return perturbed[0][1], gap


def _hash(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - KEY_BITS)


def turn_key(turn_index: int, session_id: str, session_seed: int | None, request_seed: int | None) -> int:
    """The key of a turn's keyed sampling (module docstring): from the request's seed, else the
    session's seed and the turn's index, else the session's id and the turn's index.

    >>> turn_key(3, "ses_a", None, 42) == turn_key(9, "ses_b", 1, 42)      # the request's seed wins
    True
    >>> turn_key(3, "ses_a", 1, None) == turn_key(3, "ses_b", 1, None) != turn_key(4, "ses_a", 1, None)
    True
    >>> turn_key(3, "ses_a", None, None) != turn_key(3, "ses_b", None, None)
    True
    """
    if request_seed is not None:
        return _hash("request-seed", request_seed)
    if session_seed is not None:
        return _hash("session-seed", session_seed, turn_index)
    return _hash("session-id", session_id, turn_index)


def child_seed(parent_seed: int, fork_turn: int, child: int) -> int:
    """The seed of a fork's `child`-th child, from its parent's: siblings draw differently, and the same
    fork of the same episode draws the same. Non-negative and 63-bit, as every seed here."""
    return _hash("fork", parent_seed, fork_turn, child)
