"""`specjax bench --preset h200 | cpu-smoke`: what speculative decoding can buy on an accelerator.

On a GPU, batch-1 decoding reads every weight once per token and leaves the compute idle, so
verifying T tokens costs little more than one; how much more, and what the sampler and the
batch size take back, decides the speedup. One run measures, on the default JAX device:

1. memory bandwidth: a device copy (`common.device_copy_bandwidth_gbs`), before and after the
   models (median used);
2. per model (`h200`: a Llama-3-8B-shaped model with **random bf16 weights** — speed depends on
   shapes, not values — and the default model; `cpu-smoke`: a tiny random config): batch-1 plain
   decode tokens/s and its fraction of the memory roofline (weight bytes x tokens/s ÷
   bandwidth), and the cost of one cached forward over T tokens relative to T = 1
   (`plain.forward_costs`);
3. the rejection sampler (`pallas_kernels.rejection_sampling.rejection_sample`, Pallas kernel
   vs jnp reference, dense q and one-hot q) at the target vocabulary (128256 for `h200`) as a
   fraction of one verify step (the forward over K + 1 tokens) of each model;
4. projected speedup per batch size B and drafter/K from those costs and given MALs:
   `MAL x c(B) / (c(B (K + 1)) + sampler(B, K))`, where c(m) is the batch-1 forward cost over m
   tokens (linear in T between measured points; B rows of K + 1 tokens take the same weight
   reads and matmul shapes as one row of B (K + 1), the KV reads aside). The draft cost is not
   included (≈0 for n-gram; model drafters add their own), and greedy verification skips the
   sampler, so the sampled case shown is the slower one. Projections past the largest measured
   T are left out. MALs come from `--mal-from bench.json` (a CPU `specjax bench` run: mean over
   its suites, batch sizes and temperatures per drafter/K) or are assumed, and labelled so.

The `h200` preset fits one 10-minute run: parts not yet started when its 450 s budget is spent
are skipped and listed (`--time-budget` changes it), and the forward costs compile their T
shapes in parallel on the host's cores; `cpu-smoke` runs the same code on toy sizes in seconds (CI). A compact
table is printed last; the full JSON goes to `--json-out` (default `accel-<preset>.json`):

* `kind` ("accel"), `preset`, `backend`, `device`, `time`, `time_budget_s`, `elapsed_s`;
* `bandwidth_gbs` (median of `bandwidth_measurements_gbs`, bytes read + written per second);
* `models`: [{`name`, `shape` ("llama3_8b" | "default" | "tiny"), `weights` ("random" |
  "checkpoint"), `dtype`, `params`, `weight_bytes`, `prompt_len`, `decode_tokens`,
  `decode_tokens_per_second` (median over repeats, compile excluded), `compile_seconds`,
  `roofline_tokens_per_second` (bandwidth ÷ weight bytes), `roofline_fraction`,
  `forward_context` (tokens already cached), `forward_seconds` {T: s}, `forward_cost_vs_t1`
  {T: x}}];
* `sampler`: {`vocab`, `rows`: [{`implementation` ("pallas" | "reference" | "auto": what the
  engine runs), `q` ("dense" | "one-hot"), `batch_size`, `num_draft`, `seconds`,
  `fraction_of_verify` {model: sampler seconds ÷ forward seconds at T = K + 1} (B = 1 rows), or
  `error` when it could not run; `fallback_for` ("auto") marks the reference timing the
  projections used when the kernel failed}]};
* `mals`: {`source`, `assumed` (bool), `entries`: [{`drafter`, `num_draft`, `mal`}]};
* `projections`: [{`model`, `drafter`, `num_draft`, `mal`, `batch_size`, `verify_tokens`
  (B (K + 1)), `projected_speedup`}];
* `checks`: {`kernel`: {`vocab`, `batch_size`, `num_draft`, `rows`, `rows_equal`, `bit_exact`} or
  {`error`} (the kernel as the engine runs it against the jnp reference, dense and one-hot q),
  `lossless`: [{`dtype`, `drafter`, `num_draft`, `prompts`, `identical`, `mean_accepted_length`} or
  {`dtype`, `error`}] (greedy n-gram speculation against plain decoding, f32 and bf16;
  specjax/bench/device_checks.py);
* `skipped`: [{`part`, `reason`}].
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.common import device_copy_bandwidth_gbs, timed
from specjax.bench.plain import forward_costs
from specjax.bench.report import wide_console
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class Preset:
    models: tuple[str, ...]  # "llama3_8b" | "default" | "tiny"
    forward_ts: tuple[int, ...]
    forward_context: int  # tokens in the cache before the timed forwards
    prompt_len: int
    decode_tokens: int
    sampler_vocab: int
    batch_sizes: tuple[int, ...]  # of the projection
    copy_bytes: int
    repeats: int
    time_budget: float  # seconds
    fraction_ks: tuple[int, ...]  # K values of the sampler-fraction table
    lossless_model: str  # the model of the greedy token-identity check: "default" | "tiny"


PRESETS = {
    "h200": Preset(
        models=("llama3_8b", "default"),
        forward_ts=(1, 2, 4, 8, 16, 32, 64),
        forward_context=512,
        prompt_len=128,
        decode_tokens=128,
        sampler_vocab=128256,
        batch_sizes=(1, 2, 4, 8, 16, 32, 64),
        copy_bytes=2 << 30,
        repeats=5,
        time_budget=450.0,
        fraction_ks=(3, 7),
        lossless_model="default",
    ),
    "cpu-smoke": Preset(
        models=("tiny",),
        forward_ts=(1, 2, 4),
        forward_context=16,
        prompt_len=8,
        decode_tokens=8,
        sampler_vocab=512,
        batch_sizes=(1, 2, 4),
        copy_bytes=8 << 20,
        repeats=2,
        time_budget=120.0,
        fraction_ks=(3,),
        lossless_model="tiny",
    ),
}

# Labelled as assumptions wherever they appear: typical of a trained draft head on chat data.
ASSUMED_MALS = ({"drafter": "assumed", "num_draft": 3, "mal": 2.4}, {"drafter": "assumed", "num_draft": 7, "mal": 3.2})


def load_mals(path: str | None) -> dict:
    """MALs per drafter/K from a `specjax bench --json-out` report, or the assumed ones."""
    if path is None:
        return {
            "source": "assumed (not measured): pass --mal-from bench.json for measured MALs",
            "assumed": True,
            "entries": [dict(e) for e in ASSUMED_MALS],
        }
    try:
        with open(path) as fh:
            rows = json.load(fh)["results"]
        by = {}
        for r in rows:
            if r["drafter"] != "none" and r["num_draft"] > 0:
                key = (r.get("label", r["drafter"]), r["num_draft"])
                by.setdefault(key, []).append(float(r["mean_accepted_length"]))
    except OSError as e:
        raise SpecjaxError(f"--mal-from {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(
            f"--mal-from {path}: not a `specjax bench --json-out` report ({type(e).__name__}: {e})"
        ) from None
    if not by:
        raise SpecjaxError(f"--mal-from {path}: no speculative rows (drafter other than none)")
    entries = [{"drafter": d, "num_draft": k, "mal": statistics.mean(v)} for (d, k), v in sorted(by.items())]
    return {
        "source": f"{path} (mean over its suites, batch sizes and temperatures)",
        "assumed": False,
        "entries": entries,
    }


def build_model(shape: str, model_path: str | None, dtype: str | None):
    from specjax.models import config as cfgs
    from specjax.models.loading import default_dtype, load_model, random_model

    if shape == "llama3_8b":
        dt = dtype or default_dtype()
        return random_model(cfgs.llama3_8b(), dtype=jnp.dtype(dt)), "random"
    if shape == "tiny":
        return random_model(
            cfgs.cpu_smoke(vocab_size=256, max_position_embeddings=256), dtype=jnp.dtype(dtype or "float32")
        ), "random"
    return load_model(model_path, dtype=dtype, quiet=True), "checkpoint"


def measure_decode(shape: str, model, weights: str, p: Preset, bandwidth: float, log) -> dict:
    """Batch-1 plain decode speed (compile excluded) and its share of the memory roofline."""
    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams

    cfg = model.config
    engine = Engine(model)
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, p.prompt_len).tolist()
    params = [SamplingParams(max_new_tokens=p.decode_tokens, ignore_eos=True)]
    engine.generate([prompt], params)  # compile + warm-up
    decode_s = statistics.median(engine.generate([prompt], params)[0].decode_seconds for _ in range(p.repeats))
    tps = (p.decode_tokens - 1) / decode_s  # the first token comes from the prefill
    wbytes = model.weight_bytes()
    log(f"{model.name}: plain decode {tps:.1f} tok/s at batch 1")
    return {
        "name": model.name,
        "shape": shape,
        "weights": weights,
        "dtype": str(model.dtype),
        "params": cfg.num_params(),
        "weight_bytes": wbytes,
        "prompt_len": p.prompt_len,
        "decode_tokens": p.decode_tokens,
        "decode_tokens_per_second": tps,
        "compile_seconds": engine.compile_seconds,
        "roofline_tokens_per_second": bandwidth * 1e9 / wbytes,
        "roofline_fraction": wbytes * tps / (bandwidth * 1e9),
        "forward_context": p.forward_context,
        "forward_seconds": {},
        "forward_cost_vs_t1": {},
    }


def measure_forward_costs(row: dict, model, p: Preset, log) -> None:
    costs = forward_costs(model, list(p.forward_ts), p.forward_context, p.repeats)
    row["forward_seconds"] = {str(t): s for t, s in costs.items()}
    row["forward_cost_vs_t1"] = {str(t): s / costs[min(costs)] for t, s in costs.items()}
    rel = row["forward_cost_vs_t1"]
    log(f"{model.name}: verify cost vs T=1: " + ", ".join(f"T={t} {v:.2f}x" for t, v in rel.items()))


def sampler_seconds(vocab: int, batch: int, k: int, implementation: str, dense_q: bool, repeats: int) -> float:
    """Median seconds of one rejection-sampling call on random distributions `[B, K+1, V]`."""
    from pallas_kernels.rejection_sampling import rejection_sample

    kp, kq, kd = jax.random.split(jax.random.key(0), 3)
    p = jax.nn.softmax(jax.random.normal(kp, (batch, k + 1, vocab)), axis=-1)  # [B, K+1, V]
    q = jax.nn.softmax(jax.random.normal(kq, (batch, k, vocab)), axis=-1) if dense_q else None  # [B, K, V]
    draft = jax.random.randint(kd, (batch, k), 0, vocab, jnp.int32)  # [B, K]
    seeds = jnp.arange(batch, dtype=jnp.uint32)  # [B]
    fn = jax.jit(lambda p, q, d, s: rejection_sample(p, q, d, s, implementation))
    jax.block_until_ready(fn(p, q, draft, seeds))  # compile
    return timed(lambda: jax.block_until_ready(fn(p, q, draft, seeds)), max(repeats, 20))  # sub-ms calls: more draws


def interp_cost(costs: dict[int, float], m: int) -> float | None:
    """Forward seconds over m tokens, linear between measured T; None past the largest T."""
    ts = sorted(costs)
    if not ts or m > ts[-1]:
        return None
    return float(np.interp(m, ts, [costs[t] for t in ts]))


def project(models: list[dict], mals: dict, sampler: dict[tuple[int, int], float], batch_sizes) -> list[dict]:
    """Projected speedups (see the module docstring for the formula and what it leaves out)."""
    out = []
    for m in models:
        costs = {int(t): s for t, s in m["forward_seconds"].items()}
        for e in mals["entries"]:
            k = e["num_draft"]
            for b in batch_sizes:
                plain, spec = interp_cost(costs, b), interp_cost(costs, b * (k + 1))
                samp = sampler.get((b, k))
                if plain is None or spec is None or samp is None:
                    continue
                out.append(
                    {
                        "model": m["name"],
                        "drafter": e["drafter"],
                        "num_draft": k,
                        "mal": e["mal"],
                        "batch_size": b,
                        "verify_tokens": b * (k + 1),
                        "projected_speedup": e["mal"] * plain / (spec + samp),
                    }
                )
    return out


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.t0, self.skipped = seconds, time.perf_counter(), []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, part: str, log) -> bool:
        if self.elapsed() < self.seconds:
            return True
        self.skipped.append({"part": part, "reason": f"time budget of {self.seconds:.0f} s spent"})
        log(f"skipped {part}: time budget of {self.seconds:.0f} s spent")
        return False


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def measure_sampler(p: Preset, mals: dict, budget: Budget, log) -> tuple[list[dict], dict]:
    """Sampler rows (B = 1, both implementations, both q kinds) and the engine's ("auto")
    seconds per (B, K) the projections need. A backend that cannot lower the kernel is a
    finding, recorded as the row's `error`, not a crash."""
    rows, auto = [], {}
    for k in p.fraction_ks:
        for impl in ("pallas", "reference"):
            for dense in (True, False):
                if not budget.allows(f"sampler {impl} K={k}", log):
                    continue
                row = {"implementation": impl, "q": "dense" if dense else "one-hot", "batch_size": 1, "num_draft": k}
                try:
                    row["seconds"] = sampler_seconds(p.sampler_vocab, 1, k, impl, dense, p.repeats)
                except Exception as e:
                    row["error"] = _error(e)
                rows.append(row)
    max_t = max(p.forward_ts)
    for e in mals["entries"]:
        k = e["num_draft"]
        for b in p.batch_sizes:
            if b * (k + 1) > max_t or (b, k) in auto or not budget.allows(f"sampler B={b} K={k}", log):
                continue
            row = {"implementation": "auto", "q": "dense", "batch_size": b, "num_draft": k}
            try:
                auto[(b, k)] = row["seconds"] = sampler_seconds(p.sampler_vocab, b, k, "auto", True, p.repeats)
            except Exception as err:  # the kernel did not lower: project with the jnp reference
                row["error"] = _error(err)
                ref = {
                    "implementation": "reference",
                    "q": "dense",
                    "batch_size": b,
                    "num_draft": k,
                    "fallback_for": "auto",
                }
                auto[(b, k)] = ref["seconds"] = sampler_seconds(p.sampler_vocab, b, k, "reference", True, p.repeats)
                rows.append(ref)
            rows.append(row)
    return rows, auto


