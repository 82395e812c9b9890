"""How the rejection-sampling kernel is laid out: block shapes per backend, sized to a memory
budget.

The grid is (row blocks, vocab tiles); every block is [R, P, TV] (R rows, P position slots, TV
vocab lanes). `kernel_plan` picks R, P and TV for a backend ("mosaic_tpu", "triton",
"mosaic_gpu", or None for interpret mode) so that `block_bytes` (computed from the very
`kernel_specs` the kernel is built with, double buffering and scratch included) fits
`memory_budget` (`TPU_VMEM_BUDGET` per TPU program, `GPU_SMEM_BUDGET` per GPU program).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

TPU_VMEM_BUDGET = 8 << 20  # bytes per program: half the 16 MiB default scoped VMEM (v5e; 32 MiB v6e)
GPU_SMEM_BUDGET = 96 << 10  # bytes per program: under the 99 KiB per-block opt-in of sm_86/89 (227 KiB sm_90)
GPU_MAX_BLOCK_ELEMENTS = 1 << 20  # Triton's cap on a tensor's elements
TPU_CHUNK = 512  # lanes per compute step inside a TPU block (bounds the [R, P, chunk] temporaries)
TPU_MAX_TILE = 8192  # lanes per TPU block (past this a grid step's ~0.35 us overhead is negligible)
GPU_MAX_TILE = 2048  # lanes per GPU block (elements per thread stay in registers at 4 warps)
TPU_TEMPORARIES = 8  # live [R, P, chunk] f32 arrays in one compute step (budget estimate)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How one call is laid out. Blocks are [rows, positions, tile]; the grid is
    (batch_padded // rows, n_tiles); `vocab_padded` > vocab only where the backend needs the
    vocab padded to whole tiles (GPU), else the last tile is ragged and masked."""

    backend: str | None
    layout: str  # "reduce" | "split"
    batch: int
    k: int
    vocab: int
    dtype: str
    has_q: bool
    rows: int
    positions: int
    tile: int
    chunk: int  # lanes per compute step; divides tile
    vocab_padded: int

    @property
    def n_tiles(self) -> int:
        return pl.cdiv(self.vocab, self.tile)

    @property
    def grid(self) -> tuple[int, int]:
        return (pl.cdiv(self.batch, self.rows), self.n_tiles)


def _is_gpu(backend: str | None) -> bool:
    return backend in ("triton", "mosaic_gpu")


def default_rows_per_block(backend: str | None) -> int:
    """Rows per program: one on GPU (programs split the vocab instead), a sublane-friendly 8 on
    TPU, many in interpret mode (where each program costs a loop trip)."""
    return {"triton": 1, "mosaic_gpu": 1, "mosaic_tpu": 8}.get(backend, 512)


