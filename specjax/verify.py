"""The accept step: decide which drafts the target keeps and which token it adds.

Greedy batches take an exact fast path (accept while the draft equals the target's argmax, emit
the argmax at the first miss). Otherwise the target's processed distributions go through lossless
rejection sampling (`pallas_kernels.rejection_sampling`; see there for accepted / recovered /
bonus), with the Pallas kernel or the jnp reference chosen by `implementation`. Token trees
(`accept_tree`) go through multi-candidate rejection over siblings.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.rejection_sampling import rejection_sample
from pallas_kernels.tree_sampling import tree_sample
from specjax.models.tree import ancestor_mask
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


def accept_tree(logits, tokens, parents, sampling: SamplingArrays, seeds, all_greedy: bool, width: int,
                implementation: str = "auto"):
    """The accept step of a token tree. logits [B, T+1, V] f32 from the pass over [last, nodes]
    (row 0: after the last committed token, row i + 1: after node i); tokens, parents [B, T]
    (specjax/models/tree.py; a row whose parents hold no child of the prefix, e.g. all -2,
    accepts nothing); seeds [B] uint32. `width` (static): the tree's depth, the most nodes a path
    holds. Returns n_accepted [B] int32, path [B, width] int32 (the accepted nodes root first,
    -1 after n) and tokens [B, width + 1] int32 (the path's tokens, the target's token at n, -1
    after it).

    Greedy rows follow the deepest path whose every node is the target's argmax after its
    parent; otherwise multi-candidate rejection sampling over deterministic candidates (q
    one-hot; `pallas_kernels.tree_sampling`, its final draw a Pallas kernel or the jnp reference
    as `implementation` says), which keeps the target's law."""
    b, t = tokens.shape
    if not all_greedy:
        n, path, emitted = tree_sample(target_probs(logits, sampling), tokens, parents, seeds, implementation)
        return n, path[:, :width], emitted[:, : width + 1]
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T+1]
    hit = (parents >= -1) & (tokens == jnp.take_along_axis(best, jnp.maximum(parents + 1, 0), axis=1))  # [B, T]
    anc = ancestor_mask(parents)  # [B, T, T]
    ok = ~jnp.any(anc & ~hit[:, None, :], axis=-1)  # [B, T]: every node on the way is the argmax
    depth = jnp.sum(anc, axis=-1) - 1  # [B, T]
    n = jnp.max(jnp.where(ok, depth + 1, 0), axis=1)  # [B]
    order = jnp.where(ok, depth * (t + 1) + (t - jnp.arange(t))[None], -1)  # deepest, then first
    leaf = jnp.argmax(order, axis=1)  # [B]
    on_path = jnp.take_along_axis(anc, leaf[:, None, None], axis=1)[:, 0]  # [B, T]
    levels = jnp.arange(width)[None, :, None]  # [1, W, 1]
    at = on_path[:, None, :] & (depth[:, None, :] == levels)  # [B, W, T]
    path = jnp.where(jnp.arange(width)[None] < n[:, None], jnp.argmax(at, axis=-1), -1).astype(jnp.int32)
    last = jnp.where(n > 0, leaf + 1, 0)  # [B] the pass row after the path
    bonus = jnp.take_along_axis(best, last[:, None], axis=1)  # [B, 1]
    idx = jnp.arange(width + 1)[None]
    path_tok = jnp.take_along_axis(tokens, jnp.maximum(jnp.pad(path, ((0, 0), (0, 1))), 0), axis=1)  # [B, W+1]
    emitted = jnp.where(idx < n[:, None], path_tok, jnp.where(idx == n[:, None], bonus, -1))
    return n, path, emitted.astype(jnp.int32)
