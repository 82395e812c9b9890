"""Step costs: what a step that verifies L drafts costs against a plain step, on this machine.

One quantity under two clocks. The compiled loop's per-row rule (rows.py, `generate` and batch
jobs) reads a table `costs [K + 1]` in plain steps, measured once per model, drafter and batch
bucket by timing the decode loop itself (`measure_costs`) and cached on disk, so a run's
decisions depend only on the table and the tokens emitted. The server (chunks.py) reads seconds
per step by batch bucket and K (`StepCosts`): the slot engine's warm-up table (or a JSON file),
recalibrated by every chunk's wall time, since a server may follow live timings.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax.policy.rows import ALWAYS, FORCE, IDLE


def cost_table(k: int, verify_cost: float, idle_cost: float = 1.0) -> np.ndarray:
    """[K + 1] costs in plain steps: a verify of L >= 1 drafts linear from 1 at L = 0 to
    `verify_cost` at L = K; entry 0 the step on which the drafter ran and declined (`idle_cost`,
    at least a plain step)."""
    table = 1.0 + (max(verify_cost, 1.0) - 1.0) * np.arange(k + 1) / max(k, 1)
    table[0] = max(idle_cost, 1.0)
    return table.astype(np.float32)


_COSTS: dict[str, tuple[float, float]] = {}  # cost_key -> (verify of K drafts, declined step), in plain steps
PROBE_TOKENS = 24  # tokens a row in each timed measuring run
# An executable's first run is slower than its later ones, compile excluded (buffers touched for
# the first time): each is run this many tokens a row, untimed, before it is timed.
WARM_TOKENS = 2


def _costs_file() -> str:
    from specjax.models.loading import cache_root

    return os.path.join(cache_root(), "step-costs.json")


def cost_key(model, drafter, label: str, batch: int) -> str:
    """What a verify step's relative cost depends on: model, dtype, drafter (its label, K and
    verify widths), batch bucket (a power of two), device."""
    bucket = 1 << max(batch - 1, 0).bit_length()
    return "|".join(
        [
            model.name,
            str(model.dtype),
            label,
            f"K{drafter.num_draft}",
            repr(drafter.verify_lengths),
            f"B{bucket}",
            jax.devices()[0].device_kind,
        ]
    )


def measure_costs(engine, prompt_ids, params, eos_ids, drafter, label: str) -> np.ndarray:
    """[K + 1] cost table for this batch (K: the drafter's `accept_width`): the decode loop over the
    batch's own prompts and shapes (`PROBE_TOKENS` tokens a row) timed with every live row verifying
    all K drafts (`FORCE`), with the drafter proposing and no row verifying (`IDLE`, what a gated
    drafter's declined step costs), and plain, after a short untimed run of each (`WARM_TOKENS`),
    all from one prefill per prefill shape (`Engine.holding_prefills`). The two ratios to plain are
    cached in memory and in `$SPECJAX_CACHE/step-costs.json`."""
    k = drafter.accept_width
    key = cost_key(engine.model, drafter, label, len(prompt_ids))
    if key not in _COSTS:
        try:
            with open(_costs_file()) as fh:
                stored = json.load(fh)
            _COSTS.update({k_: (float(v[0]), float(v[1])) for k_, v in stored.items() if isinstance(v, list)})
        except (OSError, ValueError, AttributeError, IndexError, TypeError):
            pass
    if key not in _COSTS:

        def per_step(mode, d, cap):
            rows = engine.generate(prompt_ids, params, eos_ids=(), drafter=d, max_new_cap=cap, spec_mode=mode)
            return rows[0].decode_seconds / max(max(r.steps for r in rows), 1)

        with engine.holding_prefills():
            for cap in (WARM_TOKENS, PROBE_TOKENS):  # the first pass warms each executable
                verify_s, idle_s, plain_s = (
                    per_step(FORCE, drafter, cap),
                    per_step(IDLE, drafter, cap),
                    per_step(ALWAYS, None, cap),
                )
        _COSTS[key] = (verify_s / plain_s, idle_s / plain_s)
        try:
            os.makedirs(os.path.dirname(_costs_file()), exist_ok=True)
            tmp = f"{_costs_file()}.tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                json.dump(_COSTS, fh, indent=1)
            os.replace(tmp, _costs_file())
        except OSError:
            pass  # an unwritable cache: measured again next run
    return cost_table(k, *_COSTS[key])


def measure_gains(engine, prompt_ids, params, eos_ids, drafters: dict, labels: dict, rows: int | None = None) -> dict:
    """K -> (cost table, gain) for each candidate K -> drafter on these prompts: the cost table
    as `measure_costs` gives it and the gain, tokens per decode second of the drafter as it
    drafts (its own gates included) over plain decoding's (`PROBE_TOKENS` tokens a row, each run
    `WARM_TOKENS` untimed first). `labels`: K -> the drafter's label (the cost cache's key);
    `rows`: count the tokens of the first this many rows only (the rest pad the batch)."""
    from specjax.drafters.base import NoDrafter

    def rate(d):  # ALWAYS: the compiled loop measure_costs timed
        out = [
            engine.generate(prompt_ids, params, eos_ids=eos_ids, drafter=d, max_new_cap=cap, spec_mode=ALWAYS)
            for cap in (WARM_TOKENS, PROBE_TOKENS)
        ][-1]
        return sum(len(r.token_ids) - 1 for r in out[:rows]) / max(out[0].decode_seconds, 1e-9)

    # One prefill per cache size, not one per run: the drafters' first (it also returns their
    # features), then plain decoding's from it.
    with engine.holding_prefills():
        got = {
            k: (measure_costs(engine, prompt_ids, params, eos_ids, d, labels[k]).tolist(), rate(d))
            for k, d in drafters.items()
        }
        plain = rate(NoDrafter())
    return {k: (table, r / plain) for k, (table, r) in got.items()}


class StepCosts:
    """Seconds per step by batch bucket and K (verify steps for K > 0, plain steps for K = 0),
    from a table (warm-up or config), scaled by live calibration (`observe`)."""

    # Decay per observed chunk of the calibration sums (half-life ~ 23 chunks), and the prior's
    # weight in predicted steps: a (bucket, K) is trusted after a few chunks, and recent chunks
    # count most (the machine's load changes).
    DECAY = 0.97
    PRIOR_STEPS = 8.0

    def __init__(self, table: dict[int, dict[int, float]], source: str):
        if not table:
            raise ValueError("empty step-cost table")
        self.table = {int(b): {int(k): float(c) for k, c in row.items()} for b, row in table.items()}
        self.source = source
        # (bucket, K) -> [decayed observed seconds, decayed predicted seconds, decayed steps]
        self._live: dict[tuple[int, int], list[float]] = {}
        self._seen_at: dict[tuple[int, int], int] = {}  # (bucket, K) -> observation number
        self.observations = 0

    def _bucket(self, b: int) -> int:
        buckets = sorted(self.table)
        return next((x for x in buckets if x >= b), buckets[-1])

    def base(self, b: int, k: int) -> float:
        """The table's cost: the bucket that holds b rows (the largest one if none does); K
        between measured values is interpolated linearly, beyond them extrapolated."""
        row = self.table[self._bucket(b)]
        if k in row:
            return row[k]
        ks = sorted(row)
        lo = max([x for x in ks if x < k], default=None)
        hi = min([x for x in ks if x > k], default=None)
        if lo is None or hi is None:  # extrapolate
            pair = ks[-2:] if hi is None else ks[:2]
            if len(pair) < 2:
                return row[ks[0]]
            lo, hi = pair
        slope = (row[hi] - row[lo]) / (hi - lo)
        return max(row[lo] + slope * (k - lo), 1e-9)

    def scale(self, b: int, k: int) -> float:
        """Live calibration of (bucket, K): observed / predicted seconds, shrunk by a prior worth
        PRIOR_STEPS steps towards what the bucket's nearest other run K says (K > 0 first for
        K > 0), or towards 1 when nothing else ran there; K = 0, the reference every K is judged
        against, is shrunk towards 1. A K never run at this bucket takes that neighbour's
        calibration as it is. What the policy reads are ratios between K values at one bucket:
        shrinking a briefly run K towards 1 while K = 0 is calibrated would skew them by however
        far the machine has drifted since warm-up (one 4-step probe at 8 rows that measured K=3
        at 2.6 plain steps left it looking cheaper than before it ran: about 2.1 plain steps
        instead of the table's 2.4). Nothing run at the bucket: the table."""
        bucket = self._bucket(b)
        near = sorted(
            (abs(kk - k) + (0.5 if k > 0 and kk == 0 else 0.0), kk) for (x, kk) in self._live if x == bucket and kk != k
        )
        borrowed = self._shrunk(bucket, near[0][1], 1.0) if near else 1.0
        if (bucket, k) not in self._live:
            return borrowed
        return self._shrunk(bucket, k, borrowed if k > 0 else 1.0)

    def _shrunk(self, bucket: int, k: int, toward: float) -> float:
        """Observed / predicted seconds of a (bucket, K) that ran, with PRIOR_STEPS steps at
        `toward`."""
        obs, pred, steps = self._live[(bucket, k)]
        prior = self.PRIOR_STEPS * pred / max(steps, 1e-9)
        return (obs + prior * toward) / (pred + prior)

    def cost(self, b: int, k: int) -> float:
        return self.base(b, k) * self.scale(b, k)

    def effective(self, b: int, k: int, verified: float) -> float:
        """Seconds per step at K when a fraction `verified` of the steps verify (the others are
        plain steps of the K variant, calibrated with it)."""
        if k == 0:
            return self.cost(b, 0)
        return (verified * self.base(b, k) + (1.0 - verified) * self.base(b, 0)) * self.scale(b, k)

    def observe(self, b: int, k: int, seconds: float, steps: int, verify_steps: int) -> None:
        """A chunk at (bucket b, K) took `seconds` for `steps` steps, `verify_steps` of which
        verified: update that (bucket, K)'s calibration."""
        if steps <= 0 or seconds <= 0:
            return
        v = min(max(verify_steps, 0), steps) if k else 0
        predicted = v * self.base(b, k) + (steps - v) * self.base(b, 0)
        sums = self._live.setdefault((self._bucket(b), k), [0.0, 0.0, 0.0])
        for i, x in enumerate((seconds, predicted, float(steps))):
            sums[i] = sums[i] * self.DECAY + x
        self.observations += 1
        self._seen_at[(self._bucket(b), k)] = self.observations

    def stale(self, b: int, k: int, within: int) -> bool:
        """(bucket, K) not observed in the last `within` observed chunks (or never)."""
        seen = self._seen_at.get((self._bucket(b), k))
        return seen is None or self.observations - seen >= within

    def to_dict(self, live: bool = False) -> dict:
        """{bucket: {K: seconds}}: the table, or (`live`) the calibrated costs."""
        get = self.cost if live else self.base
        return {str(b): {str(k): get(b, k) for k in sorted(row)} for b, row in sorted(self.table.items())}
