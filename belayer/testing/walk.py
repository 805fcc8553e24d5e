"""How often a chat turn's walk through the code returns to a room it already left (issue 35).

A *room* is one source file of this repository's packages (``gateway/``, ``engine_pool/``, ``store/``,
``core/``, ``sandbox/``, ``belayer/``), named by its path. The fake engine (``engine_pool/fake/``: it
stands in for vLLM, which runs in another process) and this rig (``belayer/testing/``) are not rooms.

The walk of one turn: one real chat completion goes through the real Starlette app in process (an
``httpx.ASGITransport`` client, over fake engines behind a `FaultInjector`, with the SQLite store),
and the *first call* of each function in a room is recorded, from the route handler
(``gateway.api.openai.routes.chat_completions``) until the store's ``finish_turn`` returns (the turn's end
is written). The hook is ``sys.setprofile`` on the event loop's thread (SQLite writes run inline, so
nothing of the turn runs in another thread); a context variable set when the route handler is entered
keeps it to the request's own task and the tasks it starts (the engine's pump, the streaming response),
leaving out the pool's probes and every other background task. The walk is the sequence of the rooms of
those first calls, consecutive repeats collapsed; a *re-entry* is a step into a room that appeared earlier
in it.

Which calls count is a choice, so three readings are reported, each from the route and from the turn's
own start (`TURN`, the runner: prompt ids to trajectory):

- *every room*: every first call, the literal count;
- *without* ``core/``: ``core/`` is the leaf of the import graph (errors, events, telemetry, keyed
  sampling, JSON): a step into it returns to its caller, so it is vocabulary more than a room;
- *without* ``core/`` *and look-ups*: a visit to a room that calls into no other room before it returns
  (a property, a row decoder, a parser's feed, ``Quarantine.admit``) is a glance into it, not a step of
  the walk: what a reader follows is the calls that lead on. On the code before issue 35's changes it
  gave 22 for a streamed turn from the route, the count the issue quoted, so it is the reading its goal
  (at most 10) is read on. ``tests/belayer/test_walk.py`` holds it from the route to at most 10 (7
  plain, 10 streamed, from 15 and 18: the session read once, with the turn the request extends, where
  the prompt is planned; each store part with its own statements; the prompt bounded by the tokenizer),
  and the turn's own part (from the runner) to at most 7.

Dataclass ``__init__`` methods are generated code (no room), and comprehensions are parts of the
function they are written in (`EXPRESSIONS`). A warm-up turn runs first, untraced, so that
the walk is a steady turn's, not the process's first (lazy imports, caches).

Variants: ``plain`` (a non-streamed turn), ``stream`` (a streamed one), ``failover`` (a streamed turn
whose worker's connection drops after 5 tokens: it resumes on another).

Example::

    python -m belayer.testing.walk                 # all three variants
    python -m belayer.testing.walk plain --quiet   # the counts only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dis
import os
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import httpx

from engine_pool.fake import FakeEngine, Fault, FaultInjector
from engine_pool.pool import EnginePool, PoolSettings
from gateway.api.openai.routes import chat_completions
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway/", "engine_pool/", "store/", "core/", "sandbox/", "belayer/")
NOT_ROOMS = ("engine_pool/fake/", "belayer/testing/")
LEAF = "core/"
VARIANTS = ("plain", "stream", "failover")
HOSTS = ("http://e0", "http://e1")
EXPRESSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
"""Comprehensions: parts of the function they are written in (Python 3.12 inlines most, PEP 709)."""
TURN = "TurnRunner.run"
"""Where the turn's own part starts (``gateway.turns.runner``): the second window reported."""


@dataclass(frozen=True, slots=True)
class Step:
    """A function's first call: its room, its name, and the step of the project function that called it
    (its index in the walk's steps; -1: none, as for a task's first coroutine)."""

    room: str
    function: str
    caller: int = -1


