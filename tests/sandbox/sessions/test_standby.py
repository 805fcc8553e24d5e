"""Standby sandboxes without Docker (`sandbox.sessions.standby`): made frozen after a checkpoint in a
bubble, unfrozen at a failure with the journal since its checkpoint replayed, discarded when superseded,
when its checkpoint goes, and when the session closes; left unused when it holds another checkpoint;
never made where it cannot or should not be. (A restarted gateway removes one left behind:
`test_adoption`.)"""

from __future__ import annotations

import threading
from typing import Any

from sandbox.config import PolicySettings
from sandbox.fake import FakeSandboxBackend, Fault
from tests.sandbox.sessions.conftest import SPEC, Env, EnvFactory, eventually

ALWAYS = PolicySettings(mode="always")


async def standby_env(make_env: EnvFactory, **overrides: Any) -> Env:
    return await make_env(**({"policy": ALWAYS, "standby": True} | overrides))


async def bubble(env: Env, sid: str) -> None:
    """One LLM call: its bubble's checkpoint, and the standby after it, run to their end."""
    turn = env.start_turn(sid)
    await env.manager.idle()
    env.finish_turn(turn)


def standby_events(env: Env, sid: str = "s1") -> list[tuple[str, str, str | None]]:
    return [
        (d["action"], d["checkpoint_id"], d.get("reason"))
        for kind, d in env.events(sid) if kind == "sandbox_standby"
    ]  # fmt: skip


def standby_of(env: Env, checkpoint_id: str) -> str:
    """The standby sandbox made of `checkpoint_id` (from its ``made`` event)."""
    return next(
        d["sandbox_id"] for kind, d in env.events() if kind == "sandbox_standby" and d["action"] == "made"
        and d["checkpoint_id"] == checkpoint_id
    )  # fmt: skip


async def with_standby(make_env: EnvFactory, call: str | None = None) -> tuple[Env, str, Any, str]:
    """A session (after `call`, if given) whose first bubble took a checkpoint and made its standby:
    (the env, the session, the checkpoint, the standby sandbox)."""
    env = await standby_env(make_env)
    sid = await env.session()
    if call is not None:
        await env.manager.exec(sid, call)
    await bubble(env, sid)
    [ckpt] = env.manager.checkpoints(sid)
    return env, sid, ckpt, standby_of(env, ckpt.checkpoint.id)


async def test_a_checkpoint_in_a_bubble_gets_a_frozen_standby(make_env: EnvFactory) -> None:
    env = await standby_env(make_env)
    sid = await env.session()
    primary = env.manager.sandbox_id(sid)
    await env.manager.exec(sid, "echo 1 > a")

    await bubble(env, sid)

    [ckpt] = env.manager.checkpoints(sid)
    assert env.backend.ops("restore_standby") == [ckpt.checkpoint.id]
    standby = standby_of(env, ckpt.checkpoint.id)
    assert sorted(env.backend.sandboxes) == sorted([primary, standby])
    assert env.backend.frozen(standby) and not env.backend.frozen(primary)
    assert standby_events(env) == [("made", ckpt.checkpoint.id, None)]
    assert env.kinds()[-2:] == ["sandbox_checkpoint", "sandbox_standby"]
    assert env.manager.stats()["standbys_made"] == 1
    # made with the session's labels: a restarted gateway finds a left-over one by them (`adoption`)
    labels = {b.id: b.spec.labels for b in env.backend.list_sandboxes({"belayer.session": sid})}
    assert labels.keys() == {primary, standby} and labels[primary] == labels[standby]


