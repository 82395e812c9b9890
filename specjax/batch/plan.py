"""Batches of a job: how valid rows are cut into batches (deterministically, from the input and
the settings alone, so a rerun repeats them) and how one batch runs: whole, or split when a row
is bad or the device runs out of memory."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from specjax.batch.inputs import JobRow
from specjax.errors import SpecjaxError


def plan_batches(rows: list[JobRow], batch_size: int, data: int = 1) -> list[tuple[list[JobRow], int]]:
    """Deterministic (batch, padded row count) pairs of the share's valid rows (see the package
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


def log(msg: str) -> None:
    print(f"specjax batch: {msg}", file=sys.stderr, flush=True)


def measure_class(batch, size, model, mesh, drafters: dict, cfg) -> dict | None:
    """What `--spec-policy auto` decides a batch class with, for each candidate K -> drafter: the cost
    table (the decode loop timed on this batch's own rows and shapes, specjax/policy/costs.py;
    cached per model, drafter and bucket) and the gain: tokens per decode second of the drafter as
    it drafts over plain decoding's, on these rows (`PROBE_TOKENS` tokens each, after a short
    untimed run of each; one prefill per prefill shape). None when the batch cannot run whole (a bad
    row, out of device memory): the batch then runs as `generate_batch` splits it, verifying every
    step, and the class's next batch measures."""
    from specjax.policy.costs import measure_gains
    from specjax.runtime.cached import get_engine

    ids, params = batch_inputs(batch, size)
    engine = get_engine(model, mesh)
    try:
        return measure_gains(
            engine,
            ids,
            params,
            model.config.eos_token_ids,
            drafters,
            {k: d.label(cfg.drafter) for k, d in drafters.items()},
            rows=len(batch),
        )
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
        out = specjax.generate(
            ids,
            model=model,
            sampling=params,
            drafter=cfg.drafter if spec else "none",
            num_draft=num_draft if spec else 0,
            tree_topk=cfg.tree_topk if spec else 1,
            tree_depth=cfg.tree_depth,
            mesh=mesh,
            spec_policy="always" if costs is None else "auto",
            spec_costs=costs,
        )
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
                return [
                    (
                        rows[0],
                        SpecjaxError(
                            f"out of device memory even alone ({len(rows[0].token_ids)} "
                            f"prompt tokens in a batch of {n}): {first_line(e)}"
                        ),
                    )
                ]
            half = (len(rows) + 1) // 2
            log(
                f"a batch of {len(rows)} rows (padded to {n}, prompts up to {len(rows[-1].token_ids)} tokens) ran "
                f"out of device memory; running it as two batches"
            )
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
