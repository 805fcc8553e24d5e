"""``belayer bench sandbox-node-loss``, scaled down (two short episodes of two tool calls) on the test
session's Ray cluster and its sandbox nodes' Docker engines (markers ``sandbox_cluster``, ``docker``,
``ray``; `tests/sandbox_cluster/conftest.py`: the bench's own three nodes and two engines took minutes to
start beside them): it completes and prints each of its figures, and the lost node is back afterwards.
No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path

import pytest

from belayer.bench import sandbox_node_loss
from belayer.testing.docker_local import LocalDockerEngine
from belayer.testing.ray_local import LocalRayCluster

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.docker, pytest.mark.ray]

FIGURES = ["lost_sandboxes", "node_loss_restored_s_p50", "node_loss_restored_s_max", "restored_pct", "rerun_s",
           "node_loss_speedup", "node_losses", "leaked_containers"]  # fmt: skip


def test_bench_sandbox_node_loss_restores_the_lost_sandboxes_elsewhere(
    whole_cluster: LocalRayCluster,
    whole_engines: dict[str, LocalDockerEngine],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    opts = argparse.Namespace(sandboxes=2, steps=2, step_s=0.1, node_timeout=2.0)
    asyncio.run(sandbox_node_loss.run_on(whole_cluster, whole_engines, opts, tmp_path))
    out = capsys.readouterr().out.splitlines()  # Ray's and the engines' own lines among the figures
    figures = dict(line.split(": ", 1) for line in out if line.split(": ", 1)[0].isidentifier())
    assert sorted(figures) == sorted(FIGURES), figures
    for name in FIGURES:
        assert not math.isnan(float(figures[name])), name
    assert int(figures["lost_sandboxes"]) >= 1 and int(figures["node_losses"]) >= 1
    assert all(engine.running() for engine in whole_engines.values())
    assert all(node.proc is not None for node in whole_cluster.nodes)
