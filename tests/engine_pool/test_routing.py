"""The router's policies (``engine_pool.router``), each alone over scripted workers (the parts of
``tests/engine_pool/test_pool_parts.py``): where each request goes, the group policy's spill under load
(and its ``session_moved`` event), and a session's worker after a failover."""

from __future__ import annotations

import pytest

from core.errors import EngineUnavailable
from engine_pool.face import Placement
from engine_pool.member import PoolMember
from engine_pool.settings import ROUTING_POLICIES, PoolSettings, RoutingPolicy
from engine_pool.states import DEAD, READY, SHADOW, UNHEALTHY
from tests.engine_pool.test_pool_parts import Parts, parts


def pool(
    routing: RoutingPolicy, *names: str, factor: float = 2.0, floor: int = 2000
) -> tuple[Parts, list[PoolMember]]:
    p = parts(PoolSettings(routing=routing, routing_spill_factor=factor, routing_spill_floor=floor))
    return p, [p.add(name, READY) for name in names]


async def placed(p: Parts, *requests: tuple[str | None, str | None]) -> list[str]:
    """The worker each (session, group) request is placed on, one after the other (each ends first)."""
    out = []
    for session, group in requests:
        async with p.router.lease(Placement(session, group=group)) as m:
            out.append(m.name)
    return out


def test_the_default_policy_is_affinity() -> None:
    assert PoolSettings().routing == "affinity" and ROUTING_POLICIES[0] == "affinity"


async def test_affinity_keeps_a_session_on_its_worker_however_loaded_else_the_fewest_outstanding() -> None:
    p, (a, b, _) = pool("affinity", "a", "b", "c")
    assert await placed(p, ("s1", None)) == ["a"]  # all idle: the first
    a.outstanding_tokens = 50000
    assert await placed(p, ("s1", "g"), ("s2", "g")) == ["a", "b"]  # no spill, no group
    b.outstanding_tokens = 1000
    assert await placed(p, ("s3", None), (None, None)) == ["c", "c"]
    assert p.events("session_moved") == [] and p.router.sessions == ["s1", "s2", "s3"]


async def test_group_places_a_groups_new_sessions_on_its_first_worker() -> None:
    p, (a, b) = pool("group", "a", "b")
    b.outstanding_tokens = 1000
    assert await placed(p, ("s1", "g7")) == ["a"]  # the least loaded: the group's worker from now on
    a.outstanding_tokens, b.outstanding_tokens = 2000, 0  # busier, not crowded (2000 > 2 * 0 + 2000: no)
    assert await placed(p, ("s2", "g7"), ("s3", "other"), ("s4", None)) == ["a", "b", "b"]
    assert p.router.groups == {"g7": "a", "other": "b"}
    a.outstanding_tokens = 0
    b.outstanding_tokens = 1000
    assert await placed(p, ("s3", "other")) == ["b"]  # a session's own worker wins over the least loaded
    assert p.events("session_moved") == []


async def test_group_spills_a_newcomer_off_a_crowded_group_worker_without_moving_the_group() -> None:
    p, (a, _) = pool("group", "a", "b")
    assert await placed(p, ("s1", "g")) == ["a"]
    a.outstanding_tokens = 3000  # 3000 > 2 * 0 + 2000: crowded
    assert await placed(p, ("s2", "g")) == ["b"]
    assert p.router.groups == {"g": "a"} and p.events("session_moved") == []  # s2 had no worker to leave
    a.outstanding_tokens = 0
    assert await placed(p, ("s3", "g")) == ["a"]


async def test_group_moves_a_session_off_its_crowded_worker_once_and_records_it() -> None:
    p, (a, b) = pool("group", "a", "b", factor=2.0, floor=2000)
    assert await placed(p, ("s1", "g")) == ["a"]
    a.outstanding_tokens, b.outstanding_tokens = 1000, 0
    assert await placed(p, ("s1", "g")) == ["a"]  # 1000 against 0 stays
    a.outstanding_tokens, b.outstanding_tokens = 4000, 1000
    assert await placed(p, ("s1", "g")) == ["a"]  # 4000 > 2 * 1000 + 2000 is false: stays
    a.outstanding_tokens = 5000
    assert await placed(p, ("s1", "g")) == ["b"]  # 5000 > 4000: moves
    [moved] = p.settings.telemetry.recent(kinds=["session_moved"])
    assert moved.session_id == "s1"
    assert moved.data == {
        "from_worker": "a", "to_worker": "b", "group": "g", "from_outstanding_tokens": 5000,
        "to_outstanding_tokens": 1000, "from_outstanding": 0, "to_outstanding": 0, "why": "load",
    }  # fmt: skip
    a.outstanding_tokens, b.outstanding_tokens = 0, 1000
    assert await placed(p, ("s1", "g"), ("s1", "g")) == ["b", "b"]  # it stays on its new worker
    assert len(p.events("session_moved")) == 1 and p.router.groups == {"g": "a"}


