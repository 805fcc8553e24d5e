"""ATIF export (``belayer export --format atif``, ``GET /api/export?format=atif``, the client's
``export(..., "atif")``): one trajectory per branch, its agent steps holding the store's exact tokens.

The episodes go through the gateway app over the scripted fake engine, in each protocol's request shape
(OpenAI chat, Anthropic Messages, OpenAI Responses), with tool calls, branches, a rewritten answer, a
failover and a fork. The last test validates the export with Harbor's own pydantic models (``harbor``
0.25 in its own venv, Python 3.12) in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.cli import main as cli
from belayer.client import AsyncBelayer
from engine_pool.fake import Fault
from store import TrajectoryStore, TurnRecord
from store.atif import session_trajectories
from store.export import recomputed_runs
from tests.gateway.test_export import CALL, chat, episode, tool_result
from tests.gateway.test_failover import Rig, rig  # noqa: F401  (the fixture: two engine hosts behind faults)
from tests.support import GatewayHarness

ANTHROPIC_TOOLS = [{"name": "bash", "description": "run a command", "input_schema": {"type": "object"}}]
RESPONSES_TOOLS = [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]


def export_dir(db: str, out: Path, *flags: str) -> list[dict[str, Any]]:
    """`belayer export --format atif` into `out`; the trajectories it wrote, by path."""
    assert cli(["export", "--store", db, "--format", "atif", "--out", str(out), *flags]) == 0
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/agent/trajectory.json"))]


def agent_steps(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps of generated turns (the ones with metrics)."""
    return [s for s in trajectory["steps"] if "metrics" in s]


def turns_of(store: TrajectoryStore, sid: str) -> dict[int, TurnRecord]:
    return {t.index: t for t in store.get_turns(sid)}


def check_tokens(trajectory: dict[str, Any], turns: dict[int, TurnRecord]) -> None:
    """Every agent step holds its turn's exact prompt, completion and logprobs, mask and segments."""
    for step in agent_steps(trajectory):
        turn = turns[step["extra"]["turn_index"]]
        m = step["metrics"]
        assert m["prompt_token_ids"] == turn.prompt_ids and m["completion_token_ids"] == turn.output_ids
        assert m["logprobs"] == turn.output_logprobs and len(m["logprobs"]) == len(turn.output_ids) > 0
        assert (m["prompt_tokens"], m["completion_tokens"]) == (len(turn.prompt_ids), len(turn.output_ids))
        assert m["extra"]["loss_mask"] == turn.loss_mask()
        segments = [{"start": a, "end": b, "version": v} for a, b, v in turn.weight_segments]
        assert m["extra"]["weight_segments"] == segments and segments
        assert m["extra"]["weight_versions"] == [s["version"] for s in segments]
        assert step["extra"]["worker"] == turn.worker and step["extra"]["finish_reason"] == turn.finish_reason
        assert step["message"] == (turn.response or {})["message"]["content"]
    assert [s["step_id"] for s in trajectory["steps"]] == list(range(1, len(trajectory["steps"]) + 1))
    totals = trajectory["final_metrics"]
    assert totals["total_steps"] == len(trajectory["steps"])
    assert totals["total_completion_tokens"] == sum(len(turns[i].output_ids) for i in indices(trajectory))


def indices(trajectory: dict[str, Any]) -> list[int]:
    return [s["extra"]["turn_index"] for s in agent_steps(trajectory)]


def call_ids(turn: TurnRecord, prefix: str = "call_") -> list[str]:
    calls = (turn.response or {})["message"]["tool_calls"]
    return [prefix + c["id"].removeprefix("call_") for c in calls]


