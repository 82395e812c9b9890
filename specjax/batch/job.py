"""`run_batch`: one process's share of a batch job, from its checks to its results (resumable:
see the package docstring), with its progress meter."""

from __future__ import annotations

import json
import os
import sys
import time

from specjax.batch import parts
from specjax.batch.config import LATENCY_BATCH_SIZE, BatchConfig
from specjax.batch.files import (
    ResultsFile,
    check_job_settings,
    check_paths,
    done_path,
    errors_path,
    job_path,
    json_line,
    policy_path,
    results_path,
)
from specjax.batch.inputs import BadRow, JobRow, input_fingerprint, parse_input, read_input, tokenize
from specjax.batch.plan import generate_batch, log, measure_class, plan_batches
from specjax.errors import SpecjaxError
from specjax.files import write_atomic
from specjax.models import sharding
from specjax.policy.batch import BatchPolicy
from specjax.stats import AcceptanceStats


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
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
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


def job_settings(cfg: BatchConfig, model, defaults, sampled: bool) -> dict:
    """What a row's result means besides its own fields: a rerun with other values would mix the
    results of two jobs in one file. The drafter, K and batch size are not here: speculation keeps
    the target's law, so a job may switch them between runs. `sampled`: whether any row samples;
    if none does, the settings only sampling reads are None (not compared), so a greedy job may
    rerun with other ones."""
    only_sampled = dict(top_k=defaults.top_k, top_p=defaults.top_p, seed=defaults.seed or 0)
    return {
        "model": model.name,
        "dtype": str(model.dtype),
        "temperature": defaults.temperature,
        **{k: v if sampled else None for k, v in only_sampled.items()},
        "max_new_tokens": defaults.max_new_tokens,
        "ignore_eos": defaults.ignore_eos,
        "stop_token_ids": list(defaults.stop_token_ids),
        "raw": cfg.raw,
    }


def run_batch(cfg: BatchConfig) -> dict:
    """Run (or resume) this process's share of a job; returns the summary (also printed)."""
    import jax

    from specjax.models.loading import get_model
    from specjax.policy.batch import draft_variants
    from specjax.sampling import SamplingParams

    # Validate everything, then write (files.py): nothing below writes a file before the
    # results file opens.
    check_paths(cfg)
    n_proc, pid = cfg.num_processes, cfg.process_id
    out_path = results_path(cfg)
    err_path = errors_path(out_path)
    batch_size = cfg.batch_size or LATENCY_BATCH_SIZE[cfg.latency_class]

    defaults = cfg.sampling or SamplingParams()
    lines, mine = _read_share(cfg, defaults)
    sizes = sharding.parse_mesh(cfg.mesh, len(jax.local_devices()))

    model = get_model(cfg.model, cfg.dtype)
    # a bad drafter spec or tree shape fails before any work
    drafters = draft_variants(cfg.drafter, cfg.num_draft, model, cfg.tree_topk, cfg.tree_depth)
    mesh = sharding.make_mesh(sizes)
    model = sharding.place_model(model, mesh)
    sampled = any(isinstance(r, JobRow) and not r.sampling.greedy for r in mine)
    settings = job_settings(cfg, model, defaults, sampled)
    job_file = job_path(out_path)
    check_job_settings(job_file, settings, out_path)
    policy = _batch_policy(cfg, drafters, out_path)
    # Rows already written are tokenized too: their lengths place them in their batch.
    checked = [tokenize(model, r, cfg.raw) if isinstance(r, JobRow) else r for r in mine]
    rows = [r for r in checked if isinstance(r, JobRow)]
    bad = [r for r in checked if isinstance(r, BadRow)]

    if n_proc > 1 and os.path.exists(done_path(out_path)):
        os.remove(done_path(out_path))  # rewritten when this run completes the part
    write_atomic(job_file, json.dumps(settings, indent=1).encode())
    results = ResultsFile(out_path)  # repairs a torn last line before any row runs
    write_atomic(err_path, b"".join(json_line(b.to_dict()) for b in bad))

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
            _write_batch(ran, results, bad, errors_fd, meter)
            meter.advance(len(todo))
    finally:
        meter.stop()
        results.close()
        os.close(errors_fd)

    summary = _summary(out_path, err_path, len(results.done), already, len(bad), meter, policy)
    if n_proc > 1:
        finish_part(cfg, out_path, lines, summary, settings)
    return summary


