"""``belayer bench fork``: N siblings forked at turn k of an episode versus N siblings re-run to turn k.

A scripted episode runs through an in-process gateway: a fake engine whose replies take
``--llm-latency`` s, and after each turn a tool call that takes ``--tool-s`` s of real time in a sandbox:
with ``--backend fake`` (the default) of the in-memory backend (`sandbox.fake`; the same manager, journal
and checkpoints as with Docker), with ``--backend docker`` a ``belayer-sandbox-python`` container whose
checkpoints hold its processes too (CRIU; a Docker engine with CRIU and ``belayer sandbox build-image``
needed), so each child is a container restored from the parent's checkpoint. A checkpoint is taken before turn k (the nearest earlier one), so the fork restores it and replays the
journaled tool calls up to k, as it must when no checkpoint is exactly at k. (The checkpoint is taken
after turn k - 3's tool call: the journal then holds the tool calls of turns k - 2 and k - 1.)

- ``fork_ready_s``: ``POST /api/sessions/{id}/fork {"at_turn": k, "n": N}`` until all N children are
  ready (their sandboxes restored and replayed);
- ``rerun_ready_s``: N new sessions each re-run from scratch to turn k (concurrently), as a team does
  without forks;
- ``fork_speedup`` = rerun / fork; ``fork_store_bytes_ratio``: the store bytes the N children added over
  the bytes N full copies of turns 0..k added (the re-runs).

Figures go to stdout as ``name: value`` lines (with ``target_*: pass|fail``), progress to stderr.
Targets: ``fork_speedup`` >= 5 at k = 10, ``fork_store_bytes_ratio`` <= 0.10.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.testing.services import progress
from engine_pool.fake import FakeEngine, LatentEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from sandbox.backend import SandboxBackend
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.images import PYTHON_IMAGE


class Episode:
    """Drives scripted sessions through the gateway's HTTP API."""

    def __init__(self, client: httpx.AsyncClient, gw: Gateway, engine: FakeEngine, opts: argparse.Namespace):
        self.client, self.gw, self.engine, self.opts = client, gw, engine, opts
        tok = gw.tokenizer
        # a long reply: each turn adds real tokens, as an agent's turns do
        self.reply = tok.encode(" ".join(["let me run the next step of the plan"] * 8)) + tok.encode(
            tok.eos_token
        )

    async def session(self) -> str:
        sandbox = (
            {"image": PYTHON_IMAGE, "shell": "/bin/bash"}
            if self.opts.backend == "docker"
            else {"image": "bench"}
        )
        body = {"sandbox": sandbox, "metadata": {"bench": "fork"}}
        r = await self.client.post("/api/sessions", json=body)
        r.raise_for_status()
        return str(r.json()["id"])

    async def run(self, sid: str, turns: int, checkpoint_at: int | None = None) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "solve the task " * 20}]
        for i in range(turns):
            self.engine.outputs.append(list(self.reply))
            body = {"model": "policy", "messages": messages, "max_tokens": 200}
            r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
            r.raise_for_status()
            content = r.json()["choices"][0]["message"]["content"]
            command = f"sleep {self.opts.tool_s} && echo {i} > /workspace/out-{i}"
            r = await self.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": command})
            r.raise_for_status()
            if checkpoint_at is not None and i == checkpoint_at:
                (await self.client.post(f"/api/sessions/{sid}/sandbox/checkpoints")).raise_for_status()
            messages += [
                {"role": "assistant", "content": content},
                {"role": "user", "content": f"tool output {i}: " + "ok " * 40},
            ]


