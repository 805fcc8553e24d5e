"""``belayer bench store``, scaled down (two episodes): it completes and prints each of its figures; the
stores read back exactly and the current layout is over ten times smaller than the old one on 50-turn
episodes (bytes, not time: the seeded episodes are the same every run). With ``--postgres auto``
(marker ``postgres``), the PostgreSQL store's figures too. No timing is asserted."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

FIGURES = ["episodes", "turns_per_episode", "generated_tokens", "final_prompt_tokens", "old_bytes", "new_bytes",
           "old_bytes_per_generated_token", "new_bytes_per_generated_token", "ratio_old_over_new",
           "old_write_ms_per_turn", "new_write_ms_per_turn", "new_get_turns_ms_per_episode",
           "new_round_trip_exact", "migrate_s", "migrated_bytes_per_generated_token",
           "migrated_round_trip_exact", "target_10x_smaller"]  # fmt: skip
POSTGRES = ["pg_write_ms_per_turn", "pg_get_turns_ms_per_episode", "pg_bytes", "pg_bytes_over_sqlite_bytes",
            "pg_round_trip_exact", "pg_2_replicas_wall_ms_per_turn"]  # fmt: skip
WORDS = {"new_round_trip_exact", "migrated_round_trip_exact", "target_10x_smaller", "pg_round_trip_exact"}


def _run(tmp_path: Path, *extra: str) -> dict[str, str]:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "store", "--episodes", "2", "--turns", "50"]
    done = subprocess.run(
        [*argv, "--dir", str(tmp_path), *extra], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for name in set(figures) - WORDS:
        assert not math.isnan(float(figures[name])), name
    return figures


def test_bench_store_is_ten_times_smaller_and_reads_back_exactly(tmp_path: Path) -> None:
    figures = _run(tmp_path)
    assert sorted(figures) == sorted(FIGURES), figures
    assert (figures["episodes"], figures["turns_per_episode"]) == ("2", "50")
    assert figures["new_round_trip_exact"] == figures["migrated_round_trip_exact"] == "true"
    assert float(figures["ratio_old_over_new"]) >= 10 and figures["target_10x_smaller"] == "pass"


@pytest.mark.postgres
def test_bench_store_on_postgres_reads_back_exactly(tmp_path: Path) -> None:
    figures = _run(tmp_path, "--postgres", "auto")
    assert sorted(figures) == sorted([*FIGURES, *POSTGRES]), figures
    assert figures["pg_round_trip_exact"] == "true"
    assert int(figures["pg_bytes"]) > 0
