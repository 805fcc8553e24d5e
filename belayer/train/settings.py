"""The RL demo's settings (`belayer.train.loop`), apart so that the CLI reads them without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Settings:  # no slots: the CLI reads the defaults off the class
    model_dir: str
    """The base model (the tiny one); the run warms it up first."""
    workdir: Path
    steps: int = 6
    group_size: int = 8
    groups_per_step: int = 4
    concurrency: int = 8
    """Episodes in flight at once."""
    max_tokens: int = 40
    lr: float = 2e-3
    """The first step's learning rate; it decays linearly over the run, to ``lr / steps`` at the last
    step. At a constant 2e-3 the tiny policy overshot: two of three runs peaked (0.78-0.83) and then
    collapsed (0.28, 0.0) by the sixth step."""
    clip: float = 0.2
    max_staleness: int = 1
    """Versions a token may lag the trainer's and still count (through its importance ratio)."""
    drain_s: float = 0.0
    """How long an update lets running turns finish before it cuts them (0: cut them at once, at a token
    boundary; the gateway resumes them on the new weights)."""
    kill_after_step: int | None = 1
    """After this step's update, ``kill -9`` a worker while it serves (None: no kill)."""
    sandboxes: bool = False
    """Each episode's tool runs in its own Docker sandbox (the gateway's ``--sandboxes``): its first
    command writes the table there, and the sandbox is checkpointed in the inference bubbles."""
    sandbox_kills: int = 2
    """With sandboxes: after `kill_after_step`'s update, ``kill -9`` this many running episodes'
    containers, one at a time at random moments (0: none)."""
    workers: int = 2
    shadows: int = 1
    warm_up_steps: int = 200
    warm_up_correct: float = 0.2
    seed: int = 0
    start_timeout: float = 900.0
    deterministic: bool = False
    """The deterministic mode (`belayer.train.deterministic`): a synchronous schedule, seeded episodes with
    keyed sampling, the trainer's own logprobs in the ratio; run twice, undisturbed and with the faults,
    and compared."""
