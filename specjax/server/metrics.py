"""Serving metrics in the Prometheus text exposition format (version 0.0.4), served at /metrics.

A small thread-safe registry (counters, gauges, histograms with labels) is all a scrape needs;
the scheduler thread writes, HTTP handlers render. `ServingMetrics` declares every series:

counters   specjax_steps_total{k}                          chunk steps run, by K
           specjax_draft_tokens_total{class}               draft positions checked by the target
           specjax_accepted_tokens_total{position}          accepted drafts by position (1-based)
           specjax_generated_tokens_total{class}
           specjax_requests_total{class, status}            finished | cancelled | error
           specjax_preemptions_total
           specjax_speculation_switches_total{class, to}    the monitor's fallback switches
gauges     specjax_mean_accepted_length{class, drafter}     rolling MAL (speculative steps)
           specjax_acceptance_rate{class, drafter}          rolling accepted / checked
           specjax_speculation_enabled{class}               1 on, 0 off (fallback)
           specjax_queue_depth{class}, specjax_running_batch{class}, specjax_batch_bucket
           specjax_num_draft                                K of the last chunk
           specjax_step_seconds{bucket, k}                  measured, last chunk at that bucket and K
           specjax_expected_step_seconds{bucket, k}         the policy's step cost (table x live calibration)
histograms specjax_time_to_first_token_seconds{class}
           specjax_inter_token_latency_seconds{class}       per token (a chunk's tokens share its gap)
"""

from __future__ import annotations

import math
import threading

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    if float(x).is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


class _Metric:
    kind = ""

    def __init__(self, registry: "Registry", name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = registry.lock
        self._values: dict[tuple, object] = {}
        registry.metrics.append(self)

    def _key(self, labels: dict) -> tuple:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            items = sorted(self._values.items())
        for key, v in items:
            lines += self._render_one(key, v)
        return lines

    def _render_one(self, key, v) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, key)} {_num(v)}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels) -> float:
        with self._lock:
            return float(self._values.get(self._key(labels), 0.0))


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def value(self, **labels) -> float:
        with self._lock:
            return float(self._values.get(self._key(labels), 0.0))


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry, name, help, labels=(), buckets=LATENCY_BUCKETS):
        super().__init__(registry, name, help, labels)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, count: int = 1, **labels) -> None:
        """`count` observations of `value` (a chunk's tokens share one inter-token gap)."""
        key = self._key(labels)
        with self._lock:
            h = self._values.setdefault(key, [[0] * len(self.buckets), 0.0, 0])
            for i, b in enumerate(self.buckets):
                if value <= b:
                    h[0][i] += count
            h[1] += value * count
            h[2] += count

    def stats(self, **labels) -> tuple[int, float]:
        """(count, sum)."""
        with self._lock:
            h = self._values.get(self._key(labels))
            return (h[2], h[1]) if h else (0, 0.0)

    def _render_one(self, key, h) -> list[str]:
        counts, total, n = h
        lines = []
        for b, c in zip(self.buckets, counts):
            le = 'le="%s"' % _num(b)
            lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} {c}")
        inf = 'le="+Inf"'
        lines.append(f"{self.name}_bucket{_labels(self.label_names, key, inf)} {n}")
        lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_num(total)}")
        lines.append(f"{self.name}_count{_labels(self.label_names, key)} {n}")
        return lines


class Registry:
    def __init__(self):
        self.lock = threading.Lock()
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        out = []
        for m in self.metrics:
            out += m.render()
        return "\n".join(out) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServingMetrics:
    """Every series the scheduler exports (see the module docstring)."""

    def __init__(self):
        r = self.registry = Registry()
        self.steps = Counter(r, "specjax_steps_total", "Decode steps run, by K (0 = plain)", ("k",))
        self.draft_tokens = Counter(r, "specjax_draft_tokens_total", "Draft tokens checked by the target", ("class",))
        self.accepted = Counter(
            r, "specjax_accepted_tokens_total", "Accepted draft tokens by draft position", ("position",)
        )
        self.generated = Counter(r, "specjax_generated_tokens_total", "Generated tokens", ("class",))
        self.requests = Counter(
            r, "specjax_requests_total", "Requests by latency class and outcome", ("class", "status")
        )
        self.preemptions = Counter(r, "specjax_preemptions_total", "Batch rows parked for interactive requests")
        self.switches = Counter(
            r, "specjax_speculation_switches_total", "Acceptance-monitor fallback switches", ("class", "to")
        )
        self.mal = Gauge(
            r, "specjax_mean_accepted_length", "Rolling mean accepted length (speculative steps)", ("class", "drafter")
        )
        self.acceptance = Gauge(r, "specjax_acceptance_rate", "Rolling acceptance rate", ("class", "drafter"))
        self.spec_enabled = Gauge(
            r, "specjax_speculation_enabled", "1 when speculation is on for the class", ("class",)
        )
        self.queue = Gauge(r, "specjax_queue_depth", "Queued requests (parked rows included)", ("class",))
        self.running = Gauge(r, "specjax_running_batch", "Rows in the running batch", ("class",))
        self.bucket = Gauge(r, "specjax_batch_bucket", "Batch-size bucket of the running batch")
        self.num_draft = Gauge(r, "specjax_num_draft", "K in use (draft tokens per step) in the last chunk")
        self.step_seconds = Gauge(
            r,
            "specjax_step_seconds",
            "Seconds per step of the last chunk run at this "
            "bucket and K (the policy's table: specjax_expected_step_seconds)",
            ("bucket", "k"),
        )
        self.expected_step = Gauge(
            r,
            "specjax_expected_step_seconds",
            "Step cost the policy uses (warm-up or config table, calibrated live)",
            ("bucket", "k"),
        )
        self.ttft = Histogram(r, "specjax_time_to_first_token_seconds", "Time to first token", ("class",))
        self.itl = Histogram(r, "specjax_inter_token_latency_seconds", "Inter-token latency", ("class",))

    def render(self) -> str:
        return self.registry.render()
