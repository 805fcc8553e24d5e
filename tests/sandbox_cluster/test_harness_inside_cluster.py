"""A harness *inside* its sandbox on a cluster node (`sandbox.cluster.relay`), and its node lost mid-episode.

The agent of `tests.sandbox.test_harness_inside` (stdlib Python, its conversation in memory only) runs in
a ``network="gateway"`` sandbox on node b or c. It reaches the gateway at ``belayer-gateway:RELAY_PORT``,
through its node's relay, which vouches for it to the gateway's sandbox listener, as its own session
only. In turn 3's bubble the sandbox is checkpointed; in turn 5's bubble its whole node is lost. The
sandbox is restored on the other node, and the agent, the same process with its memory, retries turn 3
there. The same URL now reaches the other node's relay, and the episode ends with every step run once
and the kept branch the agent's own.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.sandbox.scripting import TOOLS, scripted
from tests.sandbox.test_harness_inside import AGENT, Env, gated_gateway, new_session, read, sh, wait_for_file
from tests.sandbox_cluster.conftest import Cluster

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.docker, pytest.mark.ray]


@pytest.fixture
async def env(
    cluster: Cluster,
    tmp_path: Path,
    tiny_model_dir: Path,
    python_image: str,
) -> AsyncIterator[Env]:
    clear_relay_rules()
    rules = relay_rules()
    async with gated_gateway(cluster.backend, tmp_path, tiny_model_dir, timeout=180) as made:
        yield made
    if not cluster.lost:  # the gateway gone, its relays withdrew their ports from the nodes' firewalls
        assert relay_rules() == rules  # (a lost node's rule stays: its relay died with it)


def clear_relay_rules() -> None:
    """Remove the relay rules left by nodes lost before (by an earlier test, or a bench's engines): no
    gateway runs yet, so no relay is live. Left, one could be the very rule a relay of this test writes
    (same bridge, same address: `GatewayNetwork.open` keeps it, `close` removes it), and the comparison
    after the test would find it gone."""
    for rule in relay_rules():
        subprocess.run(["iptables", "-w", "-D", *rule.split()[1:]], check=True, capture_output=True)


def relay_rules() -> list[str]:
    """The firewall rules that let sandboxes reach a relay port (7199)."""
    out = subprocess.run(["iptables", "-w", "-S", "BELAYER-GATEWAY"], capture_output=True, text=True).stdout
    return sorted(line for line in out.splitlines() if "--dport 7199" in line)


async def test_a_harness_inside_goes_on_on_another_node_when_its_node_is_lost(
    env: Env, cluster: Cluster, python_image: str
) -> None:
    commands = [f"echo {i} >> /workspace/steps" for i in range(6)]
    env.engine.script = scripted(env.gw.tokenizer, commands)
    sid = await new_session(env, python_image)
    manager = env.gw.sandboxes
    assert manager is not None and manager.gateway_url == "http://belayer-gateway:7199"
    r = await env.client.put(
        f"/api/sessions/{sid}/sandbox/files", json={"path": "agent.py", "content": AGENT}
    )
    assert r.status_code == 200
    tools = json.dumps(json.dumps(TOOLS))
    await sh(env, sid, f"python3 /workspace/agent.py {tools} > /workspace/agent.log 2>&1 &")

    await asyncio.wait_for(env.gate.arrived[3].wait(), 120)  # turn 3's bubble: checkpoint the waiting agent
    ckpt = await manager.checkpoint(sid)
    assert (ckpt.turn_index, ckpt.in_bubble, ckpt.keep_through) == (3, True, 2)
    pid_before = await read(env, sid, "agent.pid")
    env.gate.release[3].set()

    await asyncio.wait_for(env.gate.arrived[5].wait(), 120)  # turn 5's bubble: its node is lost
    first_box = str(manager.sandbox_id(sid))
    lost = cluster.name_of(first_box)
    await asyncio.to_thread(cluster.lose, lost)
    env.gate.release[5].set()

    done = json.loads(await wait_for_file(env, sid, "agent-done.json", timeout=180))
    state = (await env.client.get(f"/api/sessions/{sid}/sandbox")).json()
    assert state["sandbox_id"] != first_box and cluster.name_of(state["sandbox_id"]) != lost
    restore = state["last_restore"]
    assert (restore["turn_index"], restore["keep_through"]) == (3, 2)
    assert restore["reason"].startswith("node_lost: ")
    assert done["executed"] == commands and str(done["pid"]) == pid_before  # the same process, its memory
    assert await read(env, sid, "steps") == "".join(f"{i}\n" for i in range(6))
    assert "retry" in (await read(env, sid, "agent.log") or "")  # its call broke with the node, re-sent
    traj = (await env.client.get(f"/api/sessions/{sid}/trajectory")).json()
    kept = [t for t in traj["turns"] if t["status"] != "discarded"]
    assert [t["status"] for t in kept] == ["complete"] * (len(commands) + 1)
    assert kept[3]["parent_index"] == 2  # the retry, from the other node, extended turn 2
    assert kept[-1]["request"]["messages"] == done["messages"][:-1]  # the kept branch is the agent's own


PROBE = """
import json, os, socket, urllib.error, urllib.request
def get(url, body=None):
    try:
        r = urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"}), timeout=10)
        return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
def connect(addr, port):
    try:
        socket.create_connection((addr, port), timeout=3).close()
        return "open"
    except OSError as e:
        return type(e).__name__
base = os.environ["BELAYER_SESSION_URL"].rsplit("/s/", 1)[0]
chat = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
node = socket.gethostbyname("belayer-gateway")
print(json.dumps({
    "base": base, "own": get(os.environ["OPENAI_BASE_URL"] + "/chat/completions", chat)[0],
    "other": get(base + "/s/OTHER/v1/chat/completions", chat), "plain": get(base + "/v1/chat/completions", chat)[0],
    "sessions": get(base + "/api/sessions")[0], "node_ssh": connect(node, 22), "outside": connect("1.1.1.1", 80),
}))
"""


async def test_a_sandbox_on_a_node_reaches_only_its_own_session(
    env: Env, cluster: Cluster, python_image: str
) -> None:
    env.engine.script = scripted(env.gw.tokenizer, [])
    sid = await new_session(env, python_image)
    other = (await env.client.post("/api/sessions", json={})).json()["id"]
    probe = PROBE.replace("OTHER", other)
    r = await env.client.put(
        f"/api/sessions/{sid}/sandbox/files", json={"path": "probe.py", "content": probe}
    )
    assert r.status_code == 200
    env.gate.release[3].set()
    out = await sh(env, sid, "python3 /workspace/probe.py")
    assert out["exit_code"] == 0, out
    seen = json.loads(out["stdout"])
    assert seen["base"] == "http://belayer-gateway:7199"
    assert seen["own"] == 200  # its own session, through its node's relay ...
    status, body = seen["other"]  # ... and nothing else
    assert (status, body["error"]["code"]) == (403, "forbidden") and sid not in json.dumps(body)  # names none
    assert seen["plain"] == seen["sessions"] == 403
    assert seen["node_ssh"] == "ConnectionRefusedError"  # the node's firewall resets its other ports
    assert seen["outside"] in ("TimeoutError", "OSError", "ConnectionRefusedError")  # no route out
    assert len(env.gw.store.get_turns(sid)) == 1 and env.gw.store.get_turns(other) == []