def run_checks(p: Preset, model_path: str | None, budget: Budget, log) -> dict:
    """The kernel against the reference and greedy token identity per dtype (device_checks.py)."""
    from specjax.bench.device_checks import kernel_check, lossless_check

    checks = {"kernel": None, "lossless": []}
    if budget.allows("kernel check", log):
        try:
            checks["kernel"] = kernel_check(p.sampler_vocab)
        except Exception as e:  # reported, not fatal: the other figures still count
            checks["kernel"] = {"error": _error(e)}
        log(f"kernel vs reference: {checks['kernel']}")
    for dt in ("float32", "bfloat16"):
        if budget.allows(f"lossless check {dt}", log):
            try:
                model, _ = build_model(p.lossless_model, model_path, dt)
                checks["lossless"].append(lossless_check(model))
                del model
            except Exception as e:
                checks["lossless"].append({"dtype": dt, "error": _error(e)})
            log(f"greedy token identity: {checks['lossless'][-1]}")
    return checks


def run_preset(
    name: str,
    model_path: str | None = None,
    dtype: str | None = None,
    mal_from: str | None = None,
    json_out: str | None = None,
    time_budget: float | None = None,
    console=None,
    out=None,
) -> dict:
    """Run a preset (order: what the projections need most comes first), print, write JSON."""
    from rich.console import Console

    if name not in PRESETS:
        raise SpecjaxError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    p = PRESETS[name]
    mals = load_mals(mal_from)  # bad input fails before anything runs
    console = console or Console(stderr=True, log_path=False)
    log = console.log
    budget = Budget(time_budget if time_budget is not None else p.time_budget)
    bws = [device_copy_bandwidth_gbs(p.copy_bytes)]
    log(f"device copy bandwidth {bws[0]:.0f} GB/s ({jax.devices()[0].device_kind})")
    models, sampler_rows, auto = [], None, {}
    for shape in p.models:
        if budget.allows(f"model {shape}", log):
            try:
                model, weights = build_model(shape, model_path, dtype)
            except SpecjaxError as e:
                budget.skipped.append({"part": f"model {shape}", "reason": str(e)})
                log(f"skipped model {shape}: {e}")
                model = None
            if model is not None:
                if weights == "random":
                    log(
                        f"{model.name}: {shape} shape with random {model.dtype} weights "
                        "(speed only; outputs meaningless)"
                    )
                row = measure_decode(shape, model, weights, p, statistics.median(bws), log)
                models.append(row)
                if budget.allows(f"forward costs of {shape}", log):
                    measure_forward_costs(row, model, p, log)
                del model
                gc.collect()
        if sampler_rows is None:  # after the first model: cheap, and every projection needs it
            sampler_rows, auto = measure_sampler(p, mals, budget, log)
    checks = run_checks(p, model_path, budget, log)
    bws.append(device_copy_bandwidth_gbs(p.copy_bytes))
    bw = statistics.median(bws)
    _relate(models, sampler_rows or [], bw)
    report = {
        "kind": "accel",
        "preset": name,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "time_budget_s": budget.seconds,
        "bandwidth_gbs": bw,
        "bandwidth_measurements_gbs": bws,
        "models": models,
        "sampler": {"vocab": p.sampler_vocab, "rows": sampler_rows or []},
        "mals": mals,
        "projections": project(models, mals, auto, p.batch_sizes),
        "checks": checks,
        "skipped": budget.skipped,
    }
    report["elapsed_s"] = budget.elapsed()
    path = json_out or f"accel-{name}.json"
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    out = out or wide_console()
    print_summary(report, out)
    out.print(f"full JSON: {path}")
    return report


