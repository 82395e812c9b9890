"""The accept step: decide which drafts the target keeps and which token it adds.

`accept` is the one entry point the decode loop calls, for chains and trees alike: it picks the
greedy fast path or rejection sampling (statically, or at run time when a batch may mix greedy
and sampled rows). Below it, `accept_chain` and `accept_tree` run one named mode. Greedy rows take
an exact fast path (accept while the draft equals the target's argmax, emit the argmax at the
first miss). Otherwise the target's processed distributions go through lossless rejection
sampling (`pallas_kernels.rejection_sampling`; see there for accepted / recovered / bonus), with
the Pallas kernel or the jnp reference chosen by `implementation`. Token trees go through
multi-candidate rejection over siblings (`pallas_kernels.tree_sampling`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rejection_sampling import rejection_sample
from pallas_kernels.tree_sampling import tree_sample
from specjax.models.tree import ancestor_mask
from specjax.sampling import SamplingArrays, sample, target_probs


def accept(
    logits,
    draft,
    q,
    sampling: SamplingArrays,
    seeds,
    all_greedy: bool,
    implementation: str = "auto",
    parents=None,
    width: int = 0,
):
    """The accept step of one verify pass, a chain or a token tree.

    Args:
      logits: [B, K+1, V] f32 from the pass over [last, d_1..d_K] (a tree: [last, nodes]).
      draft: [B, K] int32 drafts (a tree: node tokens).
      q: [B, K, V] draft probabilities, or None (one-hot; trees always).
      sampling: [B] each row's settings; seeds: [B] uint32, each row's seed for this step.
      all_greedy: static. True: the greedy fast path only; False: rejection sampling when some
        row samples (temperature > 0), else the greedy fast path, decided at run time.
      implementation: "auto" | "pallas" | "reference" (the sampling kernel).
      parents: [B, K] int32 tree parents (specjax/models/tree.py; -2: the row accepts nothing), or
        None for a chain.
      width: static, a tree's depth (the most nodes a path holds); unused for chains.

    Returns:
      n_accepted [B] int32; tokens [B, W+1] int32 (the n accepted drafts, then the
      recovered/bonus token, -1 after it; W = K for chains, `width` for trees); path [B, W] int32
      (the accepted nodes root first, -1 after n) for trees, None for chains.
    """

    def run(greedy):
        if parents is None:
            return (*accept_chain(logits, draft, q, sampling, seeds, greedy, implementation), None)
        n, path, tokens = accept_tree(logits, draft, parents, sampling, seeds, greedy, width, implementation)
        return n, tokens, path

    if all_greedy or (parents is None and draft.shape[1] == 0):
        return run(all_greedy)
    return jax.lax.cond(jnp.any(sampling.temperature > 0), lambda: run(False), lambda: run(True))


def accept_chain(logits, draft, q, sampling: SamplingArrays, seeds, greedy: bool, implementation: str = "auto"):
    """The accept step of a chain in one mode (`greedy` static). logits [B, K+1, V] f32 from the
    verify pass over [last, d_1..d_K]; draft [B, K]; q [B, K, V] or None; seeds [B] uint32, each
    row's seed for this step. Returns n_accepted [B] int32 and tokens [B, K+1] int32 (the n
    accepted drafts, then the recovered/bonus token; -1 after it). K = 0: the next token, sampled
    with each row's own settings."""
    b, kp1, _ = logits.shape
    k = kp1 - 1
    idx = jnp.arange(kp1)[None]
    if k == 0:  # plain decoding: nothing to accept, just the next token
        return jnp.zeros((b,), jnp.int32), sample(seeds, logits[:, 0], sampling)[:, None]
    if greedy:
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
        n = jnp.sum(jnp.cumprod((draft == best[:, :k]).astype(jnp.int32), axis=1), axis=1)
        return n, jnp.where(idx <= n[:, None], best, -1)
    p = target_probs(logits, sampling)  # [B, K+1, V]
    return rejection_sample(p, q, draft, seeds, implementation)


def accept_tree(
    logits, tokens, parents, sampling: SamplingArrays, seeds, greedy: bool, width: int, implementation: str = "auto"
):
    """The accept step of a token tree in one mode (`greedy` static).

    Args:
      logits: [B, T+1, V] f32 from the pass over [last, nodes] (row 0: after the last committed
        token, row i + 1: after node i).
      tokens, parents: [B, T] int32 (specjax/models/tree.py; a row whose parents hold no child of
        the prefix, e.g. all -2, accepts nothing).
      sampling: [B] settings; seeds: [B] uint32.
      width: static, the tree's depth (the most nodes a path holds).

    Returns:
      n_accepted [B] int32; path [B, width] int32 (the accepted nodes root first, -1 after n);
      tokens [B, width + 1] int32 (the path's tokens, the target's token at n, -1 after it).

    Greedy rows follow the deepest path whose every node is the target's argmax after its
    parent; otherwise multi-candidate rejection sampling over deterministic candidates (q
    one-hot; `pallas_kernels.tree_sampling`, its final draw a Pallas kernel or the jnp reference
    as `implementation` says), which keeps the target's law."""
    b, t = tokens.shape
    if not greedy:
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
