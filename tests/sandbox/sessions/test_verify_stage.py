"""The manager's verify stage over the in-memory backend: the copy, the events, which sandboxes live, the
cap on the working directory's size, and the memory the copy takes."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from sandbox.fake import FakeSandboxBackend, Shell
from sandbox.sessions.verify import VerifyPlan
from tests.sandbox.sessions.conftest import EnvFactory

TEST = b"assert greet() == 'hello, world'\n"
PLAN = VerifyPlan(
    files={"verify.sh": (b"exit 0\n", 0o644)}, originals={"test_hello.py": (TEST, 0o644)},
    protected=("test_hello.py",),
)  # fmt: skip


def verifier(seen: list[list[str]]) -> FakeSandboxBackend:
    """A backend whose `env -i ... verify.sh` passes when /workspace/hello.py says "hello, world"."""
    backend = FakeSandboxBackend()

    def find(sh: Shell, argv: list[str]) -> int:  # find DIR -mindepth 1 -delete
        for name in [n for n in sh.files if n.startswith(argv[1] + "/")]:
            del sh.files[name]
        return 0

    def env(sh: Shell, argv: list[str]) -> int:
        seen.append(argv)
        fixed = b"hello, world" in sh.files.get("/workspace/hello.py", b"")
        sh.print("verifier: ok\n" if fixed else "verifier: FAILED\n")
        return 0 if fixed and sh.files["/workspace/test_hello.py"] == TEST else 1

    backend.commands |= {"find": find, "/usr/bin/env": env}
    return backend


@pytest.mark.parametrize("fixed", [True, False])
async def test_the_copy_is_judged_in_a_new_sandbox_and_the_agent_sandbox_goes(
    make_env: EnvFactory, fixed: bool
) -> None:
    seen: list[list[str]] = []
    env = await make_env(verifier(seen))
    sid = await env.session()
    agent_box = env.manager.sandbox_id(sid)
    body = b"return 'hello, world'" if fixed else b"return 'hello'"
    await env.manager.write_file(sid, "hello.py", body)
    await env.manager.write_file(sid, "test_hello.py", b"assert True\n")  # tampered with
    outcome = await env.manager.verify(sid, PLAN)
    assert outcome.verified is fixed and outcome.action == "reset"
    assert outcome.output == ("verifier: ok\n" if fixed else "verifier: FAILED\n")
    assert [c.path for c in outcome.changes] == ["test_hello.py"]
    assert seen and seen[0][1] == "-i" and seen[0][-1] == "/belayer-verify/verify.sh"
    assert env.backend.sandboxes == []  # the agent's and the verifier's sandboxes are gone
    assert env.backend.ops("create")[1] == "belayer-sandbox-busybox"  # the clean image again
    assert not env.manager.has_sandbox(sid) and agent_box in env.backend.ops("destroy")
    assert env.kinds(sid) == ["sandbox_created", "sandbox_destroyed", "protected_path_modified"]
    assert not any("verifier" in str(data) for _, data in env.events(sid, ""))


async def test_on_tamper_fail_runs_no_verifier_and_keep_keeps_the_agent_sandbox(make_env: EnvFactory) -> None:
    seen: list[list[str]] = []
    env = await make_env(verifier(seen))
    sid = await env.session()
    await env.manager.write_file(sid, "test_hello.py", b"assert True\n")
    plan = VerifyPlan(PLAN.files, PLAN.originals, PLAN.protected, on_tamper="fail", keep_agent_sandbox=True)
    outcome = await env.manager.verify(sid, plan)
    assert (outcome.verified, outcome.action, outcome.exit_code, seen) == (False, "fail", None, [])
    assert env.backend.sandboxes == [env.manager.sandbox_id(sid)]  # kept for inspection
    [(_, data)] = env.events(sid, "protected_path_modified")
    assert (data["path"], data["change"], data["action"]) == ("test_hello.py", "modified", "fail")


async def test_a_workspace_over_the_cap_is_not_verified_and_nothing_else_is_touched(
    make_env: EnvFactory,
) -> None:
    seen: list[list[str]] = []
    env = await make_env(verifier(seen), max_workspace_bytes=64 * 1024)
    sid, other = await env.session(), await env.session("s2")
    await env.manager.write_file(sid, "hello.py", b"return 'hello, world'")
    await env.manager.write_file(sid, "big.bin", b"\0" * (4 << 20))
    outcome = await env.manager.verify(sid, PLAN)
    verdict = (outcome.verified, outcome.exit_code, outcome.reason, seen)
    assert verdict == (False, None, "workspace_too_large", [])
    summary = outcome.summary()
    assert summary["max_workspace_bytes"] == 64 * 1024
    assert 64 * 1024 < summary["workspace_bytes"] < 4 << 20  # the copy stopped early
    assert "over sandbox.max_workspace_bytes" in outcome.output
    assert len(env.backend.ops("create")) == 2  # the two agents' sandboxes; no verifier's
    [(_, data)] = env.events(sid, "workspace_too_large")
    assert data["max_workspace_bytes"] == 64 * 1024
    assert (await env.manager.exec(other, "echo fine")).stdout == "fine\n"  # the other session goes on


async def test_the_copy_streams_through_the_gateway(make_env: EnvFactory) -> None:
    """A 32 MiB working directory: the gateway never holds more than a few pieces of it besides the fake
    verify sandbox's own copy of the files (before streaming, about four copies: the archive, the tree,
    the rewritten archive and its bytes)."""
    size, files = 32 << 20, 8
    env = await make_env(verifier([]))
    sid = await env.session()
    for i in range(files):
        await env.manager.write_file(sid, f"data/{i}.bin", os.urandom(size // files))
    await env.manager.write_file(sid, "hello.py", b"return 'hello, world'")
    tracemalloc.start()
    try:
        outcome = await env.manager.verify(sid, PLAN)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - size < size // 4, f"peak {peak >> 20} MiB for a {size >> 20} MiB working directory"
    assert outcome.verified
