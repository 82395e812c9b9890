"""Lossless verification of a token tree (SpecInfer, Miao et al. 2023, multi-candidate rejection).

A step proposes T nodes: `tokens [B, T]`, `parents [B, T]` (parent index < own index, -1 for a
child of the last committed token). The target's distributions come from one pass over the
tree: `p[:, 0]` follows the last committed token, `p[:, i + 1]` follows node i. Row by row, from
the root:

* the current node's children are tried in index order; child c (token x) is **accepted** with
  probability min(1, r(x) / q(x)), where r is the current residual (at first the target's
  distribution at this node) and q the drafter's distribution its siblings were drawn from;
* on acceptance the walk moves to c, with r = the target's distribution at c;
* on rejection r becomes normalize(max(r - q, 0)) and the next sibling is tried;
* when no child is left (all rejected, or a leaf was reached) the final token is drawn from r.

Emitted: the accepted nodes' tokens, then the final token; they have exactly the target's law
when the siblings of a node are drawn independently from q. Deterministic candidates (distinct
top-k tokens, n-gram continuations; `q=None`) use q = one-hot at the candidate tried, i.e. a
rejected token's mass is removed from r and r renormalised: the walk then samples from p
exactly. A chain (parents = i - 1) reduces to `rejection_sampling.py`'s rule; greedy targets
(one-hot p) to "follow the child whose token is the argmax".

Randomness: the counter-based hash of rejection_sampling.py, acceptance uniforms at (seed, test
number, ACCEPT_STREAM), the final exponential race at (seed, T + 1, vocab index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.rejection_sampling import ACCEPT_STREAM, hash_uniform


def _normalize(r):
    return r / jnp.maximum(jnp.sum(r), jnp.finfo(jnp.float32).tiny)


def sibling_residual(r, q_row):
    """The residual after rejecting a sibling drawn from `q_row` (both `[V]`), normalised."""
    return _normalize(jnp.maximum(r - q_row, 0.0))


def _walk_row(p, q, tokens, parents, seed, residual):
    """One row: p `[T+1, V]`, q `[T+1, V]` or None, tokens/parents `[T]`, seed `[]` uint32.
    Returns (n accepted, path `[T]` node indices (-1 after n), emitted tokens `[T + 1]`)."""
    t, v = tokens.shape[0], p.shape[-1]
    nodes = jnp.arange(t)
    vocab = jnp.arange(v)

    def test(carry, i):
        cur, r, ptr, done, n, path = carry  # cur: -1 = root, else the node whose children are tried
        cand_ok = (parents == cur) & (nodes > ptr)
        cand = jnp.where(jnp.any(cand_ok), jnp.argmax(cand_ok), -1)
        live = (~done) & (cand >= 0)
        tok = tokens[jnp.maximum(cand, 0)]
        row = cur + 1  # the p / q row of the current node
        q_row = jax.nn.one_hot(tok, v, dtype=jnp.float32) if q is None else q[row]
        u = hash_uniform(seed, i.astype(jnp.uint32), jnp.uint32(ACCEPT_STREAM))
        accept = live & (u * q_row[tok] < r[tok])
        reject = live & ~accept
        r = jnp.where(accept, p[jnp.maximum(cand, 0) + 1], jnp.where(reject, residual(r, q_row), r))
        path = jnp.where(accept, path.at[n].set(cand), path)
        n = n + accept.astype(jnp.int32)
        cur = jnp.where(accept, cand, cur)
        ptr = jnp.where(accept, cand, jnp.where(reject, cand, ptr))
        done = done | (cand < 0)
        return (cur, r, ptr, done, n, path), None

    init = (jnp.int32(-1), p[0], jnp.int32(-1), jnp.bool_(False), jnp.int32(0), jnp.full((t,), -1, jnp.int32))
    (cur, r, _, _, n, path), _ = jax.lax.scan(test, init, jnp.arange(t + 1))  # T tests at most, then none left
    e = -jnp.log(hash_uniform(seed, jnp.uint32(t + 1), vocab.astype(jnp.uint32)))
    score = jnp.where(r > 0, r / e, -1.0)
    final = jnp.where(jnp.max(score) > 0, jnp.argmax(score), jnp.argmax(p[cur + 1])).astype(jnp.int32)
    idx = jnp.arange(t + 1)
    path_tok = jnp.concatenate([tokens[jnp.maximum(path, 0)], jnp.full((1,), -1, jnp.int32)])
    emitted = jnp.where(idx < n, path_tok, jnp.where(idx == n, final, -1)).astype(jnp.int32)
    return n, path, emitted


def tree_walk(p, q, tokens, parents, seeds, residual=sibling_residual):
    """`tree_sample_reference` with the residual rule as a parameter (tests pass lossy ones)."""
    p = p.astype(jnp.float32)
    q = None if q is None else q.astype(jnp.float32)
    row = lambda p_, q_, t_, par_, s_: _walk_row(p_, q_, t_, par_, s_, residual)
    if q is None:
        return jax.vmap(lambda p_, t_, par_, s_: row(p_, None, t_, par_, s_))(p, tokens, parents, seeds)
    return jax.vmap(row)(p, q, tokens, parents, seeds)


def tree_sample_reference(p, q, tokens, parents, seeds):
    """Pure-jnp reference.

    Args:
      p: [B, T+1, V] target probabilities (row 0: after the last committed token; row i + 1:
        after node i).
      q: [B, T+1, V] drafter probabilities the children of each row were drawn from, or None for
        deterministic candidates.
      tokens: [B, T] int32 node tokens.
      parents: [B, T] int32 parent node indices (< own index; -1: child of the committed prefix).
      seeds: [B] uint32, one per row and step.

    Returns:
      n_accepted [B] int32, path [B, T] int32 (accepted node indices root first, then -1; what
      `KVCache.compact` takes) and tokens [B, T+1] int32 (the path's tokens, the final token at
      index n, then -1).
    """
    return tree_walk(p, q, tokens, parents, seeds)
