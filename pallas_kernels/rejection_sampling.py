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
normalisation. All randomness comes from the counter-based hash of (seed, position, vocab index)
in `counter_hash.py`, so the Pallas kernel and the jnp reference compute the same numbers from the same seeds with no
random tensors in memory; they agree bit for bit wherever they share the float `log` and divide
(interpret mode on CPU; on a device, the device's own `log` and divide decide).

Layout (`kernel_plan.py`): the grid is (row blocks, vocab tiles) and every block is
[R, P, TV] (R rows, P position slots, TV vocab lanes), sized per backend to a stated memory
budget (`TPU_VMEM_BUDGET`, `GPU_SMEM_BUDGET`; `block_bytes` computes the bytes from the specs
the kernel is built with). Two ways to combine the race over vocab tiles, bit-identical:

* "reduce" (Mosaic TPU, interpret): the vocab axis is a reduction ("arbitrary"); the running
  race winners live in VMEM scratch and the last tile writes the winner and accept flags. p and
  q are not copied or padded: blocks overhang the K+1 (K) positions and the ragged last tile,
  and the kernel masks what lies outside the arrays.
* "split" (Triton, Mosaic GPU): every (row, tile) program writes its tile's winners, and a
  small jnp pass picks the first best tile. GPU programs run in no fixed order, and at batch 1 a
  row split over tiles still fills the device.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.counter_hash import ACCEPT_STREAM, hash_uniform
from pallas_kernels.kernel_plan import KernelPlan, default_rows_per_block, kernel_plan, kernel_specs
from pallas_kernels.platform import target_platform

_NO_INDEX = 2**30  # larger than any vocab index


def _finish(winner, accept, draft, k):
    """Combine per-position race winners and accept flags into the step's output.

    Args:
      winner: [B, >= K+1] int32 race winner per position.
      accept: [B, >= K] bool acceptance of draft i.
      draft: [B, >= K] int32 drafts.
      k: K.

    Returns:
      n_accepted [B] and tokens [B, K + 1] (drafts, then the recovered/bonus token at index n;
      entries after n are -1).
    """
    idx = jnp.arange(k + 1)  # [K+1]
    accept = accept[:, :k]  # [B, K]
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
    final = jnp.take_along_axis(winner, n[:, None], axis=1)  # [B, 1]
    draft_ext = jnp.concatenate([draft[:, :k], jnp.full_like(draft[:, :1], -1)], axis=1)  # [B, K+1]
    tokens = jnp.where(idx[None] < n[:, None], draft_ext, jnp.where(idx[None] == n[:, None], final, -1))  # [B, K+1]
    return n, tokens.astype(jnp.int32)


def rejection_sample_reference(p, q, draft, seeds):
    """Pure-jnp reference.

    Args:
      p: [B, K+1, V] target probabilities.
      q: [B, K, V] draft probabilities, or None for one-hot drafts.
      draft: [B, K] int32 draft tokens.
      seeds: [B] uint32, one per row and step.

    Returns:
      (n_accepted [B] int32, tokens [B, K+1] int32), see `_finish`.
    """
    b, kp1, v = p.shape
    k = kp1 - 1
    p = p.astype(jnp.float32)  # [B, K+1, V]
    pos = jnp.arange(kp1)[None, :, None]  # [1, K+1, 1]
    voc = jnp.arange(v)[None, None, :]  # [1, 1, V]
    d = jnp.concatenate([draft, jnp.full((b, 1), -1, draft.dtype)], axis=1)  # [B, K+1]
    is_d = voc == d[:, :, None]  # [B, K+1, V]
    if q is None:
        qf = is_d.astype(jnp.float32)  # [B, K+1, V]
    else:
        qf = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((b, 1, v), jnp.float32)], axis=1)  # [B, K+1, V]
    qf = jnp.where(pos < k, qf, 0.0)  # the bonus position races on p itself
    resid = jnp.maximum(p - qf, 0.0)  # [B, K+1, V]
    e = -jnp.log(hash_uniform(seeds[:, None, None], pos, voc))  # [B, K+1, V] Exp(1)
    score = jnp.where(resid > 0, resid / e, -1.0)  # [B, K+1, V]
    winner = jnp.argmax(score, axis=-1).astype(jnp.int32)  # [B, K+1] first index among ties
    fallback = jnp.argmax(p, axis=-1).astype(jnp.int32)  # [B, K+1]
    winner = jnp.where(jnp.max(score, axis=-1) > 0, winner, fallback)
    p_d = jnp.sum(jnp.where(is_d, p, 0.0), axis=-1)  # [B, K+1]
    q_d = jnp.sum(jnp.where(is_d, qf, 0.0), axis=-1)  # [B, K+1]
    u = hash_uniform(seeds[:, None], jnp.arange(kp1)[None], jnp.uint32(ACCEPT_STREAM))  # [B, K+1]
    accept = u * q_d < p_d  # [B, K+1]
    return _finish(winner, accept, d, k)


