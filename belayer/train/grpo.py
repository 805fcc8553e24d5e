"""GRPO on Belayer's export rows, in plain PyTorch: group advantages, which tokens count (the loss mask
and the staleness bound), and the clipped surrogate loss against the recorded logprobs.

A row is one branch of one episode as ``/api/export`` and the finished feed give it: ``prompt_ids``,
``response_ids``, ``response_mask`` (1 on the tokens the policy generated), ``response_logprobs`` (the
logprobs they were sampled with) and ``weight_segments`` (which weight version generated which run of
them). The trainer scores exactly those ids: nothing is re-tokenized.

Staleness. The trainer numbers its versions (0 for the weights the run started on); a token's *lag* is
the trainer's version minus the version that generated it. Tokens with lag ≤ ``max_staleness`` count,
through the importance ratio ``exp(logp_now - logp_recorded)`` (clipped, as in PPO: for a lag-0 token
this is the usual on-policy ratio); older tokens are masked out of the loss:

>>> row = {"response_mask": [0, 1, 1, 1, 0], "weight_segments": [
...     {"start": 1, "end": 2, "version": "v0"}, {"start": 2, "end": 4, "version": "v1"}]}
>>> token_weights(row, {"v0": 0, "v1": 1}, current=2, max_staleness=1)
[0.0, 0.0, 1.0, 1.0, 0.0]
>>> token_weights(row, {"v0": 0, "v1": 1}, current=2, max_staleness=2)
[0.0, 1.0, 1.0, 1.0, 0.0]
>>> group_advantages([1.0, 0.0, 0.5, 0.5])
[1.414..., -1.414..., 0.0, 0.0]
>>> group_advantages([0.5, 0.5])
[0.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

Row = Mapping[str, Any]


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """Each reward's distance from its group's mean, in the group's standard deviations (0 for all when
    the group's rewards are equal: such a group teaches nothing)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std < eps:
        return [0.0] * len(rewards)
    return [(r - mean) / std for r in rewards]


def token_versions(row: Row) -> list[str | None]:
    """The weight version that generated each response token (None: not generated, e.g. a tool's)."""
    out: list[str | None] = [None] * len(row["response_mask"])
    for seg in row["weight_segments"]:
        out[seg["start"] : seg["end"]] = [seg["version"]] * (seg["end"] - seg["start"])
    return out


def token_weights(row: Row, index: Mapping[str, int], current: int, max_staleness: int) -> list[float]:
    """1.0 for each response token that enters the loss: generated (mask 1), by a version the trainer
    knows (`index`), at most `max_staleness` versions behind `current`; else 0.0."""
    out = []
    for m, version in zip(row["response_mask"], token_versions(row), strict=True):
        lag = current - index[version] if version is not None and version in index else None
        out.append(1.0 if m and lag is not None and 0 <= lag <= max_staleness else 0.0)
    return out


def clipped_loss(
    new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, clip: float = 0.2
) -> torch.Tensor:
    """The PPO/GRPO clipped surrogate, averaged over the tokens that count: `new` and `old` are
    ``[B, T]`` token logprobs (now, and as recorded), `advantages` ``[B]``, `weights` ``[B, T]``.

    >>> lp = torch.tensor([[-1.0, -2.0]])
    >>> round(clipped_loss(lp, lp, torch.tensor([1.0]), torch.tensor([[1.0, 1.0]])).item(), 6)
    -1.0
    """
    ratio = torch.exp(new - old)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    return -(surrogate * weights).sum() / weights.sum().clamp(min=1.0)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The Pearson correlation of two equally long series (nan when one is constant or too short).

    >>> pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.5]) > 0.99
    True
    """
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


def response_slice(logprobs: torch.Tensor, row: Row, i: int) -> torch.Tensor:
    """Row `i`'s response tokens' logprobs out of `policy.sequence_logprobs`'s ``[B, T-1]`` (position
    ``j`` there scores token ``j + 1`` of ``prompt_ids + response_ids``)."""
    start = len(row["prompt_ids"]) - 1
    return logprobs[i, start : start + len(row["response_ids"])]
