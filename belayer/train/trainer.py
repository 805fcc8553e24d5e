"""The policy being trained (`Trainer`): GRPO in plain PyTorch on the exported rows, one step per batch of
groups, with every version's weights kept to recompute the logprobs of the tokens it generated."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from belayer.client import Finished
from belayer.train import grpo, policy
from belayer.train.report import Report, account, cut_spans
from belayer.train.settings import Settings

Json = dict[str, Any]


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
