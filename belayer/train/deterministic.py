"""``belayer demo rl --deterministic``: the RL demo on a synchronous, seeded schedule, run twice against
one gateway (undisturbed, then with the faults) and compared token for token, reward for reward, loss
for loss and weight for weight.

The schedule. Step k trains on a fixed set of episodes: `Settings.groups_per_step` prompts drawn from
``random.Random(seed)``, `Settings.group_size` members each. Each episode's session carries the seed
`episode_seed` ``(seed, k, group, member)`` and its turns ask for keyed sampling (``"sampling":
"keyed"``, temperature 1: ``core.keyed``), so every sampled token is a function of the policy's
distribution, the session's seed, the turn and the position, never of the worker, the batch or a
crash. All of a step's episodes run on the current weights; the finished ones are sorted by (group,
member), never by arrival; the trainer steps (its own logprobs in the ratio: `trainer.Trainer`); the
weights are pushed (``POST /api/weights``); then the next step's episodes start.

The faults of the second run (none with ``kill_after_step=None``):

- during step `Settings.kill_after_step`'s rollouts, the weights that step runs on are pushed again under
  an alias (``<version>.recut``, drain 0) while a turn streams: the update cuts the running turns and
  they resume on the "new" weights, which are the same; the trainer takes the alias for the version it
  names (the same index for staleness and importance weights);
- after that step's update, during the next step's rollouts, a worker with a turn mid-stream is killed
  (``kill -9``: the turn fails over) and, with sandboxes, `Settings.sandbox_kills` running episodes'
  containers (restored, their commands replayed).

Between the runs the gateway goes back to the warmed-up weights (pushed under a new name), so both runs
start from the same weights with the same seeds. `Comparison.lines` are the figures; `Comparison.problems`
what differed (the command's exit status).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from belayer.client import AsyncBelayer, Finished
from belayer.testing.services import progress
from belayer.train import policy, task
from belayer.train.faults import kill_sandboxes, kill_serving_worker, streaming
from belayer.train.report import Report, StepRecord
from belayer.train.rollout import EpisodeResult, run_episode
from belayer.train.serving import Tokens, counter, served
from belayer.train.settings import Settings
from belayer.train.trainer import Trainer
from core.keyed import KEY_BITS

Json = dict[str, Any]
Place = tuple[int, int, int]
"""An episode's place in the schedule: (step, group, member)."""

RECUTS = 3
"""Alias pushes a step may make until one cuts a turn (a turn may end between the look and the cut)."""


