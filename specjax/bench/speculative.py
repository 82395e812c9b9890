"""`specjax bench SUITE...`: every drafter and K against plain decoding, same process, interleaved.

Methodology: every (drafter, K) configuration is compiled and run once on each shape it will
meet (`warm_batches`: an executable's first run is slow) before timing (the warm-up, reported
apart: `warmup_seconds`, `compile_seconds`); then, in each repeat, plain decoding and every
configuration run on each prompt batch one after another (interleaved batch by batch), so
machine drift hits all alike; figures are medians over repeats; speedup = configuration
tokens/s ÷ plain tokens/s at the same suite, batch size and sampling settings
(`report.add_speedups`). A batch size larger than a suite cycles its prompts, so every timed
batch really holds B rows.

Speculation policy (`--spec-policy`): every drafter configuration is measured once per listed
policy. "always" verifies whatever the drafter proposes; "auto" decides as `specjax.generate`
does (`policy.batch.plan_call`: at B > 1 the drafter's measured gain on the suite's first batch
decides whether the batch speculates at all; then the compiled loop's per-row fallback,
specjax/policy/rows.py, with the measured step-cost table), once per (suite, temperature, batch
size, configuration) at the start of its first warm-up, so never inside a timed repeat.

Time shares of draft / verify / accept come from `components.py` (each component timed as its
own compiled function at the loop's shapes).

The JSON report's fields are documented in `report.py`; plots in `plots.py`; other
implementations (HF transformers, llama.cpp) in `peers.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import numpy as np

from specjax.bench import report as rep
from specjax.bench.common import PeakMemory, compiled_memory_mb
from specjax.bench.components import component_times
from specjax.drafters.base import NoDrafter
from specjax.drafters.cached import get_drafter
from specjax.errors import DrafterError
from specjax.policy.batch import plan_call
from specjax.policy.rows import AUTO
from specjax.prompts import encode_prompt
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams
from specjax.stats import AcceptanceStats, zero_extend

CHAIN = "chain"


@dataclasses.dataclass
class Config:
    """One measured configuration: a drafter spec as given on the command line, its K and its
    speculation policy ("none" for plain decoding, else "always" or "auto")."""

    spec: str  # "none" | "ngram" | "draft:PATH" | "mtp" | ...
    num_draft: int
    drafter: object  # specjax.drafters.Drafter
    spec_policy: str = "always"
    tree: str = CHAIN  # "chain" | "KxD" (`parse_tree`)

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.spec, self.num_draft, self.tree, self.spec_policy)


def parse_tree(text: str) -> tuple[int, int]:
    """ "chain" -> (1, 0); "KxD" (a dynamic tree: K children per expanded node, D levels) -> (K, D)."""
    text = text.strip().lower()
    if text == CHAIN:
        return 1, 0
    k, sep, d = text.partition("x")
    if not (sep and k.isdigit() and d.isdigit() and int(k) >= 2 and int(d) >= 1):
        raise DrafterError(
            f"a tree shape is 'chain' or KxD with K >= 2 children and D >= 1 levels (e.g. 4x5), got {text!r}"
        )
    return int(k), int(d)


def check_drafter_names(specs: list[str]) -> None:
    """Cheap check of drafter names before the target loads; `resolve_configs` does the rest."""
    from specjax.drafters import KINDS, KNOWN, split_spec

    if not specs:
        raise DrafterError("--drafters is empty (give none, ngram, draft:PATH, ...)")
    for s in specs:
        if split_spec(s)[0] not in KINDS:
            raise DrafterError(f"unknown drafter {s!r} (known: {', '.join(KNOWN)})")


def resolve_configs(
    specs: list[str],
    num_drafts: list[int],
    model,
    spec_policies: tuple[str, ...] = ("always",),
    trees: tuple[str, ...] = (CHAIN,),
) -> list[Config]:
    """Plain decoding first, then every drafter x K x tree shape of `trees` x policy of
    `spec_policies` ("always", "auto"), each drafter built through `make_drafter` (via the API's
    drafter cache, so a draft model loads once for all K). Raises DrafterError for unknown names
    or missing checkpoints, before anything runs. A drafter that fixes its own K is listed once,
    under the K it reports; K values or tree shapes a drafter cannot draft (more than an MTP
    drafter's module count, trees of a chain drafter, more nodes than a tree holds) are skipped
    for it, and only a drafter with no usable configuration is an error."""
    if any(k < 1 for k in num_drafts):
        raise DrafterError(f"--num-draft values must be >= 1, got {num_drafts}")
    configs = [Config("none", 0, get_drafter("none", 0, model), "none")]
    seen = {configs[0].key}
    for spec in specs:
        spec = spec.strip()
        if spec == "none":
            continue
        errors, built = [], 0
        for k in num_drafts:
            for tree in trees:
                try:  # e.g. K above a trained head count, trees of a chain drafter: skip that shape
                    d = get_drafter(spec, k, model, *parse_tree(tree))
                except DrafterError as e:
                    errors.append(e)
                    continue
                built += 1
                for policy in spec_policies:
                    c = Config(spec, d.num_draft, d, policy, tree.strip().lower())
                    if c.key not in seen:
                        seen.add(c.key)
                        configs.append(c)
        if not built:
            raise errors[0]
    return configs


def batches_of(ids: list[list[int]], b: int) -> list[list[list[int]]]:
    """Consecutive batches of exactly b prompts; the prompt list is cycled to fill the last."""
    n = max(1, -(-len(ids) // b)) * b
    cycled = [ids[i % len(ids)] for i in range(n)]
    return [cycled[i : i + b] for i in range(0, n, b)]


@dataclasses.dataclass
class RunFigures:
    tokens: int  # generated, all rows
    seconds: float  # prefill + decode, compile excluded
    steps: int
    rows: int
    checked: np.ndarray  # [K] (a tree: per depth)
    accepted: np.ndarray  # [K]
    off_chain: int = 0  # tree steps that accepted more than the top-1 chain would have

    @staticmethod
    def total(parts: list["RunFigures"]) -> "RunFigures":
        """The figures of one pass made of `parts` (runs over disjoint batches)."""
        return RunFigures(
            sum(p.tokens for p in parts),
            sum(p.seconds for p in parts),
            sum(p.steps for p in parts),
            sum(p.rows for p in parts),
            sum(p.checked for p in parts),
            sum(p.accepted for p in parts),
            sum(p.off_chain for p in parts),
        )


def row_params(sampling: SamplingParams, first_row: int, n: int) -> list[SamplingParams]:
    """Sampling params of n batch rows with seeds of their own (`first_row` + their index), so a
    prompt cycled into a batch twice differs."""
    return [dataclasses.replace(sampling, seed=(sampling.seed or 0) + first_row + j) for j in range(n)]


def run_config(
    engine: Engine,
    batches,
    sampling: SamplingParams,
    drafter,
    on_batch=None,
    plan: tuple | None = None,
    first_row: int = 0,
) -> RunFigures:
    """One pass over `batches`, whose first row is row `first_row` of the suite (rows' seeds
    follow their index); `on_batch(rows)` (progress) is called after each batch. `plan` (K, cost
    table) from `plan_call` runs "auto": the per-row fallback (spec_mode AUTO) with that table, or
    plain decoding where the table is None (figures keep the drafter's K); None verifies
    whatever the drafter proposes."""
    k = drafter.accept_width
    policy = {}
    if plan is not None and plan[1] is None:
        drafter = NoDrafter()
    elif plan is not None:
        policy = {"spec_mode": AUTO, "costs": np.asarray(plan[1], np.float32)}
    parts, row = [], first_row
    for batch in batches:
        params = row_params(sampling, row, len(batch))
        row += len(batch)
        out = engine.generate(batch, params, engine.model.config.eos_token_ids, drafter, **policy)
        parts.append(
            RunFigures(
                sum(len(r.token_ids) for r in out),
                out[0].prefill_seconds + out[0].decode_seconds,
                sum(r.steps for r in out),
                len(out),
                sum((zero_extend(r.checked, k) for r in out), np.zeros(k)),
                sum((zero_extend(r.accepted, k) for r in out), np.zeros(k)),
                sum(r.off_chain for r in out),
            )
        )
        if on_batch is not None:
            on_batch(len(batch))
    return RunFigures.total(parts)


def _compiled(engine: Engine) -> dict:
    return dict(engine.compiled.executables)


def _row(
    suite,
    temp,
    b,
    c: Config,
    runs: list[RunFigures],
    warm: float,
    compile_s: float,
    peak: tuple,
    compiled_mb,
    comp: dict,
) -> dict:
    """One result row from a configuration's repeats (speedup is added by `report.add_speedups`)."""
    tokens, steps = sum(r.tokens for r in runs), sum(r.steps for r in runs)
    rows = sum(r.rows for r in runs)
    # the prefill emits each row's first token; MAL counts the tokens of draft-verify steps
    stats = AcceptanceStats.from_counts(
        steps,
        tokens - rows,
        sum(r.checked for r in runs),
        sum(r.accepted for r in runs),
        sum(r.off_chain for r in runs),
    )  # [K] each (K = 0: empty)
    total = sum(comp.values())
    return {
        "suite": suite,
        "temperature": temp,
        "batch_size": b,
        "drafter": c.spec,
        "label": "plain" if c.spec == "none" else rep.short_label(c.spec),
        "num_draft": c.num_draft,
        "spec_policy": c.spec_policy,
        "tree": c.tree,
        "prompts": runs[0].rows,
        "tokens": statistics.median(r.tokens for r in runs),
        "tokens_per_second": statistics.median(r.tokens / r.seconds for r in runs),
        "tokens_per_second_repeats": [r.tokens / r.seconds for r in runs],
        "mean_accepted_length": stats.mal,
        "acceptance_rate": stats.acceptance_rate,
        "per_position_acceptance": stats.per_position(),
        "verified_share": stats.verified_share,
        "off_chain_share": stats.off_chain_share,
        "warmup_seconds": warm,
        "compile_seconds": compile_s,
        "peak_memory_mb": peak[0],
        "peak_memory_source": peak[1],
        "compiled_memory_mb": compiled_mb,
        "component_seconds": comp,
        "time_share": {n: v / total for n, v in comp.items()} if total else {},
        "sampler_vs_verify": comp["accept"] / comp["verify"] if comp.get("verify") else None,
    }


def warm_batches(engine: Engine, batches, max_new: int, drafter) -> list:
    """The first batch of each compiled shape (rows, prompt bucket, cache size) that `drafter`
    runs among `batches`. An executable's first run is slower than its later ones, compile
    excluded (docs/spec-policy.md, session 33), and the cache size grows with K, so a
    speculative configuration meets more shapes than plain decoding: warm-up runs each shape
    once, so that no timed repeat holds a first run."""
    seen, out = set(), []
    for batch in batches:
        key = (len(batch), *engine.shapes([len(p) for p in batch], max_new, drafter.num_draft))
        if key not in seen:
            seen.add(key)
            out.append(batch)
    return out


def prompt_runs(
    engine: Engine, suite_ids: dict[str, list], configs, batch_sizes, n_temps: int, repeats: int, max_new: int
) -> int:
    """Prompt runs (batch rows generated) of a whole `run_speculative_bench`, warm-ups included:
    the progress display's total."""
    total = 0
    for ids in suite_ids.values():
        for b in batch_sizes:
            batches = batches_of(ids, b)
            for c in configs:
                total += b * (len(warm_batches(engine, batches, max_new, c.drafter)) + repeats * len(batches))
    return total * n_temps


def _config_label(c: Config) -> str:
    return rep.config_name(
        {
            "drafter": c.spec,
            "label": rep.short_label(c.spec),
            "num_draft": c.num_draft,
            "spec_policy": c.spec_policy,
            "tree": c.tree,
        }
    )


def run_speculative_bench(
    model,
    suite_ids: dict[str, list[list[int]]],
    configs: list[Config],
    batch_sizes: list[int],
    temperatures: list[float],
    max_new_tokens: int,
    repeats: int,
    console=None,
    progress=None,
) -> list[dict]:
    """suite_ids: name -> token ids of its prompts. Returns result rows, speedups included.
    `progress` (a `progress.BenchProgress`, optional) is told every configuration and batch."""
    from rich.console import Console

    console = console or Console(stderr=True, log_path=False)
    engine = Engine(model)
    rows = []
    if progress is not None:
        total = prompt_runs(engine, suite_ids, configs, batch_sizes, len(temperatures), repeats, max_new_tokens)
        progress.begin("specjax", total)
    advance = progress.advance if progress is not None else None

    for suite, ids in suite_ids.items():
        for temp in temperatures:
            sampling = SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=0)
            for b in batch_sizes:
                batches = batches_of(ids, b)
                tables = {}  # config key -> its "auto" plan (K, cost table or None), measured once
                stage = functools.partial(_stage, progress, (suite, temp, b))
                warm, comp_s, comp_mb = _warm_up(engine, configs, batches, sampling, b, tables, stage, advance)
                runs, peaks = _timed_repeats(engine, configs, batches, sampling, b, tables, stage, advance, repeats)
                group, comps = [], {}
                for c in configs:  # components do not depend on the policy: timed once per (drafter, K, tree)
                    if c.key[:3] not in comps:
                        comps[c.key[:3]] = component_times(engine, c.drafter, ids[0], sampling, batch=b)
                    comp = comps[c.key[:3]]
                    group.append(
                        _row(
                            suite,
                            temp,
                            b,
                            c,
                            runs[c.key],
                            warm[c.key],
                            comp_s[c.key],
                            peaks[c.key],
                            comp_mb[c.key],
                            comp,
                        )
                    )
                rep.add_speedups(group)
                for r in group:
                    console.log(
                        f"{suite} T={temp:g} B={b} {rep.config_name(r)}: {r['tokens_per_second']:.1f} tok/s, "
                        f"x{r['speedup']:.2f}, MAL {r['mean_accepted_length']:.2f}"
                        + (f", verified {r['verified_share']:.0%}" if r["verified_share"] is not None else "")
                    )
                rows += group
    return rows


def _stage(progress, group: tuple, what: str, c: Config, n: int) -> None:
    """Tell `progress` (or nobody) that configuration `c` of `group` (suite, T, B) starts `what`."""
    if progress is not None:
        progress.stage(f"{group[0]} T={group[1]:g} B={group[2]} {_config_label(c)} ({what})", n, group)


def _warm_up(engine, configs, batches, sampling, b: int, tables: dict, stage, advance):
    """Compile every configuration and run it once on each of its shapes (`warm_batches`) of B =
    `b` rows (measuring an "auto" plan into `tables` first, as `generate` gets it).
    Returns per config key: warm-up seconds, compile seconds, compiled memory MB (None when
    nothing new compiled)."""
    warm, comp_s, comp_mb = {}, {}, {}
    for c in configs:
        warm_on = warm_batches(engine, batches, sampling.max_new_tokens, c.drafter)
        stage("warm-up", c, b * len(warm_on))
        before, c0, t0 = _compiled(engine), engine.compile_seconds, time.perf_counter()
        if c.spec_policy == "auto" and c.key not in tables:
            eos = engine.model.config.eos_token_ids
            variants, labels = {c.num_draft: c.drafter}, {c.num_draft: c.drafter.label(c.spec)}
            tables[c.key] = plan_call(engine, batches[0], row_params(sampling, 0, b), eos, variants, labels)
        run_config(engine, warm_on, sampling, c.drafter, advance, tables.get(c.key))
        warm[c.key], comp_s[c.key] = time.perf_counter() - t0, engine.compile_seconds - c0
        new = [v for k, v in _compiled(engine).items() if k not in before]
        comp_mb[c.key] = compiled_memory_mb(new) if new else None
    return warm, comp_s, comp_mb


def _timed_repeats(engine, configs, batches, sampling, b: int, tables: dict, stage, advance, repeats: int):
    """The timed runs, interleaved batch by batch (plain, then every configuration, on each batch
    of each repeat) so that machine drift hits all alike. Returns per config key: its
    `RunFigures` per repeat (summed over the batches) and peak memory (MB, source)."""
    mem = PeakMemory()
    runs = {c.key: [] for c in configs}
    peaks = {c.key: (0.0, "") for c in configs}
    for rep_i in range(repeats):
        parts = {c.key: [] for c in configs}
        for i, batch in enumerate(batches):
            for c in configs:
                stage(f"repeat {rep_i + 1}/{repeats}, batch {i + 1}/{len(batches)}", c, b)
                mem.reset()
                plan = tables.get(c.key)
                parts[c.key].append(run_config(engine, [batch], sampling, c.drafter, advance, plan, first_row=i * b))
                mb, src = mem.read()
                peaks[c.key] = (max(peaks[c.key][0], mb), src)
        for c in configs:
            runs[c.key].append(RunFigures.total(parts[c.key]))
    return runs, peaks


def encode_suites(model, suites: dict[str, list]) -> dict[str, list[list[int]]]:
    """Token ids of every prompt (the chat template applied), shared by specjax and the peers."""
    return {name: [encode_prompt(model, p) for p in prompts] for name, prompts in suites.items()}


def bench_suites(
    model,
    suites: dict[str, list],
    drafters: list[str],
    num_drafts: list[int],
    batch_sizes: list[int],
    temperatures: list[float],
    max_new_tokens: int,
    repeats: int,
    peers: list[str] = (),
    json_out: str | None = None,
    plots_dir: str | None = None,
    console=None,
    out=None,
    peer_factory: str | None = None,
    peer_threads: int | None = None,
    spec_policies: tuple[str, ...] = ("always",),
    trees: tuple[str, ...] = (CHAIN,),
) -> dict:
    """The whole `specjax bench SUITE...` run: measure, compare, recommend, print, write.
    Progress goes to stderr (`progress.py`), the report to stdout. Each peer runs in its own
    process (`peer_process.py`; `peer_factory` "module:function" replaces how peers are made,
    for tests; `peer_threads`: each peer's CPU threads, default all cores). `spec_policies`:
    every drafter configuration is measured under each ("always", "auto"; see the module doc).
    `trees`: proposal shapes, "chain" and/or "KxD" dynamic trees of `num_drafts` nodes."""
    from rich.console import Console

    from specjax.bench import peer_process
    from specjax.bench import peers as peers_mod
    from specjax.bench.progress import BenchProgress

    console = console or Console(stderr=True, log_path=False)
    configs = resolve_configs(drafters, num_drafts, model, tuple(spec_policies), tuple(trees))  # raises first
    suite_ids = encode_suites(model, suites)
    peer_names, skipped = peers_mod.plan_peers(list(peers), model)
    for name, why in skipped.items():
        console.log(f"peer {name}: skipped ({why})")
    t_start = time.time()
    job = _peer_job(model, drafters, num_drafts, suite_ids, temperatures, max_new_tokens, repeats, peer_threads)
    if peer_factory:
        job["factory"] = peer_factory
    with BenchProgress(console) as progress:
        rows = run_speculative_bench(
            model, suite_ids, configs, batch_sizes, temperatures, max_new_tokens, repeats, console, progress
        )
        peer_rows, peer_status = peer_process.run_peers(peer_names, job, console, progress)
    for name, why in skipped.items():
        peer_status[name] = peer_process.peer_status("skipped", why)
    for name, st in peer_status.items():
        if st["status"] != "ok" and name not in skipped:
            skipped[name] = peer_process.one_line(st)
    report = {
        "kind": "speculative",
        "model": model.name,
        "model_source": model.source,
        "dtype": str(model.dtype),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "temperatures": temperatures,
        "batch_sizes": batch_sizes,
        "num_drafts": num_drafts,
        "drafters": list(drafters),
        "spec_policies": list(spec_policies),
        "trees": list(trees),
        "suites": {name: len(ids) for name, ids in suite_ids.items()},
        "compile_seconds": sum(r["compile_seconds"] for r in rows),
        "results": rows,
        "peers": peer_rows,
        "peers_skipped": skipped,
        "peers_status": peer_status,
        "peer_comparison": rep.compare_peers(rows, peer_rows),
        "recommendations": rep.recommend(rows),
        "plots": [],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)),
    }
    return _publish(report, json_out, plots_dir, out)


def _peer_job(model, drafters, num_drafts, suite_ids, temperatures, max_new_tokens, repeats, threads) -> dict:
    """What each peer's own process needs to run the bench's prompts (`peer_process.py`)."""
    return {
        "model_source": model.source,
        "eos_ids": [int(e) for e in model.config.eos_token_ids],
        "threads": threads,
        "drafters": list(drafters),
        "num_drafts": list(num_drafts),
        "suite_ids": suite_ids,
        "temperatures": list(temperatures),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
    }


def _publish(report: dict, json_out: str | None, plots_dir: str | None, out) -> dict:
    """Write the plots (next to `json_out`, or in `plots_dir`), print the report to `out` and
    write it as JSON; returns it."""
    if json_out or plots_dir:
        import os

        from specjax.bench.plots import write_plots

        pdir = plots_dir or os.path.dirname(os.path.abspath(json_out))
        stem = os.path.splitext(os.path.basename(json_out))[0] if json_out else "bench"
        report["plots"] = write_plots(report, pdir, stem)
    rep.print_report(report, out)
    if json_out:
        rep.dump(report, json_out)
    return report
