"""Creating and removing sessions' sandboxes without Docker: errors, the gateway network, settling."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.errors import (
    ImageNotFound,
    NoSandbox,
    SandboxArgumentError,
    SandboxError,
    SandboxExists,
)
from sandbox.backend import SandboxSpec
from sandbox.fake import FakeSandboxBackend, Fault
from tests.sandbox.sessions.conftest import SPEC, Env, EnvFactory, eventually


async def test_create_labels_the_sandbox_and_refuses_a_second_one(env: Env) -> None:
    sid = await env.session()
    box = env.manager.sandbox_id(sid)
    store_id = env.store.store_id()
    spec = SPEC.model_copy(update={"labels": {"belayer.store": store_id, "belayer.session": sid}})
    assert env.events() == [
        (
            "sandbox_created",
            {
                "sandbox_id": box, "image": SPEC.image, "network": "none", "address": None,
                "spec": spec.model_dump(mode="json"), "harness_inside": False, "recovery": "replay",
            },
        ),
    ]  # fmt: skip
    with pytest.raises(SandboxExists):
        await env.manager.create(sid, SPEC)
    with pytest.raises(SandboxArgumentError, match="recovery must be"):
        await env.manager.create("s2", SPEC, recovery="sometimes")
    state = env.manager.describe(sid)
    assert (state["status"], state["recovery"], state["checkpoints"], state["gateway_url"]) == (
        "running", "replay", [], None,
    )  # fmt: skip


async def test_an_unknown_image_is_named(make_env: EnvFactory) -> None:
    env = await make_env(FakeSandboxBackend(images={"belayer-sandbox-busybox"}))
    with pytest.raises(ImageNotFound, match="No such image: other; build it with"):
        await env.session(spec=SandboxSpec(image="other"))
    assert not env.manager.has_sandbox("s1")


async def test_the_gateway_network_gives_each_sandbox_its_own_session(env: Env) -> None:
    spec = SandboxSpec(image="img", network="gateway", env={"OPENAI_API_KEY": "mine"})
    with pytest.raises(SandboxError, match="needs the gateway's sandbox listener"):
        await env.session(spec=spec)
    env.manager.gateway_url = "http://10.99.0.1:9000"
    sid = await env.session("s2", spec=spec)

    url = "http://10.99.0.1:9000/s/s2"
    assert (
        await env.manager.exec(sid, 'echo "$OPENAI_BASE_URL $OPENAI_API_KEY"')
    ).stdout == f"{url}/v1 mine\n"
    [(_, created)] = env.events(sid)
    assert created["address"] == "10.99.0.2"
    assert await env.manager.owner_of("10.99.0.2") == sid
    assert await env.manager.owner_of("10.99.0.3") is None
    assert env.manager.describe(sid)["gateway_url"] == url


async def test_destroy_removes_the_sandbox_and_its_checkpoints(env: Env) -> None:
    sid = await env.session()
    box = env.manager.sandbox_id(sid)
    await env.manager.checkpoint(sid)
    await env.manager.destroy(sid)

    assert (env.backend.sandboxes, env.backend.checkpoint_ids, env.manager.has_sandbox(sid)) == (
        [],
        [],
        False,
    )
    assert env.events()[-1] == ("sandbox_destroyed", {"sandbox_id": box})
    with pytest.raises(NoSandbox, match="POST /api/sessions/s1/sandbox"):
        await env.manager.exec(sid, "true")


async def test_settled_waits_for_a_restore_in_progress(env: Env) -> None:
    sid = await env.session(recovery="truncate")
    await env.manager.checkpoint(sid)
    release = threading.Event()
    env.backend.inject(Fault("restore", "block", release=release))
    restore = asyncio.create_task(env.manager.restore(sid))
    await eventually(lambda: env.backend.ops("restore") != [])
    settled = asyncio.create_task(env.manager.settled(sid))
    await asyncio.sleep(0.05)
    assert not settled.done()

    release.set()
    info = await restore
    await asyncio.wait_for(settled, 30)  # ends with the restore (a hang fails; 30: a loaded machine)
    assert env.manager.sandbox_id(sid) == info.sandbox_id
    await asyncio.wait_for(env.manager.settled(sid), 30)  # nothing in progress: returns, not waits


async def test_a_restored_sandbox_is_known_by_its_new_address_before_its_first_call_is_judged(
    env: Env,
) -> None:
    """A restored process calls the gateway at once, before the restore has looked its address up:
    the listener's lookup waits for the restore instead of refusing it (a 403 the agent cannot
    recover from)."""
    env.manager.gateway_url = "http://10.99.0.1:9000"
    spec = SandboxSpec(image="img", network="gateway")
    sid = await env.session(spec=spec, recovery="truncate")
    await env.manager.checkpoint(sid)
    release = threading.Event()
    env.backend.inject(Fault("restore", "block", release=release))
    restore = asyncio.create_task(env.manager.restore(sid))
    await eventually(lambda: env.backend.ops("restore") != [])
    lookup = asyncio.create_task(env.manager.owner_of("10.99.0.3"))  # the restored sandbox's address
    await asyncio.sleep(0.05)
    assert not lookup.done()

    release.set()
    await restore
    assert await asyncio.wait_for(lookup, 30) == sid  # answered once the restore is done (30: as above)
    assert await env.manager.owner_of("10.99.0.2") is None  # the dead sandbox's address, at once


async def test_an_address_is_forgotten_before_its_container_is_removed(env: Env) -> None:
    """Docker may give a removed container's address to the next one at once: a request from it, asked
    about while the container is being removed (by a restore, then by the session's end), never maps to
    the session that had it."""
    env.manager.gateway_url = "http://10.99.0.1:9000"
    sid = await env.session(spec=SandboxSpec(image="img", network="gateway"), recovery="truncate")
    await env.manager.checkpoint(sid)
    loop = asyncio.get_running_loop()
    destroy, asked = env.backend.destroy, []

    def destroying(sandbox_id: str) -> None:  # runs in the manager's pool, while the loop waits for it
        address = env.backend.network.address(sandbox_id)
        assert address is not None
        asked.append((address, asyncio.run_coroutine_threadsafe(env.manager.owner_of(address), loop)))
        destroy(sandbox_id)

    env.backend.destroy = destroying  # type: ignore[method-assign]
    await env.manager.restore(sid)
    await env.manager.destroy(sid)
    answers = [(address, await asyncio.wait_for(asyncio.wrap_future(f), 5)) for address, f in asked]
    assert answers == [("10.99.0.2", None), ("10.99.0.3", None)]


async def test_a_new_sandbox_takes_its_address_from_a_stopped_ones_session(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container that stopped frees its address before the watcher notices; Docker gives it to the
    next container, and the listener maps it to that one's session, not the stopped one's."""
    env.manager.gateway_url = "http://10.99.0.1:9000"
    spec = SandboxSpec(image="img", network="gateway")
    first = await env.session("s1", spec=spec)
    env.backend.kill(env.manager.sandbox_id(first))
    monkeypatch.setattr(env.backend.network, "address", lambda sandbox_id: "10.99.0.2")  # reused
    second = await env.session("s2", spec=spec)
    assert await env.manager.owner_of("10.99.0.2") == second
