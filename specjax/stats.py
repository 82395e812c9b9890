"""Acceptance statistics: the one definition of MAL, acceptance rate and per-position acceptance.

`specjax.generate`'s stats, `specjax bench` rows, the serving monitor and scheduler, batch jobs and
the load bench all sum their steps into an `AcceptanceStats` and read these figures from it, so
they agree on what each means and on what an empty one reports (MAL 1.0, rates None).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def zero_extend(x, w: int) -> np.ndarray:
    """x `[n]` zero-extended to `[w]` (w >= n); np.pad costs ~70 us a call, and the scheduler
    adds a few dozen of these per chunk."""
    x = np.asarray(x, np.int64)
    if len(x) == w:
        return x
    out = np.zeros(w, np.int64)
    out[: len(x)] = x
    return out


@dataclasses.dataclass
class AcceptanceStats:
    """Sums over some rows' draft/verify steps (plain steps included: they verify nothing)."""

    steps: int = 0  # steps, summed over rows
    tokens: int = 0  # tokens those steps emitted (a row's first token comes from the prefill: not counted)
    verified: int = 0  # steps whose drafts the target checked
    checked: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # [W] per draft position
    accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # [W]
    off_chain: int = 0  # tree steps whose accepted path left the drafter's top-1 chain

    @classmethod
    def from_counts(cls, steps: int, tokens: int, checked, accepted, off_chain: int = 0) -> "AcceptanceStats":
        """From step, token and per-position counts: every verify step checks draft 0, so
        `checked[0]` counts the steps that verified."""
        checked = np.asarray(checked, np.int64)
        return cls(
            int(steps),
            int(tokens),
            int(checked[0]) if len(checked) else 0,
            checked,
            np.asarray(accepted, np.int64),
            int(off_chain),
        )

    def add(self, o: "AcceptanceStats") -> None:
        self.steps += o.steps
        self.tokens += o.tokens
        self.verified += o.verified
        self.off_chain += o.off_chain
        w = max(len(self.checked), len(o.checked))
        self.checked = zero_extend(self.checked, w) + zero_extend(o.checked, w)
        self.accepted = zero_extend(self.accepted, w) + zero_extend(o.accepted, w)

    @property
    def mal(self) -> float:
        """Mean accepted length: tokens per step, bonus included (1.0 without steps)."""
        return self.tokens / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / checked draft positions (None when none was checked)."""
        c = int(self.checked.sum())
        return float(self.accepted.sum()) / c if c else None

    def per_position(self) -> list[float | None]:
        """P(draft i accepted | drafts < i accepted), one entry per position; None where no draft
        was ever checked (a rate of 0 would read as "always rejected")."""
        return [float(a) / float(c) if c else None for a, c in zip(self.accepted, self.checked)]

    @property
    def off_chain_share(self) -> float | None:
        """Share of verify steps where a token tree accepted more than its top-1 chain would have
        (None without verify steps)."""
        return self.off_chain / self.verified if self.verified else None

    @property
    def verified_share(self) -> float | None:
        """Share of steps that verified (None without steps or draft positions)."""
        return self.verified / self.steps if self.steps and len(self.checked) else None
