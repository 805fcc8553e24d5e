"""``belayer bench env-recovery``: recovering an agent's environment from a checkpoint versus replay.

One scripted episode of ``--tool-calls`` (>= 20) tool calls runs through an in-process gateway (a fake
engine whose replies take ``--llm-latency`` s, so each LLM call is a real bubble) in a
``belayer-sandbox-python`` container. The tool calls build and "install" a package from local files,
generate data, and talk to a background HTTP server whose hit counter lives only in its memory.

1. The episode runs with automatic checkpoints off: ``episode_no_ckpt_s``.
2. It runs again with the adaptive policy and standby sandboxes on (``sandbox.standby``: after a
   checkpoint, in what is left of a bubble, the checkpoint restored into a paused container):
   ``episode_adaptive_s``; ``failure_free_overhead_pct`` is the difference (so it includes making the
   standbys, ``standbys_made`` of them), and ``checkpoints_in_bubbles_pct`` the share of its checkpoints
   that ended in their bubble.
3. A failure is injected late, after tool call F = tool_calls - 3: the state after tool calls 0..F-1 is
   rebuilt two ways, each checked against the episode's own outputs (the server's counter included):
   ``replay_recovery_s`` starts a new sandbox from the image and replays every tool call;
   ``checkpoint_recovery_s`` restores the newest checkpoint that existed at F and replays the rest;
   ``stale_checkpoint_recovery_s`` does the same from a checkpoint ``--stale-lag`` calls older (as if the
   policy had deferred), so that the "replay the rest" part is measured too.
   ``checkpoint_recovery_<phase>_s`` split ``checkpoint_recovery_s`` (`PHASES`): the new container, the
   dump staged into it, the engine's start around CRIU, CRIU's restore, and the calls replayed after it.
   ``standby_recovery_s`` does it the standby's way: the newest checkpoint at F restored ahead of time
   and paused as the session makes its standby (``standby_make_s``, not on the recovery path), then, at
   the failure, unpaused (``standby_recovery_unfreeze_s``) and the calls since replayed
   (``standby_recovery_replayed_calls_s``); ``standby_env_recovery_speedup`` is replay over it.
   After each timed recovery (not timed), the server is asked once more: its count must be the
   episode's next one, so its memory came back even when no call was left to replay.

Figures go to stdout as ``name: value`` lines (with ``target_*: pass|fail``), progress to stderr.
Needs a Docker engine with CRIU and the images (``belayer sandbox build-image``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.waits import within
from belayer.testing.services import progress
from core.errors import BenchError
from engine_pool.fake import FakeEngine, LatentEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from sandbox.backend import SandboxSpec
from sandbox.backends import backend_for
from sandbox.config import Mode, PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import PYTHON_IMAGE, ensure_python_image
from sandbox.sessions.manager import CheckpointInfo
from sandbox.workloads import PYTHON_COUNTER_QUERY as QUERY
from sandbox.workloads import PYTHON_COUNTER_SERVER as SERVER

PHASES = ["container_create", "dump_stage", "engine_start", "criu_restore", "restore_other", "replayed_calls"]
"""Where a checkpoint recovery's time goes: the Docker backend's restore phases
(`sandbox.docker_backend.checkpoints`; ``criu_restore`` is NaN, and inside ``engine_start``, where CRIU's
restore log is not found), what else the restore call took, and the tool calls replayed after it."""

STANDBY_PHASES = ["unfreeze", "replayed_calls"]
"""Where a standby recovery's time goes: unpausing the standby, and the tool calls replayed after it."""

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
THINKING = "Let me look at the state of the workspace and decide on the next step. " * 6

