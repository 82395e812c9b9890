"""Lossless rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One speculative step for row b, with K draft tokens d_0..d_{K-1}, draft distributions q_i and the
target's distributions p_0..p_K (p_i scores the token after draft position i - 1):

* draft i is **accepted** with probability min(1, p_i(d_i) / q_i(d_i)), i.e. when
  u_i * q_i(d_i) < p_i(d_i) for u_i ~ U[0, 1); `n` = number of leading accepted drafts;
* if n < K the **recovered** token is drawn from normalize(max(p_n - q_n, 0));
* if n = K the **bonus** token is drawn from p_K.

The emitted tokens d_0..d_{n-1}, then the recovered/bonus token, have exactly the target's law.
Drafters without probabilities use one-hot q (q_i = e_{d_i}); greedy targets use one-hot p, and
the same formulas then reduce to "accept while d_i = argmax, emit the argmax at the first miss".

Sampling from the residual uses the exponential race: argmax_v r_v / E_v with E_v ~ Exp(1) is a
draw from r / sum(r), so the kernel needs one pass over the vocabulary, no sort and no
normalisation. All randomness comes from a counter-based hash of (seed, position, vocab index),
so the Pallas kernel and the jnp reference produce bit-identical results for the same seeds, on
every backend, with no random tensors in memory.

Layout: each program takes R rows (see `default_rows_per_block`); positions are padded to P (a
power of two >= 8, as TPU tiling and Triton both want) and the vocabulary is swept in tiles of
`VOCAB_TILE` lanes, carrying the running race winner, so no [V]-sized temporary is ever formed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

VOCAB_TILE = 2048  # lanes per vocab tile (smaller vocabularies use one tile of round_up(V, 128))
ACCEPT_STREAM = 0x7FFFFFFF  # vocab index reserved for the acceptance uniforms


def mix32(x):
    """A 32-bit integer finaliser with good avalanche (xor-shift-multiply)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seed, pos, vocab):
    """U(0, 1) float32 (never 0 or 1) from uint32 seed, position and vocab index (broadcast).

    The key state x = f(seed, pos) enters twice, before and after the vocab mix: with only
    `mix32(x ^ vocab)`, two keys whose states differ by a small c (probability ~V / 2^32 per
    pair of keys, so hundreds of pairs over a row's thousands of steps) gave the same uniforms for
    every vocab index, relabelled v -> v ^ c, and two draws shared their randomness."""
    x = mix32(seed.astype(jnp.uint32) ^ mix32(pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)))
    return unit_float(mix32(x ^ vocab.astype(jnp.uint32)) ^ mix32(x + jnp.uint32(0x6A09E667)))


def unit_float(x):
    """uint32 bits -> float32 in (0, 1), uniform on 2^23 midpoints. 23 bits: m + 0.5 is exact in
    float32 for m < 2^23, so u <= 1 - 2^-24 < 1. (With 24 bits, m = 2^24 - 1 rounded to u = 1.0,
    and `u * q < p` then rejected a draft with p = q.)"""
    return ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def _positions(k: int) -> int:
    return max(8, pl.next_power_of_2(k + 1))


def _vocab_tile(v: int) -> int:
    return min(VOCAB_TILE, pl.cdiv(v, 128) * 128)


def _prepare(p, q, draft, seeds):
    """Pad to kernel shapes: p [B, P, Vp], q [B, P, Vp] | None, draft [B, P] (-1 pad)."""
    b, kp1, v = p.shape
    k = kp1 - 1
    pp = _positions(k)
    tile = _vocab_tile(v)
    vp = pl.cdiv(v, tile) * tile
    p = jnp.pad(p.astype(jnp.float32), ((0, 0), (0, pp - kp1), (0, vp - v)))
    if q is not None:
        q = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pp - k), (0, vp - v)))
    draft = jnp.pad(draft.astype(jnp.int32), ((0, 0), (0, pp - k)), constant_values=-1)
    return p, q, draft, seeds.astype(jnp.uint32), k, v


def _finish(winner, accept, draft, k):
    """Combine per-position race winners and accept flags into the step's output.

    Returns n_accepted [B] and tokens [B, K + 1] (drafts, then the recovered/bonus token at
    index n; entries after n are -1).
    """
    idx = jnp.arange(k + 1)
    accept = accept[:, :k]
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    final = jnp.take_along_axis(winner, n[:, None], axis=1)  # [B, 1]
    draft_ext = jnp.concatenate([draft[:, :k], jnp.full_like(draft[:, :1], -1)], axis=1)
    tokens = jnp.where(idx[None] < n[:, None], draft_ext, jnp.where(idx[None] == n[:, None], final, -1))
    return n, tokens.astype(jnp.int32)