@dataclass(slots=True)
class Walk:
    """The first calls of one turn, in order (`steps`), and whether its end reached the store.

    Its path can be read three ways: every room (the default); without ``core/`` (``core=False``); and
    without look-ups as well (``lookups=False``): a call into a room that calls no function of any other
    room (``core/`` aside) before it returns, such as a property or a row decoder, is a glance into the
    room, not a step of the walk, and its room is left out of the path there."""

    steps: list[Step] = field(default_factory=list)
    stored: bool = False

    def path(self, core: bool = True, lookups: bool = True, start: str | None = None) -> list[Step]:
        """The walk from the first call of `start` (a qualified name; None: from the route), its rooms
        in order, consecutive repeats collapsed."""
        kept = [core or not step.room.startswith(LEAF) for step in self.steps]
        if not lookups:
            glances = self._lookups(kept)
            kept = [k and not g for k, g in zip(kept, glances, strict=True)]
        first = next(
            (i for i, step in enumerate(self.steps) if start in (None, step.function)), len(self.steps)
        )
        out: list[Step] = []
        for step, keep in zip(self.steps[first:], kept[first:], strict=True):
            if keep and (not out or out[-1].room != step.room):
                out.append(step)
        return out

    def _lookups(self, kept: list[bool]) -> list[bool]:
        """Which steps belong to a look-up: a visit to a room (entered from another) from which no
        kept step goes on into a third room."""
        n = len(self.steps)
        leaves = [True] * n  # no kept step below it in another room than its own
        for i in reversed(range(n)):  # callers come before their callees
            step, up = self.steps[i], self.steps[i].caller
            if up >= 0 and kept[i] and (step.room != self.steps[up].room or not leaves[i]):
                leaves[up] = False
        glance = [False] * n
        for i, step in enumerate(self.steps):
            up = step.caller
            entered = up < 0 or self.steps[up].room != step.room
            glance[i] = (entered and leaves[i]) or (not entered and up >= 0 and glance[up])
        return glance

    def reentries(self, core: bool = True, lookups: bool = True, start: str | None = None) -> int:
        """Steps into a room the walk had already left."""
        return len(reentered(self.path(core, lookups, start)))

    def rooms(self, core: bool = True, lookups: bool = True, start: str | None = None) -> int:
        return len({step.room for step in self.path(core, lookups, start)})


def reentered(path: list[Step]) -> list[Step]:
    """The steps of `path` into a room it had already left."""
    seen: set[str] = set()
    out = []
    for step in path:
        if step.room in seen:
            out.append(step)
        seen.add(step.room)
    return out


class Tracer:
    """A ``sys.setprofile`` hook that records `Walk` from `entry`'s first call, in its context only."""

    def __init__(self, entry: CodeType) -> None:
        self.entry = entry
        self.walk = Walk()
        self._inside = contextvars.ContextVar("walk_inside", default=False)
        self._steps: dict[CodeType, int] = {}
        self._visits: dict[FrameType, int] = {}
        """The step of the visit each frame of a room runs in (kept for the one turn traced)."""
        self._rooms: dict[str, str] = {}
        self._starts: dict[CodeType, int] = {}
        self._end: FrameType | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.walk.stored or event not in ("call", "return"):
            return
        code = frame.f_code
        if not self._inside.get():
            if event == "call" and code is self.entry:
                self._inside.set(True)  # the request's task, and the tasks it starts (they copy it)
                self._record(frame)
            return
        if event == "return":
            self.walk.stored = frame is self._end
            if self.walk.stored:
                self._visits.clear()
        elif self._fresh(frame):  # not a generator or coroutine resumed
            self._record(frame)
            if self._end is None and code.co_name == "finish_turn" and self._room(code).startswith("store/"):
                self._end = frame  # the outermost: its return is the turn's end written

    def _record(self, frame: FrameType) -> None:
        """A call in a room: a step if it is its function's first, and the visit its frame belongs to
        (the calls it makes are that visit's: a look-up is a visit that goes into no other room)."""
        code = frame.f_code
        room = self._room(code)
        if not room or code.co_name in EXPRESSIONS:
            return  # not a room, or not a function: its calls belong to the visit that called it
        caller, up = -1, frame.f_back
        while up is not None and caller < 0:
            caller = self._visits.get(up, -1)
            up = up.f_back
        if code not in self._steps:
            self._steps[code] = self._visits[frame] = len(self.walk.steps)
            self.walk.steps.append(Step(room, code.co_qualname, caller))
        elif caller >= 0 and self.walk.steps[caller].room == room:
            self._visits[frame] = caller  # a call within the visit
        else:
            self._visits[frame] = self._steps[code]  # a room entered again by a call made before

    def _fresh(self, frame: FrameType) -> bool:
        """The frame starts (a generator's or coroutine's resumption is a ``call`` event too)."""
        code = frame.f_code
        start = self._starts.get(code)
        if start is None:
            start = self._starts[code] = next(
                (i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0
            )
        return frame.f_lasti <= start

    def _room(self, code: CodeType) -> str:
        """The file's path in the repository when it is a room, else ''."""
        room = self._rooms.get(code.co_filename)
        if room is None:
            path = Path(code.co_filename)
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
            ok = rel.startswith(PACKAGES) and not rel.startswith(NOT_ROOMS)
            room = self._rooms[code.co_filename] = rel if ok else ""
        return room


class _FailNext(FaultInjector):
    """Drops the next generation request's stream after `after` events, whichever worker it went to."""

    def __init__(self, inner: httpx.AsyncBaseTransport, after: int) -> None:
        super().__init__(inner)
        self.armed, self.after = False, after

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.armed and request.url.path == "/v1/completions":
            self.armed = False
            self.faults[request.url.host] = [Fault("drop_after", self.after)]
        return await super().handle_async_request(request)


def _step(context: list[int]) -> int:
    """The fake engine's next token: a function of the context, so a resumed turn goes on exactly."""
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


@contextlib.asynccontextmanager
async def _gateway(model: str, store_dir: str, faults: _FailNext) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig(
        model=model,
        store_path=f"{store_dir}/walk.db",
        failover=FailoverConfig(stall_timeout=5.0, no_worker_wait=1.0, max_failovers=3),
        allowed_hosts=["gw"],
    )
    async with httpx.AsyncClient(transport=faults, timeout=10) as engine_http:
        pool = EnginePool(engine_http, PoolSettings())
        for host in HOSTS:
            pool.add_remote(host)
        app = build_app(config, pool=pool)
        transport = httpx.ASGITransport(app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=10) as client,
        ):
            yield client


