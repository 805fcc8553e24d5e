"""SkyRL's generator through Belayer: ``BelayerGenerator``, a ``GeneratorInterface`` for SkyRL's trainer.

SkyRL's trainer asks its generator for a batch (``generate(GeneratorInput)``: the prompts as chat
messages, the sampling parameters, and a ``TrajectoryID`` per prompt whose ``instance_id`` is the GRPO
group) and trains on the ``GeneratorOutput`` it returns. This generator runs each prompt's episode in its
own Belayer session (``skyrl_batch``, ``skyrl_index`` and the ``group`` in its metadata), `concurrency` at
a time, and returns what the gateway recorded, by position in the batch: the export row's
``prompt_ids``, ``response_ids``, ``response_mask`` (SkyRL's ``loss_masks``) and ``response_logprobs``
(``rollout_logprobs``), the verifier's reward, and the weight versions in ``rollout_metrics``. Nothing is
re-tokenized.

It imports SkyRL, so it runs where SkyRL is installed (``skyrl`` 0.3 pins transformers, ray and peft other
than the project's, and its trainer extra needs flash-attn, a CUDA build: the generator's own virtual
environment has ``skyrl`` with what its generator and data path import, as verl has one) and reaches the
gateway over HTTP; the rest of Belayer never imports this module. On Python 3.11 importing it first makes
``typing.TypedDict`` typing_extensions' (SkyRL 0.3 fails to import there otherwise; see below).

Example (the episode is an async ``(session, messages, sampling_params) -> reward``, as for verl)::

    generator = BelayerGenerator("http://127.0.0.1:8000", episode=play, token=api_token)
    output = await generator.generate(input_batch)  # SkyRL's trainer calls it
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

if sys.version_info < (3, 12):  # pragma: no cover - depends on the interpreter
    # SkyRL 0.3 declares Python >= 3.11, but pydantic builds schemas from its typing.TypedDicts, which it
    # accepts only from Python 3.12 (or typing_extensions): on 3.11 `import skyrl` fails without this.
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from belayer.client import AsyncBelayer, AsyncSession
from belayer.train.rollout import newest_rows

Episode = Callable[[AsyncSession, list[dict[str, Any]], dict[str, Any]], Awaitable[float]]


class BelayerGenerator(GeneratorInterface):  # type: ignore[misc]
    """One SkyRL prompt = one Belayer session; the output is the sessions' recorded rows, in order."""

    def __init__(self, url: str, episode: Episode, token: str | None = None, concurrency: int = 8) -> None:
        self.url, self.token, self.episode = url, token, episode
        self.concurrency = concurrency

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        prompts = [list(p) for p in input_batch["prompts"]]
        ids = input_batch.get("trajectory_ids") or [None] * len(prompts)
        sampling = dict(input_batch.get("sampling_params") or {})
        batch, room = uuid.uuid4().hex, asyncio.Semaphore(self.concurrency)
        async with AsyncBelayer(self.url, token=self.token, timeout=600.0) as gw:

            async def one(i: int) -> tuple[str, float, float]:
                metadata: dict[str, Any] = {"skyrl_batch": batch, "skyrl_index": i}
                if ids[i] is not None:
                    metadata |= {"group": ids[i].instance_id, "repetition": ids[i].repetition_id}
                async with room, gw.session(metadata=metadata) as s:
                    t0 = time.monotonic()
                    reward = float(await self.episode(s, prompts[i], sampling))
                    await s.reward(reward)
                return s.id, reward, time.monotonic() - t0

            played = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            rows = await newest_rows(gw, {"skyrl_batch": batch})
        missing = [sid for sid, _, _ in played if sid not in rows]
        if missing:
            raise RuntimeError(f"sessions {missing} have no complete turn to train on")
        ordered = [rows[sid] for sid, _, _ in played]
        return {
            "prompt_token_ids": [list(r["prompt_ids"]) for r in ordered],
            "response_ids": [list(r["response_ids"]) for r in ordered],
            "rewards": [reward for _, reward, _ in played],
            "loss_masks": [list(r["response_mask"]) for r in ordered],
            "stop_reasons": [str(r.get("finish_reason") or "stop") for r in ordered],
            "rollout_metrics": {
                "belayer/sessions": [sid for sid, _, _ in played],
                "belayer/weight_versions": [list(r["weight_versions"]) for r in ordered],
            },
            "rollout_logprobs": [[float(x) for x in r["response_logprobs"]] for r in ordered],
            "trajectory_ids": input_batch.get("trajectory_ids"),
            "trajectory_generation_times": [seconds for _, _, seconds in played],
            "rollout_expert_indices": None,
            "is_last_step": None,
            "env_metrics": None,
            "pixel_values": None,
            "image_grid_thw": None,
        }
