"""Launched workers ask a key the gateway holds (issue 31, finding 8): a worker on a Ray node listens on
the node's address with vLLM's development endpoints (``/pause``, ``/collective_rpc``) on."""

from __future__ import annotations

import httpx

from core.worker_auth import KEY_ENV, RequireApiKey
from engine_pool.engine.client import EngineClient, SamplingParams
from engine_pool.fake import FakeEngine
from engine_pool.workers.worker import GUARD, WorkerSpec


def test_a_launched_worker_gets_its_key_in_its_environment_and_guards_every_route() -> None:
    spec = WorkerSpec(model="/m", port=8100, api_key="k3y")
    argv = spec.argv()
    assert argv[argv.index("--middleware") + 1] == GUARD == "core.worker_auth.RequireApiKey"
    assert not any("k3y" in a for a in argv)  # the command line shows in `ps` to every local user
    assert spec.env()[KEY_ENV] == "k3y"  # vLLM's --api-key, read from its environment
    assert "k3y" not in repr(spec)
    plain = WorkerSpec(model="/m", port=8100)
    assert "--middleware" not in plain.argv() and KEY_ENV not in plain.env()
    fake = WorkerSpec(model="/m", port=8100, kind="fake", api_key="k3y")
    assert fake.env()[KEY_ENV] == "k3y"


async def test_the_engine_client_sends_the_key_and_a_guarded_worker_refuses_anyone_without() -> None:
    engine = FakeEngine(outputs=[[11, 12, 2]])
    guarded = httpx.ASGITransport(
        RequireApiKey(engine.app(), key="k3y")
    )  # as `python -m engine_pool.fake` serves
    async with httpx.AsyncClient(transport=guarded, base_url="http://worker") as http:
        for method, path in [("POST", "/pause"), ("POST", "/collective_rpc"), ("POST", "/v1/completions"),
                             ("GET", "/v1/models"), ("POST", "/update_weight_version")]:  # fmt: skip
            r = await http.request(method, path, json={})
            assert r.status_code == 401, (method, path)
        assert (await http.get("/health")).status_code == 200
        assert engine.requests == []
        client = EngineClient("http://worker", "fake", http, api_key="k3y")
        assert (await client.model_info()).name == "fake"
        await client.name_weight_version("v1")
        assert await client.weight_version() == "v1"
        chunks = [c async for c in client.generate([1, 2, 3], SamplingParams(max_tokens=8))]
        assert [t for c in chunks for t in c.token_ids] == [11, 12, 2]
        keyless = EngineClient("http://worker", "fake", http)
        assert await keyless.weight_version() is None  # refused: it does not say
