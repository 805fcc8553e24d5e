"""Recovery without Docker: replay, truncation, the watcher, hangs, and restores with nothing to restore."""

from __future__ import annotations

import itertools

import pytest

from core.errors import NoCheckpoint, SandboxCallFailed, SandboxFailed, SandboxRestored, SandboxTimeout
from sandbox.fake import Fault, Shell
from tests.sandbox.sessions.conftest import SPEC, Env, EnvFactory


async def test_replay_restores_the_checkpoint_and_runs_the_journal_and_the_call_again(env: Env) -> None:
    sid = await env.session()
    first = env.manager.sandbox_id(sid)
    await env.manager.exec(sid, "echo 1 > a")
    ckpt = await env.manager.checkpoint(sid)
    await env.manager.exec(sid, "echo 2 >> a")
    await env.manager.write_file(sid, "b", b"file\n")
    env.backend.inject(Fault("exec", "kill"))

    result = await env.manager.exec(sid, "echo 3 >> a; cat a b")

    assert (result.exit_code, result.stdout) == (0, "1\n2\n3\nfile\n")
    box = env.manager.sandbox_id(sid)
    assert box != first and env.backend.sandboxes == [box]  # the failed one is gone
    assert env.backend.ops("restore") == [ckpt.checkpoint.id]
    state = env.manager.describe(sid)
    assert (state["status"], state["journaled_calls"]) == ("running", 3)  # the retried call joined them
    restored = state["last_restore"]
    assert (restored["mode"], restored["checkpoint_id"], restored["replayed"], restored["diverged"]) == (
        "replay", ckpt.checkpoint.id, 2, 0,
    )  # fmt: skip
    assert (restored["discarded_turns"], restored["sandbox_id"]) == ([], box)
    assert env.kinds() == ["sandbox_created", "sandbox_checkpoint", "sandbox_failure", "sandbox_restored"]
    assert env.events()[3][1] == restored  # the manager's record of the restore is the event it stored
    assert restored["seconds"] == round(restored["seconds"], 4)
    failure = env.events()[2][1]
    assert failure == {
        "kind": "exited", "detail": "exec failed: container exited, exit code 137", "sandbox_id": first,
    }  # fmt: skip
    assert env.manager.stats()["replays"] == 1


async def test_replay_without_a_checkpoint_starts_again_from_the_image(env: Env) -> None:
    sid = await env.session()
    await env.manager.exec(sid, "cd /tmp; X=1")
    env.backend.inject(Fault("exec", "break"))

    result = await env.manager.exec(sid, 'echo "$X"; pwd')

    assert result.stdout == "1\n/tmp\n"  # the session's state came back by replay alone
    assert env.backend.ops("restore") == [] and len(env.backend.ops("create")) == 2
    [(_, failure), (_, restored)] = env.events()[1:]
    assert (failure["kind"], failure["detail"]) == (
        "sandbox_error", "exec failed: exec on " + failure["sandbox_id"] + ": the exec transport broke (connection reset)",
    )  # fmt: skip
    assert (restored["checkpoint_id"], restored["turn_index"], restored["replayed"]) == ("", -1, 1)


async def test_a_replayed_call_with_another_output_counts_as_diverged(env: Env) -> None:
    rolls = itertools.count(1)

    def roll(shell: Shell, argv: list[str]) -> int:
        shell.print(f"{next(rolls)}\n")
        return 0

    env.backend.commands["roll"] = roll
    sid = await env.session()
    assert (await env.manager.exec(sid, "roll")).stdout == "1\n"
    env.backend.kill(env.manager.sandbox_id(sid))

    assert (await env.manager.exec(sid, "echo next")).stdout == "next\n"
    restored = env.manager.describe(sid)["last_restore"]
    assert (restored["replayed"], restored["diverged"]) == (1, 1)