def _tpu_sublanes(itemsize: int) -> int:
    return 8 * max(1, 4 // itemsize)  # f32 8, bf16 16, int8 32 rows per (sublane, lane) tile


def _buffer_bytes(shape, dtype, backend: str | None) -> int:
    """Bytes of one buffer of `shape`; on TPU the last two dims are padded to the memory tile."""
    itemsize = jnp.dtype(dtype).itemsize
    if backend != "mosaic_tpu":
        return math.prod(shape) * itemsize
    *lead, sub, lane = shape
    sub = pl.cdiv(sub, _tpu_sublanes(itemsize)) * _tpu_sublanes(itemsize)
    return math.prod(lead) * sub * (pl.cdiv(lane, 128) * 128) * itemsize


def kernel_plan(
    backend: str | None,
    batch: int,
    k: int,
    vocab: int,
    dtype=jnp.float32,
    has_q: bool = True,
    rows: int | None = None,
    tile: int | None = None,
) -> KernelPlan:
    """The layout the kernel uses for p [batch, k+1, vocab] of `dtype` (pure; no arrays).

    Args:
      backend: "mosaic_tpu" | "triton" | "mosaic_gpu" | None (interpret, TPU-like layout).
      batch, k, vocab: B, K, V.
      dtype: dtype of p and q as passed in (blocks keep it; the kernel computes in f32).
      has_q: whether dense q is streamed besides p.
      rows: rows per block (default: `default_rows_per_block`).
      tile: vocab lanes per block, a multiple of 128 (a power of two on GPU); default: the
        largest that keeps `block_bytes(...)["total"]` within the backend's budget.

    Returns:
      KernelPlan.
    """
    rows = min(rows or default_rows_per_block(backend), batch)
    shared = dict(backend=backend, batch=batch, k=k, vocab=vocab, dtype=jnp.dtype(dtype).name, has_q=has_q, rows=rows)
    if _is_gpu(backend):
        positions = max(8, pl.next_power_of_2(k + 1))  # Triton loads want power-of-two sizes
        cap = min(GPU_MAX_TILE, max(128, pl.next_power_of_2(vocab)))
        if tile is not None and (tile % 128 or tile & (tile - 1)):
            raise ValueError(f"GPU vocab tile must be a power of two >= 128, got {tile}")

        def plan_of(t):
            padded = pl.cdiv(vocab, t) * t
            return KernelPlan(**shared, layout="split", positions=positions, tile=t, chunk=t, vocab_padded=padded)

        candidates = [cap >> i for i in range(cap.bit_length()) if cap >> i >= 128]  # descending
    else:
        positions = pl.cdiv(k + 1, 8) * 8  # blocks overhang p's K+1 and q's K rows; the kernel masks them
        cap = min(TPU_MAX_TILE, pl.cdiv(vocab, 128) * 128)
        if tile is not None and tile % 128:
            raise ValueError(f"TPU vocab tile must be a multiple of 128, got {tile}")

        def plan_of(t):
            chunk = math.gcd(t, TPU_CHUNK)
            return KernelPlan(**shared, layout="reduce", positions=positions, tile=t, chunk=chunk, vocab_padded=vocab)

        chunk = min(TPU_CHUNK, cap)
        candidates = [cap] + list(range((cap - 1) // chunk * chunk, chunk - 1, -chunk))  # descending
    if tile is not None:
        return plan_of(tile)
    for t in candidates:  # the largest tile whose program fits the budget
        plan = plan_of(t)
        used = block_bytes(plan)
        if used["total"] <= memory_budget(backend) and (
            not _is_gpu(backend) or used["largest_block"] <= GPU_MAX_BLOCK_ELEMENTS
        ):
            return plan
    return plan_of(candidates[-1])


@dataclasses.dataclass(frozen=True)
class KernelSpecs:
    """What `pl.pallas_call` is given for a plan (inputs: seeds, drafts, p[, q])."""

    in_specs: tuple
    in_dtypes: tuple
    out_specs: tuple
    out_shape: tuple
    scratch_shapes: tuple


def kernel_specs(plan: KernelPlan) -> KernelSpecs:
    """BlockSpecs, output shapes and scratch of the kernel for `plan` (pure; no arrays).

    Args:
      plan: a `kernel_plan(...)` result.

    Returns:
      KernelSpecs. Inputs: seeds `[R, 1, 1]`, drafts `[R, 1, P]`, p (and q) `[R, P, TV]` blocks.
      Outputs: "reduce": winner and accept `[Bp, 1, P]` int32, scratch six `[R, P]` race states;
      "split": the six race states per tile `[Bp, n_tiles, P]`, no scratch.
    """
    r, n_pos, tv = plan.rows, plan.positions, plan.tile
    bp = plan.grid[0] * r if _is_gpu(plan.backend) else plan.batch
    row = lambda i, j: (i, 0, 0)
    vocab_block = pl.BlockSpec((r, n_pos, tv), lambda i, j: (i, 0, j))
    in_specs = [pl.BlockSpec((r, 1, 1), row), pl.BlockSpec((r, 1, n_pos), row), vocab_block]
    in_dtypes = [jnp.uint32, jnp.int32, plan.dtype] + [plan.dtype] * plan.has_q
    in_specs += [vocab_block] * plan.has_q
    if plan.layout == "reduce":
        from jax.experimental.pallas import tpu as pltpu

        out_specs = (pl.BlockSpec((r, 1, n_pos), row),) * 2  # winner, accept
        out_shape = (jax.ShapeDtypeStruct((bp, 1, n_pos), jnp.int32),) * 2
        scratch = tuple(pltpu.VMEM((r, n_pos), dt) for dt in _CARRY_DTYPES)
    else:
        out_specs = (pl.BlockSpec((r, 1, n_pos), lambda i, j: (i, j, 0)),) * 6  # per-tile race state
        out_shape = tuple(jax.ShapeDtypeStruct((bp, plan.n_tiles, n_pos), dt) for dt in _CARRY_DTYPES)
        scratch = ()
    return KernelSpecs(tuple(in_specs), tuple(jnp.dtype(d) for d in in_dtypes), out_specs, out_shape, scratch)


def block_bytes(plan: KernelPlan) -> dict[str, int]:
    """Memory one program holds, from `kernel_specs(plan)`: every input and output block twice
    (double buffering), scratch once, and on TPU `TPU_TEMPORARIES` [R, P, chunk] f32 arrays.
    TPU buffers are padded to (sublane, 128-lane) tiles.

    Args:
      plan: a `kernel_plan(...)` result.

    Returns:
      bytes of "inputs", "outputs", "scratch", "temporaries" and their "total"; "largest_block":
      the most elements in one block.
    """
    specs = kernel_specs(plan)
    be = "mosaic_tpu" if plan.layout == "reduce" else plan.backend
    inputs = sum(2 * _buffer_bytes(s.block_shape, d, be) for s, d in zip(specs.in_specs, specs.in_dtypes))
    outputs = sum(2 * _buffer_bytes(s.block_shape, o.dtype, be) for s, o in zip(specs.out_specs, specs.out_shape))
    scratch = sum(_buffer_bytes(s.shape, s.dtype, be) for s in specs.scratch_shapes)
    temps = (
        TPU_TEMPORARIES * _buffer_bytes((plan.rows, plan.positions, plan.chunk), jnp.float32, be)
        if be == "mosaic_tpu"
        else 0
    )
    largest = max(math.prod(s.block_shape) for s in specs.in_specs + specs.out_specs)
    return {
        "inputs": inputs,
        "outputs": outputs,
        "scratch": scratch,
        "temporaries": temps,
        "total": inputs + outputs + scratch + temps,
        "largest_block": largest,
    }


def memory_budget(backend: str | None) -> int:
    """Bytes `block_bytes(...)["total"]` must stay within for `backend` (as `kernel_plan`'s)."""
    return GPU_SMEM_BUDGET if _is_gpu(backend) else TPU_VMEM_BUDGET


# ---- the kernel ------------------------------------------------------------------------------

_CARRY_DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.float32)
# best score, its index, max p, its index, p(draft), q(draft); each [R, P]
