"""`specjax bench SUITE...`: every drafter and K against plain decoding, same process, interleaved.

Methodology: every (drafter, K) configuration is compiled and run once before timing (warm-up,
reported as compile seconds); then, for each repeat, plain decoding and every configuration run
over the same prompt batches one after another, so machine drift hits all alike; figures are
medians over repeats; speedup = configuration tokens/s / plain tokens/s at the same batch size
and sampling settings.

Time shares of draft / verify / accept come from timing each component as its own compiled
function at the loop's shapes (inside the fused loop they cannot be separated).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.bench.common import peak_memory_mb, timed
from specjax.drafters import make_drafter
from specjax.drafters.base import InitContext, StepContext
from specjax.engine import Engine, _prefill
from specjax.generate import encode_prompt
from specjax.sampling import SamplingArrays, SamplingParams
from specjax.verify import accept


@dataclasses.dataclass
class RunFigures:
    tokens: int
    seconds: float  # prefill + decode, compile excluded
    steps: int
    checked: np.ndarray  # [K]
    accepted: np.ndarray  # [K]


def run_config(engine: Engine, batches, sampling: SamplingParams, drafter) -> RunFigures:
    tokens = steps = 0
    seconds = 0.0
    k = drafter.num_draft
    checked, accepted = np.zeros(k), np.zeros(k)
    for batch in batches:
        rows = engine.generate(batch, [sampling] * len(batch), engine.model.config.eos_token_ids, drafter)
        seconds += rows[0].prefill_seconds + rows[0].decode_seconds
        for r in rows:
            tokens += len(r.token_ids)
            steps += r.steps
            checked += r.checked
            accepted += r.accepted
    return RunFigures(tokens, seconds, steps, checked, accepted)


def component_times(engine: Engine, drafter, prompt_ids: list[int], sampling: SamplingParams,
                    repeats: int = 5) -> dict[str, float]:
    """Median seconds of one draft, one verify forward (T = K + 1) and one accept step, batch 1."""
    model, k = engine.model, drafter.num_draft
    t, s = engine.shapes([len(prompt_ids)], 64, k)
    prompt = jnp.asarray([prompt_ids + [0] * (t - len(prompt_ids))], jnp.int32)
    plen = jnp.asarray([len(prompt_ids)], jnp.int32)
    cache, logits, hid, fin = jax.jit(
        lambda p, x, n: _prefill(model.graphdef, p, x, n, cache_size=s, collect=drafter.hidden_layers,
                                 want_final=drafter.needs_final_hidden)
    )(model.params, prompt, plen)
    samp = SamplingArrays.from_params([sampling])
    greedy = sampling.greedy
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    history = jnp.zeros((1, s), jnp.int32).at[:, : t].set(prompt).at[0, plen[0]].set(first[0])
    hlen = plen + 1
    dparams = drafter.params()
    dstate = drafter.init(dparams, InitContext(prompt, plen, history, hlen, samp, hid, fin, s, greedy))
    key = jax.random.key(0)
    out = {}
    if k > 0:
        propose = jax.jit(lambda dp, st, h, n: drafter.propose(dp, st, StepContext(h, n, samp, key, greedy)))
        draft, q, _ = propose(dparams, dstate, history, hlen)
        out["draft"] = timed(lambda: jax.block_until_ready(propose(dparams, dstate, history, hlen)), repeats)
    else:
        draft, q = jnp.zeros((1, 0), jnp.int32), None
        out["draft"] = 0.0
    tokens_in = jnp.concatenate([first[:, None], draft], axis=1)

    def verify(p, x, c):
        m = nnx.merge(model.graphdef, p)
        h, c, _ = m.hidden(x, c, collect=drafter.hidden_layers)
        return m.logits(h)

    vf = jax.jit(verify)
    vlogits = vf(model.params, tokens_in, cache)
    out["verify"] = timed(lambda: jax.block_until_ready(vf(model.params, tokens_in, cache)), repeats)
    af = jax.jit(lambda lg, d, qq: accept(lg, d, qq, samp, key, greedy, engine.implementation))
    jax.block_until_ready(af(vlogits, draft, q))
    out["accept"] = timed(lambda: jax.block_until_ready(af(vlogits, draft, q)), repeats)
    return out


def run_speculative_bench(model, suites: dict[str, list], drafters: list[str], num_drafts: list[int],
                          batch_sizes: list[int], temperatures: list[float], max_new_tokens: int,
                          repeats: int, console=None) -> dict:
    """suites: name -> list of prompts (strings or message lists). Returns every figure."""
    from rich.console import Console

    console = console or Console(stderr=True)
    engine = Engine(model)
    configs = [("none", 0)] + [(d, k) for d in drafters if d != "none" for k in num_drafts]
    drafter_objs = {c: make_drafter(c[0], c[1], model) for c in configs}
    results = []
    for suite, prompts in suites.items():
        ids = [encode_prompt(model, p) for p in prompts]
        for temp in temperatures:
            sampling = SamplingParams(temperature=temp, max_new_tokens=max_new_tokens, seed=0)
            for b in batch_sizes:
                batches = [ids[i : i + b] for i in range(0, len(ids) - b + 1, b)] or [ids[:b]]
                t0 = time.perf_counter()
                for c in configs:  # warm-up: compile every shape used below
                    run_config(engine, batches[:1], sampling, drafter_objs[c])
                warm = time.perf_counter() - t0
                runs = {c: [] for c in configs}
                for _ in range(repeats):  # interleaved: plain then every config, per repeat
                    for c in configs:
                        runs[c].append(run_config(engine, batches, sampling, drafter_objs[c]))
                plain_tps = statistics.median(r.tokens / r.seconds for r in runs[("none", 0)])
                for c in configs:
                    rs = runs[c]
                    tps = statistics.median(r.tokens / r.seconds for r in rs)
                    r0 = rs[0]
                    checked, acc = r0.checked, r0.accepted
                    comp = component_times(engine, drafter_objs[c], ids[0], sampling)
                    total = sum(comp.values())
                    row = {
                        "suite": suite, "temperature": temp, "batch_size": b,
                        "drafter": c[0], "num_draft": c[1],
                        "prompts": sum(len(x) for x in batches),
                        "tokens_per_second": tps,
                        "speedup": tps / plain_tps,
                        "mean_accepted_length": (r0.tokens - sum(len(x) for x in batches)) / r0.steps if r0.steps else 1.0,
                        "acceptance_rate": float(acc.sum() / checked.sum()) if checked.sum() else None,
                        "per_position_acceptance": [float(a / x) if x else 0.0 for a, x in zip(acc, checked)],
                        "time_share": {n: v / total for n, v in comp.items()},
                        "component_seconds": comp,
                        "sampler_vs_verify": comp["accept"] / comp["verify"],
                        "warmup_seconds": warm,
                        "peak_memory_mb": peak_memory_mb(),
                        "tokens_per_second_repeats": [r.tokens / r.seconds for r in rs],
                    }
                    results.append(row)
                    console.log(
                        f"{suite} T={temp} B={b} {c[0]} K={c[1]}: {tps:.1f} tok/s, x{row['speedup']:.2f}, "
                        f"MAL {row['mean_accepted_length']:.2f}"
                    )
    return {"model": model.name, "dtype": str(model.dtype), "backend": jax.default_backend(),
            "max_new_tokens": max_new_tokens, "repeats": repeats, "compile_seconds": engine.compile_seconds,
            "results": results, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def print_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"speculative decoding — {report['model']} ({report['dtype']}, {report['backend']})")
    for col in ("suite", "T", "B", "drafter", "K", "tok/s", "speedup", "MAL", "accept", "draft/verify/accept"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        ts = r["time_share"]
        table.add_row(
            r["suite"], f"{r['temperature']:g}", str(r["batch_size"]), r["drafter"], str(r["num_draft"]),
            f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.2f}x", f"{r['mean_accepted_length']:.2f}",
            "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}",
            f"{100 * ts['draft']:.0f}/{100 * ts['verify']:.0f}/{100 * ts['accept']:.0f}%",
        )
    console.print(table)


def dump(report: dict, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