def rejection_sample_reference(p, q, draft, seeds):
    """Pure-jnp reference. p [B, K+1, V] target probs; q [B, K, V] draft probs or None (one-hot
    drafts); draft [B, K] int32; seeds [B] uint32. Returns (n_accepted [B], tokens [B, K+1])."""
    b, kp1, v = p.shape
    k = kp1 - 1
    p = p.astype(jnp.float32)
    pos = jnp.arange(kp1)[None, :, None]
    voc = jnp.arange(v)[None, None, :]
    d = jnp.concatenate([draft, jnp.full((b, 1), -1, draft.dtype)], axis=1)  # [B, K+1]
    is_d = voc == d[:, :, None]  # [B, K+1, V]
    if q is None:
        qf = is_d.astype(jnp.float32)
    else:
        qf = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((b, 1, v), jnp.float32)], axis=1)
    qf = jnp.where(pos < k, qf, 0.0)  # the bonus position races on p itself
    resid = jnp.maximum(p - qf, 0.0)
    e = -jnp.log(hash_uniform(seeds[:, None, None], pos, voc))
    score = jnp.where(resid > 0, resid / e, -1.0)
    winner = jnp.argmax(score, axis=-1).astype(jnp.int32)  # first index among ties
    fallback = jnp.argmax(p, axis=-1).astype(jnp.int32)
    winner = jnp.where(jnp.max(score, axis=-1) > 0, winner, fallback)
    p_d = jnp.sum(jnp.where(is_d, p, 0.0), axis=-1)
    q_d = jnp.sum(jnp.where(is_d, qf, 0.0), axis=-1)
    u = hash_uniform(seeds[:, None], jnp.arange(kp1)[None], jnp.uint32(ACCEPT_STREAM))
    accept = u * q_d < p_d
    return _finish(winner, accept, d, k)


def _kernel(seed_ref, draft_ref, p_ref, *rest, tile: int, has_q: bool):
    """R rows: seed_ref [R, 1, 1]; draft_ref [R, 1, P]; p_ref, q_ref [R, P, Vp]; outputs
    winner_ref, accept_ref [R, 1, P]. (Unit middle axes keep every block's last two dims equal
    to the array's, as TPU tiling requires.)"""
    if has_q:
        q_ref, winner_ref, accept_ref = rest
    else:
        (winner_ref, accept_ref) = rest
    r, n_pos, vp = p_ref.shape
    shape = (r, n_pos, tile)
    seed = seed_ref[:, 0, :][:, :, None]  # [R, 1, 1]
    draft = draft_ref[:, 0, :]  # [R, P] int32
    pos = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    n_draft = jnp.sum((draft >= 0).astype(jnp.int32), axis=1)[:, None, None]  # [R, 1, 1]

    def body(t, carry):
        best, arg, pmax, parg, p_d, q_d = carry  # each [R, P]
        start = pl.multiple_of(t * tile, tile)
        pt = p_ref[:, :, pl.ds(start, tile)]  # [R, P, TV]
        voc = lane + start
        is_d = voc == draft[:, :, None]
        qt = q_ref[:, :, pl.ds(start, tile)] if has_q else is_d.astype(jnp.float32)
        qt = jnp.where(pos < n_draft, qt, 0.0)
        resid = jnp.maximum(pt - qt, 0.0)
        e = -jnp.log(hash_uniform(seed, pos, voc))
        score = jnp.where(resid > 0, resid / e, -1.0)
        t_best = jnp.max(score, axis=2)  # [R, P]
        t_arg = jnp.min(jnp.where(score == t_best[:, :, None], voc, jnp.int32(2**30)), axis=2)
        t_pmax = jnp.max(pt, axis=2)
        t_parg = jnp.min(jnp.where(pt == t_pmax[:, :, None], voc, jnp.int32(2**30)), axis=2)
        better = t_best > best  # strict: earlier tiles win ties, like argmax
        pbetter = t_pmax > pmax
        return (
            jnp.where(better, t_best, best),
            jnp.where(better, t_arg, arg),
            jnp.where(pbetter, t_pmax, pmax),
            jnp.where(pbetter, t_parg, parg),
            p_d + jnp.sum(jnp.where(is_d, pt, 0.0), axis=2),
            q_d + jnp.sum(jnp.where(is_d, qt, 0.0), axis=2),
        )

    zeros = jnp.zeros((r, n_pos), jnp.float32)
    izeros = jnp.zeros((r, n_pos), jnp.int32)
    init = (zeros - 2.0, izeros, zeros - 1.0, izeros, zeros, zeros)
    best, arg, _, parg, p_d, q_d = jax.lax.fori_loop(0, vp // tile, body, init)
    winner_ref[:, 0, :] = jnp.where(best > 0, arg, parg)
    u = hash_uniform(seed[:, :, 0], jax.lax.broadcasted_iota(jnp.int32, (r, n_pos), 1), jnp.uint32(ACCEPT_STREAM))
    accept_ref[:, 0, :] = (u * q_d < p_d).astype(jnp.int32)


def _compiler_params(backend: str | None):
    if backend == "triton":
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=4, num_stages=1)
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    return None


