"""Load-aware throttling: which K the next chunk runs with.

Speculation trades compute for memory traffic. A step at K costs c(B, K) seconds (the target
verifies K + 1 tokens per row) and emits MAL(K) tokens per row instead of 1, so its expected
gain over plain decoding is

    gain(B, K) = MAL(K) * c(B, 0) / c_eff(B, K),   c_eff = f * c(B, K) + (1 - f) * c(B, 0)

where f is the fraction of the batch's steps that run the verify pass. A row's drafter may
decline (the n-gram drafter has no match), but the batch verifies when any row proposes, so with
a share f_c of row-steps verifying in class c (n_c rows), f = 1 - prod_c (1 - f_c)^n_c: at 32
rows a drafter that proposes on a fifth of its rows' steps makes nearly every step a verify.
When the accelerator is memory-bound (small B) c(B, K) is close to c(B, 0) and any
MAL > 1 pays; as B grows the verify pass becomes compute-bound, c(B, K) / c(B, 0) grows towards
K + 1 and the gain falls below 1. Low acceptance (high-entropy text, high temperature) shrinks
MAL(K) towards 1 with the same effect. The step costs come from the slot engine's warm-up (one
timed chunk per (bucket, K)) or from a JSON file (`step_costs` in the serving config), and are
recalibrated live: every chunk's wall time is compared with what the table predicts for its
verify and plain steps, and a decayed ratio per (bucket, K) scales the table. Warm-up times a
few steps of a synthetic row, once; in service the steps run on real contexts, pay the
drafter's proposal on every step, and share the machine with whatever else runs. In one
serve-bench sweep on this CPU a disturbed warm-up timed K = 3 at 1.10x K = 0 for one row
where the chunks then ran at ~1.9x, and uncalibrated rules speculated on every step of a load
where speculation lost (docs/performance.md).
MAL(K) and f come from the acceptance monitor's rolling window, per latency class.

The rules policy picks, for the running batch, the K that maximises expected weighted
throughput

    value(K) = sum over classes c of  w_c * n_c * MAL_c(K) / c_eff(B, K)

(n_c rows of class c, MAL_c from each acceptance lowered by `confidence_z` standard errors of
its window, so a young or small window does not buy K > 0 on luck; a class whose speculation the
monitor has switched off counts MAL 1;
interactive rows weigh `interactive_weight` while no request is queued, 1 otherwise: with a
queue, every waiting request's latency is throughput). Smoothness: value(K) is continuous in
the measured inputs and the choice is its argmax over a ladder of K values (0, 1, 2, ...), so
as the batch grows K steps down one rung at a time where adjacent rungs are worth the same,
not from K_max straight to 0; a switch needs an expected gain of `margin` over the current K
(hysteresis), so the throughput at a switch point moves by at most that margin and the policy
does not flap between neighbours.

Other policies: `always` (K_max, the bench's "speculation always on"), `never` (K = 0) and
`schedule` (K from a user table by running rows, `configs/serving-policy.yaml`); the monitor's
fallback applies to `rules` and `schedule`.

Token trees (`tree_topk` > 1 in the serving config): K is then a tree's node count, the verify
pass checks K nodes, and a step accepts at most the tree's depth, so MAL_c(K) is priced over
`widths[K]` positions with the class's acceptance per depth: as the batch grows the policy
steps down to smaller trees, then to none, as it does with chains. The per-depth rates are
measured on whichever trees ran, so a smaller tree is priced with a larger one's acceptance
(somewhat optimistic for it); the live calibration keeps the costs honest, not the MAL.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from specjax.policy.costs import StepCosts
from specjax.policy.monitor import Estimate

if TYPE_CHECKING:  # the server's config; policy never imports the server at run time
    from specjax.server.config import ServingConfig


@dataclasses.dataclass
class Decision:
    k: int
    reason: str
    value: float = 0.0  # expected weighted tokens per second
    gain: float = 1.0  # expected gain over K = 0 for the batch


def batch_verify_share(shares) -> float:
    """The share of a batch's steps that run the verify pass, from each row's share of steps on
    which its drafter proposed: a step verifies when any row proposes, and rows are taken as
    independent (1 - prod (1 - share), never below the busiest row's)."""
    return 1.0 - math.prod(1.0 - s for s in shares)


class Policy:
    """Chooses K for the next chunk (see the module docstring)."""

    def __init__(self, cfg: ServingConfig, costs: StepCosts, ks: tuple[int, ...], widths: dict[int, int] | None = None):
        """`widths[K]`: the most drafts a step at K accepts (K for chains, a tree's depth)."""
        self.cfg = cfg
        self.costs = costs
        self.ks = tuple(sorted(ks))
        self.kmax = self.ks[-1]
        self.widths = {k: (widths or {}).get(k, k) for k in self.ks}

    def mal(self, est: Estimate, k: int) -> float:
        """Expected tokens per row-step at K (a tree: over its depth)."""
        return est.mal(self.widths.get(k, k))

    def gain(self, est: Estimate, b: int, k: int) -> float:
        """Expected speed of K relative to plain decoding for rows with this estimate."""
        if k == 0:
            return 1.0
        return self.mal(est, k) * self.costs.cost(b, 0) / self.costs.effective(b, k, est.verified)

    def best_gain(self, est: Estimate, b: int) -> tuple[float, int]:
        """(the best expected gain over K > 0, its K); (1.0, 0) when no K > 0 is allowed."""
        options = [(self.gain(est, b, k), k) for k in self.ks if k > 0]
        return max(options) if options else (1.0, 0)

    def choose(
        self,
        bucket: int,
        rows: dict[str, int],
        queued: int,
        estimates: dict[str, Estimate],
        spec_on: dict[str, bool],
        probing: tuple[str, ...],
        current_k: int,
    ) -> Decision:
        """rows: live rows per class; estimates: per class; spec_on: the monitor's switches."""
        n = sum(rows.values())
        mode = self.cfg.policy
        if mode == "never" or self.kmax == 0:
            return Decision(0, "policy never: plain decoding")
        if mode == "always":
            return Decision(self.kmax, f"policy always: K={self.kmax}")
        present = [c for c, m in rows.items() if m > 0]
        if probing:
            est = estimates[probing[0]]
            g, k = self.best_gain(est, bucket)
            return Decision(k, f"probe for class {probing[0]}: K={k} (expected gain {g:.2f} before probing)")
        if mode == "schedule":
            k = next((k for rows_max, k in self.cfg.schedule if n <= rows_max), self.cfg.schedule[-1][1])
            if k and not any(spec_on.get(c, True) for c in present):
                return Decision(
                    0, f"schedule gives K={k} for {n} rows, but speculation is off for {', '.join(present)}"
                )
            return Decision(k, f"schedule: {n} running rows -> K={k}")
        return self._rules(bucket, rows, queued, estimates, spec_on, current_k)

    def _rules(self, b, rows, queued, estimates, spec_on, current_k) -> Decision:
        present = [c for c, m in rows.items() if m > 0]
        if not present:
            return Decision(current_k, "no running rows")
        estimates = {c: e.lower(self.cfg.confidence_z) for c, e in estimates.items()}
        weight = {c: (self.cfg.interactive_weight if c == "interactive" and queued == 0 else 1.0) for c in present}
        f = batch_verify_share(estimates[c].verified for c in present for _ in range(rows[c]))

        def value(k):
            toks = sum(
                weight[c] * rows[c] * (self.mal(estimates[c], k) if spec_on.get(c, True) or k == 0 else 1.0)
                for c in present
            )
            return toks / self.costs.effective(b, k, f)

        values = {k: value(k) for k in self.ks}
        best = max(values, key=lambda k: (values[k], -k))  # ties: the smaller K
        keep = current_k in values and values[best] <= values[current_k] * (1.0 + self.cfg.margin)
        k = current_k if keep else best
        gain = values[k] / values[0]
        off = [c for c in present if not spec_on.get(c, True)]
        mals = ", ".join(f"MAL_{c}({k})={self.mal(estimates[c], k):.2f}" for c in present)
        why = (
            f"B={b} ({', '.join(f'{rows[c]} {c}' for c in present)}), queue {queued}: K={k} expected "
            f"{gain:.2f}x plain ({mals}; cost K/0 = {self.costs.effective(b, k, f) / self.costs.cost(b, 0):.2f}"
            f", f={f:.2f})"
        )
        if keep and best != current_k:
            why += f"; K={best} would gain only {values[best] / values[current_k]:.3f}x, kept"
        if off:
            why += f"; speculation off for {', '.join(off)}"
        return Decision(k, why, values[k], gain)
