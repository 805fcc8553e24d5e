"""The walk of a chat turn through the code (``belayer.testing.walk``, issue 35): a structural ratchet on
how often the turn's walk returns to a room it already left, not a timing bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer.testing.walk import TURN, Step, Walk, measure


@pytest.mark.parametrize("variant", ["plain", "stream"])
async def test_a_turn_returns_to_rooms_it_left_at_most_ten_times(variant: str, tiny_model_dir: Path) -> None:
    walk = await measure(variant, str(tiny_model_dir))
    assert walk.stored
    path = walk.path()
    assert path[0] == Step("gateway/api/openai/routes.py", "chat_completions")
    assert path[-1].room.startswith("store/")  # the walk ends where the turn's end is written
    assert TURN in [step.function for step in path]
    assert walk.reentries(core=False, lookups=False) <= 10  # issue 35's goal, from the route
    assert walk.reentries(core=False, lookups=False, start=TURN) <= 7  # the turn's own part


async def test_a_session_urls_turn_reads_the_store_once_before_it_begins(tiny_model_dir: Path) -> None:
    walk = await measure("stream", str(tiny_model_dir))
    functions = [step.function for step in walk.steps]
    reads = functions[: functions.index(TURN)]
    assert "SqlStore.session_and_parent" in reads  # the session, with the turn the messages extend
    assert not {"SqlStore.get_session", "SqlStore.find_turn_by_ext_keys"} & set(reads)


async def test_a_failover_walks_through_the_failover_room(tiny_model_dir: Path) -> None:
    walk = await measure("failover", str(tiny_model_dir))
    functions = [step.function for step in walk.steps]
    assert walk.stored
    assert "TurnStream._lost" in functions and "TurnStream._switched" in functions


def test_a_room_left_and_entered_again_is_a_reentry_a_glance_into_one_is_not() -> None:
    walk = Walk([
        Step("a.py", "f"), Step("b.py", "g", 0), Step("c.py", "h", 1), Step("a.py", "k", 0),
        Step("d.py", "look", 3), Step("a.py", "m", 3), Step("core/x.py", "leaf", 5), Step("a.py", "n", 5),
    ])  # fmt: skip
    rooms = ["a.py", "b.py", "c.py", "a.py", "d.py", "a.py", "core/x.py", "a.py"]
    assert [s.room for s in walk.path()] == rooms
    assert walk.reentries() == 3
    assert walk.reentries(core=False) == 2
    spine = [s.room for s in walk.path(core=False, lookups=False)]
    assert spine == ["a.py", "b.py", "a.py"]  # c.py and d.py: glances (they call no other room)
    assert walk.reentries(core=False, lookups=False) == 1
    assert walk.reentries(start="k") == 2  # from a.k: d.py, then a.py and core/x.py, a.py again
