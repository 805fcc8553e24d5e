"""A trainer-side example: one episode through a Belayer gateway, then its token-level trajectory.

What a trainer's rollout worker does per episode, with nothing but the official ``openai`` SDK and
``httpx``: create a session, hand its ``base_url`` to the agent (here a few scripted chat turns, one of
them streamed), attach a reward, close the session, and read back every prompt id, generated id,
logprob and loss-mask bit. Exits 0 when the trajectory holds every turn, else 1.

Environment: ``BELAYER_URL`` (http://gateway:8000), ``BELAYER_API_TOKEN`` (when the gateway has
``--api-token``), ``BELAYER_MODEL`` (policy), ``BELAYER_TURNS`` (3), ``BELAYER_MAX_TOKENS`` (24),
``BELAYER_WAIT_S`` (seconds to wait for the gateway's ``/health``, 600: a vLLM worker loads slowly).

Run it beside the compose file's gateway (``docker compose run --rm trainer``) or on a host::

    BELAYER_URL=http://127.0.0.1:8000 python deploy/docker/trainer_example.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import httpx
import openai


def say(line: str) -> None:
    sys.stdout.write(f"[trainer] {line}\n")
    sys.stdout.flush()


def wait_ready(api: httpx.Client, wait_s: float) -> None:
    """Poll ``/health`` until a worker is ready (200); 503 means the engines are still starting."""
    deadline = time.monotonic() + wait_s
    last = ""
    while True:
        try:
            resp = api.get("/health")
            if resp.status_code == 200:
                return
            status = resp.json().get("status", resp.status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        if str(status) != last:
            say(f"gateway not ready yet: {status}")
            last = str(status)
        if time.monotonic() > deadline:
            raise SystemExit(f"the gateway at {api.base_url} was not ready within {wait_s:.0f}s")
        time.sleep(1.0)


def episode(client: openai.OpenAI, model: str, turns: int, max_tokens: int) -> list[str]:
    """A scripted multi-turn chat; the last turn streams. Returns the assistant's answers."""
    messages: list[Any] = [{"role": "system", "content": "You are a helpful assistant."}]
    answers = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Step {i + 1}: tell me something new."})
        if i == turns - 1:
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            done = client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0
            )
            text = done.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
    return answers


def check(traj: dict[str, Any], turns: int) -> list[str]:
    """What is wrong with the trajectory, if anything."""
    got = traj["turns"]
    problems = [] if len(got) == turns else [f"{len(got)} turns recorded, {turns} run"]
    for t in got:
        if not t["output_ids"] or len(t["loss_mask"]) != len(t["prompt_ids"]) + len(t["output_ids"]):
            problems.append(f"turn {t['index']}: no output ids, or a loss mask of the wrong length")
    return problems


def main() -> int:
    url = os.environ.get("BELAYER_URL", "http://gateway:8000").rstrip("/")
    token = os.environ.get("BELAYER_API_TOKEN")
    model = os.environ.get("BELAYER_MODEL", "policy")
    turns = int(os.environ.get("BELAYER_TURNS", "3"))
    max_tokens = int(os.environ.get("BELAYER_MAX_TOKENS", "24"))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as api:
        wait_ready(api, float(os.environ.get("BELAYER_WAIT_S", "600")))
        session = (
            api.post("/api/sessions", json={"metadata": {"example": "compose"}}).raise_for_status().json()
        )
        say(f"session {session['id']}: base_url {session['base_url']}")
        # The agent side needs only the session's base_url; its id in the URL is the capability.
        client = openai.OpenAI(base_url=session["base_url"], api_key="unused", max_retries=0)
        answers = episode(client, model, turns, max_tokens)
        for i, text in enumerate(answers):
            say(f"turn {i}: {text[:60]!r}")
        sid = session["id"]
        api.post(f"/api/sessions/{sid}/reward", json={"reward": 1.0}).raise_for_status()
        api.post(f"/api/sessions/{sid}/close").raise_for_status()
        traj = api.get(f"/api/sessions/{sid}/trajectory").raise_for_status().json()
    problems = check(traj, turns)
    summary = {
        "session": sid,
        "turns": len(traj["turns"]),
        "generated_tokens": sum(len(t["output_ids"]) for t in traj["turns"]),
        "last_prompt_tokens": len(traj["turns"][-1]["prompt_ids"]) if traj["turns"] else 0,
        "workers": sorted({t["worker"] for t in traj["turns"] if t["worker"]}),
        "ok": not problems,
    }
    say(json.dumps(summary))
    for problem in problems:
        say(f"PROBLEM: {problem}")
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
