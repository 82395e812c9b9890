"""The serving scheduler: continuous batching with latency classes, throttled speculation.

One background thread owns the device. Other threads (HTTP handlers, the load bench) `submit`
requests and `cancel` them through a lock-protected queue; the thread reports tokens back through
each request's `on_event` callback (called on the scheduler thread: keep it short).

One iteration of the loop:

1. cancelled requests leave (their slot gets a free row, so they stop computing);
2. admission: queued requests are prefilled (batch 1) and inserted into free slots, interactive
   requests first, then parked batch rows (resumed where they stopped), then new batch requests.
   When no slot is free the running batch grows to the next bucket; at the largest bucket an
   interactive request may preempt a batch row, which is parked (its one-row state kept on the
   device) and resumed later;
3. the policy (specjax/policy/chunks.py) picks K for the chunk from the running rows per class, the queue depth,
   the step costs (warm-up table, calibrated by every chunk's wall time) and the acceptance
   monitor (specjax/policy/monitor.py); probes run here too;
4. one compiled chunk of up to `chunk_steps` steps runs (it returns early when a row finishes and
   requests are waiting, so they get the slot at once);
5. the rows' counters are read back: new tokens go to their requests, finished rows leave, the
   monitor and the metrics see the chunk's deltas; the batch shrinks to a smaller bucket when the
   live rows have fitted one for two chunks and nothing is queued.

Each row draws from its own random stream, keyed by its request's seed and its own step count,
and checks only its own drafts (specjax/sampling.py): output laws are exact, and a sampled
request's text does not depend on its batch-mates, bucket or slot, only on the K of its steps.
Greedy output is token-identical to plain decoding whatever K, bucket or slot a row runs with.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

import numpy as np

from specjax.policy.chunks import Policy, batch_verify_share
from specjax.policy.costs import StepCosts
from specjax.policy.monitor import AcceptanceMonitor, DecisionLog, Estimate
from specjax.runtime.slots import STOP_WIDTH, SlotEngine
from specjax.sampling import SamplingParams
from specjax.server.config import LATENCY_CLASSES, ServingConfig
from specjax.server.metrics import ServingMetrics
from specjax.stats import AcceptanceStats

_ids = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    latency_class: str = "interactive"
    on_event: Callable[[str, object], None] | None = None  # ("tokens", [ids]) / ("done", self)
    id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    # set by the scheduler
    stop_ids: tuple[int, ...] = ()
    arrival: float = 0.0
    admitted: float | None = None
    first_token_time: float | None = None
    last_emit: float = 0.0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    preemptions: int = 0
    k_steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    sample: AcceptanceStats = dataclasses.field(default_factory=AcceptanceStats)  # all its steps
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    parked: object = None  # one-row state of a preempted row
    seen: dict = dataclasses.field(default_factory=dict)  # counters already accounted for
    run_steps: int = 0  # steps since (re)admission

    def stats(self, drafter: str) -> dict:
        """Per-request speculative statistics (returned in `usage.specjax`)."""
        s = self.sample
        return {
            "latency_class": self.latency_class,
            "drafter": drafter,
            "steps": s.steps,
            "mean_accepted_length": s.mal,
            "acceptance_rate": s.acceptance_rate,
            "per_position_acceptance": s.per_position(),
            "draft_tokens_checked": int(s.checked.sum()),
            "accepted_tokens": int(s.accepted.sum()),
            "steps_by_k": {str(k): n for k, n in sorted(self.k_steps.items())},
            "queue_seconds": (self.admitted or self.arrival) - self.arrival,
            "time_to_first_token": (self.first_token_time - self.arrival) if self.first_token_time else None,
            "inter_token_latency": (
                (self.last_emit - self.first_token_time) / (len(self.token_ids) - 1)
                if len(self.token_ids) > 1
                else None
            ),
            "preemptions": self.preemptions,
        }


class Scheduler:
    def __init__(
        self,
        engine: SlotEngine,
        cfg: ServingConfig,
        eos_ids=(),
        metrics: ServingMetrics | None = None,
        log: DecisionLog | None = None,
        k_override: Callable[[int, dict], int] | None = None,
    ):
        """`k_override(bucket, rows_per_class) -> K` replaces the policy (experiments, tests)."""
        self.engine, self.cfg = engine, cfg
        self.eos_ids = tuple(eos_ids)
        self.metrics = metrics or ServingMetrics()
        self.log = log or DecisionLog()
        table = cfg.costs_table()
        self.costs = StepCosts(table, "config") if table else StepCosts(engine.step_costs, "warm-up")
        self.policy = Policy(cfg, self.costs, engine.ks, engine.accept_widths)
        self.monitor = AcceptanceMonitor(
            cfg.monitor,
            LATENCY_CLASSES,
            engine.drafter_name,
            self.log,
            enabled=cfg.policy in ("rules", "schedule") and engine.kmax > 0,
        )
        self.k_override = k_override
        self.buckets = tuple(b for b in engine.buckets if b in cfg.buckets)
        if not self.buckets:
            raise ValueError(f"none of the config's buckets {cfg.buckets} is compiled ({engine.buckets})")
        self._cv = threading.Condition()
        self._queues = {c: collections.deque() for c in LATENCY_CLASSES}
        self._cancel: dict[str, str] = {}  # request id -> finish reason (cancelled | stop)
        self._all: dict[str, Request] = {}  # live requests (queued, running, parked)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.bucket = self.buckets[0]
        self.state = engine.empty(self.bucket)
        self.slots: list[Request | None] = [None] * self.bucket
        self.k = engine.kmax if cfg.policy != "never" else 0
        self.steps = 0  # scheduler steps (chunks x steps)
        self.chunks = 0
        self.chunk_time = collections.Counter()  # (bucket, K) -> seconds spent in chunks there
        self.chunk_steps = collections.Counter()  # (bucket, K) -> steps run there
        self.resizes = 0
        self._small_for = 0  # consecutive chunks the live rows fitted a smaller bucket
        self.failure: str | None = None
        for c in LATENCY_CLASSES:
            self.metrics.spec_enabled.set(1, **{"class": c})
        for b in self.buckets:
            for k in engine.ks:
                self.metrics.expected_step.set(self.costs.cost(b, k), bucket=b, k=k)

    # ---- API (any thread) ----------------------------------------------------------------------

    def submit(self, req: Request) -> Request:
        if req.latency_class not in LATENCY_CLASSES:
            raise ValueError(f"latency class must be one of {LATENCY_CLASSES}, got {req.latency_class!r}")
        stops = tuple(req.sampling.stop_token_ids) + (() if req.sampling.ignore_eos else self.eos_ids)
        req.stop_ids = tuple(dict.fromkeys(stops))[:STOP_WIDTH]
        if len(req.prompt_ids) + req.sampling.max_new_tokens > self.engine.max_seq_len:
            raise ValueError(
                f"prompt of {len(req.prompt_ids)} tokens + max_tokens {req.sampling.max_new_tokens} "
                f"exceeds the context of {self.engine.max_seq_len} tokens"
            )
        req.arrival = time.perf_counter()
        with self._cv:
            if self.failure:
                raise RuntimeError(f"scheduler stopped: {self.failure}")
            self._all[req.id] = req
            self._queues[req.latency_class].append(req)
            self._cv.notify_all()
        return req

    def cancel(self, req_id: str, reason: str = "cancelled") -> None:
        """Stop a request (client gone: "cancelled"; a stop string seen by the caller: "stop");
        its row is freed before the next chunk."""
        with self._cv:
            if req_id in self._all:
                self._cancel[req_id] = reason
                self._cv.notify_all()

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.failure

    def queue_depth(self) -> dict[str, int]:
        with self._cv:
            return {c: len(q) for c, q in self._queues.items()}

    # ---- the loop (scheduler thread) -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._cancel and not any(self._queues.values()) and not any(self.slots):
                    self._cv.wait(0.5)
                if self._stop:
                    break
            try:
                self.iteration()
            except Exception as e:  # a bug: fail what is in flight, keep serving new requests
                self.log.add("error", f"scheduler iteration failed: {type(e).__name__}: {e}")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
        self._fail_all("server shutting down")

    def iteration(self) -> None:
        """One scheduling round (public so tests and the bench can drive it without a thread)."""
        self._handle_cancellations()
        self._admit()
        self._gauges()
        if not any(self.slots):
            return
        rows = self._rows_per_class()
        queued = sum(self.queue_depth().values())
        k, n_steps = self._choose(rows, queued)
        t0 = time.perf_counter()
        self.state, ran = self.engine.run_chunk(self.state, k, n_steps, exit_on_finish=queued > 0)
        self._collect(k, ran, time.perf_counter() - t0)
        self._maybe_shrink()
        self._gauges()

    def _choose(self, rows: dict[str, int], queued: int) -> tuple[int, int]:
        n_steps = self.cfg.chunk_steps
        if self.k_override is not None:
            k = self.k_override(self.bucket, rows)
            reason = "override"
        else:
            width = self.engine.stat_width
            est = {c: self.monitor.estimate(c, width) for c in LATENCY_CLASSES}
            spec_on = {c: self.monitor.spec_on(c) for c in LATENCY_CLASSES}
            d = self.policy.choose(self.bucket, rows, queued, est, spec_on, (), self.k)
            # Probe and explore only where a good drafter would pay at this batch size, by a
            # margin (probe_gain, see specjax/policy/monitor.py): a probe runs every row at K > 0, and
            # where the verify pass costs about what even a good drafter returns, the measurement
            # is better taken when the batch is smaller.
            good = Estimate(1.0, [self.cfg.monitor.probe_acceptance] * width, 0)
            cheap = self.policy.best_gain(good, self.bucket)[0] >= self.cfg.monitor.probe_gain
            new = tuple(
                c for c in LATENCY_CLASSES if rows.get(c) and cheap and self.monitor.probe_due(c, self.steps, d.k == 0)
            )
            probing = tuple(c for c in LATENCY_CLASSES if rows.get(c) and self.monitor.probing(c)) + new
            if probing:
                d = self.policy.choose(self.bucket, rows, queued, est, spec_on, probing, self.k)
                n_steps = max(self.monitor.probe_steps(c, rows[c]) for c in probing)
                for c in new:
                    self.monitor.start_probe(c, self.steps, d.k, n_steps)
            k, reason = d.k, d.reason
            if (
                k > 0
                and not probing
                and self.cfg.policy == "rules"
                and self.cfg.calibrate_costs
                and self.cfg.cost_refresh_chunks
                and self.costs.stale(self.bucket, 0, self.cfg.cost_refresh_chunks)
            ):
                reason = (
                    f"plain chunk to time K=0 at bucket {self.bucket} (not timed in the last "
                    f"{self.cfg.cost_refresh_chunks} chunks; every K > 0 is priced against it); "
                    f"the policy chose K={k}: {reason}"
                )
                k = 0
        if k != self.k:
            self.log.add(
                "k",
                f"K {self.k} -> {k}: {reason}",
                k=k,
                previous=self.k,
                bucket=self.bucket,
                rows=sum(rows.values()),
                step=self.steps,
            )
        self.k = k
        self.metrics.num_draft.set(k)
        return k, n_steps

    def _collect(self, k: int, ran: int, seconds: float) -> None:
        st = self.state
        done, stopped = np.asarray(st.done), np.asarray(st.stopped)
        hist_len, steps = np.asarray(st.hist_len), np.asarray(st.steps)
        checked, accepted = np.asarray(st.checked), np.asarray(st.accepted)
        history = np.asarray(st.history)
        now = time.perf_counter()
        self.steps += ran
        self.chunks += 1
        self.chunk_time[(self.bucket, k)] += seconds
        self.chunk_steps[(self.bucket, k)] += ran
        self.metrics.steps.inc(ran, k=k)
        if ran:
            self.metrics.step_seconds.set(seconds / ran, bucket=self.bucket, k=k)
        per_class = {c: AcceptanceStats() for c in LATENCY_CLASSES}
        shares = []  # each row's share of its steps that verified (`batch_verify_share`)
        for slot, req in enumerate(self.slots):
            if req is None:
                continue
            seen = req.seen
            d = AcceptanceStats(
                int(steps[slot] - seen["steps"]),
                int(hist_len[slot] - seen["hist_len"]),
                int(checked[slot, 0] - seen["checked"][0]),
                checked[slot] - seen["checked"],
                accepted[slot] - seen["accepted"],
            )
            new = history[slot, seen["hist_len"] : hist_len[slot]].tolist()
            req.seen = {
                "steps": int(steps[slot]),
                "hist_len": int(hist_len[slot]),
                "checked": checked[slot].copy(),
                "accepted": accepted[slot].copy(),
            }
            req.run_steps += d.steps
            shares.append(d.verified / d.steps if d.steps else 0.0)
            req.sample.add(d)
            if d.steps:
                req.k_steps[k] += d.steps
            per_class[req.latency_class].add(d)
            self._emit(req, new, now)
            if done[slot]:
                self._finish(req, "stop" if stopped[slot] else "length")
                self.slots[slot] = None
        verify_steps = round(ran * batch_verify_share(shares))  # rounded, never below the busiest row's count
        if self.cfg.calibrate_costs:
            self.costs.observe(self.bucket, k, seconds, ran, verify_steps)
            for b in self.buckets:  # a (bucket, K) not run yet borrows the nearest bucket's calibration
                self.metrics.expected_step.set(self.costs.cost(b, k), bucket=b, k=k)
        for c, d in per_class.items():
            label = {"class": c}
            if d.steps == 0:
                continue
            if k:
                self.metrics.draft_tokens.inc(int(d.checked.sum()), **label)
                for i, a in enumerate(d.accepted[:k]):
                    if a:
                        self.metrics.accepted.inc(int(a), position=str(i + 1))
            self.monitor.record(c, k, d)
            if self.k_override is None:
                # The drafter's worth for the class, priced where speculation is cheapest (the
                # smallest bucket): load is the policy's business, not a reason to switch off.
                b = self.buckets[0]
                est = self.monitor.estimate(c, self.engine.stat_width, measured=True)
                gain, best_k = self.policy.best_gain(est, b)
                gain_on = self.policy.best_gain(est.lower(self.cfg.confidence_z), b)[0]
                on = self.monitor.spec_on(c)
                detail = (
                    f"MAL({best_k}) {self.policy.mal(est, best_k):.2f}, verified {est.verified:.2f}, step cost "
                    f"K={best_k}/K=0 {self.costs.cost(b, best_k) / self.costs.cost(b, 0):.2f} at B={b}"
                )
                self.monitor.evaluate(c, gain, detail, self.steps, gain_on)
                if self.monitor.spec_on(c) != on:
                    self.metrics.switches.inc(**label, to="on" if not on else "off")
            snap = self.monitor.snapshot()[c]
            self.metrics.mal.set(snap["rolling_mal"], **label, drafter=self.engine.drafter_name)
            if snap["rolling_acceptance_rate"] is not None:
                self.metrics.acceptance.set(snap["rolling_acceptance_rate"], **label, drafter=self.engine.drafter_name)
            self.metrics.spec_enabled.set(1 if snap["speculation"] else 0, **label)

    def _emit(self, req: Request, tokens: list[int], now: float) -> None:
        if not tokens:
            return
        label = {"class": req.latency_class}
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival, **label)
            if len(tokens) > 1:
                self.metrics.itl.observe(0.0, count=len(tokens) - 1, **label)
        else:
            self.metrics.itl.observe((now - req.last_emit) / len(tokens), count=len(tokens), **label)
        req.last_emit = now
        req.token_ids += tokens
        self.metrics.generated.inc(len(tokens), **label)
        if req.on_event:
            req.on_event("tokens", tokens)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        status = {"cancelled": "cancelled", "error": "error"}.get(reason, "finished")
        self.metrics.requests.inc(**{"class": req.latency_class}, status=status)
        with self._cv:
            self._all.pop(req.id, None)
            self._cancel.pop(req.id, None)
        req.done.set()
        if req.on_event:
            req.on_event("done", req)

    # ---- admission, preemption, buckets --------------------------------------------------------

    def _pop(self) -> Request | None:
        with self._cv:
            for c in ("interactive", "batch"):  # parked batch rows sit at the front of theirs
                if self._queues[c]:
                    return self._queues[c].popleft()
        return None

    def _push_front(self, req: Request) -> None:
        with self._cv:
            self._queues[req.latency_class].appendleft(req)

    def _admit(self) -> None:
        while True:
            req = self._pop()
            if req is None:
                return
            slot = self._free_slot()
            if slot is None and self.bucket < self.buckets[-1]:
                queued = sum(self.queue_depth().values()) + 1
                live = sum(r is not None for r in self.slots)
                target = next((b for b in self.buckets if b >= live + queued), self.buckets[-1])
                self._resize(target, f"{live} running + {queued} waiting rows")
                slot = self._free_slot()
            if slot is None and req.latency_class == "interactive" and self.cfg.preempt:
                slot = self._preempt()
            if slot is None:
                self._push_front(req)
                return
            self._place(req, slot)

    def _place(self, req: Request, slot: int) -> None:
        now = time.perf_counter()
        if req.parked is not None:
            row, req.parked = req.parked, None
            self.log.add("resume", f"request {req.id} ({req.latency_class}) resumed in slot {slot}", slot=slot)
        else:
            req.admitted = now
            try:
                row = self.engine.prefill(req.prompt_ids, req.sampling, req.stop_ids)
            except Exception as e:
                self._finish(req, "error", f"prefill failed: {type(e).__name__}: {e}")
                return
            plen = len(req.prompt_ids)
            first = int(np.asarray(row.history)[0, plen])
            req.seen = {
                "steps": 0,
                "hist_len": plen + 1,
                "checked": np.zeros(self.engine.stat_width, np.int64),
                "accepted": np.zeros(self.engine.stat_width, np.int64),
            }
            self._emit(req, [first], time.perf_counter())
            if bool(np.asarray(row.done)[0]):
                self._finish(req, "stop" if bool(np.asarray(row.stopped)[0]) else "length")
                return
        req.run_steps = 0
        self.state = self.engine.insert(self.state, slot, row)
        self.slots[slot] = req

    def _free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def _preempt(self) -> int | None:
        """Park the most recently admitted batch row that has run `min_run_steps` (at most as many
        parked rows as the largest bucket: each holds a full-length cache row)."""
        with self._cv:
            parked = sum(r.parked is not None for r in self._queues["batch"])
        if parked >= self.buckets[-1]:
            return None
        victims = [
            (i, r)
            for i, r in enumerate(self.slots)
            if r is not None and r.latency_class == "batch" and r.run_steps >= self.cfg.min_run_steps
        ]
        if not victims:
            return None
        slot, req = max(victims, key=lambda x: x[1].admitted or 0.0)
        req.parked = self.engine.extract(self.state, slot)
        self.state = self.engine.insert(self.state, slot, self.engine.free_row())
        req.preemptions += 1
        self.slots[slot] = None
        self._push_front(req)
        self.metrics.preemptions.inc()
        self.log.add(
            "preempt",
            f"batch request {req.id} parked after {req.run_steps} steps to admit an "
            f"interactive request (bucket {self.bucket} full)",
            slot=slot,
        )
        return slot

    def _resize(self, bucket: int, why: str) -> None:
        live = [i for i, r in enumerate(self.slots) if r is not None]
        self.state = self.engine.resize(self.state, live, bucket)
        self.slots = [self.slots[i] for i in live] + [None] * (bucket - len(live))
        self.log.add("bucket", f"running batch bucket {self.bucket} -> {bucket}: {why}", bucket=bucket)
        self.resizes += 1
        self.bucket = bucket
        self._small_for = 0

    def _maybe_shrink(self) -> None:
        live = sum(r is not None for r in self.slots)
        target = next(b for b in self.buckets if b >= max(live, 1))
        if target >= self.bucket or any(self.queue_depth().values()):
            self._small_for = 0
            return
        self._small_for += 1
        if self._small_for >= 2:
            self._resize(target, f"{live} running rows, nothing queued")

    def _handle_cancellations(self) -> None:
        """Cancelled requests leave wherever they are; a running one's slot gets a free row, so
        it stops computing at once."""
        with self._cv:
            cancel, self._cancel = self._cancel, {}
            reqs = [self._all[r] for r in cancel if r in self._all]
            for c, q in self._queues.items():
                self._queues[c] = collections.deque(r for r in q if r.id not in cancel)
        for req in reqs:
            req.parked = None
            if req in self.slots:
                slot = self.slots.index(req)
                self.state = self.engine.insert(self.state, slot, self.engine.free_row())
                self.slots[slot] = None
            self._finish(req, cancel[req.id])

    def _fail_all(self, message: str) -> None:
        with self._cv:
            reqs = list(self._all.values())
            for q in self._queues.values():
                q.clear()
            self._cancel.clear()
        for r in reqs:
            r.parked = None
            self._finish(r, "error", message)
        self.slots = [None] * self.bucket
        self.state = self.engine.empty(self.bucket)

    # ---- views ---------------------------------------------------------------------------------

    def _rows_per_class(self) -> dict[str, int]:
        rows = {c: 0 for c in LATENCY_CLASSES}
        for r in self.slots:
            if r is not None:
                rows[r.latency_class] += 1
        return rows

    def _gauges(self) -> None:
        for c, n in self._rows_per_class().items():
            self.metrics.running.set(n, **{"class": c})
        for c, n in self.queue_depth().items():
            self.metrics.queue.set(n, **{"class": c})
        self.metrics.bucket.set(self.bucket)


def build_scheduler(
    model, drafter: str | None, cfg: ServingConfig, log=None, measure: bool | None = None, implementation: str = "auto"
) -> Scheduler:
    """A warmed-up scheduler for `model` with the drafter spec (`ngram`, `eagle3[:PATH]`, ...).

    Every (bucket, K) chunk, insert/extract and prompt bucket is compiled here; step costs are
    timed unless the config gives them (`measure` overrides)."""
    from specjax.drafters import make_drafter

    ks = cfg.ks if (drafter or "none") != "none" else (0,)
    family = (
        make_drafter(drafter, max(ks), model, tree_topk=cfg.tree_topk, tree_depth=cfg.tree_depth)
        if max(ks) > 0
        else None
    )
    if family is not None and family.k_dependent_state and sum(k > 0 for k in ks) > 1 and cfg.policy != "schedule":
        # a drafter whose state follows K (MTP) serves at one K: the largest, and plain steps
        ks = tuple(k for k in ks if k in (0, max(ks)))
        cfg = dataclasses.replace(cfg, ks=ks)
        if log:
            log(f"the {family.name} drafter keeps state per draft size: K in {list(ks)}")
    engine = SlotEngine(
        model, family, ks=ks, buckets=cfg.buckets, max_seq_len=cfg.max_seq_len, implementation=implementation
    )
    if measure is None:
        measure = cfg.costs_table() is None
    engine.warmup(measure=measure, log=log)
    return Scheduler(engine, cfg, eos_ids=model.config.eos_token_ids)
