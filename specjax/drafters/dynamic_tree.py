"""EAGLE-2 dynamic token trees (Li et al. 2024) from any autoregressive drafter state.

A drafter that reads its own previous output (EAGLE-3's feature g, a draft model's hidden state)
is described by three things: `root [B, D]`, its output at the last accepted position; `logits`,
output -> draft-vocab logits; and `expand`, one read-only pass over expanded nodes. From them:

* level 1: the top-k tokens of the drafter's distribution at the root, scored by log-probability;
* level d >= 2: the k best nodes of level d - 1 by cumulative score are expanded: one drafter
  pass on each node's token and its parent's output at position m + d - 2, attending to the
  prefix and to the node's expanded ancestors (the tree mask), whose top-k children join level d;
* the tree is the `num_nodes` best candidates overall by cumulative score; scores fall along a
  path, so a kept node's ancestors are kept (ties go to the earlier, shallower node).

Shapes are static: C = k + (D - 1) k^2 candidates, E = (D - 1) k expansions. Every level's pass
reruns the expansions before it (T grows to E <= 40 positions for k, D <= 8, 6): simple and
exact, and nothing is written to the drafter's cache. k = 1 is chain drafting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.tree import ancestor_mask


def tree_candidates(topk: int, depth: int) -> int:
    """C = k + (D - 1) k^2: the candidates a tree of `depth` levels, `topk` children per node, ranks."""
    return topk + (depth - 1) * topk * topk


def dynamic_tree(expand, logits, d2t, root, lengths, topk: int, depth: int, num_nodes: int):
    """An EAGLE-2 dynamic tree (module doc).

    Args:
      expand: (tokens `[B, E]` target ids, feats `[B, E, D]` (each node's parent's output),
        positions `[B, E]`, mask `[B, E, E]`) -> outputs `[B, E, D]`: the drafter's pass over E
        expanded nodes, reading its cache without writing it.
      logits: `[..., D]` -> `[..., N]` draft-vocab logits.
      d2t: `[N]` draft -> target ids (None: N = V, the ids themselves).
      root: `[B, D]` the drafter's output at the last accepted position.
      lengths: `[B]` the position of a first draft.
      topk, depth: k children per expanded node, D levels.
      num_nodes: nodes kept (at most C = `tree_candidates(topk, depth)`).

    Returns:
      tokens `[B, n]` int32 target ids, parents `[B, n]` (-1: child of the prefix), depths
      `[B, n]` (0-based) and cumulative log-probabilities `[B, n]`, n = min(num_nodes, C),
      ordered so that parents come before their children.
    """
    to_target = (lambda t: t) if d2t is None else (lambda t: jnp.take(d2t, t))
    b = root.shape[0]
    k = topk
    logp = jax.nn.log_softmax(logits(root), axis=-1)  # [B, N]
    score, tok = jax.lax.top_k(logp, k)  # [B, k] level 1
    c_tok, c_score = tok, score  # candidates: draft-vocab ids, cumulative scores
    c_par = jnp.full((b, k), -1, jnp.int32)  # candidate parent (candidate index)
    c_depth = jnp.zeros((b, k), jnp.int32)
    e_cand = jnp.zeros((b, 0), jnp.int32)  # expanded candidates, by expansion index
    e_in = jnp.zeros((b, 0, root.shape[-1]), root.dtype)  # the feature each expansion reads
    e_out = e_in  # its output g (the feature its children read)
    e_par = jnp.zeros((b, 0), jnp.int32)  # expansion index of the parent's expansion (-1: root)
    c_exp = jnp.full((b, k), -1, jnp.int32)  # candidate -> its expansion index
    level_start = 0
    for d in range(2, depth + 1):
        level = jnp.arange(level_start, c_tok.shape[1])  # candidates of level d - 1
        _, pick = jax.lax.top_k(c_score[:, level], k)  # [B, k] frontier among them
        front = level[pick]  # [B, k] candidate indices
        par_c = jnp.take_along_axis(c_par, front, axis=1)  # [B, k]
        par_e = jnp.where(par_c >= 0, jnp.take_along_axis(c_exp, jnp.maximum(par_c, 0), axis=1), -1)  # [B, k]
        outs = jnp.concatenate([root[:, None], e_out], axis=1)  # [B, 1 + E, D]: root, expansions
        new_in = jnp.take_along_axis(outs, (par_e + 1)[..., None], axis=1)  # [B, k, D]
        base = e_cand.shape[1]
        e_cand = jnp.concatenate([e_cand, front], axis=1)  # [B, E]
        e_par = jnp.concatenate([e_par, par_e], axis=1)  # [B, E]
        e_in = jnp.concatenate([e_in, new_in], axis=1)  # [B, E, D]
        c_exp = jnp.concatenate([c_exp, jnp.full((b, k * k), -1, jnp.int32)], axis=1)  # [B, C]
        c_exp = jax.vmap(lambda ce, f: ce.at[f].set(base + jnp.arange(k, dtype=jnp.int32)))(c_exp, front)
        n_e = e_cand.shape[1]
        e_tok = jnp.take_along_axis(c_tok, e_cand, axis=1)  # [B, E] draft ids
        e_depth = jnp.take_along_axis(c_depth, e_cand, axis=1)  # [B, E] 0-based depth of the node
        positions = lengths[:, None] + e_depth  # [B, E]: draft i + 1 runs at m + i - 1
        e_out = expand(to_target(e_tok), e_in, positions, ancestor_mask(e_par))  # [B, E, D]
        lp = jax.nn.log_softmax(logits(e_out[:, n_e - k :]), axis=-1)  # [B, k, N]
        s, t = jax.lax.top_k(lp, k)  # [B, k, k]
        front_score = jnp.take_along_axis(c_score, front, axis=1)  # [B, k]
        level_start = c_tok.shape[1]
        c_tok = jnp.concatenate([c_tok, t.reshape(b, k * k)], axis=1)  # [B, C]
        c_score = jnp.concatenate([c_score, (front_score[..., None] + s).reshape(b, k * k)], axis=1)  # [B, C]
        c_par = jnp.concatenate([c_par, jnp.repeat(front, k, axis=1)], axis=1)  # [B, C]
        c_depth = jnp.concatenate([c_depth, jnp.full((b, k * k), d - 1, jnp.int32)], axis=1)  # [B, C]
    tokens, parents, depths, scores = best_nodes(c_tok, c_score, c_par, c_depth, num_nodes)
    return to_target(tokens).astype(jnp.int32), parents, depths, scores


def best_nodes(c_tok, c_score, c_par, c_depth, num_nodes: int):
    """The tree of the `num_nodes` best candidates by score, in candidate order; ties go to the
    earlier candidate, so a kept node's ancestors are kept.

    Args:
      c_tok, c_score, c_par, c_depth: `[B, C]` each: token, cumulative score, parent candidate
        index or -1, depth; parents listed before children.
      num_nodes: nodes kept.

    Returns:
      tokens, parents (node indices, -1: child of the prefix), depths and scores, `[B, n]` each,
      n = min(num_nodes, C).
    """
    c = c_tok.shape[1]
    n = min(num_nodes, c)
    _, keep = jax.lax.top_k(c_score - 1e-6 * jnp.arange(c), n)  # [B, n]
    keep = jnp.sort(keep, axis=1)  # candidate order: parents first
    where = jax.vmap(lambda kp: jnp.full((c,), -1, jnp.int32).at[kp].set(jnp.arange(n)))(keep)  # [B, C]
    par = jnp.take_along_axis(c_par, keep, axis=1)  # [B, n] parent candidate indices
    parents = jnp.where(par >= 0, jnp.take_along_axis(where, jnp.maximum(par, 0), axis=1), -1)  # [B, n] node indices
    gather = lambda x: jnp.take_along_axis(x, keep, axis=1)
    return gather(c_tok), parents.astype(jnp.int32), gather(c_depth), gather(c_score)
