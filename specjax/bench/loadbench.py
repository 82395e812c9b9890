"""`specjax serve-bench`: an offered-load sweep of the serving rules against fixed policies.

Offered load = C concurrent closed-loop clients (each sends its next request when the previous one
finished), a share of them interactive, the rest batch. Each client has its own fixed list of
requests, so every mode runs exactly the same work. At every load point the modes run in turn,
`repeats` times in a balanced order (`run_order`: drift on a shared machine hits every mode
alike), on one warmed-up slot engine (nothing compiles during the sweep). Each mode is one
scheduler that runs for the whole sweep, as a server does while its load changes: the rules'
acceptance monitor and cost calibration carry over from point to point (a fresh scheduler per
point would charge every short point with what a server learns once):

* `always`: speculation always on at K_max (no fallback);
* `never`: plain decoding (K = 0);
* `rules`: the serving rules (specjax/policy/chunks.py + monitor.py), as `specjax serve` runs them.

Reported per point and mode: generated tokens per second (median over repeats, and the spread
of the repeats, which is the noise the claim is judged against), mean inter-token latency and
time to first token per class, mean accepted length, and (JSON) every decision about
speculation with its reason; per point: rules / max(always, never) and rules / never
throughput, as a ratio of the medians and as the median of the ratios within each repeat
("paired": the modes of one repeat ran back to back, so the machine's slow drift cancels). The
claim under test: rules >= the better fixed mode within noise, and never below 0.97x plain.
The scheduler is driven in-process (no HTTP), so the figures measure the scheduling rules, not
the HTTP stack. Prompts: the batch class takes the first suite (code: HumanEval), the
interactive class the second (chat: MT-Bench), greedy.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import statistics
import sys
import threading
import time

from specjax.runtime.slots import SlotEngine
from specjax.sampling import SamplingParams
from specjax.server.config import ServingConfig
from specjax.server.scheduler import Request, Scheduler
from specjax.stats import AcceptanceStats

MODES = ("always", "never", "rules")
# decisions about speculation kept in the JSON, with their reasons (K changes, probes, switches)
SPEC_DECISIONS = ("k", "probe", "explored", "probe_failed", "spec_on", "spec_off")


def _prompts(model, suites: str, max_prompt: int, n: int, seed: int) -> dict[str, list[list[int]]]:
    from specjax import datasets
    from specjax.prompts import encode_prompt

    names = [s.strip() for s in suites.split(",") if s.strip()] or ["humaneval"]
    by_class = {"batch": names[0], "interactive": names[-1]}
    out = {}
    for cls, name in by_class.items():
        ids = [encode_prompt(model, p) for p in datasets.load_suite(name, 4 * n)]
        ids = [x for x in ids if len(x) <= max_prompt] or [x[-max_prompt:] for x in ids]
        random.Random(seed).shuffle(ids)
        out[cls] = ids[:n] if len(ids) >= n else (ids * n)[:n]
    return out


def client_requests(clients: int, n_requests: int, interactive_share: float) -> list[tuple[str, list[int]]]:
    """(latency class, indices into that class's prompt pool) per client: `n_requests` in all,
    dealt round-robin, so the work does not depend on which client finishes first."""
    n_inter = min(clients, round(clients * interactive_share))
    if clients > 1 and interactive_share > 0:
        n_inter = max(n_inter, 1)
    classes = ["interactive"] * n_inter + ["batch"] * (clients - n_inter)
    out, seen = [], collections.Counter()
    for j, cls in enumerate(classes):
        mine = range(j, n_requests, clients)
        out.append((cls, [seen[cls] + i for i in range(len(mine))]))
        seen[cls] += len(mine)
    return out


def run_order(modes: list[str], rep: int) -> list[str]:
    """The modes' order in repeat `rep`: rotated by rep // 2, reversed in odd repeats. Over any
    even number of repeats every mode runs at every position equally often on average, so a
    machine that slows (or speeds up) steadily through a load point favours no mode; plain
    rotation with 3 modes and 4 repeats ran the rules after plain decoding in 3 of 4 repeats."""
    r = (rep // 2) % len(modes)
    order = list(modes[r:]) + list(modes[:r])
    return order[::-1] if rep % 2 else order


def start_modes(engine: SlotEngine, cfg: ServingConfig, eos_ids, modes) -> dict[str, Scheduler]:
    """One running scheduler per mode, kept for the whole sweep: a server whose offered load
    changes, so the rules' monitor and cost calibration carry over from point to point."""
    cfgs = {m: dataclasses.replace(cfg, policy=m).validate() for m in modes}  # before any starts
    return {m: Scheduler(engine, c, eos_ids=eos_ids).start() for m, c in cfgs.items()}


def run_point(
    sched: Scheduler,
    clients: int,
    n_requests: int,
    prompts: dict[str, list[list[int]]],
    max_tokens: int,
    interactive_share: float,
) -> dict:
    """One load point on a running scheduler (its policy is the mode): C closed-loop clients,
    each through its own request list."""
    mode = sched.cfg.policy
    first_seq = max((d["seq"] for d in sched.log.recent()), default=0)
    time0, steps0, iter0 = collections.Counter(sched.chunk_time), collections.Counter(sched.chunk_steps), sched.chunks
    resizes0 = sched.resizes
    compiles0 = sched.engine.compiles_after_warmup
    lock = threading.Lock()
    done: list[Request] = []
    sp = SamplingParams(max_new_tokens=max_tokens)

    def client(cls: str, indices: list[int]):
        pool = prompts[cls]
        for i in indices:
            req = sched.submit(Request(pool[i % len(pool)], sp, cls))
            req.done.wait()
            with lock:
                done.append(req)

    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=client, args=work, daemon=True)
        for work in client_requests(clients, n_requests, interactive_share)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ks = collections.Counter()
    for r in done:
        ks.update(r.k_steps)
    decisions = [d for d in sched.log.recent() if d["kind"] in SPEC_DECISIONS and d["seq"] > first_seq]
    row = {
        "mode": mode,
        "clients": clients,
        "requests": len(done),
        "seconds": wall,
        "tokens": sum(len(r.token_ids) for r in done),
        "steps_by_k": {str(k): v for k, v in sorted(ks.items())},
        "k_changes": sum(d["kind"] == "k" for d in decisions),
        "fallback_switches": sum(d["kind"] in ("spec_off", "spec_on") for d in decisions),
        "live_step_costs": sched.costs.to_dict(live=True),
        # where the scheduler's time went: per bucket and K the steps run and ms per step,
        # chunks, bucket changes, and compiles on the hot path (should be 0)
        "steps_ms_by_bucket_k": {
            f"{b}:{k}": [n, 1e3 * (sched.chunk_time[(b, k)] - time0[(b, k)]) / n]
            for b, k in sorted(sched.chunk_steps)
            if (n := sched.chunk_steps[(b, k)] - steps0[(b, k)])
        },
        "resizes": sched.resizes - resizes0,
        "chunk_seconds": sum(sched.chunk_time.values()) - sum(time0.values()),
        "chunks": sched.chunks - iter0,
        "compiles": sched.engine.compiles_after_warmup - compiles0,
        "decisions": decisions,
    }
    failed = [r for r in done if r.finish_reason == "error"]
    if failed:  # a failed request's figures are not throughput: stop the sweep
        what = f"{len(failed)} of {len(done)} requests failed ({mode}, {clients} clients)"
        raise RuntimeError(f"{what}: {failed[0].error}")
    row["tokens_per_second"] = row["tokens"] / wall
    for cls in ("interactive", "batch"):
        rs = [r for r in done if r.latency_class == cls]
        itl = [(r.last_emit - r.first_token_time) / (len(r.token_ids) - 1) for r in rs if len(r.token_ids) > 1]
        row[f"itl_ms_{cls}"] = 1e3 * statistics.mean(itl) if itl else None
        row[f"ttft_ms_{cls}"] = 1e3 * statistics.mean(r.first_token_time - r.arrival for r in rs) if rs else None
    total = AcceptanceStats()
    for r in done:
        total.add(r.sample)
    row["mal"] = total.mal
    return row


