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
until every check has passed (`batch_files.py`; docs/files.md).

Devices and hosts: see `scaleout.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any

from specjax.errors import SpecjaxError, short_repr
from specjax.policy.batch import BatchPolicy
from specjax.serving import scaleout
from specjax.serving.batch_files import (
    ResultsFile,
    check_job_settings,
    check_paths,
    json_line,
    policy_path,
    results_path,
)
from specjax.stats import AcceptanceStats

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_new_tokens", "seed")
ROW_FIELDS = {"id", "prompt", "messages", "raw", "max_tokens", *SAMPLING_FIELDS}  # what a row may carry
LATENCY_BATCH_SIZE = {"batch": 16, "interactive": 1}  # default --batch-size per latency class


@dataclasses.dataclass
class JobRow:
    line: int  # 1-based line of the input
    id: str | int
    prompt: str | list  # text (chat template applied unless raw) or chat messages
    sampling: Any  # SamplingParams
    token_ids: list[int] | None = None  # set by validation (own share only)


@dataclasses.dataclass
class BadRow:
    line: int
    id: Any  # None when the row has no usable id
    reason: str

    def to_dict(self) -> dict:
        return {"line": self.line, "id": self.id, "reason": self.reason}


@dataclasses.dataclass
class BatchConfig:
    output: str
    input: str | None = None  # a JSONL file, or
    suite: str | None = None  # a packaged prompt suite (specjax.datasets): humaneval, mtbench, sharegpt
    limit: int | None = None  # only the first N rows (of the file or the suite)
    model: Any = None  # a Model, a path, or None (the default model)
    dtype: str | None = None
    drafter: str | None = "none"
    num_draft: int | str = 0  # K, or `auto` / `auto:N1,N2`: per batch class, the fastest measured (policy/batch.py)
    tree_topk: int = 1  # > 1: token trees of num_draft nodes (specjax.generate's tree_topk / tree_depth)
    tree_depth: int = 0
    spec_policy: str | int = "auto"  # specjax/policy/batch.py: auto | always | N (speculate up to N rows)
    sampling: Any = None  # default SamplingParams of rows
    batch_size: int | None = None  # None: from the latency class
    latency_class: str = "batch"
    raw: bool = False  # no chat template for "prompt" strings
    mesh: str | None = None  # "data=2,model=2"; None: every local device on `data`
    process_id: int = 0
    num_processes: int = 1
    merge_wait: float = 600.0  # process 0 gives up merging when no part grew for this long
    progress: bool = True


# ---- input -------------------------------------------------------------------------------------


def read_input(cfg: BatchConfig) -> list[tuple[int, bytes]]:
    """(line number, raw bytes) of every non-blank input line."""
    if cfg.suite:
        from specjax import datasets

        rows = datasets.load_suite(cfg.suite, cfg.limit)
        return [(i + 1, json.dumps({"id": f"{cfg.suite}-{i}", **suite_row(m)}).encode()) for i, m in enumerate(rows)]
    try:
        with open(cfg.input, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise SpecjaxError(f"{cfg.input}: {e.strerror or e}") from None
    lines = [(i, line) for i, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    return lines[: cfg.limit] if cfg.limit else lines


def suite_row(prompt) -> dict:
    """The batch-input fields of one suite prompt: chat messages, or completion text
    (`datasets.RawText`, e.g. humaneval-raw) as a raw prompt."""
    from specjax.datasets import RawText

    return {"prompt": str(prompt), "raw": True} if isinstance(prompt, RawText) else {"messages": prompt}


def write_suite_jsonl(suite: str, path: str, limit: int | None = None) -> int:
    """Write a packaged suite as batch input (`{"id", "messages"}` or `{"id", "prompt", "raw"}`
    rows, `suite_row`); returns the row count."""
    lines = read_input(BatchConfig(output="", suite=suite, limit=limit))
    scaleout.write_atomic(path, b"".join(raw + b"\n" for _, raw in lines))
    return len(lines)


def _valid_id(x) -> bool:
    return (isinstance(x, str) and x != "") or (isinstance(x, int) and not isinstance(x, bool))


def parse_row(line: int, raw: bytes, defaults, ignored: dict[str, int] | None = None) -> JobRow | BadRow:
    """One input line -> a row (not yet tokenized) or the reason it is bad. `ignored` counts the
    fields of JSON-object rows that specjax does not read (metadata, or a misspelt setting), so the
    job can name them once instead of silently dropping a setting."""
    from specjax.sampling import SamplingParams

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return BadRow(line, None, "not UTF-8 text")
    except json.JSONDecodeError as e:
        return BadRow(line, None, f"invalid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return BadRow(line, None, "invalid JSON (nested too deeply)")
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        return BadRow(line, None, f"invalid JSON ({e})")
    if not isinstance(obj, dict):
        return BadRow(line, None, "a row must be a JSON object")
    if ignored is not None:
        for f in obj.keys() - ROW_FIELDS:
            ignored[f] = ignored.get(f, 0) + 1
    rid = obj.get("id")
    if not _valid_id(rid):
        what = f"invalid id {short_repr(rid)}" if "id" in obj else "missing id"
        return BadRow(line, None, f"{what}: a row needs an 'id' (a non-empty string or an integer)")
    if "max_tokens" in obj:  # OpenAI's name for it
        if "max_new_tokens" in obj and obj["max_new_tokens"] != obj["max_tokens"]:
            return BadRow(line, rid, "'max_tokens' and 'max_new_tokens' disagree; give one")
        obj["max_new_tokens"] = obj["max_tokens"]
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p and has_m:
        return BadRow(line, rid, "give either 'prompt' or 'messages', not both")
    if "raw" in obj and (not isinstance(obj["raw"], bool) or (obj["raw"] and not has_p)):
        return BadRow(line, rid, "'raw' must be true or false, and only with a 'prompt' string")
    if has_p:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            return BadRow(line, rid, "'prompt' must be a non-empty string")
        if obj.get("raw"):
            from specjax.datasets import RawText

            prompt = RawText(prompt)  # encode_prompt: no chat template
    elif has_m:
        prompt = obj["messages"]
        if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        ):
            return BadRow(line, rid, "'messages' must be a non-empty list of {'role': str, 'content': str}")
    else:
        return BadRow(line, rid, "missing prompt: a row needs a 'prompt' string or a 'messages' list")
    kw = {}
    for f in SAMPLING_FIELDS:
        if f in obj:
            v = obj[f]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return BadRow(line, rid, f"{f} must be a number, got {short_repr(v)}")
            kw[f] = v
    if "seed" not in kw:  # the job's seed (0 when unset) and the line: a rerun draws the same
        kw["seed"] = line_seed(defaults.seed or 0, line)
    try:
        sampling = dataclasses.replace(defaults, **kw)
    except SpecjaxError as e:  # SamplingParams validates on construction
        return BadRow(line, rid, str(e))
    assert isinstance(sampling, SamplingParams)
    return JobRow(line, rid, prompt, sampling)


def line_seed(job_seed: int, line: int) -> int:
    """The seed of a row without its own: a hash of the job's seed and the row's input line."""
    return int.from_bytes(hashlib.blake2b(f"{job_seed}:{line}".encode(), digest_size=4).digest(), "little")


def parse_input(lines: list[tuple[int, bytes]], defaults, ignored: dict[str, int] | None = None
                ) -> list[JobRow | BadRow]:
    """Parse every line; a repeated id is bad on every line after the first that has it."""
    first: dict[str, int] = {}
    out = []
    for line, raw in lines:
        r = parse_row(line, raw, defaults, ignored)
        if r.id is not None:
            key = json.dumps(r.id)
            if key in first:
                r = BadRow(line, r.id, f"duplicate id (first on line {first[key]})")
            else:
                first[key] = line
        out.append(r)
    return out


def tokenize(model, row: JobRow, raw: bool) -> JobRow | BadRow:
    """Token ids of a row's prompt, checked against the context (prompt + its max_new_tokens)."""
    from specjax.generate import check_fits, encode_prompt

    try:
        ids = encode_prompt(model, row.prompt, raw)
        check_fits(model, len(ids), row.sampling.max_new_tokens)
    except SpecjaxError as e:
        return BadRow(row.line, row.id, str(e))
    except Exception as e:  # e.g. a chat template that rejects these messages
        return BadRow(row.line, row.id, f"cannot tokenize the prompt: {type(e).__name__}: {e}")
    return dataclasses.replace(row, token_ids=ids)


def input_fingerprint(lines: list[tuple[int, bytes]]) -> str:
    h = hashlib.sha256()
    for line, raw in lines:
        h.update(b"%d:" % line + raw + b"\n")
    return h.hexdigest()[:16]


# ---- planning ----------------------------------------------------------------------------------


def plan_batches(rows: list[JobRow], batch_size: int, data: int = 1) -> list[tuple[list[JobRow], int]]:
    """Deterministic (batch, padded row count) pairs of the share's valid rows (see the module
    docstring). A batch runs with its row count rounded up to a power of two (at most batch_size,
    then to a multiple of `data`): a job of a few rows does not run a large batch, and a group's
    last, short batch (which holds its longest prompts) does not pay for a full batch of them.
    """
    groups: dict[tuple, list[JobRow]] = {}
    for r in rows:
        key = ("greedy",) if r.sampling.greedy else ("sampled",)
        groups.setdefault(key, []).append(r)
    out = []
    for g in groups.values():
        g = sorted(g, key=lambda r: (len(r.token_ids), r.line))
        for i in range(0, len(g), batch_size):
            batch = g[i : i + batch_size]
            out.append((batch, batch_rows(len(batch), batch_size, data)))
    return out


def batch_rows(n: int, batch_size: int, data: int = 1) -> int:
    """Rows a batch of n runs with: n rounded up to a power of two (at most batch_size), then to
    a multiple of the mesh's `data` axis."""
    # imported here: jax loads only when a job runs, not for the CLI's input checks
    from specjax.runtime.engine import bucket_multiple, bucket_pow2

    return bucket_multiple(min(batch_size, bucket_pow2(n, lo=1)), data)


def batch_inputs(batch: list[JobRow], size: int) -> tuple[list[list[int]], list]:
    """Token ids and sampling params of a batch padded to `size` rows. Pad rows repeat the first
    row for one token (they are done after the prefill)."""
    params = [r.sampling for r in batch]
    params += [dataclasses.replace(batch[0].sampling, max_new_tokens=1)] * (size - len(batch))
    ids = [r.token_ids for r in batch] + [batch[0].token_ids] * (size - len(batch))
    return ids, params


# ---- progress ----------------------------------------------------------------------------------


class Meter:
    """Counts this run's rows and tokens; drives a rich progress bar (rows/s, tok/s, MAL, ETA)."""

    def __init__(self, total: int, already: int, enabled: bool, label: str):
        self.t0 = time.perf_counter()
        self.rows = self.tokens = 0
        self.stats = AcceptanceStats()  # the rows' draft/verify steps
        self.prefill_seconds = self.decode_seconds = 0.0  # engine time of the batches run
        self.progress = None
        if enabled and total:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn(label), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(file=sys.stderr),
            )
            self.task = self.progress.add_task("batch", total=total, completed=already, rate="")
            self.progress.start()

    def add(self, result) -> None:
        self.rows += 1
        self.tokens += len(result.token_ids)
        # the prefill's token is no step
        self.stats.add(AcceptanceStats(result.stats.steps, max(len(result.token_ids) - 1, 0)))

    def add_batch(self, results) -> None:
        """Engine time of one batch (its rows share it; rows run alone on a failed batch add theirs)."""
        seen = set()
        for res in results:
            if not isinstance(res, SpecjaxError):
                t = (res.stats.prefill_seconds, res.stats.decode_seconds)
                if t not in seen:
                    seen.add(t)
                    self.prefill_seconds += t[0]
                    self.decode_seconds += t[1]

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def rates(self) -> str:
        s = max(self.seconds, 1e-9)
        return f"{self.rows / s:.2f} rows/s  {self.tokens / s:.1f} tok/s  MAL {self.stats.mal:.2f}"

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=n, rate=self.rates())

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


# ---- the job -----------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"specjax batch: {msg}", file=sys.stderr, flush=True)


def job_settings(cfg: BatchConfig, model, defaults, sampled: bool) -> dict:
    """What a row's result means besides its own fields: a rerun with other values would mix the
    results of two jobs in one file. The drafter, K and batch size are not here: speculation keeps
    the target's law, so a job may switch them between runs. `sampled`: whether any row samples;
    if none does, the settings only sampling reads are None (not compared), so a greedy job may
    rerun with other ones."""
    only_sampled = dict(top_k=defaults.top_k, top_p=defaults.top_p, seed=defaults.seed or 0)
    return {"model": model.name, "dtype": str(model.dtype), "temperature": defaults.temperature,
            **{k: v if sampled else None for k, v in only_sampled.items()},
            "max_new_tokens": defaults.max_new_tokens, "ignore_eos": defaults.ignore_eos,
            "stop_token_ids": list(defaults.stop_token_ids), "raw": cfg.raw}


def run_batch(cfg: BatchConfig) -> dict:
    """Run (or resume) this process's share of a job; returns the summary (also printed)."""
    import jax

    from specjax.generate import get_model
    from specjax.policy.batch import draft_variants
    from specjax.sampling import SamplingParams

    # Validate everything, then write (batch_files.py): nothing below writes a file before the
    # results file opens.
    check_paths(cfg)
    n_proc, pid = cfg.num_processes, cfg.process_id
    out_path = results_path(cfg)
    err_path = scaleout.errors_path(out_path)
    batch_size = cfg.batch_size or LATENCY_BATCH_SIZE[cfg.latency_class]

    lines = read_input(cfg)
    extra: dict[str, int] = {}
    defaults = cfg.sampling or SamplingParams()
    parsed = parse_input(lines, defaults, extra)
    if extra and pid == 0:
        print("specjax batch: ignoring row fields it does not use: "
              + ", ".join(f"{f} ({n} rows)" for f, n in sorted(extra.items())), file=sys.stderr)
    mine = [r for i, r in enumerate(parsed) if i % n_proc == pid]
    sizes = scaleout.parse_mesh(cfg.mesh, len(jax.local_devices()))

    model = get_model(cfg.model, cfg.dtype)
    # a bad drafter spec or tree shape fails before any work
    drafters = draft_variants(cfg.drafter, cfg.num_draft, model, cfg.tree_topk, cfg.tree_depth)
    drafter = drafters[max(drafters)]
    mesh = scaleout.make_mesh(sizes)
    model = scaleout.place_model(model, mesh)
    sampled = any(isinstance(r, JobRow) and not r.sampling.greedy for r in mine)
    settings = job_settings(cfg, model, defaults, sampled)
    job_file = scaleout.job_path(out_path)
    check_job_settings(job_file, settings, out_path)
    policy = BatchPolicy(cfg.spec_policy, tuple(drafters), drafter.tree_label(cfg.drafter or "none"),
                         policy_path(out_path), str(cfg.num_draft) if len(drafters) > 1 else None)
    # Rows already written are tokenized too: their lengths place them in their batch.
    checked = [tokenize(model, r, cfg.raw) if isinstance(r, JobRow) else r for r in mine]
    rows = [r for r in checked if isinstance(r, JobRow)]
    bad = [r for r in checked if isinstance(r, BadRow)]

    if n_proc > 1 and os.path.exists(scaleout.done_path(out_path)):
        os.remove(scaleout.done_path(out_path))  # rewritten when this run completes the part
    scaleout.write_atomic(job_file, json.dumps(settings, indent=1).encode())
    results = ResultsFile(out_path)  # repairs a torn last line before any row runs
    scaleout.write_atomic(err_path, b"".join(json_line(b.to_dict()) for b in bad))

    already = sum(json.dumps(r.id) in results.done for r in rows)
    meter = Meter(len(rows), already, cfg.progress, f"part {pid}/{n_proc}" if n_proc > 1 else "batch")
    data = sizes["data"] if mesh is not None else 1
    errors_fd = os.open(err_path, os.O_WRONLY | os.O_APPEND)
    told: set[tuple[int, bool]] = set()  # batch classes whose speculation this run has logged
    try:
        for batch, size in plan_batches(rows, batch_size, data):
            todo = [r for r in batch if json.dumps(r.id) not in results.done]
            if not todo:
                continue
            # The whole batch runs even when some rows are done, so every row gets exactly the
            # result an uninterrupted run gives it (with the cost table it ran with,
            # specjax/policy/batch.py); only the missing rows are written.
            greedy = batch[0].sampling.greedy
            spec, costs, k = policy.plan(size, greedy, lambda: measure_class(batch, size, model, mesh, drafters, cfg))
            if (size, greedy) not in told:
                log(policy.describe(size, greedy))
                told.add((size, greedy))
            ran = generate_batch(batch, size, model, cfg, mesh, spec, costs, k)
            done = [res for _, res in ran if not isinstance(res, SpecjaxError)]
            policy.record(size, greedy, sum(r.stats.steps for r in done), sum(r.stats.verified_steps for r in done))
            meter.add_batch([res for _, res in ran])
            for r, res in ran:
                if json.dumps(r.id) in results.done:
                    continue
                if isinstance(res, SpecjaxError):
                    bad.append(BadRow(r.line, r.id, str(res)))
                    os.write(errors_fd, json_line(bad[-1].to_dict()))
                else:
                    results.append({"id": r.id, "line": r.line, **res.to_dict()})
                    meter.add(res)
            meter.advance(len(todo))
    finally:
        meter.stop()
        results.close()
        os.close(errors_fd)

    secs = meter.seconds
    summary = {
        "output": out_path, "rows": len(results.done), "written": meter.rows, "already": already,
        "errors": len(bad), "errors_file": err_path, "tokens": meter.tokens, "seconds": secs,
        "rows_per_second": meter.rows / secs, "tokens_per_second": meter.tokens / secs,
        "mean_accepted_length": meter.stats.mal, "prefill_seconds": meter.prefill_seconds,
        "decode_seconds": meter.decode_seconds,
    }
    if policy.path:
        summary["speculation"] = policy.summary()
    log(f"{meter.rows} rows written to {out_path} ({already} were already there), {len(bad)} bad rows "
        f"in {err_path}; {meter.tokens} tokens in {secs:.1f} s: {meter.rates()} (engine: prefill "
        f"{meter.prefill_seconds:.1f} s, decode {meter.decode_seconds:.1f} s)")
    if n_proc > 1:
        finish_part(cfg, out_path, lines, summary, settings)
    return summary


def measure_class(batch, size, model, mesh, drafters: dict, cfg) -> dict | None:
    """What `--spec-policy auto` decides a batch class with, for each candidate K -> drafter:
    the cost table (the decode loop timed on this batch's own rows and shapes,
    specjax/policy/costs.py; cached per model, drafter and bucket) and the gain: tokens per decode
    second of the drafter as it drafts over plain decoding's, on these rows (`PROBE_TOKENS`
    tokens each; each run once untimed first). None when the batch cannot run whole (a bad row,
    out of device memory): the batch then runs as `generate_batch` splits it, verifying every
    step, and the class's next batch measures."""
    from specjax.generate import drafter_label, get_engine
    from specjax.policy.costs import measure_gains

    ids, params = batch_inputs(batch, size)
    engine = get_engine(model, mesh)
    try:
        return measure_gains(engine, ids, params, model.config.eos_token_ids, drafters,
                             {k: drafter_label(cfg.drafter, d) for k, d in drafters.items()}, rows=len(batch))
    except SpecjaxError:
        return None
    except Exception as e:
        if not out_of_memory(e):
            raise
        return None


def generate_batch(batch, size, model, cfg, mesh, spec: bool, costs, num_draft: int) -> list[tuple[JobRow, Any]]:
    """(row, GenerationResult) for each row, with the drafter at K = `num_draft` if `spec` (deciding per row with
    the cost table `costs`, or verifying every step when None). When the batch fails on bad input, its rows run one
    by one and those that fail alone get their SpecjaxError instead of a result. When it runs out
    of device memory, it runs as two halves (recursively, each padded to its own power of two), so
    one oversized batch does not end the job; a row that does not fit alone is a bad row."""
    import specjax

    data = mesh.shape["data"] if mesh is not None else 1

    def gen(rows, n):
        ids, params = batch_inputs(rows, max(n, len(rows)))
        out = specjax.generate(ids, model=model, sampling=params, drafter=cfg.drafter if spec else "none",
                               num_draft=num_draft if spec else 0, tree_topk=cfg.tree_topk if spec else 1,
                               tree_depth=cfg.tree_depth, mesh=mesh,
                               spec_policy="always" if costs is None else "auto", spec_costs=costs)
        return out[: len(rows)]

    def run(rows, n):
        try:
            return list(zip(rows, gen(rows, n)))
        except SpecjaxError as e:
            if len(rows) == 1:
                return [(rows[0], e)]
        except Exception as e:  # only device out-of-memory is handled here; anything else re-raises
            if not out_of_memory(e):
                raise
            if len(rows) == 1:
                return [(rows[0], SpecjaxError(f"out of device memory even alone ({len(rows[0].token_ids)} "
                                               f"prompt tokens in a batch of {n}): {first_line(e)}"))]
            half = (len(rows) + 1) // 2
            log(f"a batch of {len(rows)} rows (padded to {n}, prompts up to {len(rows[-1].token_ids)} tokens) ran "
                f"out of device memory; running it as two batches")
            return [x for part in (rows[:half], rows[half:]) for x in run(part, batch_rows(len(part), n, data))]
        out = []
        for r in rows:
            try:
                out.append((r, gen([r], data)[0]))
            except SpecjaxError as e:
                out.append((r, e))
        return out

    return run(batch, size)


def out_of_memory(e: BaseException) -> bool:
    """XLA's out-of-memory error (XlaRuntimeError / JaxRuntimeError: RESOURCE_EXHAUSTED)."""
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def finish_part(cfg: BatchConfig, part: str, lines, summary: dict, settings: dict) -> None:
    """Mark the part complete; merge when every part is (process 0 waits for the others)."""
    marker = {"rows": summary["rows"], "errors": summary["errors"], "input": input_fingerprint(lines),
              "num_processes": cfg.num_processes, "settings": settings}
    scaleout.write_atomic(scaleout.done_path(part), json.dumps(marker).encode())
    n = cfg.num_processes
    if cfg.process_id == 0 and not scaleout.wait_for_parts(cfg.output, n, cfg.merge_wait, log):
        log(f"gave up waiting for parts {scaleout.missing_parts(cfg.output, n)}: no progress for "
            f"{cfg.merge_wait:.0f} s; when they finish, `specjax batch --merge --output {cfg.output} "
            f"--num-processes {n}`")
        return
    if not scaleout.missing_parts(cfg.output, n):
        rows = scaleout.merge_parts(cfg.output, n)
        log(f"merged {n} parts: {rows} rows in {cfg.output}")
