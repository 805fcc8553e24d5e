"""Sessions API, prefix reuse and branching, over the scripted fake engine."""

from __future__ import annotations

import itertools
import json
from typing import Any

from engine_pool.fake import fake_logprob
from tests.support import GatewayHarness

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


async def chat(gw: GatewayHarness, sid: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    body = {"model": "policy", "messages": messages, "tools": TOOLS, **kw}
    r = await gw.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()["choices"][0]["message"]
    return out


async def traj(gw: GatewayHarness, sid: str) -> dict[str, Any]:
    data: dict[str, Any] = (await gw.client.get(f"/api/sessions/{sid}/trajectory")).json()
    return data


async def test_session_lifecycle(gateway: GatewayHarness) -> None:
    r = await gateway.client.post("/api/sessions", json={"metadata": {"task": "fix-tests", "seed": 3}})
    s = r.json()
    assert (
        r.status_code == 201
        and s["base_url"] == f"http://gw/s/{s['id']}/v1"
        and s["metadata"]["task"] == "fix-tests"
    )
    r = await gateway.client.post(
        f"/api/sessions/{s['id']}/reward", json={"reward": 0.5, "info": {"tests": "3/4"}}
    )
    assert r.json()["reward"] == 0.5 and r.json()["reward_info"] == {"tests": "3/4"}
    assert (await gateway.client.post(f"/api/sessions/{s['id']}/close")).json()["status"] == "closed"
    r = await gateway.client.post(
        f"/s/{s['id']}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
    listed = (await gateway.client.get("/api/sessions")).json()["data"]
    assert [x["id"] for x in listed] == [s["id"]]


async def test_multi_turn_prefix_reuse_with_tool_calls(gateway: GatewayHarness) -> None:
    replies = gateway.queue_replies("Let me look." + CALL, "Found it.")
    gateway.queue_replies("Done.", eos=False)
    sid, _ = await gateway.new_session()
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
    ]
    m1 = await chat(gateway, sid, msgs)
    msgs += [m1, {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "a.py b.py"}]
    m2 = await chat(gateway, sid, msgs)
    msgs += [m2, {"role": "user", "content": "thanks"}]
    await chat(gateway, sid, msgs, max_tokens=3)
    t = await traj(gateway, sid)
    turns = t["turns"]
    assert [x["branch"] for x in turns] == [0, 0, 0] and [x["parent_index"] for x in turns] == [None, 0, 1]
    tok = gateway.gw.tokenizer
    for prev, cur in itertools.pairwise(turns):
        base = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(base)] == base  # generated tokens never re-tokenized
        tail = tok.decode(cur["prompt_ids"][len(base) :], skip_special_tokens=False)
        assert tail.startswith("\n<|im_start|>")  # the model emitted <|im_end|>, so only the newline follows
    # The whole last prompt decodes to the full rendering of the conversation.
    rendered = [
        {
            **m,
            "tool_calls": [
                {
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    }
                }
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in msgs
    ]
    full = tok.render(rendered, TOOLS, add_generation_prompt=True)
    assert (
        tok.decode(turns[2]["prompt_ids"], skip_special_tokens=False).replace(
            "Let me look.<tool_call>", "Let me look.\n<tool_call>"
        )
        == full
    )
    # Loss mask: exactly the two earlier outputs inside the last prompt, then its own output.
    mask = turns[2]["loss_mask"]
    assert sum(mask) == len(replies[0]) + len(replies[1]) + 3
    assert [e["kind"] for e in t["events"]] == ["fresh_prompt", "prefix_reuse", "prefix_reuse"]
    # Logprobs aligned with the full sequence: generated positions carry the generating turn's logprobs.
    lps = turns[2]["logprobs"]
    start = len(turns[0]["prompt_ids"])
    assert lps[start : start + len(replies[0])] == turns[0]["output_logprobs"]
    assert all(lp is None for lp, m in zip(lps, mask, strict=True) if not m)


async def test_max_tokens_cut_turn_gets_end_of_turn_as_context(gateway: GatewayHarness) -> None:
    gateway.queue_replies("cut short here", "ok")
    sid, _ = await gateway.new_session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    m1 = await chat(gateway, sid, msgs, max_tokens=2)
    await chat(gateway, sid, [*msgs, m1, {"role": "user", "content": "b"}])
    t0, t1 = (await traj(gateway, sid))["turns"]
    base = t0["prompt_ids"] + t0["output_ids"]
    assert t1["prompt_ids"][: len(base)] == base
    assert gateway.gw.tokenizer.decode(t1["prompt_ids"][len(base) :], skip_special_tokens=False).startswith(
        "<|im_end|>\n<|im_start|>user"
    )


async def test_history_rewrite_branches_and_both_stay_readable(gateway: GatewayHarness) -> None:
    gateway.queue_replies("one", "two", "three", "four")
    sid, _ = await gateway.new_session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    m1 = await chat(gateway, sid, msgs)
    msgs += [m1, {"role": "user", "content": "b"}]
    m2 = await chat(gateway, sid, msgs)
    # The harness compacts history: it rewrites the first answer and continues from there.
    rewritten = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "(summary)"},
        {"role": "user", "content": "c"},
    ]
    await chat(gateway, sid, rewritten)
    await gateway.gw.runner.idle()  # the rewritten answer's logprobs are recomputed in the background
    # ... and another request extends the ORIGINAL turn 1 (an older turn): also a branch.
    await chat(gateway, sid, [*msgs[:2], {"role": "user", "content": "b2"}])
    t = await traj(gateway, sid)
    assert [x["branch"] for x in t["turns"]] == [0, 0, 1, 2]
    assert [x["parent_index"] for x in t["turns"]] == [None, 0, None, 0]
    assert [b["turn_indices"] for b in t["branches"]] == [[0, 1], [2], [3]]
    kinds = [e["kind"] for e in t["events"]]
    assert kinds == ["fresh_prompt", "prefix_reuse", "branch", "recomputed_logprobs", "branch"]
    assert t["turns"][2]["loss_mask"].count(1) == len(t["turns"][2]["output_ids"])  # fresh tokenization
    # The rewritten answer ("(summary)" and its end-of-turn) has the engine's prompt logprobs, marked.
    t2 = t["turns"][2]
    span = [i for i, m in enumerate(t2["recomputed_mask"]) if m]
    tok = gateway.gw.tokenizer
    assert tok.decode([t2["prompt_ids"][i] for i in span], skip_special_tokens=False) == "(summary)<|im_end|>"
    assert [t2["logprobs"][i] for i in span] == [fake_logprob(-1 - i, t2["prompt_ids"][i]) for i in span]
    assert gateway.engine.requests[-2]["prompt_logprobs"] == 0  # one prompt-logprobs pass
    others = [lp for i, lp in enumerate(t2["logprobs"][: len(t2["prompt_ids"])]) if i not in span]
    assert others == [None] * len(others)  # user and system tokens: no logprob, as before
    base = t["turns"][0]["prompt_ids"] + t["turns"][0]["output_ids"]
    assert t["turns"][3]["prompt_ids"][: len(base)] == base
    assert m2["content"] == "two"


