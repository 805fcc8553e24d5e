"""What a fake engine's ``/metrics`` reports (`FakeStats`), under vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(slots=True)
class FakeStats(Collector):
    """What ``/metrics`` reports, as vLLM names it: requests running, tokens, KV-cache usage, and the
    prefix cache, which like vLLM's caches whole blocks of ``block_size`` tokens (prompt and output) and
    counts a prompt's leading cached blocks as hits.

    >>> stats = FakeStats(block_size=2)
    >>> stats.admit([1, 2, 3, 4, 5], [6]); stats.admit([1, 2, 3, 4, 5, 6, 7], [8])
    >>> stats.prefix_cache_queries, stats.prefix_cache_hits
    (12, 6)
    """

    model: str = "fake"
    block_size: int = 16
    kv_cache_tokens: int = 65536
    max_cached_blocks: int = 1 << 16
    running: int = 0
    running_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    _cached: set[int] = field(default_factory=set)

    def _blocks(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full blocks of `ids`: a block's hash stands for its whole prefix."""
        hashes, h = [], 0
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            h = hash((h, *ids[start : start + self.block_size]))
            hashes.append(h)
        return hashes

    def admit(self, prompt: list[int], output: list[int]) -> None:
        """A request starts: its prompt is looked up in the prefix cache and its blocks are cached."""
        prompt_blocks = self._blocks(prompt)
        hit = next((i for i, h in enumerate(prompt_blocks) if h not in self._cached), len(prompt_blocks))
        self.prefix_cache_queries += len(prompt)
        self.prefix_cache_hits += hit * self.block_size
        self.prompt_tokens += len(prompt)
        if len(self._cached) > self.max_cached_blocks:
            self._cached.clear()  # evicted all at once: it is a fake
        self._cached.update(self._blocks(prompt + output))
        self.running += 1
        self.running_tokens += len(prompt) + len(output)

    def finish(self, prompt: list[int], output: list[int], sent: int) -> None:
        """A request ends, `sent` of its output tokens sent."""
        self.running -= 1
        self.running_tokens -= len(prompt) + len(output)
        self.generation_tokens += sent

    def collect(self) -> list[Metric]:
        labels = ["engine", "model_name"]  # in vLLM's order
        values = ["0", self.model]

        def gauge(name: str, about: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, about, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, about: str, value: float) -> Metric:
            family = CounterMetricFamily(name, about, labels=labels)
            family.add_metric(values, value)
            return family

        usage = min(1.0, self.running_tokens / self.kv_cache_tokens)
        return [
            gauge(
                "vllm:num_requests_running", "Number of requests in model execution batches.", self.running
            ),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 0),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.prefix_cache_queries,
            ),
            counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.prefix_cache_hits,
            ),
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens
            ),
        ]