GEN_SRC = (
    'mkdir -p src/pkg && python3 -c "\nfor i in range(400):\n'
    "    open(f'src/pkg/m{i}.py','w').write(f'VALUE = {i}\\\\n' + 'def f(x):\\\\n    return x * %d\\\\n' % i * 20)\n"
    "open('src/pkg/__init__.py','w').write('')\" && ls src/pkg | wc -l"
)
BUILD = (
    "python3 -m compileall -q src && python3 -c \"import hashlib; h=b'build'\n"
    'for _ in range({n}): h = hashlib.sha256(h).digest()\nprint(h.hex()[:16])"'
)
GEN_DATA = (
    'python3 -c "import random, hashlib; r = random.Random(7); d = r.randbytes({mib} << 20)\n'
    "open('data.bin','wb').write(d); print(hashlib.sha256(d).hexdigest()[:16])\""
)
INSTALL = (
    "mkdir -p dist /opt/site && tar czf dist/pkg.tgz src && tar xzf dist/pkg.tgz -C /opt/site && "
    "python3 -c 'import sys; sys.path.insert(0, \"/opt/site/src\"); import pkg.m7 as m; print(m.VALUE, m.f(6))'"
)
ANALYSE = (
    "python3 -c \"import hashlib; d = open('data.bin','rb').read(); h = b''\n"
    'for i in range(0, len(d), 1 << 16): h = hashlib.sha256(h + d[i:i + (1 << 16)]).digest()\nprint(h.hex()[:16])"'
)


def tool_calls(n: int, work: int, data_mib: int = 24) -> list[str]:
    """The episode's commands: expensive steps early and in the middle, cheap ones in between. `work`:
    sha256 rounds of each build; `data_mib`: the generated data's size."""
    expensive = {
        1: GEN_SRC, 3: BUILD.replace("{n}", str(work)), 5: GEN_DATA.replace("{mib}", str(data_mib)),
        7: INSTALL, 9: ANALYSE,
        12: BUILD.replace("{n}", str(work)).replace("build", "rebuild"), 15: ANALYSE,
    }  # fmt: skip
    cheap = [QUERY, "echo edit-{i} >> notes.txt && wc -l < notes.txt", QUERY, "grep -c def src/pkg/m1.py"]
    calls = [f"cat > server.py <<'EOF'\n{SERVER}\nEOF\npython3 server.py >/dev/null 2>&1 &\n"
             f"for i in $(seq 100); do {QUERY} >/dev/null 2>&1 && break; sleep 0.05; done; echo up"]  # fmt: skip
    for i in range(1, n):
        calls.append(expensive.get(i, cheap[i % len(cheap)].replace("{i}", str(i))))
    return calls


class Episode:
    """One scripted episode through the gateway: LLM call, then the tool call it names, repeated."""

    def __init__(self, client: httpx.AsyncClient, gw: Gateway, commands: list[str]) -> None:
        self.client, self.gw, self.commands = client, gw, commands
        self.outputs: list[str] = []

    async def run(self, sid: str) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "build, install and analyse"}]
        started = time.monotonic()
        for _ in range(len(self.commands) + 1):
            r = await self.client.post(
                f"/s/{sid}/v1/chat/completions",
                json={"model": "policy", "messages": messages, "tools": TOOLS, "temperature": 0},
            )
            r.raise_for_status()
            message = r.json()["choices"][0]["message"]
            messages.append({k: message[k] for k in ("role", "content", "tool_calls") if message.get(k)})
            for call in message.get("tool_calls") or []:
                command = json.loads(call["function"]["arguments"])["command"]
                x = await self.client.post(
                    f"/api/sessions/{sid}/sandbox/exec", json={"command": command, "timeout_s": 300}
                )
                x.raise_for_status()
                self.outputs.append(x.json()["stdout"])
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": f"RESULT-: {x.json()['stdout']}"}
                )
        return time.monotonic() - started


def script_for(gw: Gateway, commands: list[str]) -> Any:
    tok = gw.tokenizer
    eos = tok.encode(tok.eos_token)

    def script(prompt: list[int]) -> list[int]:
        step = tok.decode(prompt).count("RESULT-")
        if step >= len(commands):
            return tok.encode("Done.") + eos
        call = json.dumps({"name": "bash", "arguments": {"command": commands[step]}})
        return tok.encode(f"{THINKING}\n<tool_call>\n{call}\n</tool_call>") + eos

    return script