def shape(trajectory: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, message) of each step: what a reader of the conversation sees."""
    return [(s["source"], s["message"]) for s in trajectory["steps"]]


async def test_each_branch_is_a_trajectory_with_the_exact_tokens(
    gateway: GatewayHarness, tmp_path: Path
) -> None:
    sid = await episode(gateway)
    store = gateway.gw.store
    turns = turns_of(store, sid)
    trajectories = export_dir(gateway.gw.config.store_path, tmp_path / "atif")
    assert [t["trajectory_id"] for t in trajectories] == [f"{sid}-branch-{b}" for b in (0, 1, 2)]
    assert [indices(t) for t in trajectories] == [[0, 1, 2], [0, 3], [4]]
    for t in trajectories:
        check_tokens(t, turns)
        assert t["schema_version"] == "ATIF-v1.8" and t["session_id"] == sid
        assert t["extra"]["reward"] == 1.0 and t["extra"]["status"] == "closed"
        assert t["extra"]["metadata"] == {"task": "export", "seed": 3, "tags": ["a"]}
        assert t["agent"] == {
            "name": "unknown",
            "version": "unknown",
            "model_name": "policy",
            "tool_definitions": [
                {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
            ],
        }
    main, off_first, rewritten = trajectories
    assert shape(main) == [
        ("system", "be brief"),
        ("user", "list files"),
        ("agent", "Let me look."),
        ("agent", "Once more."),
        ("agent", "Done."),
    ]
    first, second, last = agent_steps(main)
    for step, turn, result in ((first, turns[0], "a.py b.py"), (second, turns[1], "c.py")):
        [call_id] = call_ids(turn)
        assert step["tool_calls"] == [
            {"tool_call_id": call_id, "function_name": "bash", "arguments": {"command": "ls"}}
        ]
        assert step["observation"] == {"results": [{"content": result, "source_call_id": call_id}]}
    assert "tool_calls" not in last and "observation" not in last
    # The branch off turn 0: the same first step, the other tool result, then turn 3.
    assert agent_steps(off_first)[0]["observation"]["results"][0]["content"] == "nothing here"
    assert shape(off_first)[-1] == ("agent", "Other.")
    # Rewritten history: the summary the harness wrote is copied context, not a generated step.
    assert shape(rewritten) == [
        ("system", "be brief"),
        ("user", "list files"),
        ("agent", "(summary)"),
        ("user", "go on"),
        ("agent", "Fine."),
    ]
    assert rewritten["steps"][2]["is_copied_context"] is True and "metrics" not in rewritten["steps"][2]
    [leaf] = agent_steps(rewritten)
    runs = recomputed_runs(store.get_events(sid))[turns[4].id]
    assert leaf["metrics"]["extra"]["recomputed_logprobs"] == [{"start": s, "logprobs": v} for s, v in runs]
    assert runs and all(v for _, v in runs)

    # The HTTP export answers the same trajectories, one per line.
    r = await gateway.client.get("/api/export?format=atif&order=asc")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    assert [json.loads(line) for line in r.text.splitlines()] == trajectories
    assert r.headers["x-row-count"] == "3" and r.headers["x-total-count"] == "1"


async def test_anthropic_tool_use_keeps_its_ids_and_results(gateway: GatewayHarness) -> None:
    gateway.queue_replies("Look." + CALL + "\n" + CALL, "Done.")
    sid, _ = await gateway.new_session(harness="claude-code", model="qwen-tiny")

    async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": "policy", "max_tokens": 100, "system": "be brief", "tools": ANTHROPIC_TOOLS}
        r = await gateway.client.post(f"/s/{sid}/v1/messages", json={**body, "messages": messages})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    reply = await ask(msgs)
    uses = [b for b in reply["content"] if b["type"] == "tool_use"]
    results = [
        {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "a.py"},
        {"type": "tool_result", "tool_use_id": uses[1]["id"], "is_error": True,
         "content": [{"type": "text", "text": "denied"}]},
        {"type": "text", "text": "and?"},
        {"type": "text", "text": "go on"},
    ]  # fmt: skip
    await ask(
        [*msgs, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": results}]
    )

    [trajectory] = session_trajectories(gateway.gw.store, sid)
    turns = turns_of(gateway.gw.store, sid)
    check_tokens(trajectory, turns)
    ids = call_ids(turns[0], "toolu_")  # the ids the harness saw, not the stored call_ ones
    assert ids == [u["id"] for u in uses] and len(set(ids)) == 2
    assert shape(trajectory) == [
        ("system", "be brief"),
        ("user", "list files"),
        ("agent", turns[0].response["message"]["content"]),  # type: ignore[index]
        ("user", "and?\ngo on"),  # text blocks joined as the gateway renders them
        ("agent", "Done."),
    ]
    step = trajectory["steps"][2]
    assert [c["tool_call_id"] for c in step["tool_calls"]] == ids
    assert step["observation"]["results"] == [
        {"content": "a.py", "source_call_id": ids[0]},
        {"content": "denied", "source_call_id": ids[1], "extra": {"is_error": True}},
    ]
    assert trajectory["agent"]["name"] == "claude-code" and trajectory["agent"]["model_name"] == "qwen-tiny"
    assert trajectory["agent"]["tool_definitions"] == [
        {"type": "function", "function": {"name": "bash", "description": "run a command",
                                          "parameters": {"type": "object"}}}
    ]  # fmt: skip


async def test_responses_continued_by_previous_response_id(gateway: GatewayHarness) -> None:
    gateway.queue_replies("R." + CALL, "Fin.")
    sid, _ = await gateway.new_session(agent="codex", agent_version="0.1")
    body = {"model": "policy", "instructions": "be brief", "tools": RESPONSES_TOOLS}
    r = await gateway.client.post(f"/s/{sid}/v1/responses", json={**body, "input": "hi"})
    assert r.status_code == 200, r.text
    [call] = [item for item in r.json()["output"] if item["type"] == "function_call"]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}
    follow = {**body, "previous_response_id": r.json()["id"], "input": [output]}
    assert (await gateway.client.post(f"/s/{sid}/v1/responses", json=follow)).status_code == 200

    [trajectory] = session_trajectories(gateway.gw.store, sid)
    turns = turns_of(gateway.gw.store, sid)
    check_tokens(trajectory, turns)
    assert indices(trajectory) == [0, 1]
    assert shape(trajectory) == [("system", "be brief"), ("user", "hi"), ("agent", "R."), ("agent", "Fin.")]
    step = trajectory["steps"][2]
    assert step["tool_calls"][0]["tool_call_id"] == call["call_id"] == call_ids(turns[0])[0]
    assert step["observation"] == {"results": [{"content": "a.py", "source_call_id": call["call_id"]}]}
    assert trajectory["agent"]["name"] == "codex" and trajectory["agent"]["version"] == "0.1"


async def test_a_completion_is_its_prompt_and_the_generated_text(gateway: GatewayHarness) -> None:
    gateway.queue_replies("four")
    sid, _ = await gateway.new_session()
    body = {"model": "policy", "prompt": "2 + 2 =", "max_tokens": 8}
    assert (await gateway.client.post(f"/s/{sid}/v1/completions", json=body)).status_code == 200
    [trajectory] = session_trajectories(gateway.gw.store, sid)
    turns = turns_of(gateway.gw.store, sid)
    check_tokens(trajectory, turns)
    assert shape(trajectory) == [("user", "2 + 2 ="), ("agent", "four")]


async def test_a_failover_and_its_weight_segments_are_in_extra(rig: Rig) -> None:  # noqa: F811
    rig.faults.faults["e0"] = [Fault("drop_after", 5)]
    _, traj = await rig.chat(False, max_tokens=12)
    sid = traj["session"]["id"]
    [trajectory] = session_trajectories(rig.gw.store, sid)
    [step] = agent_steps(trajectory)
    [event] = [e for e in traj["events"] if e["kind"] == "failover"]
    assert step["extra"]["failovers"] == [{"kind": "failover", **event["data"]}]
    assert (event["data"]["token_index"], event["data"]["from_worker"]) == (5, "remote-0")
    segments = step["metrics"]["extra"]["weight_segments"]
    assert [(s["start"], s["end"]) for s in segments] == [(0, 5), (5, 12)]  # one per submission
    check_tokens(trajectory, turns_of(rig.gw.store, sid))


async def test_a_fork_child_copies_its_parents_steps(gateway: GatewayHarness) -> None:
    gateway.queue_replies("Let me look." + CALL, "Parent done.", "Child done.")
    parent, _ = await gateway.new_session(harness="h")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    m1 = await chat(gateway, parent, msgs)
    after = [*msgs, m1, tool_result(m1, "a.py")]
    await chat(gateway, parent, after)
    r = await gateway.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0, "n": 1})
    assert r.status_code == 201, r.text
    child = r.json()["data"][0]["id"]
    await chat(gateway, child, after)

    [trajectory] = session_trajectories(gateway.gw.store, child)
    assert shape(trajectory) == [("user", "list files"), ("agent", "Let me look."), ("agent", "Child done.")]
    shared, own = agent_steps(trajectory)
    assert shared["is_copied_context"] is True and shared["extra"]["session_id"] == parent
    assert "is_copied_context" not in own and own["extra"]["session_id"] == child
    assert (trajectory["extra"]["parent_session"], trajectory["extra"]["fork_turn"]) == (parent, 0)
    check_tokens(trajectory, turns_of(gateway.gw.store, child))
    assert [t["trajectory_id"] for t in session_trajectories(gateway.gw.store, parent)] == [
        f"{parent}-branch-0"
    ]


async def test_the_client_writes_the_directory_and_filters_apply(
    gateway: GatewayHarness, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = await episode(gateway)
    gateway.queue_replies("Hi.")
    opened, _ = await gateway.new_session()
    await chat(gateway, opened, [{"role": "user", "content": "hello"}])
    transport = httpx.ASGITransport(gateway.app)
    async with AsyncBelayer("http://gw", transport=transport) as gw:
        assert await gw.export(tmp_path / "all", "atif", page_size=1, mark=False) == 4
        assert await gw.export(tmp_path / "closed", "atif", status="closed") == 3
    written = sorted(p.parent.parent.name for p in (tmp_path / "all").glob("*/agent/trajectory.json"))
    assert written == sorted([f"{closed}-branch-{b}" for b in (0, 1, 2)] + [f"{opened}-branch-0"])
    db = gateway.gw.config.store_path
    cli_closed = export_dir(db, tmp_path / "cli", "--status", "closed", "--rewarded-only", "--since", "1h")
    assert cli_closed == [json.loads(p.read_text()) for p in sorted((tmp_path / "closed").glob("*/*/*.json"))]
    assert export_dir(db, tmp_path / "none", "--since", "2999-01-01") == []
    capsys.readouterr()
    (tmp_path / "file").write_text("")
    assert cli(["export", "--store", db, "--format", "atif", "--out", str(tmp_path / "file")]) == 2
    assert "--format atif writes a directory" in capsys.readouterr().err
    bad = await gateway.client.get("/api/export?format=atif-v2")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"
    assert "jsonl, parquet, atif" in bad.json()["error"]["message"]


HARBOR_CHECK = """
import json, sys
from pathlib import Path
from harbor.models.trajectories import Trajectory