async def _turn(client: httpx.AsyncClient, stream: bool) -> None:
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "temperature": 0,
            "max_tokens": 12, "stream": stream, "logprobs": True}  # fmt: skip
    r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
    if r.status_code != 200 or '"error"' in r.text:
        raise RuntimeError(f"the traced turn failed: {r.status_code} {r.text[:500]}")


async def measure(variant: str, model: str) -> Walk:
    """The walk of one turn of `variant` (one of `VARIANTS`), over the tiny model at `model`."""
    faults = _FailNext(httpx.ASGITransport(FakeEngine(step=_step, max_model_len=4096).app()), after=5)
    with tempfile.TemporaryDirectory(prefix="belayer-walk-") as tmp:
        async with _gateway(model, tmp, faults) as client:
            await _turn(client, stream=False)  # warm-up, untraced
            faults.armed = variant == "failover"
            tracer, before = Tracer(chat_completions.__code__), sys.getprofile()
            sys.setprofile(tracer)
            try:
                await _turn(client, stream=variant != "plain")
            finally:
                sys.setprofile(before)
    return tracer.walk


def report(variant: str, walk: Walk, quiet: bool = False, full: bool = False) -> str:
    """``walk_reentries: N`` (from the route, every room), the table of re-entries from the route and
    from the turn (`TURN`) under each reading (every room; without ``core/``; without look-ups as well),
    and unless `quiet` the path from the route without ``core/`` and look-ups (`full`: with both),
    ``<-`` marking a re-entry."""
    lines = [f"variant: {variant}", f"walk_reentries: {walk.reentries()}", f"reaches_store: {walk.stored}",
             "  re-entries (rooms)          from the route   from the turn"]  # fmt: skip
    for name, core, lookups in READINGS:
        cells = [
            f"{walk.reentries(core, lookups, at):>3} ({walk.rooms(core, lookups, at):>2})"
            for at in (None, TURN)
        ]
        lines.append(f"  {name:28} {cells[0]:>14}   {cells[1]:>13}")
    if not quiet:
        path = walk.path(full, full)
        again = {id(step) for step in reentered(path)}
        for step in path:
            lines.append(f"  {'<-' if id(step) in again else '  '} {step.room:40} {step.function}")
    return "\n".join(lines) + "\n"


READINGS = (
    ("every room", True, True),
    ("without core/", False, True),
    ("without core/ and look-ups", False, False),
)


def tiny_model() -> str:
    """The tiny model's directory (``BELAYER_TINY_MODEL``, else ``.cache/tiny-model``), built if absent."""
    path = Path(os.environ.get("BELAYER_TINY_MODEL", ROOT / ".cache" / "tiny-model")).resolve()
    if not (path / "model.safetensors").exists():
        from belayer.testing.tiny_model import build_tiny

        build_tiny(path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer.testing.walk", description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="*", metavar="VARIANT", help=f"of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--quiet", action="store_true", help="the counts only, not the path")
    p.add_argument("--full", action="store_true", help="the path through every room, look-ups included")
    args = p.parse_args(argv)
    if unknown := set(args.variants) - set(VARIANTS):
        p.error(f"unknown variant(s): {', '.join(sorted(unknown))}")
    model = tiny_model()
    for variant in args.variants or VARIANTS:
        walk = asyncio.run(measure(variant, model))
        sys.stdout.write(report(variant, walk, args.quiet, args.full) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
