"""The weight owner's figures for ``belayer bench recovery``: the same pool twice, with a weight owner
(``--weight-owner``: workers and shadows map one copy of the weights from /dev/shm) and with each worker
loading its own copy from disk, in one run:

* memory: ``weights_mib`` (the checkpoint), per worker and per shadow ``*_pss_mib_owner|private`` (the
  whole process group's PSS: a page shared by N processes counts 1/N to each) and ``*_uss_mib_*`` (its
  private pages: what it alone costs the host); ``shadow_extra_memory_ratio``: a shadow's PSS with an owner
  less its runtime state (a disk-loaded shadow's PSS less the weights), over the weights;
* ``replacement_ready_s_owner|disk``: a killed worker's replacement, from launch to ``/health``;
* ``failover_s_owner|disk``: the kill → the client's next token (as ``failover_s``);
* KV rebuild: a failover resubmits the logged prefix (prompt + generated ids), so the new worker prefills
  it again: time to the first token for fresh prompts of several lengths on a promoted shadow
  (``kv_rebuild_ttft_s_ctx_<n>``) and the least-squares slope, ``kv_rebuild_s_per_1k_tokens``.

Every worker gets one short request before memory is read, so that each has touched its weights. The
requests made to a worker itself (that one, the prefills) send the key the bench gave the gateway
(`belayer.bench.stand_up.WorkerKey`), which launched workers ask.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.pool import engines, kill_once, wait_until
from belayer.bench.stand_up import WorkerKey, serve_service, start
from belayer.bench.waits import found
from belayer.testing.services import Service, base_url, progress, running
from core import shm_weights

MIB = 1024 * 1024


def group_memory(pgid: int, owner_dir: Path | None) -> dict[str, int]:
    """PSS/USS of a worker's whole process group, and the PSS of its mappings of the owner's files."""
    out = {"pss": 0, "uss": 0, "mapped_pss": 0}
    for pid in shm_weights.group_pids(pgid):
        mem = shm_weights.process_memory(pid)
        out["pss"] += mem["pss"]
        out["uss"] += mem["uss"]
        if owner_dir is not None:
            out["mapped_pss"] += shm_weights.mapped_memory(pid, owner_dir)["pss"]
    return out


async def _warm(http: httpx.AsyncClient, url: str, key: WorkerKey) -> None:
    body = {"model": "policy", "prompt": [11, 12, 13, 14], "max_tokens": 4, "temperature": 0}
    (await http.post(f"{url}/v1/completions", json=body, headers=key.headers)).raise_for_status()


async def prefill_seconds(http: httpx.AsyncClient, url: str, tokens: int, seed: int, key: WorkerKey) -> float:
    """Time to the first (only) token of a prompt no cache holds (random ids): a KV rebuild of `tokens`."""
    rng = random.Random(seed)
    body = {"model": "policy", "prompt": [rng.randrange(10, 8000) for _ in range(tokens)], "max_tokens": 1,
            "temperature": 0}  # fmt: skip
    t0 = time.monotonic()
    (await http.post(f"{url}/v1/completions", json=body, headers=key.headers)).raise_for_status()
    return time.monotonic() - t0


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares seconds per token through (length, seconds) points.

    >>> round(slope([(1000, 1.1), (2000, 2.1), (4000, 4.1)]), 6)
    0.001
    """
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


async def _measure(
    url: str, opts: argparse.Namespace, owner_dir: Path | None, kv: bool, key: WorkerKey
) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=900, trust_env=False) as http:
        await wait_until(http, url, opts.workers, opts.shadows, 1800)
        pool = await engines(http, url)
        for e in pool:
            await _warm(http, e["url"], key)
        active = next(e for e in pool if e["state"] == "ready")
        shadow = next(e for e in pool if e["state"] == "shadow")
        w, s = group_memory(active["pid"], owner_dir), group_memory(shadow["pid"], owner_dir)
        out: dict[str, float] = {"worker_pss": w["pss"], "worker_uss": w["uss"], "shadow_pss": s["pss"], "shadow_uss": s["uss"],
               "shadow_mapped_pss": s["mapped_pss"]}  # fmt: skip
        killed = await kill_once(url, opts, key)
        out["failover_s"] = killed["failover_s"]
        newest = max(await engines(http, url), key=lambda e: e["launched_at"] or 0)
        out["replacement_ready_s"] = float(newest["ready_at"] - newest["launched_at"])
        if kv:  # on the shadow promoted by the kill: what a failover's resubmission costs
            promoted = await found(
                lambda: _ready(http, url, shadow["name"]), f"{shadow['name']} promoted", 600
            )
            for i, n in enumerate(opts.kv_contexts):  # the median of 3, each prompt a new one
                runs = [await prefill_seconds(http, promoted["url"], n, 10 * i + r, key) for r in range(3)]
                out[f"ttft_{n}"] = statistics.median(runs)
    return out


