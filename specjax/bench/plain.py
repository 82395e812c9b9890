"""`specjax bench plain`: throughput of the target alone.

Reports, for each batch size: decode tokens/s, prefill tokens/s, peak memory; at batch 1 the
fraction of the memory roofline (weight bytes x tokens/s / copy bandwidth measured in this run);
and the cost of one forward pass over T = 1, 2, 4, ... tokens relative to T = 1, the ratio the
speculative loop lives on.

Shared machines are noisy, so the copy bandwidth is measured next to every timed run (median
used), and the forward costs are timed round-robin over T inside a compiled loop, as the engine
runs them (see `forward_costs`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from specjax.bench.common import copy_bandwidth_gbs, peak_memory_mb
from specjax.models.loading import load_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams


def forward_costs(model, ts: list[int], context: int, repeats: int, steps: int = 8) -> dict[int, float]:
    """Median seconds of one cached forward of T tokens at batch 1 (prefix of `context` tokens).

    Timed as the engine runs it: `steps` forwards inside one compiled loop that carries the
    (donated) cache, divided by `steps`. The tokens change every step and every logit feeds the
    carry, so XLA can neither hoist work out of the loop nor drop the LM head as dead code.
    """
    size = context + max(ts) + 128
    m = model.module()
    vocab = model.config.vocab_size

    def run(params, tokens, cache):
        model_ = nnx.merge(model.graphdef, params)

        def step(i, carry):
            cache, acc = carry
            logits, cache, _ = model_((tokens + i) % vocab, cache)  # [1, T, V]
            return cache, acc + jnp.argmax(logits, axis=-1).sum()

        return jax.lax.fori_loop(0, steps, step, (cache, jnp.zeros((), jnp.int32)))

    f = jax.jit(run, donate_argnums=(2,))

    def fresh_cache():
        return jax.block_until_ready(m.new_cache(1, size).with_lengths(jnp.asarray([context], jnp.int32)))

    tokens = {t: jnp.ones((1, t), jnp.int32) for t in ts}
    # One executable per T: traced here in turn, compiled in parallel (XLA releases the GIL while
    # compiling; an unrolled 30-layer model takes tens of seconds per shape, which a many-core
    # host overlaps).
    cache0 = fresh_cache()
    lowered = {t: f.lower(model.params, tokens[t], cache0) for t in ts}
    del cache0
    with ThreadPoolExecutor(max_workers=min(len(ts), os.cpu_count() or 1)) as pool:
        exe = dict(zip(ts, pool.map(lambda lw: lw.compile(), [lowered[t] for t in ts])))
    for t in ts:  # warm-up
        jax.block_until_ready(exe[t](model.params, tokens[t], fresh_cache()))
    times: dict[int, list[float]] = {t: [] for t in ts}
    for _ in range(repeats):
        for t in ts:  # round-robin, so that load drifts hit every T alike
            cache = fresh_cache()
            t0 = time.perf_counter()
            jax.block_until_ready(exe[t](model.params, tokens[t], cache))
            times[t].append((time.perf_counter() - t0) / steps)
    return {t: statistics.median(v) for t, v in times.items()}


def run_plain_bench(
    model_path=None,
    dtype=None,
    batch_sizes=(1, 8, 32),
    max_new_tokens=64,
    prompt_len=128,
    forward_ts=(1, 2, 4, 8, 16),
    repeats=3,
    json_out=None,
    console=None,
) -> dict:
    console = console or Console(stderr=True, log_path=False)
    model = load_model(model_path, dtype=dtype)
    engine = Engine(model)
    bws = [copy_bandwidth_gbs()]
    wbytes = model.weight_bytes()
    rng = np.random.default_rng(0)
    rows = []
    for b in batch_sizes:
        prompts = [rng.integers(100, model.config.vocab_size, prompt_len).tolist() for _ in range(b)]
        params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)] * b
        engine.generate(prompts, params)  # compile + warm-up, excluded
        runs = []
        for _ in range(repeats):
            runs.append(engine.generate(prompts, params)[0])
            bws.append(copy_bandwidth_gbs())
        decode_s = float(np.median([r.decode_seconds for r in runs]))
        prefill_s = float(np.median([r.prefill_seconds for r in runs]))
        decode_tps = b * (max_new_tokens - 1) / decode_s  # first token comes from the prefill
        row = {
            "batch_size": b,
            "decode_tokens_per_second": decode_tps,
            "prefill_tokens_per_second": b * prompt_len / prefill_s,
            "decode_seconds": decode_s,
            "prefill_seconds": prefill_s,
            "peak_memory_mb": peak_memory_mb(),
        }
        rows.append(row)
        console.log(f"batch {b}: decode {decode_tps:.1f} tok/s, prefill {row['prefill_tokens_per_second']:.0f} tok/s")
    costs = forward_costs(model, list(forward_ts), prompt_len, repeats)
    bw = statistics.median(bws)
    for row in rows:
        if row["batch_size"] == 1:
            row["roofline_fraction"] = wbytes * row["decode_tokens_per_second"] / (bw * 1e9)
    result = {
        "model": model.name,
        "dtype": str(model.dtype),
        "backend": jax.default_backend(),
        "weight_bytes": wbytes,
        "copy_bandwidth_gbs": bw,
        "roofline_tokens_per_second": bw * 1e9 / wbytes,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "compile_seconds": engine.compile_seconds,
        "batches": rows,
        "forward_seconds": {str(t): s for t, s in costs.items()},
        "forward_cost_vs_t1": {str(t): s / costs[min(costs)] for t, s in costs.items()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print_plain(result)
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def print_plain(result: dict) -> None:
    """The plain bench's tables (batches; forward cost of T tokens) and roofline line, to stdout."""
    costs = {int(t): s for t, s in result["forward_seconds"].items()}
    bw, wbytes = result["copy_bandwidth_gbs"], result["weight_bytes"]
    table = Table(title=f"plain decoding — {result['model']} ({result['dtype']}, {result['backend']})")
    for col in ("batch", "decode tok/s", "prefill tok/s", "peak MB", "roofline"):
        table.add_column(col, justify="right")
    for r in result["batches"]:
        rf = f"{100 * r['roofline_fraction']:.0f}%" if "roofline_fraction" in r else ""
        table.add_row(
            str(r["batch_size"]),
            f"{r['decode_tokens_per_second']:.1f}",
            f"{r['prefill_tokens_per_second']:.0f}",
            f"{r['peak_memory_mb']:.0f}",
            rf,
        )
    out = Console()
    out.print(table)
    t2 = Table(title="forward cost of T tokens vs T = 1 (batch 1)")
    t2.add_column("T", justify="right")
    t2.add_column("ms", justify="right")
    t2.add_column("x T=1", justify="right")
    for t, s in costs.items():
        t2.add_row(str(t), f"{1e3 * s:.1f}", f"{result['forward_cost_vs_t1'][str(t)]:.2f}")
    out.print(t2)
    out.print(
        f"copy bandwidth {bw:.1f} GB/s; weights {wbytes / 1e6:.0f} MB; "
        f"roofline {result['roofline_tokens_per_second']:.1f} tok/s at batch 1"
    )
