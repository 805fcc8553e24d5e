"""``GET /metrics/engines``: every worker's own Prometheus metrics (vLLM's prefix-cache hits, KV-cache
usage, queue lengths), re-exposed through the gateway with a ``worker`` label on every sample.

Prometheus then needs only the gateway's address, not each worker's (workers come and go, on ports
the pool picks). Every worker the pool has (but the dead) is scraped at once, each within
``SCRAPE_TIMEOUT_S``; ``belayer_engine_metrics_up{worker}`` is 1 for a worker that answered and 0 for
one that did not (starting, hung, gone), whose samples are then absent. A family's HELP and TYPE come
once, from the first worker that has it.

The gateway's own ``/metrics`` scrapes the workers too (`scrape_pool`), for one figure computed from
theirs: ``belayer_prefix_cache_hit_rate`` (`prefix_cache_hit_rate`), each worker's prefix-cache hits
over its queries (vLLM's ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, in
tokens, since the worker started), and ``worker="all"``: the pool's, the sums' ratio over the workers
that answered. A worker with no query yet has no sample.

Example::

    $ curl -s localhost:8000/metrics/engines | grep kv_cache_usage
    vllm:kv_cache_usage_perc{engine="0",model_name="policy",worker="worker-0"} 0.02

>>> text = '''# HELP vllm:num_requests_running Requests running.
... # TYPE vllm:num_requests_running gauge
... vllm:num_requests_running{engine="0"} 2.0'''
>>> print(render(relabel([("worker-0", text), ("worker-1", None)])).decode(), end="")
# HELP belayer_engine_metrics_up Whether the worker answered the gateway's scrape of its /metrics (1) or not (0).
# TYPE belayer_engine_metrics_up gauge
belayer_engine_metrics_up{worker="worker-0"} 1.0
belayer_engine_metrics_up{worker="worker-1"} 0.0
# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",worker="worker-0"} 2.0
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_pool.face import MemberView
from engine_pool.states import DEAD
from gateway.gateway import Gateway, gateway_of

log = logging.getLogger("belayer.gateway")

SCRAPE_TIMEOUT_S = 2.0
"""How long a worker may take to answer: a scrape must not hang on one hung worker."""
UP = "belayer_engine_metrics_up"
HIT_RATE = "belayer_prefix_cache_hit_rate"
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
"""vLLM's prefix-cache counters (in tokens; their samples end in ``_total``)."""

Scrape = tuple[str, str | None]
"""A worker's name and its ``/metrics`` text (None: it did not answer)."""


async def scrape(http: httpx.AsyncClient, member: MemberView, timeout: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """`member`'s ``/metrics`` text, or None when it does not answer 200 within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):  # the whole answer, whatever the transport
            resp = await http.get(f"{member.url}/metrics", timeout=timeout)
    except (httpx.HTTPError, TimeoutError) as exc:
        log.debug("metrics of %s: no answer (%r)", member.name, exc)
        return member.name, None
    if resp.status_code != 200:
        log.debug("metrics of %s: HTTP %d", member.name, resp.status_code)
        return member.name, None
    return member.name, resp.text


async def scrape_pool(gw: Gateway) -> list[Scrape]:
    """Every worker's ``/metrics`` (but the dead's), at once, each within ``SCRAPE_TIMEOUT_S``."""
    members = [m for m in gw.pool.view().members if m.state != DEAD]
    return list(await asyncio.gather(*(scrape(gw.pool.http, m) for m in members)))


def _parse(worker: str, text: str) -> list[Metric] | None:
    try:
        return list(text_string_to_metric_families(text))
    except ValueError as exc:  # not Prometheus text: as if it had not answered
        log.warning("metrics of %s: not Prometheus text (%s)", worker, exc)
        return None


def relabel(scrapes: Sequence[Scrape]) -> list[Metric]:
    """The families of all `scrapes`, merged by name, every sample labelled with its ``worker``; first
    ``belayer_engine_metrics_up``. A family whose type differs from the first worker's is left out."""
    up = GaugeMetricFamily(
        UP,
        "Whether the worker answered the gateway's scrape of its /metrics (1) or not (0).",
        labels=["worker"],
    )
    merged: dict[str, Metric] = {}
    for worker, text in scrapes:
        families = _parse(worker, text) if text is not None else None
        up.add_metric([worker], 0.0 if families is None else 1.0)
        for family in families or []:
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            if into.type != family.type:
                continue
            for sample in family.samples:
                labels = {**{k: v for k, v in sample.labels.items() if k != "worker"}, "worker": worker}
                into.samples.append(sample._replace(labels=labels))
    return [up, *merged.values()]


def _total(families: list[Metric], name: str) -> float:
    """The sum of the samples of counter `name` (``name_total``; 0 when the worker has none)."""
    return sum(s.value for f in families for s in f.samples if s.name == f"{name}_total")


def prefix_cache_hit_rate(scrapes: Sequence[Scrape]) -> Metric:
    """``belayer_prefix_cache_hit_rate``, per worker and for ``worker="all"`` (module docstring).

    >>> w0 = '''vllm:prefix_cache_queries_total{engine="0"} 80.0
    ... vllm:prefix_cache_hits_total{engine="0"} 48.0'''
    >>> w2 = '''vllm:prefix_cache_queries_total{engine="0"} 20.0
    ... vllm:prefix_cache_hits_total{engine="0"} 2.0'''
    >>> rate = prefix_cache_hit_rate([("worker-0", w0), ("worker-1", None), ("worker-2", w2)])
    >>> [(s.labels["worker"], s.value) for s in rate.samples]
    [('worker-0', 0.6), ('worker-2', 0.1), ('all', 0.5)]
    """
    rate = GaugeMetricFamily(
        HIT_RATE,
        "Prefix-cache hits over queries (tokens), since each worker started: per worker, and all workers.",
        labels=["worker"],
    )
    queries = hits = 0.0
    for worker, text in scrapes:
        families = _parse(worker, text) if text is not None else None
        if not families:
            continue
        q, h = _total(families, PREFIX_QUERIES), _total(families, PREFIX_HITS)
        if q > 0:
            rate.add_metric([worker], h / q)
        queries, hits = queries + q, hits + h
    if queries > 0:
        rate.add_metric(["all"], hits / queries)
    return rate


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric]) -> bytes:
    """The Prometheus text exposition of `families`."""
    return generate_latest(_Families(families))


async def engine_metrics(request: Request) -> Response:
    gw = gateway_of(request)
    scrapes = await scrape_pool(gw)
    body = await gw.offload(lambda: render(relabel(scrapes)))  # parsing pages of text: off the loop
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def routes() -> list[Route]:
    return [Route("/metrics/engines", engine_metrics, methods=["GET"])]
