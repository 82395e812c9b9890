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

Randomness: the counter-based hash of counter_hash.py, acceptance uniforms at (seed, test
number, ACCEPT_STREAM), the final exponential race at (seed, T + 1, vocab index).

Deterministic candidates need no vocabulary pass until the end: after rejecting tokens x_1..x_j
at a node with target law p, the residual is p with them removed, divided by m = 1 - sum p(x_i),
so the next child x is accepted iff u * m < p(x), and the final token is the exponential race
over p without the rejected tokens (unnormalised: the race does not need it). `tree_sample_*`
walk these scalars in jnp and run the one race per row over the vocabulary, in jnp (reference) or
as a Pallas kernel (`tree_race_pallas`); both compute the same floats in the same order, so they
agree bit for bit (interpret mode on CPU). Drafts drawn from a q go through the general walk
(`tree_walk`), reference only.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.counter_hash import ACCEPT_STREAM, hash_uniform
from pallas_kernels.platform import target_platform
from pallas_kernels.rejection_sampling import _CUSTOM_CALLS, gpu_kernel_backends


def _normalize(r):  # [V] -> [V], summing to 1 (all zeros stay zeros)
    return r / jnp.maximum(jnp.sum(r), jnp.finfo(jnp.float32).tiny)


def sibling_residual(r, q_row):
    """The residual after rejecting a sibling drawn from `q_row`, normalised.

    Args:
      r: [V] the current residual (a distribution).
      q_row: [V] the distribution the rejected sibling was drawn from.

    Returns:
      [V] normalize(max(r - q_row, 0)); all zeros when q_row covers r.
    """
    return _normalize(jnp.maximum(r - q_row, 0.0))


def _walk_row(p, q, tokens, parents, seed, residual):
    """One row: p `[T+1, V]`, q `[T+1, V]` or None, tokens/parents `[T]`, seed `[]` uint32.
    Returns (n accepted, path `[T]` node indices (-1 after n), emitted tokens `[T + 1]`)."""
    t, v = tokens.shape[0], p.shape[-1]
    nodes = jnp.arange(t)  # [T]
    vocab = jnp.arange(v)  # [V]

    def test(carry, i):
        cur, r, ptr, done, n, path = carry  # cur: -1 = root, else the node whose children are tried
        cand_ok = (parents == cur) & (nodes > ptr)  # [T] untried children of cur
        cand = jnp.where(jnp.any(cand_ok), jnp.argmax(cand_ok), -1)  # [] the next one, -1: none left
        live = (~done) & (cand >= 0)
        tok = tokens[jnp.maximum(cand, 0)]
        row = cur + 1  # the p / q row of the current node
        q_row = jax.nn.one_hot(tok, v, dtype=jnp.float32) if q is None else q[row]  # [V]
        u = hash_uniform(seed, i.astype(jnp.uint32), jnp.uint32(ACCEPT_STREAM))  # []
        accept = live & (u * q_row[tok] < r[tok])
        reject = live & ~accept
        r = jnp.where(accept, p[jnp.maximum(cand, 0) + 1], jnp.where(reject, residual(r, q_row), r))  # [V]
        path = jnp.where(accept, path.at[n].set(cand), path)  # [T]
        n = n + accept.astype(jnp.int32)
        cur = jnp.where(accept, cand, cur)
        ptr = jnp.where(accept, cand, jnp.where(reject, cand, ptr))
        done = done | (cand < 0)
        return (cur, r, ptr, done, n, path), None

    init = (jnp.int32(-1), p[0], jnp.int32(-1), jnp.bool_(False), jnp.int32(0), jnp.full((t,), -1, jnp.int32))
    (cur, r, _, _, n, path), _ = jax.lax.scan(test, init, jnp.arange(t + 1))  # T tests at most, then none left
    e = -jnp.log(hash_uniform(seed, jnp.uint32(t + 1), vocab.astype(jnp.uint32)))  # [V] Exp(1)
    score = jnp.where(r > 0, r / e, -1.0)  # [V]
    final = jnp.where(jnp.max(score) > 0, jnp.argmax(score), jnp.argmax(p[cur + 1])).astype(jnp.int32)
    idx = jnp.arange(t + 1)  # [T+1]
    path_tok = jnp.concatenate([tokens[jnp.maximum(path, 0)], jnp.full((1,), -1, jnp.int32)])  # [T+1]
    emitted = jnp.where(idx < n, path_tok, jnp.where(idx == n, final, -1)).astype(jnp.int32)  # [T+1]
    return n, path, emitted


