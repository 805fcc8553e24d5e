from __future__ import annotations

from tests.conftest import GatewayHarness


async def test_plain_chat(gateway: GatewayHarness) -> None:
    gateway.engine.outputs.append(gateway.encode_reply("hello world"))
    r = await gateway.client.post("/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    print(r.json())
    assert r.json()["choices"][0]["message"]["content"] == "hello world"
