"""Acceptance monitor with fallback: is speculation paying for a latency class right now?

The scheduler feeds the monitor, after every chunk, each class's share of the chunk: row-steps,
tokens emitted, row-steps that verified drafts, and per-position checks / accepts (deltas of the
rows' counters in the loop state). Only chunks that ran with K > 0 enter the rolling window: a
plain chunk says nothing about the drafter.

From the window the monitor estimates, per class, the fraction f of row-steps that verified and
the per-position acceptance a_i = P(draft i accepted | drafts < i accepted); the policy turns
them into MAL(K) = 1 + f * sum_{j<=K} prod_{i<=j} a_i and, with the measured step costs, into
the expected gain of K over plain decoding (chunks.py). Fallback rules, per class:

* on -> off when the window holds at least `min_steps` row-steps and the best expected gain over
  every K > 0 is below `off_below` (1.0: speculation would be slower than plain decoding). The
  window is bounded (`window_steps`), so a drafter that turns bad is switched off within about
  `window_steps` row-steps, and a class that starts bad within `min_steps`;
* while off, the class gets a probe every `probe_every` scheduler steps: chunks at the K the
  policy picks for the current batch, until the probe holds `min_steps` row-steps (a probe of a
  few steps is judged on noise: one repetitive stretch of code looks like a great drafter). The
  window is cleared when the probe starts, so it measures the present, not the past. Each failed
  probe multiplies the interval by `probe_backoff` (up to `probe_every_max`), so a drafter that
  does not pay costs ever less. Switching off again within `probe_every_max` steps of switching
  on keeps backing off from the interval reached (a drafter near break-even flaps on a lucky
  probe, and each flap restarting the ladder at `probe_every` cost 3-6% of a 4-client load point
  on this CPU); only a class that stayed on longer starts again at `probe_every`;
* a class that is on but has no evidence (the policy priced the prior and chose plain decoding,
  so no speculative step ever measured the drafter) gets an exploration probe every
  `probe_every` steps;
* probes and exploration run only at batch sizes where a good drafter (per-position acceptance
  `probe_acceptance`) would gain at least `probe_gain` (>= `on_above`, what a probe needs to
  switch speculation on): a probe runs every row of the batch at K > 0, and at a batch size
  where verifying costs about what even a good drafter returns, the measurement waits for a
  smaller batch. On this CPU, at 8 rows, where a good drafter would gain 1.04-1.13, probes cost
  6-9% of a load point in 3 of 8 repeats (a 4-step K=2 probe: 500 ms steps against 200);
* off -> on when a probe's expected gain is at least `on_above` (> off_below: hysteresis, so a
  class near the break-even point does not flap), or when rows of the class that ran in other
  classes' speculative chunks since the switch (the window is cleared at it) show that much.
  The switch on is judged on the gain with each acceptance lowered by `confidence_z` standard
  errors (the scheduler passes it as `gain_on`), the same pessimism the policy applies before it
  buys K > 0: 16 row-steps of a repetitive stretch measure MAL(3) 2.4 for a drafter whose
  replies average 1.35; the switch off on the point estimate.

Every switch and probe result is a decision with its reason in the `DecisionLog` (also logged
with Python's `logging` under `specjax.serving`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from specjax.stats import AcceptanceStats, zero_extend

logger = logging.getLogger("specjax.serving")


@dataclasses.dataclass
class MonitorConfig:
    """Acceptance monitor and fallback: the `monitor` section of the serving config
    (specjax/server/config.py). Steps are row-steps of the class."""

    window_steps: int = 64  # rolling window of speculative row-steps per class
    min_steps: int = 16  # no decision before this many row-steps in the window
    off_below: float = 1.0  # switch speculation off when the expected gain falls below this
    on_above: float = 1.05  # ... and back on when a probe measures at least this (hysteresis)
    probe_every: int = 96  # steps (of the scheduler) between probes while a class is off
    probe_steps: int = 2  # least steps per probe chunk (a probe runs until it holds min_steps row-steps)
    probe_backoff: float = 2.0  # each failed probe multiplies the interval between probes by this
    probe_every_max: int = 768  # ... up to this many steps
    prior_acceptance: float = 0.6  # per-position acceptance assumed before any measurement
    probe_acceptance: float = 0.75  # probe / explore only where a drafter this good ...
    probe_gain: float = 1.15  # ... would gain at least this (>= on_above)


@dataclasses.dataclass
class Estimate:
    """What the policy needs to price K for a class."""

    verified: float  # f, fraction of row-steps that verify
    acceptance: list[float]  # a_i per draft position (prior where unmeasured)
    steps: int  # evidence behind it
    checks: list[int] | None = None  # times each position was checked (None: the prior, unmeasured)

    def lower(self, z: float) -> "Estimate":
        """Each measured a_i lowered by z standard errors (sqrt(a (1 - a) / n), n its checks; a
        position checked fewer than 4 times counts as never accepted): a pessimistic view for
        choosing K > 0 over plain decoding. The first tokens of replies are often easy, so a
        young window overstates MAL; this keeps the policy from paying for that."""
        if self.checks is None or z <= 0:
            return self
        acc = []
        for i, a in enumerate(self.acceptance):
            n = self.checks[i] if i < len(self.checks) else 0
            acc.append(0.0 if n < 4 else max(a - z * (a * (1.0 - a) / n) ** 0.5, 0.0))
        return dataclasses.replace(self, acceptance=acc)

    def mal(self, k: int) -> float:
        """Expected tokens per row-step at K: 1 + f * sum_j prod_{i<=j} a_i."""
        total, prod = 0.0, 1.0
        for i in range(k):
            prod *= self.acceptance[min(i, len(self.acceptance) - 1)]
            total += prod
        return 1.0 + self.verified * total


class DecisionLog:
    """Recent scheduling decisions with their reasons (thread-safe ring buffer + logging)."""

    def __init__(self, maxlen: int = 500):
        self._items: collections.deque = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self._seq = 0

    def add(self, kind: str, reason: str, **fields) -> dict:
        with self._lock:
            self._seq += 1
            item = {"seq": self._seq, "time": time.time(), "kind": kind, **fields, "reason": reason}
            self._items.append(item)
        logger.info("%s: %s", kind, reason)
        return item

    def recent(self, n: int | None = None) -> list[dict]:
        with self._lock:
            items = list(self._items)
        return items[-n:] if n else items


class _ClassState:
    def __init__(self):
        self.window: collections.deque[AcceptanceStats] = collections.deque()
        self.window_steps = 0
        self.on = True
        self.probing = False
        self.last_probe_step = -(10**9)  # scheduler step when the class went off or last probed
        self.off_since = 0
        self.on_since = 0  # scheduler step when speculation last went on
        self.switches = 0
        self.probe_interval = 0  # steps between probes while off (see evaluate: backoff, reset)


class AcceptanceMonitor:
    """Rolling acceptance / MAL per latency class and the on/off state of speculation."""

    def __init__(self, cfg: MonitorConfig, classes, drafter: str, log: DecisionLog, enabled: bool = True):
        self.cfg = cfg
        self.drafter = drafter
        self.log = log
        self.enabled = enabled  # False: always on, no probes (policies "always" / "never")
        self.classes = {c: _ClassState() for c in classes}
        self.totals = {c: AcceptanceStats() for c in classes}  # since start, K > 0 chunks

    # ---- feeding -------------------------------------------------------------------------------

    def record(self, cls: str, k: int, sample: AcceptanceStats) -> None:
        if k == 0 or sample.steps == 0:
            return
        st = self.classes[cls]
        st.window.append(sample)
        st.window_steps += sample.steps
        while len(st.window) > 1 and st.window_steps - st.window[0].steps >= self.cfg.window_steps:
            st.window_steps -= st.window.popleft().steps
        self.totals[cls].add(sample)

    def window(self, cls: str) -> AcceptanceStats:
        out = AcceptanceStats()
        for s in self.classes[cls].window:
            out.add(s)
        return out

    def estimate(self, cls: str, width: int, measured: bool = False) -> Estimate:
        """Measured f and a_i once the window holds `min_steps` row-steps (with `measured`, as
        soon as it holds any), the prior before: the policy keeps speculating until there is
        evidence either way (a class that never ran speculative steps could never be judged)."""
        w = self.window(cls)
        prior = self.cfg.prior_acceptance
        if w.steps < (1 if measured else self.cfg.min_steps):
            return Estimate(1.0, [prior] * max(width, 1), w.steps)
        checked = zero_extend(w.checked, width)
        acc = [a / c if c else prior for a, c in zip(zero_extend(w.accepted, width), checked)]
        verified = w.verified / w.steps if w.steps else 1.0
        return Estimate(verified, acc or [prior], w.steps, [int(c) for c in checked] or None)

    # ---- decisions -----------------------------------------------------------------------------

    def spec_on(self, cls: str) -> bool:
        return not self.enabled or self.classes[cls].on

    def probe_due(self, cls: str, step: int, worth_exploring: bool = False) -> bool:
        """A probe is due for a class that is off, every `probe_every` steps (more after failed
        probes); and, as exploration, for a class that is on but has no evidence yet, when
        `worth_exploring` (the policy, pricing the prior, chose plain decoding)."""
        st = self.classes[cls]
        if not self.enabled or st.probing:
            return False
        interval = self.cfg.probe_every if st.on else st.probe_interval
        if step - st.last_probe_step < interval:
            return False
        return not st.on or (worth_exploring and st.window_steps < self.cfg.min_steps)

    def probing(self, cls: str) -> bool:
        """A probe started and not yet judged (it runs until it holds `min_steps` row-steps)."""
        return self.enabled and self.classes[cls].probing

    def probe_steps(self, cls: str, rows: int) -> int:
        """Steps for the next probe chunk: `probe_steps`, or enough for the window to hold
        `min_steps` row-steps of the class with `rows` rows running."""
        need = -(-(self.cfg.min_steps - self.classes[cls].window_steps) // max(rows, 1))
        return max(self.cfg.probe_steps, need)

    def start_probe(self, cls: str, step: int, k: int, steps: int) -> None:
        st = self.classes[cls]
        st.probing, st.last_probe_step = True, step
        if st.on:
            why = f"no evidence yet on the drafter for class {cls}; exploring"
        else:
            why = f"class {cls}: speculation off since step {st.off_since}; probing"
            self._clear(st)
        self.log.add("probe", f"{why} K={k} for {steps} steps", cls=cls, k=k, step=step)

    def evaluate(self, cls: str, gain: float, detail: str, step: int, gain_on: float | None = None) -> None:
        """After a chunk: switch the class off / on from the best expected gain over K > 0
        (`gain`: from the window's estimate; `gain_on`, judged for switching on: from a
        pessimistic one, see the module docstring; default `gain`)."""
        if not self.enabled:
            return
        st = self.classes[cls]
        cfg = self.cfg
        up = gain if gain_on is None else gain_on
        seen = f"{gain:.2f}" if gain_on is None else f"{gain:.2f} (lower bound {up:.2f})"
        if st.probing:
            if st.window_steps < cfg.min_steps:
                return  # not enough evidence yet (or the chunk ended early): the probe goes on
            st.probing = False
            st.last_probe_step = step
            if st.on:  # exploration: from now on the policy prices K from this evidence
                self.log.add(
                    "explored",
                    f"class {cls}: measured expected gain {gain:.2f} over {st.window_steps} row-steps ({detail})",
                    cls=cls,
                    gain=gain,
                    step=step,
                )
            elif up >= cfg.on_above:
                st.on, st.on_since = True, step
                st.switches += 1
                self.log.add(
                    "spec_on",
                    f"class {cls}: probe measured expected gain {seen} >= "
                    f"{cfg.on_above:.2f}; speculation back on ({detail})",
                    cls=cls,
                    gain=gain,
                    step=step,
                )
                return
            else:
                st.probe_interval = self._backoff(st.probe_interval)
                self.log.add(
                    "probe_failed",
                    f"class {cls}: probe measured expected gain {seen} < "
                    f"{cfg.on_above:.2f} over {st.window_steps} row-steps; speculation stays off, next "
                    f"probe in {st.probe_interval} steps ({detail})",
                    cls=cls,
                    gain=gain,
                    step=step,
                )
                return
        if st.window_steps < cfg.min_steps:
            return
        if st.on and gain < cfg.off_below:
            # a class that was on only briefly (a lucky probe) keeps backing off
            brief = st.probe_interval > 0 and step - st.on_since < cfg.probe_every_max
            st.probe_interval = self._backoff(st.probe_interval) if brief else cfg.probe_every
            self.log.add(
                "spec_off",
                f"class {cls}: expected gain {gain:.2f} < {cfg.off_below:.2f} over the "
                f"last {st.window_steps} row-steps; speculation off, next probe in {st.probe_interval} "
                f"steps ({detail})",
                cls=cls,
                gain=gain,
                step=step,
            )
            st.on = False
            st.switches += 1
            st.last_probe_step = st.off_since = step
            self._clear(st)  # what comes next (probes, other classes' K > 0 chunks) is fresh evidence
        elif not st.on and up >= cfg.on_above:  # measured in other classes' speculative chunks
            st.on, st.on_since = True, step
            st.switches += 1
            self.log.add(
                "spec_on",
                f"class {cls}: expected gain {seen} >= {cfg.on_above:.2f} over "
                f"{st.window_steps} row-steps since it was switched off; speculation back on ({detail})",
                cls=cls,
                gain=gain,
                step=step,
            )

    def _backoff(self, interval: int) -> int:
        return min(max(int(interval * self.cfg.probe_backoff), self.cfg.probe_every), self.cfg.probe_every_max)

    @staticmethod
    def _clear(st: _ClassState) -> None:
        st.window.clear()
        st.window_steps = 0

    def snapshot(self) -> dict:
        """Per class: on/off, rolling MAL and acceptance, totals (for /metrics and responses)."""
        out = {}
        for c, st in self.classes.items():
            w = self.window(c)
            out[c] = {
                "speculation": st.on or not self.enabled,
                "probing": st.probing,
                "switches": st.switches,
                "rolling_mal": w.mal,
                "rolling_acceptance_rate": w.acceptance_rate,
                "window_steps": w.steps,
                "drafter": self.drafter,
            }
        return out