async def test_truncate_restores_and_discards_the_later_turns(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    env.finish_turn(env.start_turn(sid))
    await env.manager.exec(sid, "echo a > f")
    turn1 = env.start_turn(sid)
    ckpt = await env.manager.checkpoint(sid)  # in turn 1's bubble
    env.finish_turn(turn1)
    await env.manager.exec(sid, "echo b >> f")
    env.finish_turn(env.start_turn(sid))
    env.backend.inject(Fault("exec", "oom"))

    with pytest.raises(SandboxRestored) as raised:
        await env.manager.exec(sid, "echo c >> f")

    info = raised.value.info
    assert (info.checkpoint_id, info.turn_index, info.keep_through, info.discarded_turns, info.mode) == (
        ckpt.checkpoint.id, 1, 1, [2], "truncate",
    )  # fmt: skip
    assert "continue after turn 1 (turns [2] were discarded)" in str(raised.value)
    assert (ckpt.turn_index, ckpt.in_bubble, ckpt.keep_through) == (1, True, 1)
    assert env.turn_statuses() == ["complete", "complete", "discarded"]
    assert await env.manager.read_file(sid, "f") == b"a\n"
    assert env.kinds()[-3:] == ["sandbox_failure", "turns_discarded", "sandbox_restored"]
    assert env.events()[-2][1]["kind"] == "oom"
    assert env.manager.describe(sid)["journaled_calls"] == 0


@pytest.mark.parametrize(("oom", "kind"), [(False, "exited"), (True, "oom")])
async def test_the_watcher_restores_a_sandbox_killed_while_idle(env: Env, oom: bool, kind: str) -> None:
    sid = await env.session()
    await env.manager.exec(sid, "echo kept > a")
    await env.manager.checkpoint(sid)
    await env.manager.exec(sid, "echo replayed >> a")
    first = env.manager.sandbox_id(sid)
    env.backend.kill(first, oom=oom)

    await env.manager.watcher.sweep()

    box = env.manager.sandbox_id(sid)
    assert box != first and env.backend.sandboxes == [box]
    assert await env.manager.read_file(sid, "a") == b"kept\nreplayed\n"
    _, failure = env.events()[-2]
    detail = "container exited, exit code 137" + (
        ", killed for running out of memory (raise memory_mb)" if oom else ""
    )
    assert failure == {"kind": kind, "detail": f"sandbox stopped: {detail}", "sandbox_id": first}
    assert (await env.manager.exec(sid, "echo fine")).stdout == "fine\n"  # replay: nothing to report
    await env.manager.watcher.sweep()  # a running sandbox is left alone
    assert env.manager.sandbox_id(sid) == box


async def test_truncate_reports_the_watchers_restore_on_the_next_call_without_running_it(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    await env.manager.checkpoint(sid)
    env.backend.kill(env.manager.sandbox_id(sid))
    await env.manager.watcher.sweep()

    with pytest.raises(SandboxRestored, match=r"before this call .* nothing of this call ran"):
        await env.manager.exec(sid, "echo ran > marker")
    with pytest.raises(FileNotFoundError):
        await env.manager.read_file(sid, "marker")
    assert (await env.manager.exec(sid, "echo next")).stdout == "next\n"  # reported once


async def test_a_hung_exec_is_a_sandbox_failure_and_its_thread_comes_back(env: Env) -> None:
    sid = await env.session()
    first = env.manager.sandbox_id(sid)
    env.backend.inject(Fault("exec", "hang"))

    result = await env.manager.exec(sid, "echo answered", timeout_s=0.1)

    assert result.stdout == "answered\n"
    [(_, failure), _] = env.events()[1:]
    assert failure == {"kind": "tool_hang", "detail": "exec did not return within 0.3s", "sandbox_id": first}
    assert env.backend.sandboxes == [env.manager.sandbox_id(sid)]  # destroying it ended the hung call


async def test_a_command_timeout_is_the_callers_error_and_stays_in_the_journal(env: Env) -> None:
    sid = await env.session()
    with pytest.raises(SandboxTimeout) as raised:
        await env.manager.exec(sid, "echo partial; sleep 5", timeout_s=0.1)
    assert raised.value.stdout == "partial\n"
    assert env.manager.describe(sid)["journaled_calls"] == 1
    assert "sandbox_failure" not in env.kinds()


async def test_a_call_that_breaks_the_sandbox_again_after_a_replay_is_refused(env: Env) -> None:
    env.backend.commands["die"] = lambda shell, argv: shell.kill_sandbox()
    sid = await env.session()
    await env.manager.exec(sid, "echo kept > a")
    await env.manager.checkpoint(sid)
    await env.manager.exec(sid, "echo replayed >> a")

    with pytest.raises(SandboxCallFailed, match="after a restore and a replay of the 1 tool calls before it"):
        await env.manager.exec(sid, "die")

    assert await env.manager.read_file(sid, "a") == b"kept\n"  # back at the checkpoint, nothing replayed
    assert (await env.manager.exec(sid, "echo fine")).stdout == "fine\n"
    failures = [data for kind, data in env.events() if kind == "sandbox_failure"]
    assert [f.get("after_replay", False) for f in failures] == [False, True]
    restores = [data["mode"] for kind, data in env.events() if kind == "sandbox_restored"]
    assert restores == ["replay", "truncate"]


async def test_restore_with_no_checkpoint(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    with pytest.raises(NoCheckpoint, match="has no checkpoint to restore"):
        await env.manager.restore(sid)
    await env.manager.checkpoint(sid)
    with pytest.raises(NoCheckpoint, match="has no checkpoint 'nope'"):
        await env.manager.restore(sid, "nope")
    assert len(env.manager.checkpoints(sid)) == 1  # an unknown id changed nothing


async def test_a_failure_with_nothing_to_restore_fails_the_sandbox(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    first = env.manager.sandbox_id(sid)
    env.backend.inject(Fault("exec", "kill"))

    with pytest.raises(SandboxFailed, match="there is no checkpoint to restore"):
        await env.manager.exec(sid, "true")

    state = env.manager.describe(sid)
    assert (state["status"], state["sandbox_id"]) == ("failed", None)
    assert state["failure"] == "exited: exec failed: container exited, exit code 137"
    assert env.backend.sandboxes == [] and first not in env.backend.sandboxes
    with pytest.raises(SandboxFailed, match="failed earlier"):
        await env.manager.exec(sid, "true")
    assert await env.manager.create(sid, SPEC) != first  # a failed sandbox may be created again


async def test_without_auto_restore_a_failure_fails_the_sandbox(make_env: EnvFactory) -> None:
    env = await make_env(auto_restore=False)
    sid = await env.session()
    await env.manager.checkpoint(sid)
    env.backend.inject(Fault("exec", "break"))
    with pytest.raises(SandboxFailed):
        await env.manager.exec(sid, "true")
    assert env.backend.ops("restore") == []


async def test_restore_to_an_older_checkpoint_deletes_the_newer_ones(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    c1, c2, c3 = [await env.manager.checkpoint(sid) for _ in range(3)]

    info = await env.manager.restore(sid, c1.checkpoint.id)

    assert info.checkpoint_id == c1.checkpoint.id
    assert [c.checkpoint.id for c in env.manager.checkpoints(sid)] == [c1.checkpoint.id]
    assert env.backend.checkpoint_ids == [c1.checkpoint.id]
    assert env.backend.ops("delete_checkpoint") == [c2.checkpoint.id, c3.checkpoint.id]


async def test_a_turn_discarded_by_a_restore_and_finishing_later_stays_discarded(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    env.finish_turn(env.start_turn(sid))
    turn1 = env.start_turn(sid)
    ckpt = await env.manager.checkpoint(sid)  # in turn 1's bubble: keeps turn 1
    info = await env.manager.restore(sid)  # while turn 1 still runs
    assert (ckpt.keep_through, info.discarded_turns) == (1, [])

    env.finish_turn(turn1)

    assert env.turn_statuses() == ["complete", "discarded"]
    [(_, discarded)] = env.events(prefix="turns_discarded")
    assert discarded == {
        "after_turn": None,
        "turn_indices": [1],
        "reason": "finished after a sandbox restore",
    }


async def test_a_harness_inside_is_truncated_to_the_turn_before_the_bubble(env: Env) -> None:
    sid = await env.session(harness_inside=True, recovery="replay")
    env.finish_turn(env.start_turn(sid))
    turn1 = env.start_turn(sid)
    ckpt = await env.manager.checkpoint(sid)  # the harness is frozen waiting for turn 1
    env.finish_turn(turn1)
    env.backend.kill(env.manager.sandbox_id(sid))
    await env.manager.watcher.sweep()

    assert (env.manager.describe(sid)["recovery"], ckpt.keep_through) == ("truncate", 0)
    assert env.turn_statuses() == ["complete", "discarded"]
