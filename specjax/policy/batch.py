"""A batch job's speculation (`specjax batch --spec-policy`), the same on every resume.

Settings:

* `auto` (default): once per batch class (padded rows; greedy or sampled), on the class's first
  batch with its own rows and shapes, measure the cost table (costs.measure_costs) and the
  class's gain: tokens per second of a short run of the drafter as it drafts (its own gates
  included) over a plain run's (`PROBE_TOKENS` tokens a row, after an untimed run of each);
  write both to `OUT.policy.json` before that batch writes a row. A class speculates only on a
  gain of at least 1 + `MARGIN`; its rows then follow the per-row rule of rows.py; otherwise they
  decode plainly, without the drafter. A verify pass is paid by the whole batch, and the per-row
  rule prices a row's verify as if its batch-mates gained as much, so where the batch as a whole
  does not gain, a few rows that do cannot carry it: on this CPU rows deciding alone made
  EAGLE-3 at 32 rows decode at 0.41x plain and the n-gram drafter (K = 15) at 8 rows at 0.5x.
  A rerun after a kill reads the file, so every batch makes the same decisions (the per-row
  rule reads nothing else but the tokens the rows emit): resumed rows equal uninterrupted ones
  bit for bit, sampled rows too.
* `always`: every row verifies whatever the drafter proposes, however large the batch.
* N >= 0: `always` in batches of at most N rows, plain decoding above (vLLM's disable by batch
  size); 0 never speculates.

The file also counts, per class, the batches, steps and verify steps that ran, for the job's
summary (`speculation`).
"""

from __future__ import annotations

import json
import os

from specjax.errors import SpecjaxError

FILE_VERSION = 4
MARGIN = 0.05  # a class speculates only on a measured gain of at least 1 + MARGIN


def parse_policy(value) -> str | int:
    """'auto' | 'always' | N >= 0 (int); anything else is a one-line error."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "always"):
            return text
        try:
            n = int(text)
        except ValueError:
            raise SpecjaxError(f"--spec-policy must be auto, always or a row count >= 0, got {value!r}") from None
    if n < 0:
        raise SpecjaxError(f"--spec-policy row count must be >= 0, got {n}")
    return n


def class_key(size: int, greedy: bool) -> str:
    return f"{size}/{'greedy' if greedy else 'sampled'}"


class BatchPolicy:
    """How each batch of one job (one process's part) speculates; state in `path` under `auto`."""

    def __init__(self, policy, num_draft: int, drafter: str, path: str | None):
        self.policy = parse_policy(policy)
        self.k = num_draft
        self.drafter = drafter
        self.path = path if self.policy == "auto" and num_draft > 0 else None
        # class -> {"costs": [K + 1], "gain", "speculates", "batches", "steps", "verified_steps"}
        self.classes: dict[str, dict] = {}
        if self.path and os.path.exists(self.path):
            self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError) as e:
            raise SpecjaxError(f"{self.path}: unreadable speculation state ({e}); delete it to measure the "
                               "step costs again") from None
        if not isinstance(state, dict) or (state.get("version"), state.get("drafter"), state.get("num_draft")) != (
                FILE_VERSION, self.drafter, self.k):
            # Another drafter or K (or an older file): its tables do not apply. Rows written stay.
            return
        classes = state.get("classes")
        if not isinstance(classes, dict) or not all(
                isinstance(c, dict) and isinstance(c.get("costs"), list) and len(c["costs"]) == self.k + 1
                and isinstance(c.get("speculates"), bool)
                for c in classes.values()):
            raise SpecjaxError(f"{self.path}: malformed speculation state; delete it to measure the step costs again")
        self.classes = classes

    def _save(self) -> None:
        from specjax.serving.scaleout import write_atomic

        state = {"version": FILE_VERSION, "drafter": self.drafter, "num_draft": self.k, "classes": self.classes}
        write_atomic(self.path, (json.dumps(state, indent=1) + "\n").encode())

    def speculates(self, size: int) -> bool:
        """Whether the settings let batches of `size` rows run the drafter at all."""
        if self.k == 0:
            return False
        return size <= self.policy if isinstance(self.policy, int) else True

    def plan(self, size: int, greedy: bool, measure) -> tuple[bool, list[float] | None]:
        """(run the drafter, cost table the rows decide with; None: verify whatever the drafter
        proposes) for a batch of this class. Under `auto` from the recorded figures, else from
        `measure()`'s (cost table [K + 1], gain), recorded before they are used; a failed
        measurement (None) records nothing and the batch verifies every step."""
        if not self.speculates(size):
            return False, None
        if self.path is None:
            return True, None
        cls = class_key(size, greedy)
        if cls not in self.classes:
            got = measure()
            if got is None:
                return True, None
            table, gain = [float(x) for x in got[0]], float(got[1])
            self.classes[cls] = {"costs": table, "gain": gain, "speculates": gain >= 1.0 + MARGIN,
                                 "batches": 0, "steps": 0, "verified_steps": 0}
            self._save()
        entry = self.classes[cls]
        return entry["speculates"], entry["costs"] if entry["speculates"] else None

    def record(self, size: int, greedy: bool, steps: int, verified_steps: int) -> None:
        """A batch of this class ran: its rows' steps and verify steps (call before writing its rows)."""
        entry = self.classes.get(class_key(size, greedy)) if self.path else None
        if entry is None:
            return
        entry["batches"] += 1
        entry["steps"] += steps
        entry["verified_steps"] += verified_steps
        self._save()

    def summary(self) -> dict:
        """Per class: batches, the verify step's cost at K in plain steps, the measured gain,
        whether the class speculates, and the share of steps that verified."""
        return {cls: {"batches": e["batches"], "verify_cost": e["costs"][-1], "gain": e["gain"],
                      "speculates": e["speculates"],
                      "verified_share": e["verified_steps"] / e["steps"] if e["steps"] else None}
                for cls, e in sorted(self.classes.items(), key=lambda x: (int(x[0].split("/")[0]), x[0]))}

    def describe(self, size: int, greedy: bool) -> str:
        mode = "greedy" if greedy else "sampled"
        if not self.speculates(size):
            return f"{mode} batches of {size} rows: plain decoding (--spec-policy {self.policy})"
        entry = self.classes.get(class_key(size, greedy)) if self.path else None
        if entry is None:
            return f"{mode} batches of {size} rows: K={self.k}, every step verifies (--spec-policy {self.policy})"
        c, g = entry["costs"][-1], entry["gain"]
        if not entry["speculates"]:
            return (f"{mode} batches of {size} rows: plain decoding (the drafter ran at {g:.2f}x plain on the first "
                    "batch)")
        return (f"{mode} batches of {size} rows: K={self.k} (the drafter ran at {g:.2f}x plain on the first batch); "
                f"each row verifies while its acceptance pays for a verify step at {c:.2f} plain steps")