def summarize(points: list[dict]) -> list[dict]:
    """Per load: median tokens/s per mode over its repeats, the repeats' relative spread
    ((max - min) / median, the largest over modes: the noise), and the rules' ratios."""
    out = []
    for c in sorted({p["clients"] for p in points}):
        runs = collections.defaultdict(list)
        for p in points:
            if p["clients"] == c:
                runs[p["mode"]].append(p["tokens_per_second"])
        by = {m: statistics.median(v) for m, v in runs.items()}
        s = {"clients": c, **{f"{m}_tok_s": v for m, v in by.items()}, "repeats": max(len(v) for v in runs.values())}
        spreads = [(max(v) - min(v)) / statistics.median(v) for v in runs.values() if len(v) > 1]
        s["noise"] = max(spreads) if spreads else None
        if "rules" in by:
            fixed = [by[m] for m in ("always", "never") if m in by]
            if fixed:
                s["rules_vs_best_fixed"] = by["rules"] / max(fixed)
            if "never" in by:
                s["rules_vs_plain"] = by["rules"] / by["never"]
            # Paired: the ratio within each repeat (its modes ran minutes apart, so slow drift of a
            # shared machine cancels), then the median over repeats.
            per_rep = collections.defaultdict(dict)
            for p in points:
                if p["clients"] == c and "repeat" in p:
                    per_rep[p["repeat"]][p["mode"]] = p["tokens_per_second"]
            for name, ref in (("best_fixed", ("always", "never")), ("plain", ("never",))):
                ratios = [
                    r["rules"] / max(r[m] for m in ref if m in r)
                    for r in per_rep.values()
                    if "rules" in r and any(m in r for m in ref)
                ]
                if ratios:
                    s[f"rules_vs_{name}_paired"] = statistics.median(ratios)
        out.append(s)
    return out


