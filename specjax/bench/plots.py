"""PNG plots of a `specjax bench SUITE...` report (matplotlib, Agg backend: no display needed).

Three files, `<stem>_<name>.png`, written next to `--json-out` or into `--plots-dir`:

* `speedup`: speedup over plain decoding vs batch size, one panel per (suite, temperature), one
  line per drafter/K; peers' own speedups (batch 1) as separate markers; a dashed line at 1x;
* `acceptance`: per-position acceptance P(draft i accepted | drafts < i accepted) vs position,
  one panel per suite, one line per drafter/K (at the smallest batch size and temperature:
  acceptance does not depend on batch size);
* `mal`: mean accepted length per suite, one bar per drafter/K (same slice), plain's 1.0 dashed.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import matplotlib
from matplotlib.figure import Figure

from specjax.bench.report import PLAIN, config_name


def _grid(n: int) -> tuple[int, int]:
    cols = min(n, 3)
    return math.ceil(n / cols), cols


def _axes(n: int, title: str):
    rows, cols = _grid(n)
    fig = Figure(figsize=(5 * cols, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title)  # the model on its own line: one 5-inch panel is narrower than a long name
    return fig, axes


def plot_speedup(report: dict, path: str) -> None:
    rows = [r for r in report["results"] if r["drafter"] != PLAIN]
    panels = sorted({(r["suite"], r["temperature"]) for r in report["results"]})
    fig, axes = _axes(len(panels), f"speedup over plain decoding\n{report['model']}")
    for ax, (suite, temp) in zip(axes, panels):
        lines = defaultdict(list)
        for r in rows:
            if (r["suite"], r["temperature"]) == (suite, temp):
                lines[config_name(r)].append((r["batch_size"], r["speedup"]))
        for name, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", label=name)
        for p in report.get("peers") or []:
            if (p["suite"], p["temperature"]) == (suite, temp) and p["drafter"] != PLAIN and p.get("speedup"):
                ax.plot(
                    [p["batch_size"]],
                    [p["speedup"]],
                    marker="x",
                    linestyle="none",
                    label=f"{p['peer']}: {config_name(p)}",
                )
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        bs = sorted({r["batch_size"] for r in report["results"]})
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup (x plain)")
        ax.set_title(f"{suite}, T={temp:g}")
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def _slice(report: dict) -> list[dict]:
    """Rows at the smallest batch size and temperature, where acceptance is read."""
    rs = report["results"]
    b = min(r["batch_size"] for r in rs)
    t = min(r["temperature"] for r in rs)
    return [r for r in rs if r["batch_size"] == b and r["temperature"] == t]


def plot_acceptance(report: dict, path: str) -> None:
    rows = [r for r in _slice(report) if r["drafter"] != PLAIN]
    suites = sorted({r["suite"] for r in report["results"]})
    fig, axes = _axes(len(suites), f"per-position acceptance\n{report['model']}")
    for ax, suite in zip(axes, suites):
        for r in rows:
            if r["suite"] == suite and r["per_position_acceptance"]:
                acc = [float("nan") if a is None else a for a in r["per_position_acceptance"]]  # None: never checked
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=config_name(r))
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(accept i | accepted < i)")
        ax.set_title(suite)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def plot_mal(report: dict, path: str) -> None:
    rows = [r for r in _slice(report) if r["drafter"] != PLAIN]
    suites = sorted({r["suite"] for r in report["results"]})
    names = sorted({config_name(r) for r in rows})
    fig = Figure(figsize=(max(5, 1.6 * len(suites) * max(1, len(names)) ** 0.5 + 2), 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        mal = {r["suite"]: r["mean_accepted_length"] for r in rows if config_name(r) == name}
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(suites))]
        ax.bar(xs, [mal.get(s, 0.0) for s in suites], width, label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain")
    ax.set_xticks(range(len(suites)), suites)
    ax.set_ylabel("mean accepted length (tokens / step)")
    ax.set_title(f"MAL per suite\n{report['model']}")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)


def write_plots(report: dict, out_dir: str, stem: str = "bench") -> list[str]:
    """Write the three PNGs; returns their paths."""
    matplotlib.use("Agg")  # figures are built without pyplot; this keeps any pyplot use headless too
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fn in (("speedup", plot_speedup), ("acceptance", plot_acceptance), ("mal", plot_mal)):
        path = os.path.join(out_dir, f"{stem}_{name}.png")
        fn(report, path)
        paths.append(path)
    return paths
