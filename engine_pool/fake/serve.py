"""``python -m engine_pool.fake``: a fake engine served over HTTP (`serve`, `main`), what
``belayer serve --worker-kind fake`` launches per worker, configured by arguments and, for launched
workers (which take no arguments of their own), by environment variables."""

from __future__ import annotations

import os
import shutil
import subprocess

from core.worker_auth import RequireApiKey
from engine_pool.fake.engine import FakeEngine
from engine_pool.fake.policies import (
    POLICY_ENV,
    autoregressive,
    autoregressive_over,
    hashed_policy,
    seeded_over,
    word_ids,
)

DIE_OVER_ENV = "BELAYER_FAKE_DIE_OVER"
"""Launched fake workers take no arguments of their own (``--vllm-arg`` is vLLM's): this variable, in the
gateway's environment, gives them ``--die-on-seeded-prompts-over``."""
TOKEN_DELAY_ENV = "BELAYER_FAKE_TOKEN_DELAY"
"""And this one their ``--token-delay``."""
ENGINE_CORE_ENV = "BELAYER_FAKE_ENGINE_CORE"
"""And this one (``1``) their ``--engine-core``."""
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def engine_core() -> subprocess.Popen[bytes]:
    """A stand-in for vLLM's engine core process: a child titled as vLLM titles its own, which does
    nothing. When it dies, the fake server lingers and streams on, as vLLM's API server lingers after
    its engine core died (until its watchdog looks): only a watch of the worker's processes
    (``engine_pool.workers.exits``) tells the gateway."""
    return subprocess.Popen([ENGINE_CORE_TITLE, "infinity"], executable=shutil.which("sleep") or "/bin/sleep")


def serve(
    host: str,
    port: int,
    model: str = "fake",
    tokens: int | None = None,
    token_delay: float = 0.0,
    max_model_len: int = 4096,
    words_from: str | None = None,
    token_delay_max: float | None = None,
    die_over: int | None = None,
    with_engine_core: bool = False,
) -> None:
    """Serve a fake engine until interrupted: `tokens` tokens per request when given (benchmarks),
    else autoregressive output up to ``max_tokens`` (launched fake workers: failover stays exact),
    drawn from the whole words of the model in `words_from` when given; each stream's delay between
    tokens is drawn from [`token_delay`, `token_delay_max`] when that is given; `with_engine_core`: with a
    stand-in engine core process (`engine_core`)."""
    import uvicorn

    if tokens is not None:
        n = tokens
        engine = FakeEngine(
            model=model, max_model_len=max_model_len, token_delay=token_delay,
            token_delay_max=token_delay_max, script=lambda prompt: [(prompt[-1] + i) % 500 + 10 for i in range(n)],
        )  # fmt: skip
    else:
        step = autoregressive_over(word_ids(words_from)) if words_from else autoregressive
        engine = FakeEngine(model=model, max_model_len=max_model_len, token_delay=token_delay, step=step)
        if os.environ.get(POLICY_ENV):
            engine.step, engine.policy = None, hashed_policy
    engine.query_of_death = seeded_over(die_over) if die_over is not None else None
    app = RequireApiKey(engine.app())  # the key a launched worker is given (core.worker_auth), if any
    core = engine_core() if with_engine_core else None
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        if core is not None:
            core.kill()
            core.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_pool.fake``: what ``belayer serve --worker-kind fake`` launches per worker."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_pool.fake", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default: max_tokens)")
    delay = os.environ.get(
        TOKEN_DELAY_ENV
    )  # launched fake workers as fast as an engine: `belayer demo`'s test
    p.add_argument("--token-delay", type=float, default=float(delay) if delay else 0.02,
                   help=f"seconds between streamed tokens (default: ${TOKEN_DELAY_ENV}, else 0.02)")  # fmt: skip
    p.add_argument("--words-from", metavar="MODEL_DIR", help="write that model's whole-word tokens")
    die_over = os.environ.get(DIE_OVER_ENV)  # set by `belayer bench query-of-death` for its launched workers
    p.add_argument(
        "--die-on-seeded-prompts-over", type=int, metavar="TOKENS", default=int(die_over) if die_over else None,
        help=f"exit, as vLLM 0.32's engine does, on a seeded request whose prompt is over TOKENS tokens "
        f"(default: ${DIE_OVER_ENV}, else never)",
    )  # fmt: skip
    p.add_argument(
        "--engine-core", action="store_true", default=os.environ.get(ENGINE_CORE_ENV) == "1",
        help=f"run a stand-in engine core process, titled {ENGINE_CORE_TITLE} (default: ${ENGINE_CORE_ENV}=1)",
    )  # fmt: skip
    for option in ("--load-format", "--model-loader-extra-config", "--gpu-memory-utilization"):
        # vLLM's, as a pool with a weight owner passes them: a fake engine loads no weights
        p.add_argument(option, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    serve(
        args.host, args.port, args.model, args.tokens, args.token_delay, args.max_model_len, args.words_from,
        die_over=args.die_on_seeded_prompts_over, with_engine_core=args.engine_core,
    )  # fmt: skip
    return 0
