"""A batch job's speculation (`specjax batch --spec-policy`), the same on every resume.

Settings:

* `auto` (default): once per batch class (padded rows; greedy or sampled), on the class's first
  batch with its own rows and shapes, measure the cost table (costs.measure_costs) and the
  class's gain: tokens per second of a short run of the drafter as it drafts (its own gates
  included) over a plain run's (`PROBE_TOKENS` tokens a row, after a short untimed run of each,
  all from one prefill per prefill shape); write both to `OUT.policy.json` before that batch
  writes a row. A class speculates only on a gain of at least 1 + `MARGIN`; its rows then follow
  the per-row rule of rows.py; otherwise they decode plainly, without the drafter. A verify pass
  is paid by the whole batch, and the per-row rule prices a row's verify as if its batch-mates
  gained as much, so where the batch as a whole does not gain, a few rows that do cannot carry
  it: on this CPU rows deciding alone made EAGLE-3 at 32 rows decode at 0.41x plain and the
  n-gram drafter (K = 15) at 8 rows at 0.5x.
  A rerun after a kill reads the file, so every batch makes the same decisions (the per-row
  rule reads nothing else but the tokens the rows emit): resumed rows equal uninterrupted ones
  bit for bit, sampled rows too.
  With `--num-draft auto` (or `auto:N1,N2,...`) the first batch of each class measures every
  candidate K (tree nodes under `--tree-topk` > 1; `AUTO_TREE_NODES` / `AUTO_CHAIN_K` by
  default, those the drafter can draft) the same way and keeps the fastest: the tree size is
  chosen per batch size by timing, as EAGLE's `total_token=-1` does, but on the job's own rows
  with the acceptance they get rather than an assumed curve.
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

FILE_VERSION = 5
MARGIN = 0.05  # a class speculates only on a measured gain of at least 1 + MARGIN
AUTO_TREE_NODES = (4, 8, 16, 32)  # --num-draft auto with --tree-topk > 1: tree sizes tried
AUTO_CHAIN_K = (1, 3, 5)  # ... with chains


def _word_or_count(value, words: tuple[str, ...], usage: str, negative: str) -> str | int:
    """`value` as one of `words` (lower case) or an int >= 0; otherwise the one-line SpecjaxError
    `usage` (neither) or `negative` (a count below 0)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text in words:
            return text
        try:
            n = int(text)
        except ValueError:
            raise SpecjaxError(usage.format(value=repr(value))) from None
    if n < 0:
        raise SpecjaxError(negative.format(n=n))
    return n


def parse_num_draft(value) -> int | tuple[tuple[int, ...], bool]:
    """`--num-draft`: K >= 0 (int), or `auto` / `auto:N1,N2` -> (candidates, given explicitly);
    () candidates: the defaults for the proposal shape. Anything else is a one-line error."""
    text = str(value).strip().lower()
    if text.startswith("auto:"):
        try:
            sizes = tuple(sorted({int(x) for x in text[5:].split(",") if x.strip()}))
        except ValueError:
            sizes = ()
        if not sizes or sizes[0] < 1:
            raise SpecjaxError(f"--num-draft auto:N1,N2,... takes integers >= 1, got {value!r}")
        return sizes, True
    k = _word_or_count(
        value,
        ("auto",),
        "--num-draft must be K >= 0, auto or auto:N1,N2,..., got {value}",
        "--num-draft must be >= 0, got {n}",
    )
    return ((), False) if k == "auto" else k


def parse_policy(value) -> str | int:
    """'auto' | 'always' | N >= 0 (int); anything else is a one-line error."""
    return _word_or_count(
        value,
        ("auto", "always"),
        "--spec-policy must be auto, always or a row count >= 0, got {value}",
        "--spec-policy row count must be >= 0, got {n}",
    )