def _batch_policy(cfg: BatchConfig, drafters: dict, out_path: str) -> BatchPolicy:
    """The job's speculation policy over its drafter variants (K -> drafter), its decisions kept
    next to the results (reproducible on resume)."""
    drafter = drafters[max(drafters)]
    return BatchPolicy(
        cfg.spec_policy,
        tuple(drafters),
        drafter.tree_label(cfg.drafter or "none"),
        policy_path(out_path),
        str(cfg.num_draft) if len(drafters) > 1 else None,
    )


def _read_share(cfg: BatchConfig, defaults) -> tuple[list, list]:
    """(the input's lines, this process's rows parsed: `JobRow` or `BadRow`); row i belongs to
    process i mod num_processes. Unused row fields are reported once, by process 0."""
    lines = read_input(cfg)
    extra: dict[str, int] = {}
    parsed = parse_input(lines, defaults, extra)
    if extra and cfg.process_id == 0:
        print(
            "specjax batch: ignoring row fields it does not use: "
            + ", ".join(f"{f} ({n} rows)" for f, n in sorted(extra.items())),
            file=sys.stderr,
        )
    return lines, [r for i, r in enumerate(parsed) if i % cfg.num_processes == cfg.process_id]


def _write_batch(ran, results: ResultsFile, bad: list, errors_fd: int, meter: Meter) -> None:
    """Append a batch's rows that are not written yet: results to the results file, failed rows
    (a one-line error each) to the errors file."""
    for r, res in ran:
        if json.dumps(r.id) in results.done:
            continue
        if isinstance(res, SpecjaxError):
            bad.append(BadRow(r.line, r.id, str(res)))
            os.write(errors_fd, json_line(bad[-1].to_dict()))
        else:
            results.append({"id": r.id, "line": r.line, **res.to_dict()})
            meter.add(res)


def _summary(out_path: str, err_path: str, rows: int, already: int, errors: int, meter: Meter, policy) -> dict:
    """The job's summary (returned, and logged as one line)."""
    secs = meter.seconds
    summary = {
        "output": out_path,
        "rows": rows,
        "written": meter.rows,
        "already": already,
        "errors": errors,
        "errors_file": err_path,
        "tokens": meter.tokens,
        "seconds": secs,
        "rows_per_second": meter.rows / secs,
        "tokens_per_second": meter.tokens / secs,
        "mean_accepted_length": meter.stats.mal,
        "prefill_seconds": meter.prefill_seconds,
        "decode_seconds": meter.decode_seconds,
    }
    if policy.path:
        summary["speculation"] = policy.summary()
    log(
        f"{meter.rows} rows written to {out_path} ({already} were already there), {errors} bad rows "
        f"in {err_path}; {meter.tokens} tokens in {secs:.1f} s: {meter.rates()} (engine: prefill "
        f"{meter.prefill_seconds:.1f} s, decode {meter.decode_seconds:.1f} s)"
    )
    return summary


def finish_part(cfg: BatchConfig, part: str, lines, summary: dict, settings: dict) -> None:
    """Mark the part complete; merge when every part is (process 0 waits for the others)."""
    marker = {
        "rows": summary["rows"],
        "errors": summary["errors"],
        "input": input_fingerprint(lines),
        "num_processes": cfg.num_processes,
        "settings": settings,
    }
    write_atomic(done_path(part), json.dumps(marker).encode())
    n = cfg.num_processes
    if cfg.process_id == 0 and not parts.wait_for_parts(cfg.output, n, cfg.merge_wait, log):
        log(
            f"gave up waiting for parts {parts.missing_parts(cfg.output, n)}: no progress for "
            f"{cfg.merge_wait:.0f} s; when they finish, `specjax batch --merge --output {cfg.output} "
            f"--num-processes {n}`"
        )
        return
    if not parts.missing_parts(cfg.output, n):
        rows = parts.merge_parts(cfg.output, n)
        log(f"merged {n} parts: {rows} rows in {cfg.output}")
