"""Speculation in batch jobs only where it pays (`specjax batch --spec-throttle`).

A verify pass over K + 1 tokens per row costs about one plain step while decoding is bound by
reading the weights (few rows, accelerators); as the batch grows the pass becomes compute-bound
and costs up to K + 1 plain steps. On the 2-core CPU a 32-row batch job with EAGLE-3 at K = 3
decoded at 0.28x plain (docs/performance.md). The serving scheduler throttles K per chunk from
live figures (policy.py); a batch job must also stay resumable: a batch rerun after a kill has
to run with the K it ran with before, or its sampled rows draw other samples than an
uninterrupted run. So the job decides per *class* of batch (padded row count; greedy or sampled)
from measurements, and writes `<output>.throttle.json` before it writes any row of a batch: the
K each batch runs with and every figure a decision was made from. A rerun reads the file;
batches that ran keep their K, later ones are decided from the same figures.

Policies:

* `auto` (default): the first batch of a class first runs two short probes on its own rows and
  shapes (`PROBE_TOKENS` tokens per row; the compiled code is what the batch itself runs), one
  speculative and one plain. Expected gain of speculation = MAL x c0 / cK, where c0 and cK are
  seconds per loop iteration of the plain probe and of every speculative run of the class (the
  probe and the batches), and MAL the tokens per row-step of those runs (steps on which a
  drafter skipped verification included, with their one token). The class speculates while the
  gain is at least `1 + MARGIN`. The first tokens of replies flatter a drafter (docs/
  performance.md: MAL 2.0-2.4 in 16 row-steps against 1.35 over whole replies), so a class that
  the probe switched on is switched off by the first whole batches that show otherwise; a class
  that is off stays off (plain batches say nothing about acceptance).
* `off`: K on every batch (the drafter as asked, however the batch grows).
* an integer N: speculate in batches of at most N rows, plain above (vLLM's
  disable-by-batch-size); 0 never speculates.
"""

from __future__ import annotations

import dataclasses
import json
import os

from specjax.errors import SpecjaxError

PROBE_TOKENS = 16  # tokens per row of each probe
MARGIN = 0.05  # a class speculates only on an expected gain of at least 1 + MARGIN
FILE_VERSION = 1