async def test_load_is_outstanding_tokens_counted_from_a_lease_to_its_end() -> None:
    p, (a, b) = pool("group", "a", "b", floor=2000)
    async with p.router.lease(Placement("s1", group="g", tokens=30_000)) as first:  # one long prompt on a
        assert first is a and (a.outstanding, a.outstanding_tokens) == (1, 30_000)
        b.outstanding = 3  # three short requests on b: fewer tokens than a's one
        b.outstanding_tokens = 300
        assert await placed(p, ("s2", None)) == ["b"]  # the least loaded by tokens, not by requests
        assert await placed(p, ("s3", "g")) == ["b"]  # g's worker is crowded: 30000 > 2 * 300 + 2000
        b.outstanding, b.outstanding_tokens = 0, 0
    assert (a.outstanding, a.outstanding_tokens, b.outstanding_tokens) == (0, 0, 0)
    async with p.router.lease(Placement("s4", tokens=100)) as m, p.router.lease(Placement("s5", tokens=50)) as n:
        assert (m.name, n.name) == ("a", "b") and (a.outstanding_tokens, b.outstanding_tokens) == (100, 50)
    assert p.router.groups == {"g": "a"}


async def test_round_robin_takes_the_ready_workers_in_turn_whatever_the_session() -> None:
    p, (a, b, c) = pool("round-robin", "a", "b", "c")
    p.add("s", SHADOW)
    a.outstanding_tokens = 9000
    requests = [("s1", "g"), ("s1", "g"), (None, None), ("s2", None), ("s1", "g")]
    assert await placed(p, *requests) == ["a", "b", "c", "a", "b"]
    b.state = UNHEALTHY
    assert await placed(p, ("s1", None), ("s1", None)) == ["c", "a"]  # turns 5 and 6, of two workers
    assert p.router.pick(Placement()) is c and p.router.pick(Placement()) is c  # a pick alone does not take a turn


async def test_least_loaded_takes_the_fewest_outstanding_then_the_fewest_served() -> None:
    p, (a, b, c) = pool("least-loaded", "a", "b", "c")
    assert await placed(p, ("s1", "g"), ("s1", "g"), ("s1", "g"), ("s1", "g")) == ["a", "b", "c", "a"]
    b.outstanding_tokens = 1000
    assert (a.served, b.served, c.served) == (2, 1, 1)
    assert await placed(p, ("s1", "g")) == ["c"]
    assert p.events("session_moved") == []


@pytest.mark.parametrize("routing", ["affinity", "group"])
async def test_a_session_stays_on_the_worker_that_took_it_over_after_a_failover(
    routing: RoutingPolicy,
) -> None:
    p, (a, b) = pool(routing, "a", "b")
    assert await placed(p, ("s1", "g")) == ["a"]
    async with p.router.lease(Placement("s1", group="g")) as m:  # a's stream breaks: fenced, resubmitted elsewhere
        assert m is a
        p.supervisor.report_failure(a, EngineUnavailable("connection reset"))
        assert a.state == UNHEALTHY
        async with p.router.lease(Placement("s1", group="g", exclude=frozenset({"a"}))) as again:
            assert again is b
    p.roster.set(a, READY, "health probe passed")  # back, idle, first in the roster
    assert await placed(p, ("s1", "g"), ("s2", None)) == ["b", "a"]
    assert p.router.sessions == ["s1", "s2"]
    if routing == "group":  # the group moved with its worker's loss: a newcomer joins it on b
        assert await placed(p, ("s3", "g")) == ["b"] and p.router.groups == {"g": "b"}
    assert p.events("session_moved") == []


async def test_a_removed_worker_is_forgotten_by_its_sessions_and_groups() -> None:
    p, (a, _) = pool("group", "a", "b")
    assert await placed(p, ("s1", "g"), ("s2", "h")) == ["a", "a"]
    a.state = DEAD
    p.router.forget_worker("a")
    assert p.router.sessions == [] and p.router.groups == {}
    assert await placed(p, ("s1", "g")) == ["b"] and p.router.groups == {"g": "b"}


async def test_the_groups_map_is_bounded() -> None:
    p = parts(PoolSettings(routing="group", max_affinity=2))
    p.add("a", READY)
    assert await placed(p, (None, "x"), (None, "y"), (None, "x"), (None, "z")) == ["a"] * 4
    assert list(p.router.groups) == ["x", "z"]
