"""The shared Ray cluster's nodes b and c declare sandbox slots (``tests/conftest.py``); the head, a, none."""

from __future__ import annotations

import pytest

from belayer.testing.ray_local import LocalRayCluster
from tests.conftest import SANDBOX_SLOTS

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.ray]


def test_nodes_b_and_c_declare_sandbox_slots(ray_cluster: LocalRayCluster) -> None:
    slots = ray_cluster.query(
        f"{{n['NodeManagerAddress']: n['Resources'].get({SANDBOX_SLOTS!r}, 0) for n in ray.nodes() if n['Alive']}}"
    )
    assert slots == {ray_cluster.node("a").ip: 0, ray_cluster.node("b").ip: 8, ray_cluster.node("c").ip: 8}
