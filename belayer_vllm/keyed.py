"""Keyed sampling inside vLLM (``core.keyed``): a logits processor that draws each keyed request's next
token itself, from ``softmax(logits / T)`` under top-k and top-p, with Gumbel noise that is a function of
the request's key and the token's position in its turn only, and leaves vLLM's sampler one choice.

The gateway launches every vLLM worker with ``--logits-processors belayer_vllm.keyed:KeyedSampler``. A
request is keyed when its ``vllm_xargs`` carry ``belayer_key`` (63-bit) and ``belayer_position`` (the
turn's output tokens before this submission: a failover resubmits the prompt plus those tokens, and the
draws go on at the next position). Other requests are left to vLLM's sampler.

The processor runs before vLLM's temperature, top-k/top-p and random draw (it is not argmax-invariant, so
vLLM applies it to greedy-looking requests too): a keyed row leaves it with one finite logit, which any
sampler then picks. The logprob vLLM reports is computed before any processor (``raw_logprobs``), so the
trajectory keeps the policy's log-probability of the token, never a perturbed one.

Near ties (`core.keyed.NEAR_TIE`) are appended, one JSON line each, to
``$BELAYER_NEAR_TIES_DIR/near-ties-<pid>.jsonl`` when that variable is set.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from core.keyed import GOLDEN, KEY_BITS, M1, M2, NEAR_TIE, row_seed

KEY_ARG = "belayer_key"
POSITION_ARG = "belayer_position"
TIES_ENV = "BELAYER_NEAR_TIES_DIR"


def _signed(x: int) -> int:
    """A 64-bit unsigned integer as the signed one with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """`core.keyed.mix64` on int64 tensors: multiplication wraps modulo 2^64, as unsigned arithmetic."""
    x = (x ^ _shr(x, 30)) * _signed(M1)
    x = (x ^ _shr(x, 27)) * _signed(M2)
    return x ^ _shr(x, 31)


def gumbel_rows(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Float64 Gumbel noise ``[len(seeds), vocab]``, bit for bit `core.keyed`'s ``gumbel(token_bits(seed,
    t))`` but for the last rounding of the logarithms."""
    steps = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(GOLDEN)
    rows = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=device)[:, None]
    bits = _mix64(rows + steps)
    u = (_shr(bits, 11).to(torch.float64) + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


def keep_mask(scores: torch.Tensor, top_p: float, top_k: int | None) -> torch.Tensor | None:
    """The tokens top-k and top-p keep of one row of `scores` (True: kept), as `core.keyed.kept` (ties
    by token id); None when both keep everything."""
    vocab = scores.shape[-1]
    if top_p >= 1.0 and (top_k is None or top_k <= 0 or top_k >= vocab):
        return None
    order = torch.sort(-scores.to(torch.float64), stable=True).indices  # descending score, then id
    keep_sorted = torch.ones(vocab, dtype=torch.bool, device=scores.device)
    if top_k is not None and 0 < top_k < vocab:
        keep_sorted[top_k:] = False
    if top_p < 1.0:
        s = scores[order].to(torch.float64)
        w = torch.exp(s - s[0]) * keep_sorted
        before = torch.cumsum(w, 0) - w  # the mass of the tokens ahead of each
        keep_sorted &= before < top_p * w.sum()
        keep_sorted[0] = True
    mask = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
    mask[order[keep_sorted]] = True
    return mask


@dataclass(slots=True)
class _Keyed:
    key: int
    start: int
    """The turn's position of this submission's first output token."""
    temperature: float
    top_p: float
    top_k: int | None
    output: list[int]
    """vLLM's live list of this submission's output tokens (its length: tokens drawn so far)."""


def _state(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> _Keyed | None:
    args = params.extra_args or {}
    if KEY_ARG not in args:
        return None
    top_k = params.top_k if params.top_k and params.top_k > 0 else None
    return _Keyed(int(args[KEY_ARG]), int(args.get(POSITION_ARG, 0)), params.temperature, params.top_p,
                  top_k, output)  # fmt: skip


class KeyedSampler(LogitsProcessor):
    """vLLM's logits processor for keyed requests (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Keyed] = {}
        self.device = device
        ties = os.environ.get(TIES_ENV)
        self.ties_file = Path(ties) / f"near-ties-{os.getpid()}.jsonl" if ties else None
        self.near_ties = 0

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        if KEY_ARG not in args:
            return
        key, position = args[KEY_ARG], args.get(POSITION_ARG, 0)
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 1 << KEY_BITS:
            raise ValueError(f"{KEY_ARG} must be an integer in [0, 2^{KEY_BITS}), not {key!r}")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"{POSITION_ARG} must be a non-negative integer, not {position!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: vLLM must apply it to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = sorted(i for i in self.rows if i < logits.shape[0])
        sampled = [i for i in indices if self.rows[i].temperature >= 1e-5]
        chosen: dict[int, int] = {}
        for i in indices:
            if self.rows[i].temperature < 1e-5:  # greedy: the argmax (lowest id among equals)
                chosen[i] = int(torch.argmax(logits[i]).item())
        if sampled:
            positions = [self.rows[i].start + len(self.rows[i].output) for i in sampled]
            seeds = [row_seed(self.rows[i].key, p) for i, p in zip(sampled, positions, strict=True)]
            noise = gumbel_rows(seeds, logits.shape[-1], logits.device)
            for j, i in enumerate(sampled):
                row = self.rows[i]
                scores = logits[i].to(torch.float64) / row.temperature + noise[j]
                mask = keep_mask(logits[i] / row.temperature, row.top_p, row.top_k)
                if mask is not None:
                    scores = scores.masked_fill(~mask, float("-inf"))
                top2 = torch.topk(scores, 2)
                chosen[i] = int(top2.indices[0].item())
                gap = float(top2.values[0] - top2.values[1])
                if gap < NEAR_TIE:
                    self._near_tie(row.key, positions[j], gap)
        for i, token in chosen.items():
            logits[i].fill_(float("-inf"))
            logits[i, token] = 0.0
        return logits

    def _near_tie(self, key: int, position: int, gap: float) -> None:
        self.near_ties += 1
        if self.ties_file is not None:
            line = json.dumps({"key": key, "position": position, "gap": gap, "at": time.time()})
            with self.ties_file.open("a") as f:
                f.write(line + "\n")