async def run(opts: argparse.Namespace) -> None:
    k, n = opts.at_turn, opts.siblings
    with tempfile.TemporaryDirectory(prefix="belayer-bench-fork-") as tmp:
        store_path = Path(tmp) / "traj.db"
        config = GatewayConfig(
            model=opts.model,
            store_path=str(store_path),
            sandbox=SandboxConfig(enabled=True, sandbox_port=None, policy=PolicySettings(mode="never")),
        )
        engine = FakeEngine(max_model_len=65536)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(LatentEngine(engine.app(), opts.llm_latency)))
        pool = EnginePool(http)
        pool.add_remote("http://fake-engine")
        backend = sandbox_backend(opts.backend, Path(tmp))
        app = build_app(config, pool=pool, sandbox_backend=backend)
        async with app.router.lifespan_context(app):
            gw: Gateway = app.state.gateway
            # a Host the gateway answers (its default allowed hosts: the loopback names, `gateway.http.access`)
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=600
            )
            ep = Episode(client, gw, engine, opts)
            parent = await ep.session()
            progress(f"parent episode to turn {k} (checkpoint after turn {k - 3}'s tool call)")
            await ep.run(parent, k + 1, checkpoint_at=k - 3)

            def stored() -> int:
                gw.store.vacuum()  # checkpoint the WAL: the file's size is what is stored
                return gw.store.size_bytes()

            before = stored()
            progress(f"fork into {n}")
            t0 = time.monotonic()
            r = await client.post(f"/api/sessions/{parent}/fork", json={"at_turn": k, "n": n})
            r.raise_for_status()
            fork_s = time.monotonic() - t0
            replayed = [
                e.data["replayed"]
                for e in gw.store.get_events(r.json()["data"][0]["id"])
                if e.kind == "sandbox_forked"
            ]
            fork_bytes = stored() - before

            progress(f"re-run {n} siblings to turn {k}")
            before = stored()
            t0 = time.monotonic()
            sids = [await ep.session() for _ in range(n)]
            await asyncio.gather(*(ep.run(sid, k + 1) for sid in sids))
            rerun_s = time.monotonic() - t0
            rerun_bytes = stored() - before
            for sid in [parent, *(c["id"] for c in r.json()["data"]), *sids]:  # their sandboxes too
                (await client.post(f"/api/sessions/{sid}/close")).raise_for_status()
            await client.aclose()
        await http.aclose()
        backend.close()
    speedup = rerun_s / fork_s
    ratio = max(fork_bytes, 0) / max(rerun_bytes, 1)
    emit("backend", opts.backend)
    emit("at_turn", k)
    emit("siblings", n)
    emit("fork_replayed_tool_calls", replayed[0] if replayed else 0)
    emit("fork_ready_s", fork_s)
    emit("rerun_ready_s", rerun_s)
    emit("fork_speedup", speedup)
    emit("fork_store_bytes", fork_bytes)
    emit("rerun_store_bytes", rerun_bytes)
    emit("fork_store_bytes_ratio", ratio)
    emit("target_fork_speedup", "pass" if speedup >= 5 else "fail")
    emit("target_fork_store_bytes_ratio", "pass" if ratio <= 0.10 else "fail")


def sandbox_backend(kind: str, tmp: Path) -> SandboxBackend:
    if kind == "fake":
        return FakeSandboxBackend()
    from sandbox.backends import backend_for
    from sandbox.images import ensure_python_image

    backend = backend_for(checkpoint_dir=tmp / "checkpoints")
    ensure_python_image(backend)
    return backend


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench fork", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=".cache/tiny-model", help="the gateway's model directory (built if missing)"
    )
    p.add_argument("--at-turn", type=int, default=10, help="k: the turn to fork at (>= 3)")
    p.add_argument("--siblings", type=int, default=4, help="N")
    p.add_argument(
        "--llm-latency",
        type=float,
        default=2.0,
        help="seconds each LLM call takes (as in `belayer bench env-recovery`; an agent's calls take seconds)",
    )
    p.add_argument("--tool-s", type=float, default=0.3, help="seconds each tool call takes")
    p.add_argument(
        "--backend",
        choices=["fake", "docker"],
        default="fake",
        help="the sandboxes: in memory, or Docker containers checkpointed with CRIU",
    )
    opts = p.parse_args(argv)
    if opts.at_turn < 3:
        p.error("--at-turn must be >= 3")
    return opts


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    if not (Path(opts.model) / "model.safetensors").exists():
        from belayer.testing.tiny_model import build_tiny

        build_tiny(opts.model)
    asyncio.run(run(opts))  # a target missed is a figure (target_*: fail), as in every bench: exit 0
    return 0