def parse_policy(value) -> str | int:
    """'auto' | 'off' | N >= 0 (int); anything else is a one-line error."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "off"):
            return text
        try:
            n = int(text)
        except ValueError:
            raise SpecjaxError(f"--spec-throttle must be auto, off or a row count >= 0, got {value!r}") from None
    if n < 0:
        raise SpecjaxError(f"--spec-throttle row count must be >= 0, got {n}")
    return n


def class_key(size: int, greedy: bool) -> str:
    return f"{size}/{'greedy' if greedy else 'sampled'}"


@dataclasses.dataclass
class Figures:
    """What one run of a batch (or probe) says about its mode, summed over runs."""

    iterations: int = 0  # loop iterations: the steps of the batch's longest-running row
    seconds: float = 0.0  # decode seconds (prefill and compile excluded)
    row_steps: int = 0  # steps of all rows
    step_tokens: int = 0  # tokens those steps emitted (the prefill's first token excluded)

    @classmethod
    def of_rows(cls, steps: list[int], tokens: list[int], decode_seconds: float) -> Figures:
        """`steps[i]`, `tokens[i]`: loop steps and generated tokens of row i (real rows only)."""
        return cls(max(steps, default=0), decode_seconds, sum(steps), sum(max(t - 1, 0) for t in tokens))

    def __add__(self, o: Figures) -> Figures:
        return Figures(self.iterations + o.iterations, self.seconds + o.seconds, self.row_steps + o.row_steps,
                       self.step_tokens + o.step_tokens)

    @property
    def per_iteration(self) -> float | None:
        return self.seconds / self.iterations if self.iterations else None

    @property
    def mal(self) -> float | None:
        return self.step_tokens / self.row_steps if self.row_steps else None


def step_ratio(plain: Figures, spec: Figures) -> float | None:
    """Seconds of a speculative loop step over a plain one, or None if unknown."""
    c0, ck = plain.per_iteration, spec.per_iteration
    return ck / c0 if c0 and ck else None


def expected_gain(plain: Figures, spec: Figures) -> float | None:
    """Throughput of speculation over plain decoding these figures predict, or None if unknown:
    MAL x plain step / speculative step."""
    ratio, mal = step_ratio(plain, spec), spec.mal
    return mal / ratio if ratio and mal is not None else None


class BatchThrottle:
    """K per batch for one job (one process's part); state in `path` under `auto`."""

    def __init__(self, policy, num_draft: int, drafter: str, path: str | None):
        self.policy = parse_policy(policy)
        self.k = num_draft
        self.drafter = drafter
        self.path = path if self.policy == "auto" and num_draft > 0 else None
        self.batches: dict[str, int] = {}  # batch key (first input line) -> K it runs with
        self.classes: dict[str, str] = {}  # batch key -> class key
        self.runs: dict[str, dict] = {}  # batch key -> Figures of its speculative run (as a dict)
        self.probes: dict[str, dict] = {}  # class key -> {"spec": Figures, "plain": Figures}
        if self.path and os.path.exists(self.path):
            self._load()

    # -- state file ------------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError) as e:
            raise SpecjaxError(f"{self.path}: unreadable throttle state ({e}); delete it to start the "
                               "speculation decisions over") from None
        if (state.get("version"), state.get("drafter"), state.get("num_draft")) != (
                FILE_VERSION, self.drafter, self.k):
            # Another drafter or K: its decisions do not apply. Batches written under them stay.
            return
        self.batches = {str(k): int(v) for k, v in state.get("batches", {}).items()}
        self.classes = {str(k): str(v) for k, v in state.get("classes", {}).items()}
        self.runs = state.get("runs", {})
        self.probes = state.get("probes", {})

    def _save(self) -> None:
        if self.path is None:
            return
        from specjax.serving.scaleout import write_atomic

        state = {"version": FILE_VERSION, "drafter": self.drafter, "num_draft": self.k,
                 "decisions": self.summary(), "batches": self.batches, "classes": self.classes,
                 "runs": self.runs, "probes": self.probes}
        write_atomic(self.path, (json.dumps(state, indent=1) + "\n").encode())

    # -- decisions -------------------------------------------------------------------------------

    def _class_figures(self, cls: str) -> tuple[Figures, Figures] | None:
        probe = self.probes.get(cls)
        if probe is None:
            return None
        spec = Figures(**probe["spec"])
        for key, fig in self.runs.items():
            if self.classes.get(key) == cls:
                spec = spec + Figures(**fig)
        return Figures(**probe["plain"]), spec

    def gain(self, cls: str) -> float | None:
        figs = self._class_figures(cls)
        return expected_gain(*figs) if figs else None

    def _decide(self, cls: str) -> int:
        g = self.gain(cls)
        return self.k if g is not None and g >= 1.0 + MARGIN else 0

    def needs_probe(self, key: str, size: int, greedy: bool) -> bool:
        return (self.path is not None and key not in self.batches
                and class_key(size, greedy) not in self.probes)

    def k_for(self, key: str, size: int, greedy: bool) -> int:
        """K batch `key` runs with (recorded before it runs, under `auto`)."""
        if self.k == 0 or self.policy == "off":
            return self.k
        if isinstance(self.policy, int):
            return self.k if size <= self.policy else 0
        if key in self.batches:  # ran before (this job was killed): the same K again
            return self.batches[key]
        cls = class_key(size, greedy)
        # No probe figures (the probe failed): run as asked; the next batch of the class probes.
        k = self._decide(cls) if cls in self.probes else self.k
        self.batches[key], self.classes[key] = k, cls
        self._save()
        return k

    def record_probe(self, size: int, greedy: bool, spec: Figures, plain: Figures) -> None:
        self.probes[class_key(size, greedy)] = {"spec": dataclasses.asdict(spec), "plain": dataclasses.asdict(plain)}
        self._save()

    def record_batch(self, key: str, k: int, figures: Figures) -> None:
        """Figures of a batch that ran; call before writing its rows (speculative batches inform
        their class's later decisions)."""
        if self.path is None or k == 0:
            return
        self.runs[key] = dataclasses.asdict(figures)
        self._save()

    def summary(self) -> dict:
        """Per class: K of its batches so far, the current expected gain and what it rests on."""
        out = {}
        for cls in sorted(set(self.classes.values()) | set(self.probes), key=lambda c: (int(c.split("/")[0]), c)):
            ks = [self.batches[b] for b, c in self.classes.items() if c == cls]
            figs = self._class_figures(cls)
            entry = {"batches": len(ks), "speculative_batches": sum(k > 0 for k in ks)}
            if figs:
                plain, spec = figs
                entry.update(expected_gain=expected_gain(plain, spec), mal=spec.mal,
                             verify_step_over_plain=step_ratio(plain, spec), next_k=self._decide(cls))
            out[cls] = entry
        return out

    def describe(self, cls: str) -> str:
        figs = self._class_figures(cls)
        size, mode = cls.split("/")
        if not figs:
            return f"{mode} batches of {size} rows: K={self.k} (no probe figures)"
        plain, spec = figs
        g = expected_gain(plain, spec)
        k = self._decide(cls)
        ratio = step_ratio(plain, spec)
        return (f"{mode} batches of {size} rows: {'speculate at K=' + str(k) if k else 'decode plainly'} "
                f"(expected {g:.2f}x plain: MAL {spec.mal:.2f}, a speculative step costs {ratio:.2f} plain steps)"
                if g is not None else f"{mode} batches of {size} rows: K={k}")
