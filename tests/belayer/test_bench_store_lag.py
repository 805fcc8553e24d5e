"""``belayer bench store-lag`` scaled down: both paths run on PostgreSQL and print every figure."""

from __future__ import annotations

import pytest

from belayer.bench import store_lag
from tests.postgres_server import PostgresServer

pytestmark = pytest.mark.postgres

FIGURES = ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "failover_events", "turns_complete", "storm_s")


def test_both_paths_run_a_failover_storm_and_print_their_figures(
    postgres: PostgresServer, tiny_model_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--postgres", postgres.new_database(), "--model", str(tiny_model_dir), "--streams", "4"]
    assert store_lag.main([*argv, "--rounds", "1", "--tokens", "8", "--cut-after", "3"]) == 0
    figures = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert list(figures) == [f"{path}_{name}" for path in ("loop", "front") for name in FIGURES] + [
        "lag_p99_ratio"
    ]
    for path in ("loop", "front"):
        assert figures[f"{path}_turns_complete"] == "4"
        assert int(figures[f"{path}_failover_events"]) >= 4  # every request was cut at least once
