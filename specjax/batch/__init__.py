"""Batch jobs (`specjax batch`): a JSONL file of prompts in, a JSONL file of results out.

Input rows are `{"id": ..., "prompt": "..."}` (`"raw": true`: no chat template for this prompt, as
`--raw` does for every row) or `{"id": ..., "messages": [...]}`, optionally with their own
`temperature`, `top_k`, `top_p`, `max_new_tokens` (or OpenAI's `max_tokens`), `seed` (the CLI flags
give the defaults; a row without a seed gets one derived from the job's `--seed` and its input line,
so rows with one prompt still differ and a rerun draws the same); other fields are ignored, and the
job names them once on stderr. Output rows are `{"id", "line", "text", "token_ids", "finish_reason",
"stats"}`, the fields of `specjax generate --json` plus the input line number, in completion order
(merged multi-process outputs are in input order).

A job can be killed at any moment and rerun with the same command; it then loses and repeats
nothing:

* each result is one line appended with one `os.write` and an `fsync`, and on start a trailing
  partial line (a crash mid-write) is truncated away; ids already in the output are done;
* the batches are planned from the input and the settings alone, never from what is done: a
  batch with some rows done is run whole again and only its missing rows are written. Every row
  is therefore computed in the same batch, with the same shapes and seed, as in an uninterrupted
  run: resumed outputs equal uninterrupted ones bit for bit, sampled rows too.
  How a batch speculates (`--spec-policy`, specjax/policy/batch.py: its class's measured gain and
  cost table) is recorded before it runs and reused when it runs again;
* what gives the results their meaning (model, dtype, sampling defaults, job seed, chat
  template) is recorded in `OUTPUT.job.json`, and a rerun with other values is refused rather
  than mixing two jobs in one file. The drafter, K and batch size may change between runs:
  speculation keeps the target's law.

Bad rows (invalid JSON, no id, no prompt, duplicate id, a prompt over the context, invalid
sampling values) go to `<output>.errors.jsonl` as `{"line", "id", "reason"}` and the job goes
on. Validation is a pure function of the input, so the errors file is rewritten on each run.

Batching: greedy and sampled rows are batched apart (all-greedy batches compile a greedy-only
accept step), sorted by prompt length within a group (fewer prompt buckets, rows that finish
together) and cut into batches of `--batch-size`. Each batch is padded to a power of two rows (and
a multiple of the mesh's `data` size) so few shapes compile. Every row draws from its own seed's
stream and checks only its own drafts, so a sampled row's text does not depend on its batch-mates
or the process split, only on how its batch speculated (`--spec-policy`, per batch shape).

Files: every path the job will write is checked before the model loads, and nothing is written
until every check has passed (`files.py`; docs/files.md).

Devices: a `data` x `model` mesh (`--mesh`, specjax/models/sharding.py). Hosts: one part file per
process, then a merge (`parts.py`).

Modules, in the order a job uses them:

* `config.py` — `BatchConfig`, the job's settings (the CLI's flags);
* `files.py` — the files a job writes: their names, the checks made before anything loads, the
  append-only results file, the recorded job settings;
* `inputs.py` — reading the input (a JSONL file or a packaged suite), validating and tokenizing rows;
* `plan.py` — cutting rows into batches and running one batch (bad rows and out-of-memory split it);
* `job.py` — `run_batch`: one process's share, start to resume to finish, with its progress meter;
* `parts.py` — several processes: the rendezvous, the part files and their merge.
"""
