"""docs/export.md's example (rows to verl's batch and to slime's `Sample` fields) runs on a real export.

The example is read out of the document, so the code a user copies is the code tested; no framework is
imported, only numpy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from belayer.cli import main as cli
from tests.gateway.test_export import episode, open_session
from tests.support import REPO, GatewayHarness

DOC = REPO / "docs" / "export.md"


def example() -> dict[str, Any]:
    text = DOC.read_text()
    section = text[text.index("### Example: rows to verl's batch") :]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # the document's own example
    return namespace


async def test_the_documented_conversions_run_on_an_export(gateway: GatewayHarness, tmp_path: Path) -> None:
    await episode(gateway)
    await open_session(gateway)
    out = tmp_path / "rollouts.parquet"
    argv = ["export", "--store", gateway.gw.config.store_path, "--format", "parquet", "--out", str(out)]
    assert cli(argv) == 0
    rows = pq.read_table(out).to_pylist()
    ns = example()
    pad = gateway.gw.tokenizer.encode(gateway.gw.tokenizer.eos_token)[0]
    plen = max(len(r["prompt_ids"]) for r in rows)
    rlen = max(len(r["response_ids"]) for r in rows)
    batch = ns["to_verl_batch"](rows, pad, plen, rlen)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(rows), plen + rlen)
    for i, row in enumerate(rows):
        real = batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist()
        assert real == row["prompt_ids"] + row["response_ids"]
        n = len(row["response_ids"])
        assert batch["response_mask"][i, :n].tolist() == row["response_mask"]
        assert not batch["response_mask"][i, n:].any() and not batch["rollout_log_probs"][i, n:].any()
        assert np.allclose(batch["rollout_log_probs"][i, :n], row["response_logprobs"])
        assert batch["token_level_scores"][i].sum() == (row["reward"] or 0.0)
        positions = batch["position_ids"][i][batch["attention_mask"][i] == 1].tolist()
        assert positions == list(range(len(real)))  # from 0 at the first real token, padding aside

        sample = ns["to_slime_sample"](row)
        # slime's own checks: loss mask and logprobs cover the response exactly
        assert len(sample["loss_mask"]) == len(sample["rollout_log_probs"]) == sample["response_length"] == n
        assert sample["tokens"][-n:] == row["response_ids"] and sample["status"] == "completed"
    assert [ns["to_slime_sample"](r)["reward"] for r in rows] == [1.0, 1.0, 1.0, None]