def default_kernel_backend() -> str | None:
    """Triton on GPU (the kernel streams vocab tiles from global memory, which Triton's pointer
    loads do directly), Mosaic on TPU, none (interpret) on CPU."""
    return {"gpu": "triton", "tpu": "mosaic_tpu"}.get(jax.default_backend())


def default_rows_per_block(backend: str | None) -> int:
    """Rows per program: one on GPU (a row's tile already fills a warp group's registers), a
    sublane-friendly 8 on TPU, many in interpret mode (where each program costs a loop trip)."""
    return {"triton": 1, "mosaic_tpu": 8}.get(backend, 512)


@functools.partial(jax.jit, static_argnames=("interpret", "backend", "rows_per_block"))
def rejection_sample_pallas(p, q, draft, seeds, interpret: bool = False, backend: str | None = "default",
                            rows_per_block: int | None = None):
    """Pallas version of :func:`rejection_sample_reference` (same arguments and results).

    `backend`: "triton" | "mosaic_tpu" | None; "default" picks from the running backend. Set it
    explicitly to lower for a platform that is not present (e.g. `jax.export` for cuda/tpu).
    """
    if backend == "default":
        backend = default_kernel_backend()
    b = p.shape[0]
    r = min(rows_per_block or default_rows_per_block(None if interpret else backend), b)
    p_pad, q_pad, d_pad, seeds_pad, k, v = _prepare(p, q, draft, seeds)
    bp = pl.cdiv(b, r) * r  # pad rows to whole blocks; padded rows are sliced off below
    if bp != b:
        rows = lambda x, fill=0: jnp.pad(x, ((0, bp - b),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
        p_pad, d_pad, seeds_pad = rows(p_pad), rows(d_pad, -1), rows(seeds_pad)
        q_pad = None if q_pad is None else rows(q_pad)
    _, n_pos, vp = p_pad.shape
    blk = lambda i: (i, 0, 0)
    in_specs = [
        pl.BlockSpec((r, 1, 1), blk),
        pl.BlockSpec((r, 1, n_pos), blk),
        pl.BlockSpec((r, n_pos, vp), blk),
    ]
    args = [seeds_pad.reshape(bp, 1, 1), d_pad.reshape(bp, 1, n_pos), p_pad]
    if q_pad is not None:
        in_specs.append(pl.BlockSpec((r, n_pos, vp), blk))
        args.append(q_pad)
    out_spec = pl.BlockSpec((r, 1, n_pos), blk)
    winner, accept = pl.pallas_call(
        functools.partial(_kernel, tile=_vocab_tile(v), has_q=q is not None),
        grid=(bp // r,),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((bp, 1, n_pos), jnp.int32)] * 2,
        interpret=interpret,
        compiler_params=None if interpret else _compiler_params(backend),
        name="rejection_sample",
    )(*args)
    winner, accept = winner[:b, 0, : k + 1], accept[:b, 0, : k + 1].astype(bool)
    return _finish(winner, accept, d_pad[:b], k)


def rejection_sample(p, q, draft, seeds, implementation: str = "auto"):
    """Dispatch: "pallas" (interpret mode on CPU), "reference", or "auto" (Pallas on GPU/TPU,
    the jnp reference on CPU, where interpret mode is a correctness tool, not a fast path)."""
    if implementation == "auto":
        implementation = "reference" if jax.default_backend() == "cpu" else "pallas"
    if implementation == "reference":
        return rejection_sample_reference(p, q, draft, seeds)
    if implementation == "pallas":
        return rejection_sample_pallas(p, q, draft, seeds, interpret=jax.default_backend() == "cpu")
    raise ValueError(f"unknown implementation {implementation!r} (auto, pallas, reference)")