async def run_episode(
    opts: argparse.Namespace, backend: DockerSandboxBackend, mode: Mode, commands: list[str], workdir: Path
) -> tuple[float, list[str], list[CheckpointInfo], list[dict[str, Any]]]:
    """One episode through a gateway; checkpoints `mode`, with standby sandboxes when they are taken."""
    engine = FakeEngine(max_model_len=65536)
    config = GatewayConfig(
        model=opts.model,
        store_path=str(workdir / f"traj-{mode}.db"),
        sandbox=SandboxConfig(
            enabled=True, policy=PolicySettings(mode=mode), keep_checkpoints=len(commands) + 2,
            standby=mode != "never" and opts.standby,
        ),
    )
    http = httpx.AsyncClient(transport=httpx.ASGITransport(LatentEngine(engine.app(), opts.llm_latency)))
    pool = EnginePool(http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool, sandbox_backend=backend)
    async with app.router.lifespan_context(app):
        gw: Gateway = app.state.gateway
        assert gw.sandboxes is not None
        engine.script = script_for(gw, commands)
        # a Host the gateway answers (its default allowed hosts: the loopback names, `gateway.http.access`)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=600
        )
        created = await client.post("/api/sessions", json={})
        created.raise_for_status()
        sid = created.json()["id"]
        spec = {"image": PYTHON_IMAGE, "shell": "/bin/bash", "memory_mb": 1024, "cpus": 1.0}
        (await client.post(f"/api/sessions/{sid}/sandbox", json=spec)).raise_for_status()
        episode = Episode(client, gw, commands)
        seconds = await episode.run(sid)
        await within(gw.sandboxes.idle(), "the sandbox manager's checkpoints in the background", 600)
        ckpts = gw.sandboxes.release_checkpoints(sid)  # kept for the recovery measurement
        events = [
            e.data | {"kind": e.kind} for e in gw.store.get_events(sid) if e.kind.startswith("sandbox_")
        ]
        await client.aclose()
    await http.aclose()
    return seconds, episode.outputs, ckpts, events


def replay(backend: DockerSandboxBackend, box: str, commands: list[str], expected: list[str]) -> None:
    for command, want in zip(commands, expected, strict=True):
        got = backend.exec(box, command, timeout_s=300).stdout
        if got != want:
            raise BenchError(f"replay diverged at {command[:60]!r}: {got!r} != {want!r}")


def measure_replay(
    backend: DockerSandboxBackend, commands: list[str], outputs: list[str], fail_at: int
) -> float:
    """Recovery without checkpoints: a new sandbox from the image, every tool call replayed."""
    spec = SandboxSpec(image=PYTHON_IMAGE, shell="/bin/bash", memory_bytes=1 << 30)
    started = time.monotonic()
    box = backend.create(spec).id
    try:
        replay(backend, box, commands[:fail_at], outputs[:fail_at])
        return time.monotonic() - started
    finally:
        backend.destroy(box)


def check_counter(
    backend: DockerSandboxBackend, box: str, commands: list[str], outputs: list[str], fail_at: int
) -> None:
    """The server's in-memory count in a recovered sandbox is the episode's after `fail_at` calls: its
    next answer is one more than the last it gave (1 for the start-up's own query)."""
    answers = [int(outputs[i]) for i in range(fail_at) if commands[i] == QUERY]
    last = answers[-1] if answers else 1
    got = backend.exec(box, QUERY, timeout_s=60).stdout
    if got != f"{last + 1}\n":
        raise BenchError(f"the recovered server counts {got!r}, not {last + 1}: its memory did not come back")


def newest_before(ckpts: list[CheckpointInfo], fail_at: int, lag: int = 0) -> CheckpointInfo:
    """The newest checkpoint at least `lag` tool calls older than the failure (0: the newest that existed)."""
    usable = [c for c in ckpts if c.keep_through <= fail_at - lag]
    if not usable:
        raise BenchError(f"no checkpoint of the first {fail_at - lag} tool calls (of {len(ckpts)} taken)")
    return max(usable, key=lambda c: c.keep_through)


