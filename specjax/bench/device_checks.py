"""Correctness checks `specjax bench --preset` runs on the device it measures (specjax/bench/accel.py).

* `kernel_check`: the rejection kernel as the engine runs it (`rejection_sample(..., "pallas")`: on
  a GPU/TPU the first backend that compiles, on CPU interpret mode) against the jnp reference on
  random inputs at the preset's vocabulary. Bit-exact is expected everywhere except near-ties
  that a device's own `log` and division may break differently (docs/accelerators.md).
* `lossless_check`: greedy speculative decoding (the n-gram drafter, K = 5, on prompts that
  repeat themselves so drafts get accepted) against plain greedy decoding, token for token, per
  dtype. f32 must match; bf16 is reported (a K + 1-row verify pass and a one-row plain step
  round differently, README "Lossless").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def kernel_check(vocab: int, batch: int = 8, k: int = 7, seed: int = 0) -> dict:
    """{"vocab", "batch_size", "num_draft", "rows", "rows_equal", "bit_exact"} for dense q and
    one-hot q (each row's accepted count and all K + 1 tokens compared)."""
    from pallas_kernels.rejection_sampling import rejection_sample

    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((batch, k + 1, vocab)).astype(np.float32) * 3  # [B, K+1, V]
    p = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    q = jax.nn.softmax(jnp.asarray(logits[:, :k] + rng.standard_normal((batch, k, vocab)).astype(np.float32)), -1)
    draft = jnp.asarray(np.argmax(np.asarray(q), axis=-1), jnp.int32)  # [B, K]: likely tokens, so rows accept some
    seeds = jnp.asarray(rng.integers(0, 2**32, batch, dtype=np.uint64).astype(np.uint32))
    out = {"vocab": vocab, "batch_size": batch, "num_draft": k, "rows": 0, "rows_equal": 0}
    for qq in (q, None):
        n_k, t_k = jax.jit(lambda *a: rejection_sample(*a, implementation="pallas"))(p, qq, draft, seeds)
        n_r, t_r = jax.jit(lambda *a: rejection_sample(*a, implementation="reference"))(p, qq, draft, seeds)
        same = (np.asarray(n_k) == np.asarray(n_r)) & np.all(np.asarray(t_k) == np.asarray(t_r), axis=1)
        out["rows"] += batch
        out["rows_equal"] += int(same.sum())
    out["bit_exact"] = out["rows"] == out["rows_equal"]
    return out


def lossless_check(model, max_new: int = 32, k: int = 5) -> dict:
    """{"dtype", "drafter", "num_draft", "prompts", "identical", "mean_accepted_length"}: whether
    greedy n-gram speculation reproduces plain greedy decoding of `model` on every prompt."""
    from specjax.drafters.ngram import NgramDrafter
    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams

    vocab = model.config.vocab_size
    base = [(7 * i + 3) % vocab for i in range(12)]
    prompts = [base * 3, [(x + 11) % vocab for x in base] * 2 + base[:5]]  # [T] each: repetitive
    params = [SamplingParams(max_new_tokens=max_new, ignore_eos=True)] * len(prompts)
    eng = Engine(model)
    plain = eng.generate(prompts, params)
    spec = eng.generate(prompts, params, drafter=NgramDrafter(k))
    steps = sum(r.steps for r in spec)
    return {
        "dtype": str(model.dtype),
        "drafter": "ngram",
        "num_draft": k,
        "prompts": len(prompts),
        "identical": all(a.token_ids == b.token_ids for a, b in zip(plain, spec)),
        "mean_accepted_length": sum(len(r.token_ids) - 1 for r in spec) / max(steps, 1),
    }  # prefill's token aside