async def test_a_failure_unfreezes_the_standby_and_replays_the_journal_since_its_checkpoint(
    make_env: EnvFactory,
) -> None:
    env, sid, ckpt, standby = await with_standby(make_env, "X=1 && echo 1 > a")
    await env.manager.exec(sid, "echo 2 >> a")  # calls k+1..n, after the checkpoint
    await env.manager.write_file(sid, "b", b"file\n")
    env.backend.inject(Fault("exec", "kill"))

    result = await env.manager.exec(sid, 'echo 3 >> a; cat a b; echo "$X"')

    assert (result.exit_code, result.stdout) == (0, "1\n2\n3\nfile\n1\n")
    assert env.manager.sandbox_id(sid) == standby and env.backend.sandboxes == [standby]
    assert not env.backend.frozen(standby)
    assert env.backend.ops("restore") == []  # nothing restored from storage
    assert env.backend.ops("activate") == [standby]
    restored = env.manager.describe(sid)["last_restore"]
    assert (restored["mode"], restored["checkpoint_id"], restored["replayed"], restored["diverged"]) == (
        "replay", ckpt.checkpoint.id, 2, 0,
    )  # fmt: skip
    assert (restored["standby"], restored["sandbox_id"]) == (True, standby)
    assert env.kinds()[-3:] == ["sandbox_failure", "sandbox_standby", "sandbox_restored"]
    assert standby_events(env)[-1] == ("used", ckpt.checkpoint.id, None)
    assert env.manager.stats()["standbys_used"] == 1

    await bubble(env, sid)  # the next bubble makes the next standby
    newest = env.manager.checkpoints(sid)[-1].checkpoint.id
    assert env.backend.ops("restore_standby") == [ckpt.checkpoint.id, newest]


async def test_a_newer_checkpoint_supersedes_the_standby(make_env: EnvFactory) -> None:
    env, sid, first, old = await with_standby(make_env)

    await env.manager.exec(sid, "echo 2 > a")
    await bubble(env, sid)

    second = env.manager.checkpoints(sid)[-1]
    new = standby_of(env, second.checkpoint.id)
    assert old not in env.backend.sandboxes and new in env.backend.sandboxes
    assert standby_events(env) == [
        ("made", first.checkpoint.id, None),
        ("discarded", first.checkpoint.id, f"superseded by checkpoint {second.checkpoint.id}"),
        ("made", second.checkpoint.id, None),
    ]


async def test_a_standby_of_another_checkpoint_is_not_used(make_env: EnvFactory) -> None:
    """A checkpoint taken outside a bubble supersedes the standby at once; the failure that follows
    restores the newer checkpoint from storage."""
    env, sid, _, old = await with_standby(make_env)
    await env.manager.exec(sid, "echo 2 > a")
    second = await env.manager.checkpoint(sid)  # explicit: no bubble, no standby of it
    await env.manager.idle()
    env.backend.kill(env.manager.sandbox_id(sid))

    assert (await env.manager.exec(sid, "cat a")).stdout == "2\n"

    assert env.backend.ops("restore") == [second.checkpoint.id] and env.backend.ops("activate") == []
    assert old not in env.backend.sandboxes
    assert "standby" not in env.manager.describe(sid)["last_restore"]


async def test_a_restore_to_an_older_checkpoint_deletes_the_newer_one_and_its_standby(
    make_env: EnvFactory,
) -> None:
    env = await standby_env(make_env)
    sid = await env.session()
    await env.manager.exec(sid, "echo 1 > a")
    first = await env.manager.checkpoint(sid)
    await env.manager.exec(sid, "echo 2 > a")
    await bubble(env, sid)
    second = env.manager.checkpoints(sid)[-1]
    standby = standby_of(env, second.checkpoint.id)

    await env.manager.restore(sid, first.checkpoint.id)
    await env.manager.idle()

    assert (await env.manager.exec(sid, "cat a")).stdout == "1\n"
    assert env.backend.ops("restore") == [first.checkpoint.id]
    assert standby not in env.backend.sandboxes and env.backend.sandboxes == [env.manager.sandbox_id(sid)]
    assert standby_events(env)[-1] == ("discarded", second.checkpoint.id, "its checkpoint was deleted")


async def test_closing_the_session_removes_its_standby(make_env: EnvFactory) -> None:
    env, sid, ckpt, _ = await with_standby(make_env)

    await env.manager.destroy(sid)

    assert env.backend.sandboxes == [] and env.backend.checkpoint_ids == []
    assert standby_events(env)[-1] == ("discarded", ckpt.checkpoint.id, "the session's sandbox was removed")