def measure_checkpoint(
    backend: DockerSandboxBackend,
    commands: list[str],
    outputs: list[str],
    ckpts: list[CheckpointInfo],
    fail_at: int,
    lag: int = 0,
) -> tuple[float, int, dict[str, float]]:
    """Recovery from the newest checkpoint at least `lag` tool calls older than the failure (0: the
    newest that existed): restore it, replay the calls after it. Returns (seconds, its turn, where the
    seconds went: the restore's phases, then ``replayed_calls``)."""
    chosen = newest_before(ckpts, fail_at, lag)
    k = chosen.keep_through
    started = time.monotonic()
    restored = backend.restore(chosen.checkpoint)
    restored_at = time.monotonic()
    try:
        replay(backend, restored.id, commands[k:fail_at], outputs[k:fail_at])
        done = time.monotonic()
        check_counter(backend, restored.id, commands, outputs, fail_at)
    finally:
        backend.destroy(restored.id)
    phases = dict(restored.restore_phases)
    phases["restore_other"] = max(0.0, restored_at - started - sum(phases.values()))
    phases["replayed_calls"] = done - restored_at
    return done - started, k, phases


def measure_standby(
    backend: DockerSandboxBackend, commands: list[str], outputs: list[str], ckpts: list[CheckpointInfo], fail_at: int
) -> tuple[float, float, dict[str, float]]:
    """Recovery from the newest checkpoint's standby: made beforehand as the session makes it
    (`restore_standby`: restored, then paused), then at the failure unpaused and the calls since
    replayed. Returns (the making's seconds, the recovery's, where the recovery's went: ``unfreeze``,
    ``replayed_calls``)."""
    chosen = newest_before(ckpts, fail_at)
    k = chosen.keep_through
    started = time.monotonic()
    standby = backend.restore_standby(chosen.checkpoint)
    make_s = time.monotonic() - started
    try:
        started = time.monotonic()
        backend.activate(standby.id)
        unfrozen = time.monotonic()
        replay(backend, standby.id, commands[k:fail_at], outputs[k:fail_at])
        done = time.monotonic()
        check_counter(backend, standby.id, commands, outputs, fail_at)
    finally:
        backend.destroy(standby.id)
    return make_s, done - started, {"unfreeze": unfrozen - started, "replayed_calls": done - unfrozen}