def episode_seed(run_seed: int, step: int, group: int, member: int) -> int:
    """The session seed of the episode at (`step`, `group`, `member`) of the run seeded `run_seed`: 63
    bits, as ``POST /api/sessions`` takes them, and different for every place.

    >>> episode_seed(0, 1, 0, 0) == episode_seed(0, 1, 0, 0) != episode_seed(0, 1, 0, 1)
    True
    >>> 0 <= episode_seed(5, 2, 3, 1) < 2**63
    True
    """
    digest = hashlib.blake2b(repr(("belayer-rl", run_seed, step, group, member)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> (64 - KEY_BITS)


@dataclass(slots=True)
class Run:
    """One run of the schedule."""

    name: str
    report: Report = field(default_factory=Report)
    episodes: dict[Place, Finished] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    """The trainer's weights at the end."""
    recuts: list[str] = field(default_factory=list)
    """The alias versions pushed mid-step."""
    preempted: int = 0
    """Requests the alias pushes cut."""
    broken: str | None = None
    """Why the run stopped before its last step (an episode the client lost); None: it ran them all."""
    live: set[str] = field(default_factory=set)
    """The sessions of episodes set up and running (with sandboxes: those whose containers may be killed)."""


@dataclass(slots=True)
class Comparison:
    undisturbed: Run
    disturbed: Run
    settings: Settings
    tokens_compared: int = 0
    """Generated tokens compared (every id of every row is compared; these are the sampled ones)."""
    differences: list[str] = field(default_factory=list)
    """The first few places whose token ids differ."""
    rewards_identical: bool = True
    loss_max_abs_diff: float = 0.0
    weights_identical: bool = True
    recorded_logprob_max_abs_diff: float = 0.0
    near_ties: int = 0
    """Near ties the workers' keyed samplers reported over both runs (``belayer_vllm.keyed``): the only
    draws that may differ between runs (``core.keyed.NEAR_TIE``)."""
    seconds: float = 0.0

    @property
    def trajectories_identical(self) -> bool:
        same_places = self.undisturbed.episodes.keys() == self.disturbed.episodes.keys()
        return same_places and not self.differences and bool(self.undisturbed.episodes)

    def lines(self) -> list[tuple[str, object]]:
        a, b = self.undisturbed.report, self.disturbed.report
        return [
            ("trajectories_identical", str(self.trajectories_identical).lower()),
            ("tokens_compared", self.tokens_compared),
            ("rewards_identical", str(self.rewards_identical).lower()),
            ("loss_max_abs_diff", self.loss_max_abs_diff),
            ("weights_identical", str(self.weights_identical).lower()),
            ("failovers_in_disturbed_run", b.failovers),
            ("turns_cut_in_disturbed_run", b.turns_cut),
            ("requests_cut_by_recut_updates", self.disturbed.preempted),
            ("recut_versions", ",".join(self.disturbed.recuts) or "none"),
            ("workers_killed_in_disturbed_run", len(b.kills)),
            ("sandboxes_killed_in_disturbed_run", len(b.sandbox_kills)),
            ("sandbox_restores_in_disturbed_run", b.sandbox_restores),
            ("recorded_logprob_max_abs_diff", f"{self.recorded_logprob_max_abs_diff:.3e}"),
            ("near_ties", self.near_ties),
            ("steps", f"{len(a.steps)},{len(b.steps)}"),
            ("episodes", f"{len(self.undisturbed.episodes)},{len(self.disturbed.episodes)}"),
            ("client_errors", len(a.client_errors) + len(b.client_errors)),
            ("rewards_by_step", ",".join(f"{s.reward:.3f}" for s in a.steps)),
            ("losses_by_step", ",".join(f"{x:.6f}" for x in self.undisturbed.losses)),
            ("run_s", round(self.seconds, 1)),
        ]

    def problems(self) -> list[str]:
        """What differed between the runs, and faults asked for that did not happen ([]: none)."""
        out = [
            f"the {r.name} run stopped early: {r.broken}"
            for r in (self.undisturbed, self.disturbed)
            if r.broken
        ]
        errors = self.undisturbed.report.client_errors + self.disturbed.report.client_errors
        if errors:
            out.append(f"{len(errors)} errors (episodes the client lost, faults that failed): {errors[:3]}")
        if not self.trajectories_identical:
            out.append(f"the trajectories differ: {self.differences[:3] or 'not the same episodes'}")
        if not self.rewards_identical:
            out.append("the rewards differ")
        if self.loss_max_abs_diff != 0.0:  # nan too
            out.append(f"the losses differ by up to {self.loss_max_abs_diff}")
        if not self.weights_identical:
            out.append("the final weights differ")
        b, s = self.disturbed.report, self.settings
        if s.kill_after_step is not None and s.kill_after_step < s.steps:
            if not b.kills or not b.failovers:
                out.append("the disturbed run had no worker killed mid-stream (no failover)")
            if s.sandboxes and len(b.sandbox_kills) < s.sandbox_kills:
                out.append(f"the disturbed run killed {len(b.sandbox_kills)} of {s.sandbox_kills} sandboxes")
        if s.kill_after_step is not None and s.kill_after_step <= s.steps and not b.turns_cut:
            out.append("the disturbed run's alias update cut no turn")
        return out


def compare(a: Run, b: Run, settings: Settings) -> Comparison:
    """Place by place: every row's ids and mask, the rewards, the recorded logprobs; the losses and the
    final weights."""
    c = Comparison(a, b, settings)
    for place in sorted(a.episodes.keys() & b.episodes.keys()):
        x, y = a.episodes[place], b.episodes[place]
        c.rewards_identical &= x.session["reward"] == y.session["reward"]
        rows_x, rows_y = x.rows or [], y.rows or []
        if len(rows_x) != len(rows_y):
            c.differences.append(f"{place}: {len(rows_x)} rows against {len(rows_y)}")
            continue
        for rx, ry in zip(rows_x, rows_y, strict=True):
            if any(rx[k] != ry[k] for k in ("prompt_ids", "response_ids", "response_mask")):
                c.differences.append(f"{place}: branch {rx['branch']}'s token ids differ")
                continue
            generated = [j for j, m in enumerate(rx["response_mask"]) if m]
            c.tokens_compared += len(generated)
            diffs = [abs(rx["response_logprobs"][j] - ry["response_logprobs"][j]) for j in generated]
            c.recorded_logprob_max_abs_diff = max([c.recorded_logprob_max_abs_diff, *diffs])
    if a.episodes.keys() != b.episodes.keys():
        c.rewards_identical = False
    if len(a.losses) == len(b.losses) and a.losses:
        c.loss_max_abs_diff = max(abs(p - q) for p, q in zip(a.losses, b.losses, strict=True))
    else:
        c.loss_max_abs_diff = math.nan
    c.weights_identical = a.state.keys() == b.state.keys() and all(
        torch.equal(a.state[k], b.state[k]) for k in a.state
    )
    return c


class Schedule:
    """The runs against one gateway: its clients, the weights' directories, the finished feed's cursor."""

    def __init__(
        self,
        settings: Settings,
        clients: tuple[AsyncBelayer, AsyncBelayer, httpx.AsyncClient],
        start_dir: Path,
        weights_root: Path,
        sandbox: dict[str, Any] | None,
    ) -> None:
        self.settings, self.sandbox = settings, sandbox
        self.start_dir, self.weights_root = start_dir, weights_root
        self.gw, self.admin, self.http = clients
        self.cursor: str | None = None

    async def run(self, name: str, prefix: str, disturbed: bool) -> Run:
        """One run: from the warmed-up weights (pushed as ``<prefix>step-0`` unless served already),
        `Settings.steps` steps; with `disturbed`, the faults (module docstring)."""
        settings, run = self.settings, Run(name)
        base = (await self.gw.weights())["version"]
        path = self.start_dir
        if prefix:
            base = f"{prefix}step-0"
            await self.admin.update_weights(base, str(path.resolve()), 0.0)
        trainer = Trainer(settings, self.start_dir, base)
        failovers = await counter(self.http, "belayer_failovers_total")
        restores = await counter(self.http, "belayer_restores_total")
        rng = random.Random(settings.seed)
        started = time.monotonic()
        for step in range(1, settings.steps + 1):
            prompts = [task.Prompt(rng.choice(task.KEYS)) for _ in range(settings.groups_per_step)]
            faults = self.faults(step, trainer, path, run) if disturbed else []
            places = await self.rollouts(step, prompts, run, faults)
            if run.broken:
                break
            groups = await self.finished(places, run)
            mean = await asyncio.to_thread(trainer.step, groups, run.report)
            version = f"{prefix}step-{step}"
            path = await asyncio.to_thread(
                policy.save, trainer.model, self.weights_root / version, self.start_dir
            )
            trainer.new_version(version)
            t0 = time.monotonic()
            update = await self.admin.update_weights(version, str(path.resolve()), settings.drain_s)
            run.report.weight_updates += 1
            rewards = {version: [float(g.session["reward"]) for group in groups for g in group]}
            run.report.steps.append(StepRecord(step, version, mean, rewards, time.monotonic() - t0,
                                               int(update["preempted"])))  # fmt: skip
            progress(f"{name} run, step {step}/{settings.steps}: mean reward {mean:.3f}, loss "
                     f"{trainer.losses[-1]:.6f}, now serving {version}")  # fmt: skip
        run.report.failovers = await counter(self.http, "belayer_failovers_total") - failovers
        run.report.sandbox_restores = await counter(self.http, "belayer_restores_total") - restores
        run.report.seconds = time.monotonic() - started
        run.losses = list(trainer.losses)
        run.state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return run

    def faults(self, step: int, trainer: Trainer, path: Path, run: Run) -> list[Coroutine[Any, Any, None]]:
        """The disturbed run's faults during `step`'s rollouts (module docstring)."""
        s = self.settings
        if s.kill_after_step is None:
            return []
        if step == s.kill_after_step:
            return [self.recut(trainer, path, run)]
        if step != s.kill_after_step + 1:
            return []
        out = [kill_serving_worker(self.http, run.report, mid_stream=True)]
        if self.sandbox is not None and s.sandbox_kills:
            out.append(kill_sandboxes(run.live, s.sandbox_kills, run.report, random.Random(s.seed + step)))
        return out

    async def recut(self, trainer: Trainer, path: Path, run: Run) -> None:
        """Push the current weights again under an alias, drain 0, while a turn streams; again (up to
        `RECUTS` times) while no request was cut."""
        for attempt in range(1, RECUTS + 1):
            while not any(streaming(e) for e in (await self.http.get("/api/engines")).json()["data"]):
                await asyncio.sleep(0.01)
            alias = f"{trainer.current}.recut" + (f"{attempt}" if attempt > 1 else "")
            trainer.alias(alias)  # before the push: the turns it cuts name it
            update = await self.admin.update_weights(alias, str(path.resolve()), 0.0)
            run.recuts.append(alias)
            run.preempted += int(update["preempted"])
            progress(
                f"pushed the served weights again as {alias}: {update['preempted']} turns cut and resumed"
            )
            if update["preempted"]:
                return

    async def rollouts(
        self, step: int, prompts: Sequence[task.Prompt], run: Run, faults: Sequence[Coroutine[Any, Any, None]]
    ) -> dict[str, Place]:
        """Every episode of `step` on the current weights, `Settings.concurrency` at a time, with the
        `faults` running alongside (stopped when the episodes are done); their sessions' places."""
        s, room = self.settings, asyncio.Semaphore(self.settings.concurrency)
        places: dict[str, Place] = {}

        async def episode(g: int, m: int) -> None:
            async with room:
                result: EpisodeResult = await run_episode(
                    self.gw, prompts[g], group=f"g{(step - 1) * s.groups_per_step + g}", step=step - 1,
                    max_tokens=s.max_tokens, sandbox=self.sandbox, live=run.live, sampling="keyed",
                    session_seed=episode_seed(s.seed, step, g, m), metadata={"member": m, "run": run.name},
                )  # fmt: skip
            places[result.session] = (step, g, m)
            run.report.episodes.append(result)

        jobs = [episode(g, m) for g in range(s.groups_per_step) for m in range(s.group_size)]
        run.report.episodes_started += len(jobs)
        side = [asyncio.ensure_future(f) for f in faults]
        try:
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            for t in side:
                t.cancel()
            failed = await asyncio.gather(*side, return_exceptions=True)
        errors = [f"{type(e).__name__}: {e}" for e in outcomes if isinstance(e, BaseException)]
        run.report.client_errors += errors
        run.report.client_errors += [f"a fault failed: {e!r}" for e in failed
                                     if isinstance(e, Exception)]  # fmt: skip
        if errors:
            run.broken = f"step {step}: {len(errors)} episodes lost ({errors[0]})"
        return places

    async def finished(self, places: dict[str, Place], run: Run) -> list[list[Finished]]:
        """The finished feed's items of the sessions in `places` (all closed already), as the trainer's
        groups: sorted by (group, member)."""
        found: dict[str, Finished] = {}
        async for item in self.gw.finished(self.cursor, follow=False, rows=True):
            self.cursor = item.cursor
            if item.session["id"] in places:
                found[item.session["id"]] = item
        missing = places.keys() - found.keys()
        if missing:
            raise RuntimeError(f"closed sessions missing from the finished feed: {sorted(missing)[:3]}")
        groups: dict[int, list[Finished]] = {}
        for sid in sorted(found, key=lambda i: places[i]):
            run.episodes[places[sid]] = found[sid]
            groups.setdefault(places[sid][1], []).append(found[sid])
        return [groups[g] for g in sorted(groups)]


async def both_runs(
    settings: Settings,
    url: str,
    start_dir: Path,
    weights_root: Path,
    tokens: Tokens,
    sandbox: dict[str, Any] | None,
) -> Comparison:
    """The undisturbed run, then the disturbed one, against the gateway at `url`; compared."""
    started = time.monotonic()
    async with tokens.clients(url) as (gw, admin, http):
        schedule = Schedule(settings, (gw, admin, http), start_dir, weights_root, sandbox)
        progress("the undisturbed run")
        a = await schedule.run("undisturbed", "", disturbed=False)
        progress("the disturbed run: the same schedule and seeds, with the faults")
        b = await schedule.run("disturbed", "disturbed.", disturbed=True)
    c = compare(a, b, settings)
    c.near_ties = sum(len(f.read_text().splitlines()) for f in settings.workdir.glob("near-ties-*.jsonl"))
    c.seconds = time.monotonic() - started
    return c


def run(settings: Settings) -> Comparison:
    """Warm up, serve, run the schedule twice and compare; the gateway and its workers are stopped on
    the way out."""
    return served(settings, both_runs)