out = []
for path in sorted(Path(sys.argv[1]).glob("*/agent/trajectory.json")):
    text = path.read_text()
    t = Trajectory.model_validate_json(text)
    out.append({
        "same": t.model_dump(mode="json", exclude_unset=True) == json.loads(text),
        "steps": [[s.step_id, s.source, s.metrics.completion_token_ids, s.metrics.logprobs,
                   s.metrics.prompt_token_ids] for s in t.steps if s.metrics is not None],
        "results": [[r.source_call_id, r.content] for s in t.steps if s.observation
                    for r in s.observation.results],
    })
print(json.dumps(out))
"""


@pytest.mark.external
async def test_harbor_validates_the_export(gateway: GatewayHarness, tmp_path: Path) -> None:
    """Harbor's own models (harbor 0.25, ``Trajectory.model_validate_json``) take every trajectory as
    it is (they refuse unknown keys outside ``extra``): nothing dropped or coerced, and every token id
    and logprob is the store's."""
    from belayer.testing.services import ensure_harbor_venv

    python = ensure_harbor_venv()
    sid = await episode(gateway)
    gateway.queue_replies("Look." + CALL, "Done.")
    claude, _ = await gateway.new_session(harness="claude-code")
    body = {"model": "policy", "max_tokens": 100, "system": "be brief", "tools": ANTHROPIC_TOOLS}
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    reply = (await gateway.client.post(f"/s/{claude}/v1/messages", json={**body, "messages": msgs})).json()
    [use] = [b for b in reply["content"] if b["type"] == "tool_use"]
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a.py"}],
    }
    msgs += [{"role": "assistant", "content": reply["content"]}, result]
    r = await gateway.client.post(f"/s/{claude}/v1/messages", json={**body, "messages": msgs})
    assert r.status_code == 200, r.text

    out = tmp_path / "atif"
    export_dir(gateway.gw.config.store_path, out)
    done = subprocess.run(
        [str(python), "-c", HARBOR_CHECK, str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checked = json.loads(done.stdout)
    expected = session_trajectories(gateway.gw.store, sid) + session_trajectories(gateway.gw.store, claude)
    expected.sort(key=lambda t: str(t["trajectory_id"]))
    assert len(checked) == len(expected) == 4 and all(c["same"] for c in checked)
    store = gateway.gw.store
    for got, trajectory in zip(checked, expected, strict=True):
        turns = turns_of(store, trajectory["session_id"])
        assert [s[0] for s in got["steps"]] == [s["step_id"] for s in agent_steps(trajectory)]
        for (_, source, completion, logprobs, prompt), index in zip(
            got["steps"], indices(trajectory), strict=True
        ):
            turn = turns[index]
            assert source == "agent"
            assert (completion, logprobs, prompt) == (turn.output_ids, turn.output_logprobs, turn.prompt_ids)
    branches = sorted((t["session_id"] == claude, indices(t)) for t in expected)
    assert branches == [(False, [0, 1, 2]), (False, [0, 3]), (False, [4]), (True, [0, 1])]
    [claude_results] = [
        c["results"] for c, t in zip(checked, expected, strict=True) if t["session_id"] == claude
    ]
    assert claude_results == [[use["id"], "a.py"]]