async def run(opts: argparse.Namespace) -> bool:
    commands = tool_calls(opts.tool_calls, opts.work, opts.data_mib)
    workdir = Path(tempfile.mkdtemp(prefix="belayer-env-bench-"))
    with backend_for(checkpoint_dir=workdir / "checkpoints") as backend:
        ensure_python_image(backend)
        results: dict[str, tuple[float, list[str], list[CheckpointInfo], list[dict[str, Any]]]] = {}
        for round_ in range(opts.rounds):
            for mode in ("never", "adaptive") if round_ % 2 == 0 else ("adaptive", "never"):
                progress(f"round {round_ + 1}: episode of {len(commands)} tool calls, checkpoints {mode}")
                got = await run_episode(opts, backend, mode, commands, workdir)
                progress(f"  {got[0]:.2f}s, {len(got[2])} checkpoints")
                if mode not in results or got[0] < results[mode][0]:
                    for old in results.get(mode, (0.0, [], [], []))[2]:
                        backend.delete_checkpoint(old.checkpoint)
                    results[mode] = got
                else:
                    for c in got[2]:
                        backend.delete_checkpoint(c.checkpoint)
        t0, outputs0, _, _ = results["never"]
        t1, outputs1, ckpts, events = results["adaptive"]
        if outputs0 != outputs1:
            raise BenchError("the two episodes' tool outputs differ")
        fail_at = len(commands) - 3
        progress(f"failure injected after tool call {fail_at - 1}; measuring both recoveries")
        replay_s = measure_replay(backend, commands, outputs1, fail_at)
        ckpt_s, k, phases = measure_checkpoint(backend, commands, outputs1, ckpts, fail_at)
        # as if the policy had deferred: an older checkpoint, and the calls since it replayed
        stale_s, stale_k, _ = measure_checkpoint(backend, commands, outputs1, ckpts, fail_at, opts.stale_lag)
        make_s, standby_s, standby_phases = measure_standby(backend, commands, outputs1, ckpts, fail_at)
        for c in ckpts:
            backend.delete_checkpoint(c.checkpoint)
    decisions = [e for e in events if e["kind"] == "sandbox_checkpoint_decision"]
    taken = [e for e in events if e["kind"] == "sandbox_checkpoint"]
    in_bubble = sum(1 for e in taken if e["in_bubble"])
    standbys = [e for e in events if e["kind"] == "sandbox_standby" and e["action"] == "made"]
    overhead = (t1 - t0) / t0 * 100
    speedup = replay_s / ckpt_s
    standby_speedup = replay_s / standby_s
    emit("tool_calls", len(commands))
    emit("failure_after_tool_call", fail_at - 1)
    emit("restored_checkpoint_turn", k)
    emit("replay_recovery_s", replay_s)
    emit("checkpoint_recovery_s", ckpt_s)
    emit("env_recovery_speedup", speedup)
    for phase in PHASES:  # where checkpoint_recovery_s went
        emit(f"checkpoint_recovery_{phase}_s", phases.get(phase, math.nan))
    emit("stale_checkpoint_turn", stale_k)
    emit("stale_checkpoint_replayed_calls", fail_at - stale_k)
    emit("stale_checkpoint_recovery_s", stale_s)
    emit("stale_env_recovery_speedup", replay_s / stale_s)
    emit("standby_make_s", make_s)
    emit("standby_recovery_s", standby_s)
    for phase in STANDBY_PHASES:  # where standby_recovery_s went
        emit(f"standby_recovery_{phase}_s", standby_phases[phase])
    emit("standby_env_recovery_speedup", standby_speedup)
    emit("episode_no_ckpt_s", t0)
    emit("episode_adaptive_s", t1)
    emit("failure_free_overhead_pct", overhead)
    emit("checkpoints_taken", len(taken))
    emit("checkpoints_deferred", sum(1 for d in decisions if d["action"] == "defer"))
    emit("checkpoint_mean_s", sum(e["seconds"] for e in taken) / max(1, len(taken)))
    emit("checkpoints_in_bubbles_pct", 100.0 * in_bubble / max(1, len(taken)))
    emit("standbys_made", len(standbys))
    emit("target_env_recovery_speedup", "pass" if speedup >= 10 else "fail")
    emit("target_standby_env_recovery_speedup", "pass" if standby_speedup >= 10 else "fail")
    emit("target_failure_free_overhead", "pass" if overhead <= 2.0 else "fail")
    emit("target_checkpoints_in_bubbles", "pass" if in_bubble >= 0.9 * len(taken) else "fail")
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench env-recovery", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=".cache/tiny-model", help="the gateway's model directory (built if missing)"
    )
    p.add_argument("--tool-calls", type=int, default=22)
    p.add_argument("--llm-latency", type=float, default=2.0, help="seconds each LLM call takes (the bubble)")
    p.add_argument("--work", type=int, default=1_500_000, help="sha256 rounds of each build step")
    p.add_argument("--data-mib", type=int, default=24, help="MiB of data the episode generates and analyses")
    p.add_argument("--rounds", type=int, default=1, help="episodes per mode (the fastest counts)")
    p.add_argument(
        "--no-standby", dest="standby", action="store_false",
        help="the adaptive episode without standby sandboxes (an A/B of their failure-free cost; the "
        "standby recovery is still measured)",
    )  # fmt: skip
    p.add_argument(
        "--stale-lag", type=int, default=5, help="tool calls between the failure and the older checkpoint"
    )
    opts = p.parse_args(argv)
    if opts.tool_calls < 20:
        p.error("--tool-calls must be at least 20")
    return opts


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    backend_for().close()  # Docker down: SandboxUnavailable, before any work
    if not (Path(opts.model) / "tokenizer.json").exists():
        from belayer.testing.tiny_model import build_tiny

        build_tiny(opts.model)
    asyncio.run(run(opts))
    return 0
