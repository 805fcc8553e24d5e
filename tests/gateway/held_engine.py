"""A fake engine process whose prompt-logprobs requests (logprob recomputations) wait while a file
exists: ``python -m tests.gateway.held_engine --port P --hold FILE [--token-delay S]``.

Generation is `engine_pool.fake.autoregressive` (greedy-like: resumable, and the same for the same
prompt), streamed with `--token-delay` between tokens, up to ``max_tokens``; so a test knows every token
the engine would have produced for a prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from engine_pool.fake import FakeEngine, autoregressive


class HoldPromptLogprobs:
    """ASGI: a ``/v1/completions`` request with ``prompt_logprobs`` waits while `hold` exists."""

    def __init__(self, app: Any, hold: Path) -> None:
        self.app, self.hold = app, hold

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        if "prompt_logprobs" in json.loads(body):
            while self.hold.exists():
                await asyncio.sleep(0.05)  # a file the test removes: poll it
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--hold", type=Path, required=True)
    p.add_argument("--token-delay", type=float, default=0.01)
    args = p.parse_args()
    engine = FakeEngine(max_model_len=4096, token_delay=args.token_delay, step=autoregressive)
    app = HoldPromptLogprobs(engine.app(), args.hold)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