def draft_variants(spec: str | None, num_draft, model, tree_topk: int = 1, tree_depth: int = 0) -> dict:
    """K -> drafter: the one `--num-draft K` names, or `--num-draft auto`'s candidates (those
    of the defaults the drafter can draft; explicit ones must all be draftable)."""
    from specjax.drafters.cached import get_drafter
    from specjax.errors import DrafterError

    k = parse_num_draft(num_draft)
    if isinstance(k, int) or (spec or "none").strip() == "none":
        d = get_drafter(spec, k if isinstance(k, int) else 0, model, tree_topk, tree_depth)
        return {d.num_draft: d}
    sizes, explicit = k
    out = {}
    for n in sizes or (AUTO_TREE_NODES if tree_topk > 1 else AUTO_CHAIN_K):
        try:
            out[n] = get_drafter(spec, n, model, tree_topk, tree_depth)
        except DrafterError:
            if explicit:
                raise
    if not out:
        raise DrafterError(
            f"--num-draft auto: the {spec} drafter can draft none of "
            f"{AUTO_TREE_NODES if tree_topk > 1 else AUTO_CHAIN_K} (give auto:N1,N2,...)"
        )
    return out


def choose(gains: dict) -> tuple[int, list[float] | None]:
    """The class rule, from `costs.measure_gains`' {K: (cost table, gain)}: (the K of the best
    gain (ties: the smaller K), its cost table, or None where that gain is under 1 + MARGIN and
    the rows decode plainly, without the drafter)."""
    k = max(gains, key=lambda k: (gains[k][1], -k))
    return k, (list(gains[k][0]) if gains[k][1] >= 1.0 + MARGIN else None)


def plan_call(engine, ids, params, eos_ids, variants: dict, labels: dict) -> tuple[int, list[float] | None]:
    """`auto` for one batch outside a job (`generate`, the bench): (K, cost table; None: plain
    decoding). A batch of several rows, or a choice of K, is judged whole by `choose` on these
    rows (`costs.measure_gains`): the per-row rule alone prices a row's verify as if its
    batch-mates gained as much, and a static batch runs until its slowest row is done, so on
    this CPU rows deciding alone ran generate at 8 rows at 0.70-0.92x plain. One row with one K
    decides alone: the per-row rule then prices exactly that row's verify (`costs.measure_costs`)."""
    from specjax.policy.costs import measure_costs, measure_gains

    if len(ids) == 1 and len(variants) == 1:
        ((k, d),) = variants.items()
        return k, measure_costs(engine, ids, params, eos_ids, d, labels[k]).tolist()
    return choose(measure_gains(engine, ids, params, eos_ids, variants, labels))


def class_key(size: int, greedy: bool) -> str:
    return f"{size}/{'greedy' if greedy else 'sampled'}"