def run_sweep(
    model,
    drafter: str,
    cfg: ServingConfig,
    loads: list[int],
    modes: list[str],
    requests_per_load: int,
    max_tokens: int,
    suites: str,
    interactive_share: float,
    json_out: str | None,
    seed: int = 0,
    repeats: int = 1,
    log=None,
) -> dict:
    from specjax.server.scheduler import build_scheduler

    say = log or (lambda m: print(f"specjax serve-bench: {m}", file=sys.stderr, flush=True))
    base = build_scheduler(model, drafter, cfg, log=say)  # compiles and times everything once
    engine = base.engine
    cfg = dataclasses.replace(cfg, step_costs=base.costs.table)
    prompts = _prompts(model, suites, engine.max_seq_len - max_tokens, max(requests_per_load, 8), seed)
    points = []
    scheds = start_modes(engine, cfg, model.config.eos_token_ids, modes)
    try:
        for c in loads:
            for rep in range(repeats):
                for mode in run_order(modes, rep):
                    say(f"load {c} clients, mode {mode}, run {rep + 1}/{repeats} ...")
                    points.append(
                        run_point(scheds[mode], c, requests_per_load, prompts, max_tokens, interactive_share)
                        | {"repeat": rep}
                    )
    finally:
        for sc in scheds.values():
            sc.stop()
    result = {
        "model": model.name,
        "drafter": drafter,
        "ks": list(engine.ks),
        "buckets": list(engine.buckets),
        "max_tokens": max_tokens,
        "requests_per_load": requests_per_load,
        "repeats": repeats,
        "suites": suites,
        "step_costs": base.costs.to_dict(),
        "points": points,
        "summary": summarize(points),
    }
    print_points(result)
    for s in result["summary"]:
        parts = [f"{k} {v:.3f}" for k, v in s.items() if k.startswith("rules_vs") or (k == "noise" and v)]
        say(f"{s['clients']} clients: " + (", ".join(parts) or "(rules not run)"))
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


def print_points(result: dict) -> None:
    """serve-bench's table of load points (clients x mode), to stderr."""
    from rich.console import Console
    from rich.table import Table

    r = result
    table = Table(title=f"serve-bench: {r['model']}, drafter {r['drafter']}, K in {r['ks']}, buckets {r['buckets']}")
    for col in (
        "clients",
        "mode",
        "tok/s",
        "ITL int. ms",
        "ITL batch ms",
        "TTFT int. ms",
        "TTFT batch ms",
        "MAL",
        "steps K:n",
    ):
        table.add_column(col)
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for p in result["points"]:
        table.add_row(
            str(p["clients"]),
            p["mode"],
            fmt(p["tokens_per_second"]),
            fmt(p["itl_ms_interactive"]),
            fmt(p["itl_ms_batch"]),
            fmt(p["ttft_ms_interactive"]),
            fmt(p["ttft_ms_batch"]),
            f"{p['mal']:.2f}",
            " ".join(f"{k}:{v}" for k, v in p["steps_by_k"].items()),
        )
    Console(file=sys.stderr, width=150).print(table)
