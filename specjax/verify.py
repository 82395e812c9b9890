"""The accept step: decide which drafts the target keeps and which token it adds.

Greedy batches take an exact fast path (accept while the draft equals the target's argmax, emit
the argmax at the first miss). Otherwise the target's processed distributions go through lossless
rejection sampling (`pallas_kernels.rejection_sampling`; see there for accepted / recovered /
bonus), with the Pallas kernel or the jnp reference chosen by `implementation`.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.rejection_sampling import rejection_sample
from specjax.sampling import SamplingArrays, sample, target_probs


def accept(logits, draft, q, sampling: SamplingArrays, seeds, all_greedy: bool, implementation: str = "auto"):
    """logits [B, K+1, V] f32 from the verify pass over [last, d_1..d_K]; draft [B, K];
    q [B, K, V] or None; seeds [B] uint32, each row's seed for this step. Returns n_accepted [B]
    int32 and tokens [B, K+1] int32 (the n accepted drafts, then the recovered/bonus token; -1
    after it)."""
    b, kp1, _ = logits.shape
    k = kp1 - 1
    idx = jnp.arange(kp1)[None]
    if k == 0:  # plain decoding: nothing to accept, just the next token
        return jnp.zeros((b,), jnp.int32), sample(seeds, logits[:, 0], sampling)[:, None]
    if all_greedy:
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
        n = jnp.sum(jnp.cumprod((draft == best[:, :k]).astype(jnp.int32), axis=1), axis=1)
        return n, jnp.where(idx <= n[:, None], best, -1)
    p = target_probs(logits, sampling)  # [B, K+1, V]
    return rejection_sample(p, q, draft, seeds, implementation)