# ---- layout and budgets ----------------------------------------------------------------------


def _init_carry(r, n_pos):
    zeros = jnp.zeros((r, n_pos), jnp.float32)
    izeros = jnp.zeros((r, n_pos), jnp.int32)
    return (zeros - 2.0, izeros, zeros - jnp.inf, izeros, zeros, zeros)


def _sweep(seed, draft, p_ref, q_ref, carry, base, *, k: int, vocab: int, chunk: int):
    """Race over one block's vocab lanes, `chunk` at a time, continuing `carry`.

    Args:
      seed: [R, 1, 1] uint32; draft: [R, P] int32 (-1 past K).
      p_ref, q_ref: [R, P, TV] blocks (q_ref None: one-hot drafts); lane t is vocab index base + t.
      carry: six [R, P] arrays (see `kernel_plan._CARRY_DTYPES`).

    Returns:
      The updated carry. Ties keep the earlier index, like argmax; lanes >= vocab never count.
    """
    r, n_pos, tv = p_ref.shape
    shape = (r, n_pos, chunk)
    pos = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 2)

    def step(start, carry):
        best, arg, pmax, parg, p_d, q_d = carry  # each [R, P]
        voc = lane + (base + start)  # [R, P, C]
        valid = voc < vocab  # [R, P, C]
        pt = jnp.where(valid, p_ref[:, :, pl.ds(start, chunk)].astype(jnp.float32), 0.0)  # [R, P, C]
        is_d = voc == draft[:, :, None]  # [R, P, C]
        qt = q_ref[:, :, pl.ds(start, chunk)].astype(jnp.float32) if q_ref is not None else is_d.astype(jnp.float32)
        qt = jnp.where(valid & (pos < k), qt, 0.0)  # [R, P, C]; the bonus position races on p itself
        resid = jnp.maximum(pt - qt, 0.0)  # [R, P, C]
        e = -jnp.log(hash_uniform(seed, pos, voc))  # [R, P, C] Exp(1)
        score = jnp.where(resid > 0, resid / e, -1.0)  # [R, P, C]
        t_best = jnp.max(score, axis=2)  # [R, P]
        t_arg = jnp.min(jnp.where(score == t_best[:, :, None], voc, _NO_INDEX), axis=2)  # [R, P]
        pm = jnp.where(valid, pt, -jnp.inf)  # [R, P, C]
        t_pmax = jnp.max(pm, axis=2)  # [R, P]
        t_parg = jnp.min(jnp.where(pm == t_pmax[:, :, None], voc, _NO_INDEX), axis=2)  # [R, P]
        better = t_best > best  # [R, P]; strict: earlier chunks win ties
        pbetter = t_pmax > pmax  # [R, P]
        return (
            jnp.where(better, t_best, best),
            jnp.where(better, t_arg, arg),
            jnp.where(pbetter, t_pmax, pmax),
            jnp.where(pbetter, t_parg, parg),
            p_d + jnp.sum(jnp.where(is_d, pt, 0.0), axis=2),  # one lane of the whole vocab: exact
            q_d + jnp.sum(jnp.where(is_d, qt, 0.0), axis=2),
        )

    if tv == chunk:
        return step(0, carry)
    return jax.lax.fori_loop(0, tv // chunk, lambda c, x: step(pl.multiple_of(c * chunk, chunk), x), carry)


def _accept(seed, p_d, q_d):
    """Acceptance flags [R, P] from seeds [R, 1] and p(draft), q(draft) [R, P]."""
    pos = jax.lax.broadcasted_iota(jnp.int32, p_d.shape, 1)  # [R, P]
    return hash_uniform(seed, pos, jnp.uint32(ACCEPT_STREAM)) * q_d < p_d


def _reduce_kernel(seed_ref, draft_ref, p_ref, *rest, k: int, vocab: int, chunk: int, has_q: bool):
    """Grid (row blocks, vocab tiles), the vocab axis sequential. seed_ref [R, 1, 1];
    draft_ref [R, 1, P]; p_ref, q_ref [R, P, TV]; outputs winner_ref, accept_ref [R, 1, P];
    scratch: the six [R, P] race states, carried across vocab tiles."""
    q_ref = rest[0] if has_q else None
    winner_ref, accept_ref, *state = rest[1:] if has_q else rest
    j = pl.program_id(1)
    r, n_pos, tv = p_ref.shape

    @pl.when(j == 0)
    def _():
        for ref, x in zip(state, _init_carry(r, n_pos)):
            ref[...] = x

    carry = tuple(ref[...] for ref in state)
    carry = _sweep(seed_ref[...], draft_ref[:, 0, :], p_ref, q_ref, carry, j * tv, k=k, vocab=vocab, chunk=chunk)
    for ref, x in zip(state, carry):
        ref[...] = x

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        best, arg, _, parg, p_d, q_d = carry
        winner_ref[:, 0, :] = jnp.where(best > 0, arg, parg)
        accept_ref[:, 0, :] = _accept(seed_ref[:, 0, :], p_d, q_d).astype(jnp.int32)


def _split_kernel(seed_ref, draft_ref, p_ref, *rest, k: int, vocab: int, chunk: int, has_q: bool):
    """Grid (row blocks, vocab tiles), all parallel. Inputs as `_reduce_kernel`; outputs: the
    six race states of this tile, each [R, 1, P]."""
    q_ref = rest[0] if has_q else None
    outs = rest[1:] if has_q else rest
    r, n_pos, tv = p_ref.shape
    carry = _sweep(
        seed_ref[...],
        draft_ref[:, 0, :],
        p_ref,
        q_ref,
        _init_carry(r, n_pos),
        pl.program_id(1) * tv,
        k=k,
        vocab=vocab,
        chunk=chunk,
    )
    for ref, x in zip(outs, carry):
        ref[:, 0, :] = x


def _combine_tiles(seeds, best, arg, pmax, parg, p_d, q_d):
    """Per-tile race states [B, T, P] -> (winner [B, P], accept [B, P]); the first best tile
    wins, as in the sequential sweep."""
    pick = lambda x, t: jnp.take_along_axis(x, t[:, None], axis=1)[:, 0]
    t_best = jnp.argmax(best, axis=1)  # [B, P]
    t_pmax = jnp.argmax(pmax, axis=1)  # [B, P]
    winner = jnp.where(pick(best, t_best) > 0, pick(arg, t_best), pick(parg, t_pmax))  # [B, P]
    return winner, _accept(seeds[:, None], jnp.sum(p_d, axis=1), jnp.sum(q_d, axis=1))


def _compiler_params(plan: KernelPlan, interpret):
    if interpret is True:
        return None
    if plan.backend == "triton":
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams(num_warps=4, num_stages=1)
    if plan.backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
    if plan.layout == "reduce":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    return None


@functools.partial(jax.jit, static_argnames=("interpret", "backend", "rows_per_block", "vocab_tile"))
def rejection_sample_pallas(
    p,
    q,
    draft,
    seeds,
    interpret=False,
    backend: str | None = "default",
    rows_per_block: int | None = None,
    vocab_tile: int | None = None,
):
    """Pallas version of :func:`rejection_sample_reference` (same arguments and results).

    Args:
      p, q, draft, seeds: as :func:`rejection_sample_reference`.
      interpret: False, True (Pallas interpret mode) or a `pltpu.InterpretParams` (TPU
        interpret mode: TPU memory spaces and DMAs simulated on CPU).
      backend: "mosaic_tpu" | "triton" | "mosaic_gpu" | None; "default": None on CPU, else the
        first that lowers on the running platform (`choose_kernel_backend`). Set it explicitly
        to lower for a platform that is not present (`jax.export`), or to interpret a
        backend's layout on CPU.
      rows_per_block, vocab_tile: override `kernel_plan`'s choice.

    Returns:
      (n_accepted [B], tokens [B, K+1]).
    """
    b, kp1, v = p.shape
    if backend == "default" and target_platform() == "cpu":
        backend = None
    elif backend == "default":
        backend = choose_kernel_backend(target_platform(), p.shape, jnp.dtype(p.dtype).name, q is not None)
        if backend is None:
            raise ValueError(f"no Pallas backend lowers the kernel on {target_platform()}; use the reference")
    k = kp1 - 1
    rows = rows_per_block or (None if interpret is not True else default_rows_per_block(None))
    plan = kernel_plan(backend, b, k, v, p.dtype, q is not None, rows=rows, tile=vocab_tile)
    specs = kernel_specs(plan)
    d_ext = jnp.pad(draft.astype(jnp.int32), ((0, 0), (0, plan.positions - k)), constant_values=-1)  # [B, P]
    seeds = seeds.astype(jnp.uint32)  # [B]
    vocab_args = [p] + ([q] if q is not None else [])  # [B, K+1, V], [B, K, V]
    if plan.layout == "split":  # GPU: whole row blocks, whole tiles, power-of-two positions
        bp = plan.grid[0] * plan.rows
        pad = lambda x: jnp.pad(x, ((0, bp - b), (0, plan.positions - x.shape[1]), (0, plan.vocab_padded - v)))
        vocab_args = [pad(x) for x in vocab_args]  # [Bp, P, Vp]
        seeds = jnp.pad(seeds, (0, bp - b))  # [Bp]
        d_ext = jnp.pad(d_ext, ((0, bp - b), (0, 0)), constant_values=-1)  # [Bp, P]
    kernel = _reduce_kernel if plan.layout == "reduce" else _split_kernel
    outs = pl.pallas_call(
        functools.partial(kernel, k=k, vocab=v, chunk=plan.chunk, has_q=q is not None),
        grid=plan.grid,
        in_specs=list(specs.in_specs),
        out_specs=list(specs.out_specs),
        out_shape=list(specs.out_shape),
        scratch_shapes=list(specs.scratch_shapes),
        interpret=interpret,
        compiler_params=_compiler_params(plan, interpret),
        name="rejection_sample",
    )(seeds.reshape(-1, 1, 1), d_ext.reshape(d_ext.shape[0], 1, -1), *vocab_args)
    if plan.layout == "reduce":
        winner, accept = outs[0][:, 0], outs[1][:, 0].astype(bool)  # [B, P]
    else:
        winner, accept = _combine_tiles(seeds[:b], *(x[:b] for x in outs))  # [B, P]
    return _finish(winner[:, :kp1], accept[:, :kp1], d_ext[:b], k)


# ---- backend choice and dispatch ---------------------------------------------------------------


def _version(version: str | None) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version or jax.__version__).groups()
    return int(major), int(minor)


