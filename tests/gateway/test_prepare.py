"""Where a generating request is templated and tokenized (`Gateway.prepare`): on the event loop for a
small body over a local store, in a worker thread for a large body or a remote store, with the same
prompt ids and answer either way."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gateway.gateway import INLINE_PREPARE_BYTES
from tests.support import GatewayHarness


class ThreadsOf:
    """Wraps a tokenizer's ``encode``: records the thread of every call, then encodes as before."""

    def __init__(self, encode: Any) -> None:
        self.inner = encode
        self.threads: list[threading.Thread] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self.inner(*args, **kwargs)


async def _chat(gateway: GatewayHarness, content: str) -> tuple[list[threading.Thread], list[int]]:
    """One chat request with `content`: the threads its prompt was encoded on, and its prompt ids."""
    [out] = gateway.queue_replies("fine")
    tok = gateway.gw.tokenizer
    spy = ThreadsOf(tok.encode)
    tok.encode = spy  # type: ignore[method-assign]
    try:
        body = {"model": "policy", "messages": [{"role": "user", "content": content}], "temperature": 0}
        r = await gateway.client.post("/v1/chat/completions", json=body)
    finally:
        del tok.encode  # the class's own again
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "fine"
    assert r.json()["usage"]["completion_tokens"] == len(out)
    prompt: list[int] = gateway.engine.requests[-1]["prompt"]
    return spy.threads, prompt


@pytest.mark.parametrize(
    ("chars", "remote", "on_loop"),
    [(10, False, True), (INLINE_PREPARE_BYTES, False, False), (10, True, False)],
)
async def test_small_requests_are_prepared_on_the_loop_others_in_a_thread(
    gateway: GatewayHarness, chars: int, remote: bool, on_loop: bool
) -> None:
    gateway.gw.store.remote = remote  # as PostgreSQL: its reads must not block the loop
    try:
        threads, _ = await _chat(gateway, ("hello world " * chars)[:chars])  # a body of over `chars` bytes
    finally:
        gateway.gw.store.remote = False
    assert threads, "the prompt was not encoded"
    loop_thread = threading.current_thread()  # the test's event loop runs the ASGI app
    assert all((t is loop_thread) == on_loop for t in threads)


async def test_the_prompt_is_the_same_on_the_loop_and_in_a_thread(gateway: GatewayHarness) -> None:
    _, on_loop = await _chat(gateway, "the same question")
    gateway.gw.store.remote = True
    try:
        _, in_thread = await _chat(gateway, "the same question")
    finally:
        gateway.gw.store.remote = False
    assert on_loop == in_thread and len(on_loop) > 3