async def test_a_fresh_prompt_keeps_the_identity_of_unchanged_answers(gateway: GatewayHarness) -> None:
    gateway.queue_replies("one", "two")
    sid, _ = await gateway.new_session()
    m1 = await chat(gateway, sid, [{"role": "user", "content": "a"}])
    # the harness edits the first user message: no turn is a prefix, so the prompt is tokenized afresh
    await chat(gateway, sid, [{"role": "user", "content": "a, edited"}, m1, {"role": "user", "content": "b"}])
    await gateway.gw.runner.idle()
    t = await traj(gateway, sid)
    t0, t1 = t["turns"]
    assert t1["parent_index"] is None and t1["branch"] == 1
    # ... but its copy of answer "one" is exactly turn 0's tokens: generated, with turn 0's logprobs
    start = next(
        i
        for i in range(len(t1["prompt_ids"]))
        if t1["prompt_ids"][i : i + len(t0["output_ids"])] == t0["output_ids"]
    )
    span = range(start, start + len(t0["output_ids"]))
    assert [t1["loss_mask"][i] for i in span] == [1] * len(span)
    assert [t1["logprobs"][i] for i in span] == t0["output_logprobs"]
    assert sum(t1["loss_mask"][: len(t1["prompt_ids"])]) == len(span) and sum(t1["recomputed_mask"]) == 0
    assert "recomputed_logprobs" not in [e["kind"] for e in t["events"]]


async def test_tool_call_ids_do_not_break_reuse(gateway: GatewayHarness) -> None:
    gateway.queue_replies(CALL, "ok")
    sid, _ = await gateway.new_session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    m1 = await chat(gateway, sid, msgs)
    m1["tool_calls"][0]["id"] = "toolu_rewritten_by_harness"
    m1["content"] = None
    await chat(
        gateway,
        sid,
        [*msgs, m1, {"role": "tool", "tool_call_id": "toolu_rewritten_by_harness", "content": "x"}],
    )
    turns = (await traj(gateway, sid))["turns"]
    assert turns[1]["parent_index"] == 0 and turns[1]["branch"] == 0
