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

import functools
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
TEMPERATURE_ARG, TOP_P_ARG, TOP_K_ARG = "belayer_temperature", "belayer_top_p", "belayer_top_k"
"""The distribution a keyed request is drawn from. The gateway asks vLLM itself for greedy decoding
(temperature 0): vLLM's sampler then takes the one choice this processor leaves, without a draw of its
own; a request without them is drawn at its own temperature, top-p and top-k."""
TIES_ENV = "BELAYER_NEAR_TIES_DIR"


def _signed(x: int) -> int:
    """A 64-bit unsigned integer as the signed one with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """`core.keyed.mix64` on int64 tensors, in place: multiplication wraps modulo 2^64, as unsigned
    arithmetic."""
    x ^= _shr(x, 30)
    x *= _signed(M1)
    x ^= _shr(x, 27)
    x *= _signed(M2)
    x ^= _shr(x, 31)
    return x


@functools.lru_cache(maxsize=8)
def _steps(vocab: int, device: torch.device) -> torch.Tensor:
    """``(t + 1) * GOLDEN`` for every token id t, modulo 2^64: each token's offset from its row's seed."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(GOLDEN)


def gumbel_rows(seeds: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Float64 Gumbel noise ``[len(seeds), vocab]``, bit for bit `core.keyed`'s ``gumbel(token_bits(seed,
    t))`` but for the last rounding of the logarithms. On the CPU in NumPy (single-threaded: torch's
    small ops there pay the engine's OpenMP threads a visit each), elsewhere in torch on the device."""
    if device.type == "cpu":
        return torch.from_numpy(_gumbel_numpy(seeds, vocab))
    rows = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64, device=device)[:, None]
    bits = _mix64(rows + _steps(vocab, device))
    u = _shr(bits, 11).to(torch.float64).add_(0.5).mul_(2.0**-53)
    return u.log_().neg_().log_().neg_()


@functools.lru_cache(maxsize=8)
def _steps_numpy(vocab: int) -> Any:
    import numpy as np

    return np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(GOLDEN)


def _gumbel_numpy(seeds: list[int], vocab: int) -> Any:
    import numpy as np

    x = np.array(seeds, dtype=np.uint64)[:, None] + _steps_numpy(vocab)  # uint64 arithmetic wraps
    x ^= x >> np.uint64(30)
    x *= np.uint64(M1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(M2)
    x ^= x >> np.uint64(31)
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    return np.negative(u, out=u)


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
    top_k = args.get(TOP_K_ARG, params.top_k)
    return _Keyed(int(args[KEY_ARG]), int(args.get(POSITION_ARG, 0)),
                  float(args.get(TEMPERATURE_ARG, params.temperature)), float(args.get(TOP_P_ARG, params.top_p)),
                  int(top_k) if top_k and top_k > 0 else None, output)  # fmt: skip


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
        for name, low, high in (
            (TEMPERATURE_ARG, 0.0, 100.0),
            (TOP_P_ARG, 1e-9, 1.0),
            (TOP_K_ARG, -1, 1 << 31),
        ):
            value = args.get(name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high
            ):
                raise ValueError(f"{name} must be a number in [{low}, {high}], not {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token: vLLM must apply it to greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, _state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        indices = sorted(i for i in self.rows if i < logits.shape[0])
        rows = [self.rows[i] for i in indices]
        greedy = [r.temperature < 1e-5 for r in rows]
        chosen = torch.argmax(logits[indices], dim=-1)  # greedy rows: the argmax (lowest id among equals)
        sampled = [j for j, g in enumerate(greedy) if not g]
        if sampled:
            idx = [indices[j] for j in sampled]
            positions = [rows[j].start + len(rows[j].output) for j in sampled]
            seeds = [row_seed(rows[j].key, p) for j, p in zip(sampled, positions, strict=True)]
            temps = torch.tensor(
                [rows[j].temperature for j in sampled], dtype=torch.float64, device=logits.device
            )
            scaled = logits[idx].to(torch.float64) / temps[:, None]
            scores = scaled + gumbel_rows(seeds, logits.shape[-1], logits.device)
            for k, j in enumerate(sampled):  # top-k / top-p, where asked for
                mask = keep_mask(scaled[k], rows[j].top_p, rows[j].top_k)
                if mask is not None:
                    scores[k].masked_fill_(~mask, float("-inf"))
            top2 = torch.topk(scores, 2, dim=-1)
            chosen[sampled] = top2.indices[:, 0]
            gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
            for k, gap in enumerate(gaps):
                if gap < NEAR_TIE:
                    self._near_tie(rows[sampled[k]].key, positions[k], gap)
        forced = torch.full(
            (len(indices), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device
        )
        logits[indices] = forced.scatter_(1, chosen[:, None], 0.0)  # one finite logit: the choice
        return logits

    def _near_tie(self, key: int, position: int, gap: float) -> None:
        self.near_ties += 1
        if self.ties_file is not None:
            line = json.dumps({"key": key, "position": position, "gap": gap, "at": time.time()})
            with self.ties_file.open("a") as f:
                f.write(line + "\n")