def gpu_kernel_backends(version: str | None = None) -> tuple[str, ...]:
    """GPU backends in order of preference for a jax version.

    Pallas' Triton backend is deprecated from jax 0.11 in favour of Mosaic GPU, so 0.11 and
    later try Mosaic GPU first; earlier versions, where Triton is the mature GPU path, Triton.

    Args:
      version: a jax version string such as "0.10.1"; None: the installed jax.

    Returns:
      ("mosaic_gpu", "triton") or ("triton", "mosaic_gpu").
    """
    return ("mosaic_gpu", "triton") if _version(version) >= (0, 11) else ("triton", "mosaic_gpu")


_CUSTOM_CALLS = {"mosaic_tpu": "tpu_custom_call", "triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu_v2"}


@functools.lru_cache(maxsize=None)
def kernel_lowers(backend: str, platform: str, p_shape: tuple, dtype: str, has_q: bool) -> bool:
    """Whether the kernel lowers for `platform` with `backend` at this shape (`jax.export`; no
    device needed). Lowering is not compiling: only a device proves that.

    Args:
      backend: "mosaic_tpu" | "triton" | "mosaic_gpu".
      platform: a `jax.export` platform ("tpu", "cuda", ...).
      p_shape: (B, K+1, V) of p.
      dtype: dtype name of p and q.
      has_q: whether a dense q `[B, K, V]` is passed.

    Returns:
      True when `jax.export` lowers `rejection_sample_pallas` (cached per argument tuple).
    """
    from jax import export

    b, kp1, v = p_shape
    args = [
        jax.ShapeDtypeStruct(p_shape, dtype),
        jax.ShapeDtypeStruct((b, kp1 - 1, v), dtype) if has_q else None,
        jax.ShapeDtypeStruct((b, kp1 - 1), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.uint32),
    ]
    fn = jax.jit(lambda p, q, d, s: rejection_sample_pallas(p, q, d, s, backend=backend))
    checks = [export.DisabledSafetyCheck.custom_call(_CUSTOM_CALLS[backend])]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Triton on jax >= 0.11
            export.export(fn, platforms=[platform], disabled_checks=checks)(*args)
    except Exception:  # any lowering failure means: use another backend
        return False
    return True


