"""What an RL run shows (`Report`): per step, the reward and the weight update (`StepRecord`); over the
run, what the trained rows show of versions and cut turns (`account`), the trainer's recompute against the
recorded logprobs, the faults and the gateway's counters. `Report.lines` are the run's ``name: value``
lines, `Report.problems` the demo's promises it broke, and `plot` its PNG of the mean reward per step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from belayer.client import Finished
from belayer.train import grpo
from belayer.train.rollout import EpisodeResult

Json = dict[str, Any]


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


def rewards_by_version(batch: Sequence[Sequence[Finished]]) -> dict[str, list[float]]:
    """The rewards of `batch`'s episodes by the version that generated each one's last tokens."""
    by_version: dict[str, list[float]] = defaultdict(list)
    for item in (i for g in batch for i in g):
        segs = [s for r in item.rows or [] for s in r["weight_segments"]]
        by_version[segs[-1]["version"] if segs else "none"].append(float(item.session["reward"]))
    return dict(by_version)


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