def tree_walk(p, q, tokens, parents, seeds, residual=sibling_residual):
    """`tree_sample_reference`'s general walk with the residual rule as a parameter (tests pass
    lossy ones).

    Args:
      p, tokens, parents, seeds: as `tree_sample_reference`.
      q: [B, T+1, V] drafter probabilities, or None for deterministic candidates (one-hot q).
      residual: (r [V], q_row [V]) -> [V], the residual after a rejection (`sibling_residual`).

    Returns:
      As `tree_sample_reference`.
    """
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
      parents: [B, T] int32 parent node indices (< own index; -1: child of the committed prefix;
        a row with no child of the prefix, e.g. all -2, accepts nothing).
      seeds: [B] uint32, one per row and step.

    Returns:
      n_accepted [B] int32, path [B, T] int32 (accepted node indices root first, then -1) and
      tokens [B, T+1] int32 (the path's tokens, the final token at index n, then -1).
    """
    if q is not None:
        return tree_walk(p, q, tokens, parents, seeds)
    n, path, row, excluded = one_hot_walk(p, tokens, parents, seeds)
    p_row = _final_row(p, row)  # [B, V]
    return _finish(n, path, tokens, _race_reference(p_row, excluded, seeds, tokens.shape[1]))


def one_hot_walk(p, tokens, parents, seeds):
    """The walk over deterministic candidates (module doc), without the final draw.

    Args:
      p: [B, T+1, V] target probabilities; tokens, parents: [B, T] int32; seeds: [B] uint32 (as
        `tree_sample_reference`).

    Returns:
      n [B] int32 accepted nodes, path [B, T] int32 (as `tree_sample_reference`), the p row the
      final token is drawn from [B] int32 and the tokens it excludes (rejected at that node)
      [B, T] int32, -1 padded.
    """
    t = tokens.shape[1]
    v = p.shape[-1]
    rows = jnp.clip(parents + 1, 0, t)  # [B, T] the p row each node is tested under
    flat = p.reshape(p.shape[0], -1).astype(jnp.float32)  # [B, (T+1) V]
    p_tok = jnp.take_along_axis(flat, rows * v + jnp.clip(tokens, 0, v - 1), axis=1)  # [B, T]
    return jax.vmap(_one_hot_row)(p_tok, tokens, parents, seeds)


def _one_hot_row(p_tok, tokens, parents, seed):
    """One row of `one_hot_walk`: p_tok [T] (each node's token's probability under its parent's
    row), tokens, parents [T], seed [] -> (n [], path [T], final row [], excluded tokens [T])."""
    t = tokens.shape[0]
    nodes = jnp.arange(t)  # [T]

    def test(carry, i):
        cur, mass, ptr, done, n, path, rejected = carry  # rejected [T]: nodes rejected at cur
        cand_ok = (parents == cur) & (nodes > ptr)  # [T] untried children of cur
        cand = jnp.where(jnp.any(cand_ok), jnp.argmax(cand_ok), -1)  # [] the next one, -1: none left
        live = (~done) & (cand >= 0)
        c = jnp.maximum(cand, 0)
        again = jnp.any(rejected & (tokens == tokens[c]))  # a token already rejected here has no mass left
        p_c = jnp.where(again, 0.0, p_tok[c])
        u = hash_uniform(seed, i.astype(jnp.uint32), jnp.uint32(ACCEPT_STREAM))  # []
        accept = live & (u * mass < p_c)
        reject = live & ~accept
        mass = jnp.where(accept, 1.0, jnp.where(reject, mass - p_c, mass))  # [] the residual's mass
        rejected = jnp.where(accept, False, rejected | (reject & (nodes == cand)))  # [T]
        path = jnp.where(accept, path.at[n].set(cand), path)  # [T]
        n = n + accept.astype(jnp.int32)
        ptr = jnp.where(live, cand, ptr)
        cur = jnp.where(accept, cand, cur)
        return (cur, mass, ptr, done | (cand < 0), n, path, rejected), None

    init = (
        jnp.int32(-1),
        jnp.float32(1.0),
        jnp.int32(-1),
        jnp.bool_(False),
        jnp.int32(0),
        jnp.full((t,), -1, jnp.int32),
        jnp.zeros((t,), bool),
    )
    (cur, _, _, _, n, path, rejected), _ = jax.lax.scan(test, init, jnp.arange(t + 1))
    return n, path, cur + 1, jnp.where(rejected, tokens, -1)


def _final_row(p, row):
    """p [B, T+1, V], row [B] -> [B, V] f32."""
    return jnp.take_along_axis(p, row[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def _race_reference(p_row, excluded, seeds, t):
    """The final token: argmax_v p(v) / E_v over tokens not `excluded` (E_v = -log u at (seed,
    T + 1, v)); the row's argmax when no token is left (a target law of zeros there)."""
    v = p_row.shape[-1]
    keep = jax.vmap(lambda ex: jnp.ones((v,), bool).at[jnp.where(ex >= 0, ex, v)].set(False, mode="drop"))(excluded)
    vocab = jnp.arange(v, dtype=jnp.uint32)[None]  # [1, V]
    e = -jnp.log(hash_uniform(seeds[:, None].astype(jnp.uint32), jnp.uint32(t + 1), vocab))  # [B, V]
    score = jnp.where(keep & (p_row > 0), p_row / e, -1.0)  # [B, V]; keep [B, V]
    return jnp.where(jnp.max(score, axis=1) > 0, jnp.argmax(score, axis=1), jnp.argmax(p_row, axis=1))


def _finish(n, path, tokens, final):
    """n [B], path [B, T], tokens [B, T], final [B] -> (n, path, emitted tokens [B, T+1])."""
    t = tokens.shape[1]
    idx = jnp.arange(t + 1)[None]  # [1, T+1]
    path_tok = jnp.pad(
        jnp.take_along_axis(tokens, jnp.maximum(path, 0), axis=1), ((0, 0), (0, 1)), constant_values=-1
    )  # [B, T+1]
    emitted = jnp.where(idx < n[:, None], path_tok, jnp.where(idx == n[:, None], final[:, None], -1))  # [B, T+1]
    return n, path, emitted.astype(jnp.int32)


# ---- the final race as a Pallas kernel ---------------------------------------------------------

RACE_ROWS = 8  # rows per block (TPU sublanes; a power of two for Triton)
RACE_TILE = 2048  # vocabulary lanes per block


def _race_kernel(seed_ref, excl_ref, p_ref, score_ref, arg_ref, *, tile: int, vocab: int, pos: int):
    """One (row block, vocab tile): the tile's best p / E over the tokens kept, first index on ties.
    seed_ref [R, 1]; excl_ref [R, E]; p_ref [R, TV]; outputs score_ref, arg_ref [1, R, 1]."""
    j = pl.program_id(1)
    p = p_ref[...].astype(jnp.float32)  # [R, TV]
    lanes = j * tile + jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)  # [R, TV]
    keep = lanes < vocab
    for e in range(excl_ref.shape[1]):  # the excluded tokens, one column [R, 1] at a time
        keep = keep & (lanes != excl_ref[:, pl.ds(e, 1)])
    u = hash_uniform(seed_ref[...], jnp.uint32(pos), lanes.astype(jnp.uint32))  # [R, TV]
    score = jnp.where(keep & (p > 0), p / -jnp.log(u), -1.0)  # [R, TV]
    best = jnp.max(score, axis=1, keepdims=True)  # [R, 1]
    arg = jnp.min(jnp.where(score == best, lanes, jnp.int32(2**30)), axis=1, keepdims=True)  # [R, 1]
    score_ref[...] = best[None]
    arg_ref[...] = arg[None]