async def _ready(http: httpx.AsyncClient, url: str, name: str) -> dict[str, Any] | None:
    """The worker `name`, once it is ready (a shadow promoted by a kill), else None."""
    return next((e for e in await engines(http, url) if e["name"] == name and e["state"] == "ready"), None)


def _pool(workdir: Path, opts: argparse.Namespace, owner: bool) -> dict[str, float]:
    name = "pool-owner" if owner else "pool-disk"
    extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--no-worker-wait", "900",
             "--max-model-len", str(opts.owner_context), *(["--weight-owner"] if owner else [])]  # fmt: skip
    services: list[Service] = []
    key = WorkerKey()  # the bench warms and prefills the workers itself
    with running(services):
        gw = serve_service(workdir, name, opts.model, extra, log_dir=workdir / name, env=key.env())
        start(services, gw, timeout=1800)
        owner_dir = shm_weights.owner_dir(shm_weights.DEFAULT_BASE, shm_weights.checkpoint_hash(opts.model))
        result = asyncio.run(_measure(base_url(gw), opts, owner_dir if owner else None, owner, key))
    progress(f"{name}: { ({k: round(v, 3) for k, v in result.items()}) }")
    return result


def weights_bytes(model_dir: str) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def owner_figures(workdir: Path, opts: argparse.Namespace) -> None:
    """Both pools, one after the other (never both at once: memory), then the figures."""
    weights = weights_bytes(opts.model)
    disk = _pool(workdir, opts, owner=False)
    owned = _pool(workdir, opts, owner=True)
    emit("weights_mib", weights / MIB)
    for role in ("worker", "shadow"):
        for kind in ("pss", "uss"):
            emit(f"{role}_{kind}_mib_owner", owned[f"{role}_{kind}"] / MIB)
            emit(f"{role}_{kind}_mib_private", disk[f"{role}_{kind}"] / MIB)
    emit("shadow_weights_pss_mib_owner", owned["shadow_mapped_pss"] / MIB)
    runtime = disk["shadow_pss"] - weights  # a shadow's PSS without its weights
    ratio = (owned["shadow_pss"] - runtime) / weights
    emit("shadow_extra_memory_ratio", ratio)
    emit(
        "shadow_extra_memory_ratio_private_pages",
        (owned["shadow_uss"] - (disk["shadow_uss"] - weights)) / weights,
    )
    emit("target_shadow_extra_memory_le_15pct", "pass" if ratio <= 0.15 else "fail")
    emit("replacement_ready_s_owner", owned["replacement_ready_s"])
    emit("replacement_ready_s_disk", disk["replacement_ready_s"])
    emit("replacement_ready_speedup", disk["replacement_ready_s"] / owned["replacement_ready_s"])
    emit("failover_s_owner", owned["failover_s"])
    emit("failover_s_disk", disk["failover_s"])
    points = [(n, owned[f"ttft_{n}"]) for n in opts.kv_contexts]
    for n, seconds in points:
        emit(f"kv_rebuild_ttft_s_ctx_{n}", seconds)
    emit("kv_rebuild_s_per_1k_tokens", slope(points) * 1000)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-owner", dest="owner", action="store_false",
                   help="skip the weight-owner comparison (two more pools)")  # fmt: skip
    p.add_argument("--model-size", choices=["tiny", "500m"], default="tiny",
                   help="500m: build (once, into .cache/model-500m unless --model is given) and measure a "
                   "~530M-parameter model (2.1 GB in float32)")  # fmt: skip
    p.add_argument("--owner-context", type=int, default=8192, help="context length of the compared pools")
    p.add_argument("--kv-contexts", type=lambda v: [int(x) for x in v.split(",")], default=[512, 1024, 2048],
                   help="prompt lengths for the KV rebuild time, e.g. 512,1024,2048")  # fmt: skip


def ensure_sized_model(opts: argparse.Namespace, default_model: str) -> None:
    """With ``--model-size 500m`` and no ``--model``, the model is ``.cache/model-500m``, built once."""
    if opts.model_size == "tiny":
        return
    if opts.model == default_model:
        opts.model = f".cache/model-{opts.model_size}"
    if not (Path(opts.model) / "config.json").exists():
        from belayer.testing.tiny_model import build_tiny

        progress(f"building the {opts.model_size} model in {opts.model} (once)")
        build_tiny(opts.model, size=opts.model_size)