async def test_released_checkpoints_take_their_standby_with_them(make_env: EnvFactory) -> None:
    env, sid, _, _ = await with_standby(make_env)

    [released] = env.manager.release_checkpoints(sid)
    await env.manager.idle()

    assert env.backend.sandboxes == [env.manager.sandbox_id(sid)]
    assert env.backend.checkpoint_ids == [released.checkpoint.id]  # the caller's now
    assert standby_events(env)[-1] == ("discarded", released.checkpoint.id, "its checkpoint was deleted")


async def test_a_standby_that_cannot_be_unfrozen_is_removed_and_storage_restores(
    make_env: EnvFactory,
) -> None:
    env, sid, ckpt, standby = await with_standby(make_env, "echo 1 > a")
    env.backend.inject(Fault("activate"))
    env.backend.kill(env.manager.sandbox_id(sid))

    assert (await env.manager.exec(sid, "cat a")).stdout == "1\n"

    assert env.backend.ops("restore") == [ckpt.checkpoint.id]
    assert standby not in env.backend.sandboxes
    assert standby_events(env)[-1] == (
        "discarded", ckpt.checkpoint.id, "it could not be unfrozen: activate on " + standby + " failed (injected fault)",
    )  # fmt: skip
    assert "standby" not in env.manager.describe(sid)["last_restore"]


async def test_a_bubble_without_a_checkpoint_makes_the_standby_of_the_newest(make_env: EnvFactory) -> None:
    """Automatic checkpoints off: an explicit checkpoint's standby is made in the next bubble. One that
    fails is recorded, leaves nothing, and is not tried again for that checkpoint."""
    env = await standby_env(make_env, policy=PolicySettings(mode="never"))
    sid = await env.session()
    first = await env.manager.checkpoint(sid)
    env.backend.inject(Fault("restore_standby"))

    await bubble(env, sid)

    assert env.backend.sandboxes == [env.manager.sandbox_id(sid)]
    assert standby_events(env) == [
        ("failed", first.checkpoint.id, "RestoreError: restore_standby failed (injected fault)")
    ]
    await bubble(env, sid)
    assert env.backend.ops("restore_standby") == [first.checkpoint.id]
    second = await env.manager.checkpoint(sid)
    await bubble(env, sid)
    assert env.backend.ops("restore_standby") == [first.checkpoint.id, second.checkpoint.id]
    assert standby_events(env)[-1] == ("made", second.checkpoint.id, None)


async def test_no_standby_where_it_is_off_cannot_be_kept_on_a_network_or_would_not_fit(
    make_env: EnvFactory,
) -> None:
    class NoStandbys(FakeSandboxBackend):
        @property
        def keeps_standbys(self) -> bool:
            return False

    short = PolicySettings(mode="always", prior_fixed_cost_s=5.0)  # a standby predicted past the bubble
    envs = [
        await make_env(policy=ALWAYS),  # sandbox.standby off (the default)
        await standby_env(make_env, backend=NoStandbys()),
        await standby_env(make_env, policy=short),
    ]
    for env in envs:
        sid = await env.session()
        await bubble(env, sid)
        assert len(env.manager.checkpoints(sid)) == 1
    gateway = await standby_env(make_env)
    await gateway.session("s1", spec=SPEC.model_copy(update={"network": "full"}))
    await bubble(gateway, "s1")
    for env in [*envs, gateway]:
        assert env.backend.ops("restore_standby") == [] and len(env.backend.sandboxes) == 1


async def test_the_sessions_calls_never_wait_for_a_standby_being_made(make_env: EnvFactory) -> None:
    env = await standby_env(make_env)
    sid = await env.session()
    release = threading.Event()
    env.backend.inject(Fault("restore_standby", "block", release=release))
    turn = env.start_turn(sid)
    await eventually(lambda: env.backend.ops("restore_standby") != [], "the standby's making")

    env.finish_turn(turn)  # the bubble ends while the standby is being made: the harness acts again
    assert (await env.manager.exec(sid, "echo go")).stdout == "go\n"
    await env.manager.write_file(sid, "f", b"x")

    release.set()
    await env.manager.idle()
    [ckpt] = env.manager.checkpoints(sid)
    assert standby_events(env) == [("made", ckpt.checkpoint.id, None)]
