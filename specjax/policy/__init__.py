"""The speculation policy: when verifying drafts pays, for every entry point.

Vocabulary (one for all of it):

* a *verify step* runs the target over the last token and L drafts; a *plain step* over the last
  token alone. Both emit tokens with the target's law, so any policy is lossless: it only decides
  what is worth the verify cost.
* the *step cost* of width L: a verify step's time over a plain step's at the same batch bucket,
  measured on this machine (costs.py); width 0 in the per-row table: a *declined step*, on which
  the drafter ran but proposed nothing worth verifying (a gate), so the target took a plain step.
* *acceptance*: accepted over checked draft positions; *MAL*, tokens emitted per step; the
  *gain* of speculation: expected tokens per step over its cost in plain steps.

One rule at three time scales, because the entry points differ in what a decision may read:

* `rows.py` — per row, inside the compiled loop (`generate`, `specjax batch`): a row verifies
  while its own decayed acceptance makes a verify step beat a plain one at the measured cost
  table, and probes again with backoff. Decisions read only emitted tokens and the table, so a
  batch job that records its tables resumes with the same decisions (batch.py).
* `batch.py` — per batch: the class rule (`choose`: speculate only on a measured gain of at
  least 1 + MARGIN, at the best K), applied by a batch job once per class and recorded, and by
  `generate` and the bench to a batch of several rows (`plan_call`); a job's settings: `auto`,
  `always`, or a row limit (plain above it).
* `chunks.py` + `monitor.py` — the server: K per chunk from live acceptance per latency class,
  queue depth and step costs recalibrated by every chunk's wall time (a server may follow live
  timings; its rows come and go between chunks).

A drafter may add its own per-step judgement on top (EAGLE-3's confidence gate, the n-gram
drafter's match length: `Proposal.active` / `length`); the policy decides which rows may verify
(`StepContext.verify_rows`; a gated drafter asks `StepContext.verifies`), the drafter which of
its drafts are worth it.
"""
