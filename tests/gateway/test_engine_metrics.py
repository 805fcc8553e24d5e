"""``GET /metrics/engines``: each worker's ``/metrics`` re-exposed with a ``worker`` label; a worker that
does not answer is ``belayer_engine_metrics_up 0``. Fake engines over ``httpx.ASGITransport``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.engine.client import EngineClient
from engine_pool.face import MemberView
from engine_pool.fake import FakeEngine
from engine_pool.pool import PoolMember
from gateway.api.engine_metrics import UP, relabel, scrape
from gateway.config import GatewayConfig
from tests.support import asgi_gateway

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class ByHost(httpx.AsyncBaseTransport):
    """One fake engine per host; a host in `down` refuses connections, one in `hung` never answers."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.apps = {host: httpx.ASGITransport(e.app()) for host, e in engines.items()}
        self.down: set[str] = set()
        self.hung: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.host in self.hung and request.url.path == "/metrics":
            await asyncio.Event().wait()
        return await self.apps[request.url.host].handle_async_request(request)


def samples(text: str, prefix: str = "") -> Samples:
    """Every sample whose name starts with `prefix`, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


def labels(worker: str) -> tuple[tuple[str, str], ...]:
    return (("engine", "0"), ("model_name", "fake"), ("worker", worker))


def config(tmp_path: Path, model: Path) -> GatewayConfig:
    return GatewayConfig(model=str(model), store_path=str(tmp_path / "t.db"))


async def complete(http: httpx.AsyncClient, prompt: list[int]) -> None:
    r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})
    assert r.status_code == 200, r.text


async def test_each_workers_metrics_relabelled(tmp_path: Path, tiny_model_dir: Path) -> None:
    e0, e1 = FakeEngine(), FakeEngine()
    engines = ByHost({"e0": e0, "e1": e1})
    async with (
        asgi_gateway(config(tmp_path, tiny_model_dir), engines, hosts=["http://e0", "http://e1"]) as (
            _,
            client,
        ),
        httpx.AsyncClient(transport=engines.apps["e0"], base_url="http://e0") as direct,
    ):
        # Two requests to e0, the second extending the first (40 prompt + 8 output tokens = 3 blocks
        # of 16): its first 48 tokens are prefix-cache hits.
        e0.outputs = [list(range(100, 108)), list(range(200, 208))]
        first = list(range(1, 41))
        await complete(direct, first)
        await complete(direct, [*first, *range(100, 108), *[7] * 10])
        r = await client.get("/metrics/engines")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    got = samples(r.text, "vllm:")
    expected: Samples = {}
    for worker, (queries, hits, generated) in {"remote-0": (98, 48, 16), "remote-1": (0, 0, 0)}.items():
        expected |= {
            ("vllm:num_requests_running", labels(worker)): 0.0,
            ("vllm:num_requests_waiting", labels(worker)): 0.0,
            ("vllm:kv_cache_usage_perc", labels(worker)): 0.0,
            ("vllm:prefix_cache_queries_total", labels(worker)): queries,
            ("vllm:prefix_cache_hits_total", labels(worker)): hits,
            ("vllm:prompt_tokens_total", labels(worker)): queries,
            ("vllm:generation_tokens_total", labels(worker)): generated,
        }
    assert got == expected
    assert samples(r.text, UP) == {(UP, (("worker", "remote-0"),)): 1.0, (UP, (("worker", "remote-1"),)): 1.0}
    # one HELP and TYPE per family, however many workers have it
    assert r.text.count("# TYPE vllm:prefix_cache_hits_total counter\n") == 1
    assert r.text.count("# HELP vllm:kv_cache_usage_perc ") == 1
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="fake",worker="remote-0"} 48.0\n' in r.text


async def test_a_worker_that_does_not_answer_is_up_0(tmp_path: Path, tiny_model_dir: Path) -> None:
    engines = ByHost({"e0": FakeEngine(), "e1": FakeEngine()})
    async with asgi_gateway(config(tmp_path, tiny_model_dir), engines, hosts=["http://e0", "http://e1"]) as (
        _,
        client,
    ):
        engines.down.add("e1")
        r = await client.get("/metrics/engines")
    assert r.status_code == 200
    assert samples(r.text, UP) == {(UP, (("worker", "remote-0"),)): 1.0, (UP, (("worker", "remote-1"),)): 0.0}
    workers = {dict(key[1]).get("worker") for key in samples(r.text)}
    assert workers == {"remote-0", "remote-1"}  # remote-1 only in the up gauge
    assert not any(dict(lbl).get("worker") == "remote-1" for name, lbl in samples(r.text, "vllm:"))


async def test_a_hung_worker_is_given_up_on_after_the_timeout() -> None:
    engines = ByHost({"e0": FakeEngine()})
    engines.hung.add("e0")
    async with httpx.AsyncClient(transport=engines) as http:
        member = MemberView.of(PoolMember("worker-0", EngineClient("http://e0", "fake", http)), 300.0)
        assert await scrape(http, member, timeout=0.05) == ("worker-0", None)


def test_text_that_is_not_prometheus_counts_as_no_answer() -> None:
    families = relabel([("worker-0", "<html>502 Bad Gateway</html>\n")])
    assert [(f.name, [(s.labels, s.value) for s in f.samples]) for f in families] == [
        (UP, [({"worker": "worker-0"}, 0.0)])
    ]


def test_a_histogram_keeps_its_buckets_and_a_worker_label_is_replaced() -> None:
    text = (
        "# HELP vllm:time_to_first_token_seconds TTFT.\n"
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",worker="inner"} 1.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",worker="inner"} 2.0\n'
        'vllm:time_to_first_token_seconds_count{worker="inner"} 2.0\n'
        'vllm:time_to_first_token_seconds_sum{worker="inner"} 0.5\n'
    )
    _, ttft = relabel([("w0", text)])
    assert ttft.type == "histogram"
    assert [(s.name, s.labels, s.value) for s in ttft.samples] == [
        ("vllm:time_to_first_token_seconds_bucket", {"le": "0.1", "worker": "w0"}, 1.0),
        ("vllm:time_to_first_token_seconds_bucket", {"le": "+Inf", "worker": "w0"}, 2.0),
        ("vllm:time_to_first_token_seconds_count", {"worker": "w0"}, 2.0),
        ("vllm:time_to_first_token_seconds_sum", {"worker": "w0"}, 0.5),
    ]
