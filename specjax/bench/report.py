"""The report of `specjax bench SUITE...`: arithmetic on measured rows, tables, JSON.

Everything here is a pure function of the rows the measuring modules (`speculative.py`,
`peers.py`) produce, so the arithmetic is testable on a fixed, fake timing table.

JSON written by `--json-out` (one object):

* `kind`: "speculative"; `model`, `model_source` (path it was loaded from), `dtype`, `backend`
  (jax backend), `device` (jax device kind); `max_new_tokens`, `repeats`, `temperatures`,
  `batch_sizes`, `num_drafts`, `drafters` (specs as given); `spec_policies` (the
  `--spec-policy` values measured: "always", "auto"); `trees` (the `--trees` proposal shapes
  measured: "chain", "KxD"); `suites` {name: prompts used};
  `compile_seconds` (total XLA compile time of the run); `time` (local ISO time of the run).
* `results`: one row per (suite, temperature, batch size, configuration); plain decoding is the
  configuration with `drafter` "none" and `num_draft` 0. Fields:
  `suite`, `temperature`, `batch_size`, `drafter` (spec as given, e.g. "draft:/path"), `label`
  (short name for tables and plots), `num_draft` (K: draft tokens, or tree nodes); `tree`
  ("chain", or "KxD": a dynamic tree of top-K children per node, D levels deep); `spec_policy`
  ("none" for plain decoding; "always": every step verifies what the drafter proposes; "auto":
  the per-row fallback of `specjax generate`, rows taking plain steps while verifying does not pay); `verified_share`
  (steps in which a row verified drafts ÷ all its steps, over all rows and repeats; null for
  plain); `prompts` (rows generated per repeat: the suite's prompts, cycled to fill the last
  batch); `tokens` (generated tokens per repeat, median);
  `tokens_per_second` (median over repeats of tokens / (prefill + decode seconds), compile
  excluded); `tokens_per_second_repeats` (each repeat's figure); `speedup` (`tokens_per_second`
  ÷ plain's at the same suite, batch size and sampling settings); `mean_accepted_length` (MAL:
  tokens emitted per draft-verify step, bonus included, over all repeats; 1.0 for plain);
  `acceptance_rate` (accepted ÷ checked draft positions; null for plain);
  `per_position_acceptance` (K entries for a chain, D for a tree: P(draft i accepted | drafts < i
  accepted), i the depth in a tree); `off_chain_share` (tree steps whose accepted path left the
  top-1 chain ÷ verifying steps; 0 for chains);
  `warmup_seconds` (the first, untimed pass over one batch, compile included; for "auto" also
  the step-cost measurement, when not already cached);
  `compile_seconds` (the XLA compile time inside that warm-up); `peak_memory_mb` and
  `peak_memory_source` (see `common.PeakMemory`: "rss_peak" is this configuration's own peak
  resident memory, "device_peak_lifetime" the device's high-water mark so far);
  `compiled_memory_mb` (XLA's planned footprint of the configuration's compiled code: arguments,
  outputs and temporaries; null when it compiled nothing new); `component_seconds` {`draft`,
  `verify`, `accept`} (one call of each at this batch size, timed as separate compiled
  functions); `time_share` (the same, as fractions of their sum); `sampler_vs_verify` (accept ÷
  verify seconds).
* `peers`: rows of other implementations on the same prompt token ids (see `peers.py`):
  `peer` ("hf" | "llamacpp"), `method` ("plain" | "prompt_lookup" | "assisted"), `label`,
  `num_draft`, `suite`, `temperature`, `batch_size` (always 1: HF's assisted generation and
  prompt lookup take one sequence), `prompts`, `tokens`, `tokens_per_second`,
  `tokens_per_second_repeats`, `warmup_seconds`, `threads`, and `speedup` (÷ the same peer's
  plain decoding at the same settings).
* `peers_skipped`: {peer: one-line reason} for every requested peer that did not finish: an
  optional one that cannot run here (llamacpp without the package or a GGUF model), or one whose
  process failed or crashed (e.g. "crashed: SIGABRT; last output line: ...").
* `peers_status`: {peer: {`status`, `reason`, `returncode`, `stderr_tail`, `rows`, `seconds`}}:
  each requested peer's outcome; `status` is "ok", "skipped", "failed" (a Python exception in
  the peer's process) or "crashed" (the process died: `reason` names the signal). Each peer runs
  in its own process (see `peer_process.py`), so a crash loses only that peer's unfinished
  (suite, temperature) groups; `rows` counts the rows kept.
* `peer_comparison`: per (suite, temperature, batch size, peer): `specjax_best` and `peer_best`
  ({`label`, `num_draft`, `tokens_per_second`}, plain included) and `ratio` = specjax best tok/s ÷
  peer best tok/s.
* `recommendations`: per (suite, temperature): `by_batch` [{`batch_size`, `drafter`, `label`,
  `num_draft`, `spec_policy`, `speedup`}] (the fastest configuration, either policy; drafter
  "none" when plain decoding is fastest), `plain_wins_at` (batch sizes at which no drafter beats
  plain), `plain_wins_from` (smallest batch size from which plain wins at every larger measured
  one; null when a drafter wins at the largest) and `text` (the line printed).
* `plots`: paths of the PNG files written (see `plots.py`).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

PLAIN = "none"


def short_label(spec: str) -> str:
    """`draft:/long/path/small-model` -> `draft:small-model`; other specs unchanged."""
    kind, sep, arg = spec.partition(":")
    if not sep:
        return spec
    return f"{kind}:{os.path.basename(os.path.normpath(arg)) or arg}"


def config_name(row: dict) -> str:
    """`plain`, `LABEL K=k`, `LABEL K=k tree KxD` for trees, with ` auto` for the per-row fallback
    ("always" rows, and rows without `spec_policy`, carry no suffix)."""
    if row["drafter"] == PLAIN:
        return "plain"
    tree = row.get("tree", "chain")
    return (
        f"{row['label']} K={row['num_draft']}"
        + ("" if tree == "chain" else f" tree {tree}")
        + (" auto" if row.get("spec_policy") == "auto" else "")
    )


def _group_key(row: dict) -> tuple:
    return (row.get("peer"), row["suite"], row["temperature"], row["batch_size"])


def add_speedups(rows: list[dict]) -> list[dict]:
    """Set `speedup` = tokens/s ÷ plain tokens/s of the same implementation, suite, temperature
    and batch size (rows of one run share max_new_tokens and seed). Rows without a plain
    partner get None. Returns `rows` (changed in place)."""
    plain = {_group_key(r): r["tokens_per_second"] for r in rows if r["drafter"] == PLAIN}
    for r in rows:
        base = plain.get(_group_key(r))
        r["speedup"] = r["tokens_per_second"] / base if base else None
    return rows


def recommend(rows: list[dict]) -> list[dict]:
    """Per (suite, temperature): the fastest configuration at each batch size that verified at
    all; the batch sizes at which plain decoding is not beaten (every such speedup <= 1); and the smallest batch
    size from which plain decoding wins at every larger measured batch size."""
    groups: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        groups[(r["suite"], r["temperature"])][r["batch_size"]].append(r)
    out = []
    for (suite, temp), by_b in groups.items():
        entries = []
        for b in sorted(by_b):
            # a configuration that never verified (`auto` judged the batch not worth it) decoded plainly
            spec = [
                r
                for r in by_b[b]
                if r["drafter"] != PLAIN and r.get("speedup") is not None and r.get("verified_share") != 0
            ]
            best = max(spec, key=lambda r: r["speedup"], default=None)
            if best is None or best["speedup"] <= 1.0:
                entries.append(
                    {
                        "batch_size": b,
                        "drafter": PLAIN,
                        "label": "plain",
                        "num_draft": 0,
                        "spec_policy": "none",
                        "speedup": 1.0,
                    }
                )
            else:
                entries.append(
                    {
                        "batch_size": b,
                        "drafter": best["drafter"],
                        "label": best["label"],
                        "num_draft": best["num_draft"],
                        "spec_policy": best.get("spec_policy", "always"),
                        "speedup": best["speedup"],
                    }
                )
        plain_at = [e["batch_size"] for e in entries if e["drafter"] == PLAIN]
        plain_from = None
        for e in reversed(entries):  # the longest run of plain wins that reaches the largest B
            if e["drafter"] != PLAIN:
                break
            plain_from = e["batch_size"]
        parts = [
            f"B={e['batch_size']}: " + ("plain" if e["drafter"] == PLAIN else f"{config_name(e)} ({e['speedup']:.2f}x)")
            for e in entries
        ]
        tail = _verdict([e["batch_size"] for e in entries], plain_at, plain_from)
        text = f"{suite} (T={temp:g}): " + ", ".join(parts) + f"; {tail}"
        out.append(
            {
                "suite": suite,
                "temperature": temp,
                "by_batch": entries,
                "plain_wins_at": plain_at,
                "plain_wins_from": plain_from,
                "text": text,
            }
        )
    return out


def _verdict(measured: list[int], plain_at: list[int], plain_from: int | None) -> str:
    """The end of a recommendation line; it names the batch sizes measured, so a run at one
    batch size never reads as a claim about every batch size."""

    def bs(xs):
        return ", ".join(map(str, xs))

    if len(measured) == 1:
        who = "speculation pays" if not plain_at else "plain decoding wins"
        return f"{who} at B={measured[0]} (the only batch size measured)"
    if not plain_at:
        return f"speculation pays at every measured batch size (B={bs(measured)})"
    if plain_from == measured[0]:
        return f"plain decoding wins at every measured batch size (B={bs(measured)})"
    if plain_from is not None:
        earlier = [b for b in plain_at if b < plain_from]
        return (
            f"plain decoding wins from B={plain_from}"
            + (f" (and at B={bs(earlier)})" if earlier else "")
            + f"; measured at B={bs(measured)}"
        )
    return f"plain decoding wins at B={bs(plain_at)} only; measured at B={bs(measured)}"


def compare_peers(rows: list[dict], peer_rows: list[dict]) -> list[dict]:
    """specjax's best tok/s ÷ each peer's best tok/s, per (suite, temperature, batch size)."""

    def best(rs):
        r = max(rs, key=lambda r: r["tokens_per_second"])
        return {"label": config_name(r), "num_draft": r["num_draft"], "tokens_per_second": r["tokens_per_second"]}

    ours: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        ours[(r["suite"], r["temperature"], r["batch_size"])].append(r)
    theirs: dict[tuple, list[dict]] = defaultdict(list)
    for r in peer_rows:
        theirs[(r["suite"], r["temperature"], r["batch_size"], r["peer"])].append(r)
    out = []
    for (suite, temp, b, peer), prs in theirs.items():
        mine = ours.get((suite, temp, b))
        if not mine:
            continue
        s, p = best(mine), best(prs)
        out.append(
            {
                "suite": suite,
                "temperature": temp,
                "batch_size": b,
                "peer": peer,
                "specjax_best": s,
                "peer_best": p,
                "ratio": s["tokens_per_second"] / p["tokens_per_second"],
            }
        )
    return out


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def _speedup(r: dict) -> str:
    return "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"


def wide_console():
    """stdout console; 160 columns when not a terminal (rich's default of 80 folds the tables)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def print_report(report: dict, console=None) -> None:
    """The tables (specjax, then peers), then the peer ratios and the recommendation lines."""
    from rich.table import Table

    console = console or wide_console()
    table = Table(title=f"speculative decoding — {report['model']} ({report['dtype']}, {report['backend']})")
    for col in (
        "suite",
        "T",
        "B",
        "config",
        "tok/s",
        "speedup",
        "MAL",
        "accept",
        "verified",
        "draft/verify/accept",
        "warm-up s",
        "peak MB",
    ):
        table.add_column(col, justify="right")
    for r in report["results"]:
        ts = r.get("time_share") or {}
        share = "/".join(f"{100 * ts.get(n, 0):.0f}" for n in ("draft", "verify", "accept")) + "%" if ts else "-"
        table.add_row(
            r["suite"],
            f"{r['temperature']:g}",
            str(r["batch_size"]),
            config_name(r),
            f"{r['tokens_per_second']:.1f}",
            _speedup(r),
            f"{r['mean_accepted_length']:.2f}",
            _fmt(r.get("acceptance_rate"), ".2f"),
            _fmt(r.get("verified_share"), ".0%"),
            share,
            _fmt(r.get("warmup_seconds"), ".1f"),
            _fmt(r.get("peak_memory_mb"), ".0f"),
        )
    console.print(table)
    lost = {p: st for p, st in (report.get("peers_status") or {}).items() if st["status"] in ("failed", "crashed")}
    if report.get("peers") or lost:
        pt = Table(title="peers on the same prompt token ids (batch 1)")
        for col in ("peer", "suite", "T", "B", "config", "tok/s", "speedup", "threads"):
            pt.add_column(col, justify="right")
        for r in report.get("peers") or []:
            pt.add_row(
                r["peer"],
                r["suite"],
                f"{r['temperature']:g}",
                str(r["batch_size"]),
                config_name(r),
                f"{r['tokens_per_second']:.1f}",
                _speedup(r),
                str(r.get("threads", "-")),
            )
        for peer, st in lost.items():  # its unfinished rows: one line saying why they are missing
            pt.add_row(peer, "-", "-", "-", f"{st['status']}: {st['reason']}", "-", "-", "-")
        console.print(pt)
    for peer, why in (report.get("peers_skipped") or {}).items():
        if peer in lost:
            kept = lost[peer]["rows"]
            console.print(f"{peer}: {why}" + (f" ({kept} rows measured before are shown)" if kept else " (no rows)"))
        else:
            console.print(f"{peer}: skipped ({why})")
    for c in report.get("peer_comparison") or []:
        console.print(
            f"{c['suite']} (T={c['temperature']:g}, B={c['batch_size']}): specjax best "
            f"{c['specjax_best']['tokens_per_second']:.1f} tok/s ({c['specjax_best']['label']}) ÷ {c['peer']} best "
            f"{c['peer_best']['tokens_per_second']:.1f} tok/s ({c['peer_best']['label']}) = {c['ratio']:.2f}x"
        )
    for rec in report.get("recommendations") or []:
        console.print(f"recommendation — {rec['text']}")


def dump(report: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
