"""Figures from samples: nearest-rank percentiles (`percentile`), and Prometheus histograms read from an
exposition (`parse_histograms`), differenced and summed over processes, and their quantiles as
Prometheus computes them (`histogram_quantile`)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(xs)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


Histograms = dict[str, dict[float, float]]
"""Family (with its labels) -> upper bound -> cumulative count."""


def parse_histograms(text: str, names: tuple[str, ...]) -> Histograms:
    """The ``_bucket`` series of the families `names` in a Prometheus exposition, labels other than
    ``le`` dropped (summed over)."""
    out: Histograms = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(f"{name}_bucket{{"):
                labels, value = line[len(name) + 8 :].rsplit(" ", 1)
                le = labels.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets = out.setdefault(name, {})
                buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's ``histogram_quantile``: linear within the bucket holding rank q (0..1); the highest
    finite bound when it falls in ``+Inf``; NaN with no observation."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def subtract(after: Histograms, before: Histograms) -> Histograms:
    return {
        name: {b: c - before.get(name, {}).get(b, 0.0) for b, c in buckets.items()}
        for name, buckets in after.items()
    }


def merge(parts: list[Histograms]) -> Histograms:
    out: Histograms = {}
    for part in parts:
        for name, buckets in part.items():
            into = out.setdefault(name, {})
            for b, c in buckets.items():
                into[b] = into.get(b, 0.0) + c
    return out