def _race_compiler_params(backend, interpret):
    if interpret is True or backend is None:
        return None
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=4, num_stages=1)
    if backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


@functools.partial(jax.jit, static_argnames=("t", "interpret", "backend"))
def tree_race_pallas(p_row, excluded, seeds, t: int, interpret=False, backend: str | None = None):
    """`_race_reference` as a Pallas kernel. Grid (row blocks, vocab tiles), both parallel:
    every program writes its tile's best score and index ([tiles, B, 1]: the last two block dims
    (R, 1) suit TPU's (8, 128) rule, all dims powers of two for Triton); a small jnp pass takes
    the first best tile, so the result equals the reference's argmax.

    Args:
      p_row: [B, V] the target row each final token is drawn from.
      excluded: [B, E] int32 tokens rejected at that row (-1 padded).
      seeds: [B] uint32.
      t: T, the tree's node count (the race's counter is T + 1).
      interpret: Pallas interpret mode (CPU).
      backend: "mosaic_tpu" | "triton" | "mosaic_gpu" | None (compiler parameters).

    Returns:
      [B] int32 final tokens.
    """
    b, v = p_row.shape
    r, tv = RACE_ROWS, min(RACE_TILE, -(-v // 128) * 128)
    bp, vp = -(-b // r) * r, -(-v // tv) * tv
    e = 1 << max(excluded.shape[1] - 1, 0).bit_length()  # a power of two
    p_pad = jnp.pad(p_row, ((0, bp - b), (0, vp - v)))  # [Bp, Vp]
    excl = jnp.pad(excluded.astype(jnp.int32), ((0, bp - b), (0, e - excluded.shape[1])), constant_values=-1)  # [Bp, E]
    seed = jnp.pad(seeds.astype(jnp.uint32), (0, bp - b)).reshape(bp, 1)  # [Bp, 1]
    grid = (bp // r, vp // tv)
    score, arg = pl.pallas_call(
        functools.partial(_race_kernel, tile=tv, vocab=v, pos=t + 1),
        grid=grid,
        in_specs=[
            pl.BlockSpec((r, 1), lambda i, j: (i, 0)),
            pl.BlockSpec((r, e), lambda i, j: (i, 0)),
            pl.BlockSpec((r, tv), lambda i, j: (i, j)),
        ],
        out_specs=[pl.BlockSpec((1, r, 1), lambda i, j: (j, i, 0))] * 2,
        out_shape=[
            jax.ShapeDtypeStruct((grid[1], bp, 1), jnp.float32),
            jax.ShapeDtypeStruct((grid[1], bp, 1), jnp.int32),
        ],
        interpret=interpret,
        compiler_params=_race_compiler_params(backend, interpret),
        name="tree_race",
    )(seed, excl, p_pad)
    score, arg = score[:, :b, 0], arg[:, :b, 0]  # [tiles, B]
    first = jnp.argmax(score, axis=0)  # [B] the first tile holding the best score
    best = jnp.take_along_axis(score, first[None], axis=0)[0]  # [B]
    won = jnp.take_along_axis(arg, first[None], axis=0)[0]  # [B]
    return jnp.where(best > 0, won, jnp.argmax(p_row, axis=1)).astype(jnp.int32)


def tree_sample_pallas(p, tokens, parents, seeds, interpret=False, backend: str | None = None):
    """`tree_sample_reference` for deterministic candidates (q = None), the final race as a Pallas
    kernel.

    Args:
      p, tokens, parents, seeds: as `tree_sample_reference` (p [B, T+1, V], tokens and parents
        [B, T], seeds [B]).
      interpret, backend: as `tree_race_pallas`.

    Returns:
      As `tree_sample_reference`: n_accepted [B], path [B, T], tokens [B, T+1].
    """
    n, path, row, excluded = one_hot_walk(p, tokens, parents, seeds)
    final = tree_race_pallas(_final_row(p, row), excluded, seeds, tokens.shape[1], interpret, backend)
    return _finish(n, path, tokens, final)


@functools.lru_cache(maxsize=None)
def tree_kernel_lowers(backend: str, platform: str, b: int, t: int, v: int) -> bool:
    """Whether the race kernel lowers for `platform` with `backend` (`jax.export`; no device).

    Args:
      backend: "mosaic_tpu" | "triton" | "mosaic_gpu".
      platform: a `jax.export` platform ("tpu", "cuda", ...).
      b, t, v: B rows, T tree nodes, V vocabulary.

    Returns:
      True when `tree_race_pallas` lowers (cached per argument tuple).
    """
    from jax import export

    args = [
        jax.ShapeDtypeStruct((b, v), jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.uint32),
    ]
    fn = jax.jit(lambda p, ex, s: tree_race_pallas(p, ex, s, t, backend=backend))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            export.export(
                fn,
                platforms=[platform],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(_CUSTOM_CALLS[backend])],
            )(*args)
    except Exception:  # any lowering failure means: use another backend
        return False
    return True


def tree_sample(p, tokens, parents, seeds, implementation: str = "auto"):
    """Dispatch for deterministic candidates, as `rejection_sample` does.

    Args:
      p, tokens, parents, seeds: as `tree_sample_reference` (p [B, T+1, V], tokens and parents
        [B, T], seeds [B]).
      implementation: "reference", "pallas" (interpret mode on CPU) or "auto" (the reference on
        CPU; on GPU/TPU the kernel with the first backend that lowers, else the reference).

    Returns:
      As `tree_sample_reference`: n_accepted [B], path [B, T], tokens [B, T+1].

    Raises:
      ValueError: an unknown `implementation`, or "pallas" where no backend lowers the kernel.
    """
    platform = target_platform()
    if implementation == "reference" or (implementation == "auto" and platform == "cpu"):
        return tree_sample_reference(p, None, tokens, parents, seeds)
    if implementation == "pallas" and platform == "cpu":
        return tree_sample_pallas(p, tokens, parents, seeds, interpret=True)
    if implementation not in ("auto", "pallas"):
        raise ValueError(f"unknown implementation {implementation!r} (auto, pallas, reference)")
    cands = gpu_kernel_backends() if platform in ("gpu", "cuda") else ("mosaic_tpu",)
    plat = "cuda" if platform == "gpu" else platform
    b, t = tokens.shape
    backend = next((be for be in cands if tree_kernel_lowers(be, plat, b, t, p.shape[-1])), None)
    if backend is None:
        if implementation == "pallas":
            raise ValueError(f"no Pallas backend lowers the tree kernel on {platform}; use the reference")
        return tree_sample_reference(p, None, tokens, parents, seeds)
    return tree_sample_pallas(p, tokens, parents, seeds, backend=backend)