def choose_kernel_backend(
    platform: str, p_shape: tuple, dtype: str, has_q: bool, version: str | None = None
) -> str | None:
    """The first backend for `platform` that lowers the kernel at this shape.

    Args:
      platform: "gpu" | "cuda" | "tpu" | anything else (no backend).
      p_shape, dtype, has_q: as `kernel_lowers`.
      version: jax version for `gpu_kernel_backends` (None: the installed one).

    Returns:
      "mosaic_tpu" | "triton" | "mosaic_gpu", or None if none lowers (then `rejection_sample`
      uses the jnp reference).
    """
    candidates = gpu_kernel_backends(version) if platform in ("gpu", "cuda") else ("mosaic_tpu",) * (platform == "tpu")
    plat = "cuda" if platform == "gpu" else platform
    return next((be for be in candidates if kernel_lowers(be, plat, tuple(p_shape), dtype, has_q)), None)


def rejection_sample(p, q, draft, seeds, implementation: str = "auto"):
    """Dispatch between the Pallas kernel and the jnp reference (same results).

    Args:
      p, q, draft, seeds: as :func:`rejection_sample_reference` (p `[B, K+1, V]`, q `[B, K, V]` or
        None, draft `[B, K]`, seeds `[B]`).
      implementation: "pallas" (interpret mode on CPU), "reference", or "auto": the jnp reference
        on CPU (where interpret mode is a correctness tool, not a fast path); on GPU/TPU the kernel
        with the first backend that lowers (`choose_kernel_backend`), else the reference.

    Returns:
      (n_accepted [B] int32, tokens [B, K+1] int32).

    Raises:
      ValueError: an unknown `implementation`.
    """
    platform = target_platform()
    cpu = platform == "cpu"
    if implementation == "auto":
        if cpu:
            return rejection_sample_reference(p, q, draft, seeds)
        backend = choose_kernel_backend(platform, p.shape, jnp.dtype(p.dtype).name, q is not None)
        if backend is None:
            return rejection_sample_reference(p, q, draft, seeds)
        return rejection_sample_pallas(p, q, draft, seeds, backend=backend)
    if implementation == "reference":
        return rejection_sample_reference(p, q, draft, seeds)
    if implementation == "pallas":
        return rejection_sample_pallas(p, q, draft, seeds, interpret=cpu)
    raise ValueError(f"unknown implementation {implementation!r} (auto, pallas, reference)")
