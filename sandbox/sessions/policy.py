"""When to checkpoint a sandbox: inside an inference bubble, if the bubble is predicted to outlast it.

While a session's LLM call runs, its harness waits and its sandbox is idle, so a checkpoint taken then
costs the episode nothing, as long as it ends before the reply does. `AdaptivePolicy` predicts both:

- the bubble: prefill of the prompt plus decode of the expected reply, at the speeds recently
  observed, stretched by the engine's load (requests already in flight share it);
- the checkpoint: a fixed part plus the bytes to dump (the last dump's size plus what was written since)
  at the recently observed dump throughput.

It checkpoints when `bubble >= margin * cost`, and defers otherwise. A standby sandbox (`standby`) is
made in what is left of a bubble on the same terms, its cost predicted from the standbys made before and
the bubble taken as the shorter of the predicted one and the recent bubbles' mean. A sandbox is never left more than
`max_deferred_turns` turns behind: then it checkpoints anyway (`forced`). Every input is an exponential
moving average, so a policy adapts to the machine and the engine it runs on.

Example::

    policy = AdaptivePolicy(PolicySettings())
    d = policy.decide(prompt_tokens=900, engine_load=1.0, turns_since_checkpoint=1,
                      last_dump_bytes=40e6, bytes_written_since=0, session_cost_s=None)
    if d.checkpoint: ...
    policy.observe_turn(prompt_tokens=900, output_tokens=120, seconds=1.9, engine_load=1.0)
    policy.observe_checkpoint(seconds=0.6, dump_bytes=41e6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sandbox.config import PolicySettings


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy decided for one bubble, and why (recorded as a trajectory event)."""

    action: Literal["checkpoint", "forced", "defer", "off"]
    predicted_bubble_s: float
    predicted_cost_s: float
    reason: str

    @property
    def checkpoint(self) -> bool:
        return self.action in ("checkpoint", "forced")


class _Ema:
    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float, prior: float) -> None:
        self.alpha = alpha
        self.value = prior

    def add(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


def _observed(ema: _Ema | None, alpha: float, x: float) -> _Ema:
    """`ema` with `x` added; without a prior, the first observation starts it."""
    if ema is None:
        return _Ema(alpha, x)
    ema.add(x)
    return ema


class AdaptivePolicy:
    """Predicts bubble length and checkpoint cost from moving averages; see the module docstring."""

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        a = settings.alpha
        self._prefill_tps = _Ema(a, settings.prior_prefill_tps)
        self._decode_tps = _Ema(a, settings.prior_decode_tps)
        self._output_tokens = _Ema(a, settings.prior_output_tokens)
        self._fixed_cost = _Ema(a, settings.prior_fixed_cost_s)
        self._dump_bps = _Ema(a, settings.prior_dump_bps)
        self._standby_cost: _Ema | None = None
        self._bubble: _Ema | None = None

    # ------------------------------------------------------------------ predictions
    def predict_bubble(self, prompt_tokens: int, engine_load: float) -> float:
        """Seconds until the reply: prefill + expected decode, shared with `engine_load` other requests."""
        alone = prompt_tokens / self._prefill_tps.value + self._output_tokens.value / self._decode_tps.value
        return alone * max(1.0, engine_load)

    def predict_cost(self, dump_bytes: float, session_cost_s: float | None = None) -> float:
        """Seconds a checkpoint of `dump_bytes` takes; a session's own recent cost weighs in when known."""
        modelled = self._fixed_cost.value + dump_bytes / self._dump_bps.value
        return modelled if session_cost_s is None else max(modelled, session_cost_s)

    def predict_standby(self, dump_bytes: float) -> float:
        """Seconds a standby of a `dump_bytes` checkpoint takes to make (a restore, then a freeze): what
        the recent ones took, or, before any, what the checkpoint itself is predicted to cost."""
        return self._standby_cost.value if self._standby_cost is not None else self.predict_cost(dump_bytes)

    def standby_bubble(self, predicted_s: float) -> float:
        """The bubble a standby may count on: the shorter of the predicted one and what the recent ones
        lasted (a standby is optional work, and one that overruns its bubble slows the next tool call)."""
        return predicted_s if self._bubble is None else min(predicted_s, self._bubble.value)

    def standby_fits(self, bubble_left_s: float, dump_bytes: float) -> bool:
        """Whether a standby is predicted to be made within what is left of the bubble (by `margin`)."""
        return bubble_left_s >= self.settings.margin * self.predict_standby(dump_bytes)

    def decide(
        self,
        *,
        prompt_tokens: int,
        engine_load: float,
        turns_since_checkpoint: int,
        last_dump_bytes: float,
        bytes_written_since: float,
        session_cost_s: float | None,
    ) -> Decision:
        bubble = self.predict_bubble(prompt_tokens, engine_load)
        cost = self.predict_cost(last_dump_bytes + bytes_written_since, session_cost_s)
        s = self.settings
        if s.mode == "never":
            return Decision("off", bubble, cost, "automatic checkpoints are off")
        if s.mode == "always":
            return Decision("checkpoint", bubble, cost, "mode always")
        if bubble >= s.margin * cost:
            return Decision(
                "checkpoint", bubble, cost, f"bubble {bubble:.2f}s >= {s.margin:g} x cost {cost:.2f}s"
            )
        if turns_since_checkpoint >= s.max_deferred_turns:
            return Decision("forced", bubble, cost, f"{turns_since_checkpoint} turns without a checkpoint")
        return Decision("defer", bubble, cost, f"bubble {bubble:.2f}s < {s.margin:g} x cost {cost:.2f}s")

    # ------------------------------------------------------------------ observations
    def observe_turn(
        self, *, prompt_tokens: int, output_tokens: int, seconds: float, ttft_s: float | None
    ) -> None:
        """A finished LLM call: its prefill and decode speeds, and how long its reply was."""
        if output_tokens <= 0 or seconds <= 0:
            return
        self._bubble = _observed(self._bubble, self.settings.alpha, seconds)
        self._output_tokens.add(output_tokens)
        if ttft_s is not None and 0 < ttft_s < seconds:
            self._prefill_tps.add(max(prompt_tokens, 1) / ttft_s)
            self._decode_tps.add(output_tokens / (seconds - ttft_s))
        else:
            self._decode_tps.add(output_tokens / seconds)

    def observe_standby(self, seconds: float) -> None:
        """A standby made (`sandbox.sessions.standby`): how long it took."""
        self._standby_cost = _observed(self._standby_cost, self.settings.alpha, seconds)

    def observe_checkpoint(self, *, seconds: float, dump_bytes: float) -> None:
        """A finished checkpoint: split its time into the fixed part and the per-byte part."""
        per_byte = max(seconds - self._fixed_cost.value, 1e-3)
        if dump_bytes > 0:
            self._dump_bps.add(dump_bytes / per_byte)
        self._fixed_cost.add(max(seconds - dump_bytes / self._dump_bps.value, 0.0))
