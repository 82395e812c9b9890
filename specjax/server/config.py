"""Serving settings: one dataclass, loadable from YAML (`configs/serving-policy.yaml`).

Everything the scheduler, the throttling policy and the acceptance monitor read is set here (the
monitor's section is `MonitorConfig`, defined beside the monitor in specjax/policy/monitor.py), so
that a deployment is described by one file and the CLI flags only override a few fields.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from specjax.errors import SpecjaxError
from specjax.policy.monitor import MonitorConfig

LATENCY_CLASSES = ("interactive", "batch")
POLICIES = ("rules", "always", "never", "schedule")


@dataclasses.dataclass
class ServingConfig:
    # Defaults sized for CPU warm-up (each (bucket, K) chunk compiles in 10-30 s for the default
    # model there); on an accelerator use larger buckets and a longer K ladder.
    buckets: tuple[int, ...] = (1, 2, 4)  # running-batch sizes (static shapes)
    ks: tuple[int, ...] = (0, 1, 2, 3)  # K values the policy may choose (all compiled at warm-up)
    # token trees: tree_topk > 1 makes every K > 0 a dynamic tree of K nodes over at most
    # tree_depth levels (0: min(K, 5)), priced by the policy over its depth (specjax/policy/chunks.py)
    tree_topk: int = 1
    tree_depth: int = 0
    chunk_steps: int = 8  # steps per compiled chunk between scheduling decisions
    max_seq_len: int = 1024  # prompt + max_tokens per request (the KV cache size follows)
    policy: str = "rules"  # rules | always (K max) | never (K = 0) | schedule (K by running batch)
    schedule: tuple[tuple[int, int], ...] = ()  # (max running rows, K), first match; for `schedule`
    margin: float = 0.03  # switch K only for an expected throughput gain above this (hysteresis)
    interactive_weight: float = 2.0  # weight of interactive rows' tokens while nothing is queued
    preempt: bool = True  # park batch rows to admit waiting interactive requests
    min_run_steps: int = 8  # a row runs at least this many steps before it can be preempted
    default_class: str = "interactive"  # for requests that name none (and no API key / route)
    api_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # API key -> latency class
    default_max_tokens: int = 256  # chat completions without max_tokens (capped by the context)
    # Largest request body accepted (413 above it). 4 MiB of text is far more tokens than any
    # context served here, and tokenizing it costs seconds of CPU (off the event loop).
    max_request_bytes: int = 4 * 1024 * 1024
    step_costs: Any = None  # {bucket: {K: seconds}} or a JSON path; None = measure at warm-up
    calibrate_costs: bool = True  # scale the step costs by what the chunks actually take (specjax/policy/costs.py)
    cost_refresh_chunks: int = 32  # with calibration: run plain a chunk when K = 0 has not been timed
    # at this bucket for this many chunks (its cost is what every K > 0 is judged against); 0: never
    confidence_z: float = 1.0  # K > 0 must pay with each acceptance lowered by this many std errors
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)

    def validate(self) -> "ServingConfig":
        def bad(msg):
            raise SpecjaxError(f"serving config: {msg}")

        if not self.buckets or min(self.buckets) < 1:
            bad(f"buckets must be integers >= 1, got {self.buckets}")
        if not self.ks or min(self.ks) < 0:
            bad(f"ks must be integers >= 0, got {self.ks}")
        if self.tree_topk < 1 or self.tree_depth < 0:
            bad(f"need tree_topk >= 1 and tree_depth >= 0, got {self.tree_topk}, {self.tree_depth}")
        if self.cost_refresh_chunks < 0 or self.confidence_z < 0:
            bad("cost_refresh_chunks and confidence_z must be >= 0")
        if self.chunk_steps < 1:
            bad(f"chunk_steps must be >= 1, got {self.chunk_steps}")
        if self.max_request_bytes < 1024:
            bad(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_seq_len < 2:
            bad(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.policy not in POLICIES:
            bad(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy in ("rules", "never") and 0 not in self.ks:
            bad(f"policy {self.policy!r} runs plain chunks, so ks must include 0, got {list(self.ks)}")
        if self.policy == "schedule" and not self.schedule:
            bad("policy 'schedule' needs a schedule: a list of {max_batch, k}")
        for rows, k in self.schedule:
            if k not in self.ks:
                bad(f"schedule uses K={k}, which is not in ks {self.ks}")
        if self.default_class not in LATENCY_CLASSES:
            bad(f"default_class must be one of {', '.join(LATENCY_CLASSES)}")
        for key, cls in self.api_keys.items():
            if cls not in LATENCY_CLASSES:
                bad(f"api key class must be one of {', '.join(LATENCY_CLASSES)}, got {cls!r}")
        m = self.monitor
        if not 0 < m.off_below <= m.on_above:
            bad("monitor: need 0 < off_below <= on_above")
        if m.window_steps < 1 or m.min_steps < 1 or m.probe_every < 1 or m.probe_steps < 1:
            bad("monitor: window_steps, min_steps, probe_every, probe_steps must be >= 1")
        if not (0 < m.prior_acceptance <= 1 and 0 < m.probe_acceptance <= 1):
            bad("monitor: prior_acceptance and probe_acceptance must be in (0, 1]")
        if m.probe_gain < m.on_above:
            bad("monitor: need probe_gain >= on_above")
        if m.probe_backoff < 1 or m.probe_every_max < m.probe_every:
            bad("monitor: need probe_backoff >= 1 and probe_every_max >= probe_every")
        return self

    def costs_table(self) -> dict[int, dict[int, float]] | None:
        """`step_costs` as {bucket: {K: seconds}}, read from JSON when it is a path."""
        costs = self.step_costs
        if costs is None:
            return None
        if isinstance(costs, str):
            try:
                with open(costs) as fh:
                    costs = json.load(fh)
            except (OSError, ValueError) as e:
                raise SpecjaxError(f"step costs {self.step_costs}: {e}") from None
            costs = costs.get("step_costs", costs)
        try:
            return {int(b): {int(k): float(c) for k, c in row.items()} for b, row in costs.items()}
        except (AttributeError, TypeError, ValueError):
            raise SpecjaxError("step costs must map bucket -> {K: seconds per step}") from None


def load_config(path: str | None, **overrides) -> ServingConfig:
    """A ServingConfig from YAML (unknown keys are errors), then non-None `overrides`."""
    raw: dict[str, Any] = {}
    if path:
        import yaml

        try:
            with open(path) as fh:
                raw = yaml.safe_load(fh) or {}
        except OSError as e:
            raise SpecjaxError(f"{path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise SpecjaxError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(raw, dict):
            raise SpecjaxError(f"{path}: expected a mapping at the top level")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    fields = {f.name for f in dataclasses.fields(ServingConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise SpecjaxError(f"serving config: unknown keys {unknown} (known: {sorted(fields)})")
    kw = dict(raw)
    mon = kw.pop("monitor", None) or {}
    if isinstance(mon, MonitorConfig):
        monitor = mon
    else:
        mfields = {f.name for f in dataclasses.fields(MonitorConfig)}
        if set(mon) - mfields:
            raise SpecjaxError(f"serving config: unknown monitor keys {sorted(set(mon) - mfields)}")
        monitor = MonitorConfig(**mon)
    try:
        for name in ("buckets", "ks"):
            if name in kw:
                kw[name] = tuple(int(x) for x in kw[name])
        if "schedule" in kw:
            kw["schedule"] = tuple(_schedule_entry(e) for e in kw["schedule"] or ())
        cfg = ServingConfig(**kw, monitor=monitor)
    except (TypeError, ValueError) as e:
        raise SpecjaxError(f"serving config: {e}") from None
    return cfg.validate()


def _schedule_entry(e) -> tuple[int, int]:
    if isinstance(e, dict):
        return int(e["max_batch"]), int(e["k"])
    rows, k = e
    return int(rows), int(k)
