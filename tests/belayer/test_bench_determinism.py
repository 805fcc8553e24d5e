"""``belayer bench determinism`` on launched fake workers that sample from a fixed policy (real
processes, one SIGKILLed mid-stream per round): with keyed sampling every stream a killed worker's
failover resumed has its undisturbed twin's tokens; with the engine's own sampler (the baseline, in the
same run) the resumed streams are re-drawn. No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_bench_determinism_keyed_streams_survive_a_kill_and_the_engines_do_not(tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "determinism", "--model", str(tiny_model_dir)]
    argv += ["--worker-kind", "fake", "--streams", "4", "--rounds", "1", "--max-tokens", "60"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert set(figures) == {
        "sampled_tokens_identical_pct_keyed", "streams_identical_pct_keyed", "streams_resumed_keyed",
        "sampled_tokens_compared", "near_ties", "divergences_explained_by_near_ties",
        "sampled_tokens_identical_pct_engine", "streams_identical_pct_engine", "streams_resumed_engine",
    }  # fmt: skip
    assert int(figures["streams_resumed_keyed"]) >= 1 and int(figures["streams_resumed_engine"]) >= 1
    assert figures["sampled_tokens_identical_pct_keyed"] == "100.000"
    assert figures["streams_identical_pct_keyed"] == "100.000"
    assert figures["sampled_tokens_compared"] == str(4 * 60)
    assert float(figures["streams_identical_pct_engine"]) < 100.0  # the resumed ones were re-drawn
