"""`specjax lower`: export prefill and the decode loop for TPU and GPU from this host.

No weights are materialised: the target and the drafter are built with `nnx.eval_shape` at a
published model's shapes (e.g. Llama-3-8B, bf16) and `jax.export` lowers the two compiled
functions `Engine.generate` runs (`_prefill`, `_decode`) for each platform, under
`lowering_for(platform)` so platform-dependent choices (`linear`'s CPU path, the rejection
kernel's backend, EAGLE-3's CPU gate) are the device's. Lowering is not compiling: it proves the
loop is expressible for the device (shapes, dtypes, custom calls), not that it fits or runs.

Per platform and function the report gives OK or the first line of the error, the custom calls
the module contains, and any host callback (none may remain in the decode loop).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.platform import lowering_for
from specjax.errors import SpecjaxError
from specjax.models.config import LlamaConfig

SHAPES = {  # published decoders' shapes (config.json of each)
    "llama-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "llama-1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
DRAFT_SHAPES = {"llama-8b": "llama-1b"}  # the separate draft model of a target shape
DRAFTERS = ("none", "ngram", "draft", "mtp", "eagle3")
HOST_CALLBACKS = (
    "xla_python_cpu_callback",
    "xla_python_gpu_callback",
    "xla_ffi_python_cpu_callback",
    "xla_ffi_python_gpu_callback",
    "host_callback",
)


def _split_abstract(build):
    """(graphdef, params of ShapeDtypeStructs) of the module `build()` makes, without its arrays."""
    return nnx.split(nnx.eval_shape(build))


def abstract_model(name: str, cfg: LlamaConfig, dtype):
    """A `Model` of config `cfg` whose params are ShapeDtypeStructs."""
    from specjax.models.llama import Llama
    from specjax.models.loading import Model

    graphdef, params = _split_abstract(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return Model(cfg, graphdef, params, None, name, "abstract")


def _drafter_factory(kind: str, k: int, target, dtype):
    """(build(target, weight_params) -> Drafter, abstract weight params): the drafter is built
    inside a trace, where its params() can index the (traced) weights."""
    if kind == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        return (lambda t, w: NgramDrafter(k)), None
    if kind == "draft":
        from specjax.drafters.draft_model import DraftModelDrafter

        shape = DRAFT_SHAPES.get(target.name)
        cfg = (
            SHAPES[shape]
            if shape
            else dataclasses.replace(target.config, num_layers=max(1, target.config.num_layers // 8))
        )
        draft = abstract_model(shape or f"{target.name}-draft", cfg, dtype)
        return (lambda t, w: DraftModelDrafter(k, dataclasses.replace(draft, params=w), t.config)), draft.params
    if kind == "mtp":
        from specjax.drafters import mtp

        cfg = mtp.MTPConfig.for_target(target.config, num_modules=k)
        graphdef, params = _split_abstract(lambda: mtp.MTP(cfg, rngs=nnx.Rngs(0), dtype=dtype))
        return (lambda t, w: mtp.MTPDrafter(k, mtp.MTPWeights(cfg, graphdef, w, "abstract"), t)), params
    if kind == "eagle3":
        from specjax.drafters import eagle3

        cfg = eagle3.Eagle3Config.for_target(target.config)
        graphdef, params = _split_abstract(lambda: eagle3.Eagle3(cfg, rngs=nnx.Rngs(0), dtype=dtype))
        d2t = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32)

        def build(t, w):
            weights = eagle3.Eagle3Weights(cfg, graphdef, w, d2t, "abstract")
            return eagle3.Eagle3Drafter(k, weights, t, min_confidence=eagle3.default_min_confidence())

        return build, params
    raise SpecjaxError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}")


def _report(exported) -> dict:
    text = exported.mlir_module()
    calls = sorted(
        set(re.findall(r"custom_call @([\w$.\-]+)", text)) | set(re.findall(r'call_target_name = "([^"]+)"', text))
    )
    return {"ok": True, "custom_calls": calls, "host_callbacks": [c for c in calls if c in HOST_CALLBACKS]}


def lower_loop(
    platform: str,
    shape: str = "llama-8b",
    drafter: str = "eagle3",
    num_draft: int = 7,
    batch_size: int = 8,
    prompt_len: int = 128,
    max_new: int = 128,
    dtype: str = "bfloat16",
    temperature: float = 0.0,
) -> dict:
    """Export prefill and the decode loop for `platform` ("tpu" | "cuda" | "cpu"). Returns
    {"prefill": report, "decode": report}, each report {"ok", "custom_calls", "host_callbacks"}
    or {"ok": False, "error": the first line}."""
    from specjax.policy.rows import AUTO, new_policy
    from specjax.runtime.engine import Engine, _decode, _prefill
    from specjax.runtime.step import RowInputs
    from specjax.sampling import SamplingArrays, SamplingParams

    if shape not in SHAPES:
        raise SpecjaxError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    dt = jnp.dtype(dtype)
    k = num_draft if drafter != "none" else 0
    with lowering_for(platform):
        target = abstract_model(shape, SHAPES[shape], dt)
        d, dparams = _abstract_drafter(drafter, k, target, dt)
        b = batch_size
        t, s = Engine(target).shapes([prompt_len] * b, max_new, k)
        sds = jax.ShapeDtypeStruct
        prompt, plen = sds((b, t), jnp.int32), sds((b,), jnp.int32)
        params = [SamplingParams(max_new_tokens=max_new, temperature=temperature)] * b
        samp = jax.tree.map(lambda x: sds(x.shape, x.dtype), SamplingArrays.from_params(params))
        rows = RowInputs(prompt, plen, samp, sds((b,), jnp.int32), sds((b, 1), jnp.int32), sds((b,), jnp.uint32))
        policy = (
            None
            if k == 0
            else jax.tree.map(lambda x: sds(x.shape, x.dtype), new_policy(b, np.ones(k + 1, np.float32), AUTO))
        )
        pre_static = dict(cache_size=s, feature_layers=d.feature_layers, want_final=d.needs_final_hidden)
        pre_fn = jax.jit(partial(_prefill, target.graphdef, **pre_static))
        cache, last, hidden, final = jax.eval_shape(pre_fn, target.params, prompt, plen)
        dec_fn = jax.jit(
            partial(_decode, target.graphdef, drafter=d, all_greedy=temperature == 0.0, implementation="auto")
        )
        args = {
            "prefill": (pre_fn, (target.params, prompt, plen)),
            "decode": (
                dec_fn,
                (target.params, dparams, cache, last, hidden, final, rows, policy),
            ),
        }
        return {name: _export(fn, a, platform) for name, (fn, a) in args.items()}


def _abstract_drafter(drafter: str, k: int, target, dt):
    """(drafter, abstract drafter params) of kind `drafter` with K = `k` for the abstract target."""
    if drafter == "none":
        from specjax.drafters.base import NoDrafter

        return NoDrafter(), {}
    build, wparams = _drafter_factory(drafter, k, target, dt)
    dparams = jax.eval_shape(
        lambda tp, wp: build(dataclasses.replace(target, params=tp), wp).params(), target.params, wparams
    )
    return build(target, wparams), dparams


def _export(fn, args, platform: str) -> dict:
    """`_report` of `fn` exported for `platform` at abstract `args`, or {"ok": False, "error"}
    naming the first failure (no traceback)."""
    from jax import export

    checks = [
        export.DisabledSafetyCheck.custom_call(n)
        for n in ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu")
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return _report(export.export(fn, platforms=[platform], disabled_checks=checks)(*args))
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return {"ok": False, "error": f"{type(err).__name__}: {first[:300]}"}


def run(
    platforms: list[str],
    shape: str,
    drafters: list[str],
    num_draft: int,
    batch_size: int,
    dtype: str,
    temperature: float,
) -> tuple[list[dict], bool]:
    """`lower_loop` for every platform and drafter, one line printed per function. Returns (rows,
    whether everything lowered with no host callback)."""
    for p in platforms:
        if p not in ("tpu", "cuda", "rocm", "cpu"):
            raise SpecjaxError(f"--platforms: unknown platform {p!r} (tpu, cuda, rocm, cpu)")
    for dr in drafters:
        if dr not in DRAFTERS:
            raise SpecjaxError(f"--drafter must be one of {', '.join(DRAFTERS)}, got {dr!r}")
    if batch_size < 1 or not 0 <= num_draft <= 64:
        raise SpecjaxError("--batch-size must be >= 1 and --num-draft in [0, 64]")
    rows, good = [], True
    for dr in drafters:
        for p in platforms:
            got = lower_loop(p, shape, dr, num_draft, batch_size, dtype=dtype, temperature=temperature)
            for fn, r in got.items():
                ok = r["ok"] and not r["host_callbacks"]
                good &= ok
                what = ("custom calls: " + (", ".join(r["custom_calls"]) or "none")) if r["ok"] else r["error"]
                if r.get("host_callbacks"):
                    what += "; HOST CALLBACKS: " + ", ".join(r["host_callbacks"])
                print(
                    f"{shape} {dtype} B={batch_size} {dr} K={num_draft if dr != 'none' else 0} {p:4s} {fn:7s} "
                    f"{'OK ' if ok else 'FAIL'} {what}",
                    flush=True,
                )
                rows.append(dict(platform=p, drafter=dr, function=fn, **r))
    return rows, good