class BatchPolicy:
    """How each batch of one job (one process's part) speculates; state in `path` under `auto`."""

    def __init__(self, policy, ks: tuple[int, ...], drafter: str, path: str | None, num_draft: str | None = None):
        """`ks`: the K a class may run (one, or `--num-draft auto`'s candidates, as `num_draft`
        names them: a file written for other candidates does not apply)."""
        self.policy = parse_policy(policy)
        self.ks = tuple(sorted(ks))
        self.k = self.ks[-1]
        self.num_draft = num_draft or str(self.k)
        self.drafter = drafter
        if len(self.ks) > 1 and self.policy != "auto":
            raise SpecjaxError(f"--num-draft {self.num_draft} chooses K by measuring: it needs --spec-policy auto")
        self.path = path if self.policy == "auto" and self.k > 0 else None
        # class -> {"num_draft": K, "costs": [its width + 1], "gain", "gains": {K: gain},
        #           "speculates", "batches", "steps", "verified_steps"}
        self.classes: dict[str, dict] = {}
        if self.path and os.path.exists(self.path):
            self._load()

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as fh:
                state = json.load(fh)
        except (OSError, ValueError) as e:
            raise SpecjaxError(
                f"{self.path}: unreadable speculation state ({e}); delete it to measure the step costs again"
            ) from None
        if not isinstance(state, dict) or (state.get("version"), state.get("drafter"), state.get("num_draft")) != (
            FILE_VERSION,
            self.drafter,
            self.num_draft,
        ):
            # Another drafter or K (or an older file): its tables do not apply. Rows written stay.
            return
        classes = state.get("classes")
        if not isinstance(classes, dict) or not all(
            isinstance(c, dict)
            and isinstance(c.get("costs"), list)
            and c.get("num_draft") in self.ks
            and isinstance(c.get("speculates"), bool)
            for c in classes.values()
        ):
            raise SpecjaxError(f"{self.path}: malformed speculation state; delete it to measure the step costs again")
        self.classes = classes

    def _save(self) -> None:
        from specjax.files import write_atomic

        state = {"version": FILE_VERSION, "drafter": self.drafter, "num_draft": self.num_draft, "classes": self.classes}
        write_atomic(self.path, (json.dumps(state, indent=1) + "\n").encode())

    def speculates(self, size: int) -> bool:
        """Whether the settings let batches of `size` rows run the drafter at all."""
        if self.k == 0:
            return False
        return size <= self.policy if isinstance(self.policy, int) else True

    def plan(self, size: int, greedy: bool, measure) -> tuple[bool, list[float] | None, int]:
        """(run the drafter, cost table the rows decide with (None: verify whatever the drafter
        proposes), K) for a batch of this class. Under `auto` from the recorded figures, else from
        `measure()`'s {K: (cost table [width + 1], gain)} over `ks`: the K of the best gain,
        recorded before it is used; a failed measurement (None) records nothing and the batch
        verifies every step at the largest K."""
        if not self.speculates(size):
            return False, None, 0
        if self.path is None:
            return True, None, self.k
        cls = class_key(size, greedy)
        if cls not in self.classes:
            got = measure()
            if got is None:
                return True, None, self.k
            k, table = choose(got)
            self.classes[cls] = {
                "num_draft": k,
                "costs": [float(x) for x in got[k][0]],
                "gain": float(got[k][1]),
                "gains": {str(k_): float(g) for k_, (_, g) in sorted(got.items())},
                "speculates": table is not None,
                "batches": 0,
                "steps": 0,
                "verified_steps": 0,
            }
            self._save()
        entry = self.classes[cls]
        return entry["speculates"], entry["costs"] if entry["speculates"] else None, entry["num_draft"]

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
        return {
            cls: {
                "batches": e["batches"],
                "num_draft": e["num_draft"],
                "verify_cost": e["costs"][-1],
                "gain": e["gain"],
                "gains": e["gains"],
                "speculates": e["speculates"],
                "verified_share": e["verified_steps"] / e["steps"] if e["steps"] else None,
            }
            for cls, e in sorted(self.classes.items(), key=lambda x: (int(x[0].split("/")[0]), x[0]))
        }

    def describe(self, size: int, greedy: bool) -> str:
        mode = "greedy" if greedy else "sampled"
        if not self.speculates(size):
            return f"{mode} batches of {size} rows: plain decoding (--spec-policy {self.policy})"
        entry = self.classes.get(class_key(size, greedy)) if self.path else None
        if entry is None:
            return f"{mode} batches of {size} rows: K={self.k}, every step verifies (--spec-policy {self.policy})"
        c, g, k = entry["costs"][-1], entry["gain"], entry["num_draft"]
        tried = (
            ""
            if len(self.ks) == 1
            else (" (K " + ", ".join(f"{k_}: {g_:.2f}x" for k_, g_ in entry["gains"].items()) + ")")
        )
        if not entry["speculates"]:
            return (
                f"{mode} batches of {size} rows: plain decoding (the drafter ran at {g:.2f}x plain on the first "
                f"batch{tried})"
            )
        return (
            f"{mode} batches of {size} rows: K={k} (the drafter ran at {g:.2f}x plain on the first "
            f"batch{tried}); each row verifies while its acceptance pays for a verify step at {c:.2f} plain steps"
        )