def _relate(models: list[dict], sampler_rows: list[dict], bw: float) -> None:
    """Add the figures that relate measurements: each model's roofline at the final bandwidth
    `bw` (GB/s), and each sampler row's time as a fraction of a K + 1 verify of each model."""
    for m in models:
        m["roofline_tokens_per_second"] = bw * 1e9 / m["weight_bytes"]
        m["roofline_fraction"] = m["decode_tokens_per_second"] / m["roofline_tokens_per_second"]
    for r in sampler_rows:
        if "seconds" in r and r["implementation"] != "auto" and r["batch_size"] == 1 and "fallback_for" not in r:
            r["fraction_of_verify"] = {
                m["name"]: r["seconds"] / m["forward_seconds"][str(r["num_draft"] + 1)]
                for m in models
                if str(r["num_draft"] + 1) in m["forward_seconds"]
            }


def print_summary(report: dict, console=None) -> None:
    """The compact tables, printed last."""
    from rich.table import Table

    console = console or wide_console()
    t = Table(
        title=f"accelerator preset {report['preset']} — {report['device']} ({report['backend']}), "
        f"copy bandwidth {report['bandwidth_gbs']:.0f} GB/s"
    )
    ts = sorted({int(x) for m in report["models"] for x in m["forward_cost_vs_t1"]})
    for col in ["model", "weights", "GB", "decode tok/s", "roofline"] + [f"T={x}" for x in ts if x > 1]:
        t.add_column(col, justify="right")
    for m in report["models"]:
        cost = m["forward_cost_vs_t1"]
        t.add_row(
            m["name"],
            f"{m['weights']} {m['dtype']}",
            f"{m['weight_bytes'] / 1e9:.2f}",
            f"{m['decode_tokens_per_second']:.1f}",
            f"{100 * m['roofline_fraction']:.0f}%",
            *[f"{cost[str(x)]:.2f}x" if str(x) in cost else "-" for x in ts if x > 1],
        )
    console.print(t)
    s = Table(title=f"rejection sampler, vocab {report['sampler']['vocab']}: share of one verify step (B=1)")
    names = [m["name"] for m in report["models"]]
    for col in ["impl", "q", "K", "ms"] + names:
        s.add_column(col, justify="right")
    for r in report["sampler"]["rows"]:
        if r["batch_size"] != 1 or r["implementation"] == "auto" or "fallback_for" in r:
            continue
        if "error" in r:
            s.add_row(r["implementation"], r["q"], str(r["num_draft"]), "failed", *["-"] * len(names))
            continue
        frac = r.get("fraction_of_verify", {})
        s.add_row(
            r["implementation"],
            r["q"],
            str(r["num_draft"]),
            f"{1e3 * r['seconds']:.3f}",
            *[f"{100 * frac[n]:.1f}%" if n in frac else "-" for n in names],
        )
    console.print(s)
    bs = sorted({r["batch_size"] for r in report["projections"]})
    pt = Table(title=f"projected speedup (MAL: {report['mals']['source']})")
    for col in ["model", "drafter", "K", "MAL"] + [f"B={b}" for b in bs]:
        pt.add_column(col, justify="right")
    keys = sorted({(r["model"], r["drafter"], r["num_draft"], r["mal"]) for r in report["projections"]})
    for key in keys:
        by_b = {
            r["batch_size"]: r["projected_speedup"]
            for r in report["projections"]
            if (r["model"], r["drafter"], r["num_draft"], r["mal"]) == key
        }
        pt.add_row(key[0], key[1], str(key[2]), f"{key[3]:.2f}", *[f"{by_b[b]:.2f}x" if b in by_b else "-" for b in bs])
    console.print(pt)
    for r in report["sampler"]["rows"]:
        if "error" in r:
            console.print(f"sampler {r['implementation']} B={r['batch_size']} K={r['num_draft']} failed: {r['error']}")
    kc = report["checks"]["kernel"]
    if kc is not None:
        console.print(
            f"kernel vs reference (vocab {kc.get('vocab')}): "
            + (
                kc["error"]
                if "error" in kc
                else f"{kc['rows_equal']}/{kc['rows']} rows equal" + (" (bit-exact)" if kc["bit_exact"] else "")
            )
        )
    for c in report["checks"]["lossless"]:
        console.print(
            f"greedy ngram K={c.get('num_draft')} vs plain, {c['dtype']}: "
            + (
                c["error"]
                if "error" in c
                else f"{'identical' if c['identical'] else 'DIFFERENT'} on {c['prompts']} prompts "
                f"(MAL {c['mean_accepted_length']:.2f})"
            )
        )
    for sk in report["skipped"]:
        console.print(f"skipped {sk['part']}: {sk['reason']}")
