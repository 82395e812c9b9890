"""Sampling settings and logit processing.

Order of operations (the same for the target and, in speculative decoding, for the drafter, so
that rejection sampling compares the two processed distributions):

1. temperature: `logits / T`, computed as `(logits - max) / T`; T = 0 means greedy (argmax of the
   raw logits, nothing else applies);
2. top-k: keep the k highest logits (0 = off; ties with the k-th are kept);
3. top-p: keep the smallest set of highest-probability tokens whose mass is >= p, computed on the
   distribution left by top-k (1.0 = off; ties at the boundary are kept);
4. renormalise and sample.

This matches HF transformers' default warper order (temperature, top-k, top-p). Settings are
per-row arrays `[B]`, so one compiled loop serves rows with different settings.

Randomness is per row, as in vLLM: row b draws from a counter-based stream keyed by its own seed,
the row's step count and a stream id (the first token, drafts, verification), hashed into one
uniform per (position, vocabulary index) with `pallas_kernels.counter_hash.hash_uniform`. Under
speculation each row checks the drafts it would check alone (runtime/engine.py masks the rest of
a wider pass), so a sampled row's text depends on its prompt, settings, seed and the K it ran
with, never on its batch-mates or its place in the batch; two rows with one prompt and one seed
give one text. `seed=None` draws a fresh seed per row.
"""

from __future__ import annotations

import dataclasses
import secrets

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.counter_hash import hash_uniform, mix32
from specjax.errors import InvalidSamplingError

NEG_INF = -1e30  # finite, so 0 * masked stays 0 (no NaN) in f32 arithmetic


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """User-facing sampling settings (validated on construction)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None  # None: a fresh random seed per row (vLLM's and OpenAI's default)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        t, k, p, n = self.temperature, self.top_k, self.top_p, self.max_new_tokens
        if not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise InvalidSamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(k, int) or k < 0:
            raise InvalidSamplingError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidSamplingError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(n, int) or n < 1:
            raise InvalidSamplingError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise InvalidSamplingError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def row_seed(self) -> int:
        """The seed a row runs with: its own, or a fresh random one."""
        return secrets.randbits(32) if self.seed is None else self.seed


# Stream ids of a row's randomness within one step (see the module docstring).
STREAM_SAMPLE, STREAM_DRAFT, STREAM_VERIFY = 1, 2, 3
FIRST_TOKEN = 0xFFFFFFFF  # the step counter of the first token, sampled after the prefill


def derive(seeds: jax.Array, *words) -> jax.Array:
    """Independent per-row streams: one seed for every distinct sequence of words.

    Args:
      seeds: [B] uint32 row seeds.
      *words: counters and stream ids (a step count, `STREAM_*`), each a scalar or [B].

    Returns:
      [B] uint32 derived seeds.
    """
    x = jnp.asarray(seeds).astype(jnp.uint32)  # [B]
    for w in words:
        x = mix32(x ^ mix32(jnp.asarray(w, jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x632BE5AB)))
    return x


@struct.dataclass
class SamplingArrays:
    """Per-row sampling settings inside compiled code."""

    temperature: jax.Array  # [B] f32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] f32; 1 = off

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> "SamplingArrays":
        """The B rows' settings (one `SamplingParams` a row) as `[B]` arrays."""
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
        )


def _expand(x: jax.Array, ndim: int) -> jax.Array:
    """[B] -> [B, 1, ..., 1] with `ndim` dims in all."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def process_logits(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Apply temperature, top-k, top-p (module docstring, steps 1-3).

    The vocabulary sort needed by top-k/top-p is skipped at run time when no row uses either.

    Args:
      logits: [B, ..., V] f32 raw logits.
      s: the B rows' settings.

    Returns:
      [B, ..., V] f32 scaled logits, masked entries NEG_INF. Greedy rows (T = 0) are returned as
      raw logits; callers take their argmax.
    """
    nd = logits.ndim
    t = _expand(s.temperature, nd)  # [B, 1, ..., 1]
    # Shifted by the row maximum before dividing, so a tiny T cannot overflow to inf (the law is
    # shift-invariant); clamped at NEG_INF so masked entries stay finite.
    top = jnp.max(logits, axis=-1, keepdims=True)  # [B, ..., 1]
    scaled = jnp.where(t > 0, jnp.maximum((logits - top) / jnp.where(t > 0, t, 1.0), NEG_INF), logits)  # [B, ..., V]
    needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1.0))  # []
    return jax.lax.cond(needs_sort, lambda x: _truncate(x, s), lambda x: x, scaled)


def _truncate(x: jax.Array, s: SamplingArrays) -> jax.Array:
    """Top-k then top-p masking of scaled logits `[B, ..., V]` (NEG_INF outside; greedy rows kept)."""
    nd = x.ndim
    v = x.shape[-1]
    srt = -jnp.sort(-x, axis=-1)  # [B, ..., V] descending
    k = _expand(s.top_k, nd)  # [B, 1, ..., 1]
    kth = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, v - 1), axis=-1)  # [B, ..., 1]
    srt = jnp.where((k > 0) & (srt < kth), NEG_INF, srt)  # [B, ..., V]
    probs = jax.nn.softmax(srt, axis=-1)  # [B, ..., V]
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, ..., V] exclusive cumulative mass
    top_p = _expand(s.top_p, nd)  # [B, 1, ..., 1]
    # top_p = 1 keeps everything: the f32 cumulative mass can reach 1 before the tail ends.
    keep = (mass_before < top_p) | (top_p >= 1.0)  # [B, ..., V]
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)  # [B, ..., 1]
    pth = jnp.take_along_axis(srt, n_keep - 1, axis=-1)  # [B, ..., 1] smallest kept logit
    thresh = jnp.maximum(jnp.where(k > 0, kth, NEG_INF), pth)  # [B, ..., 1]
    greedy = _expand(s.temperature, nd) <= 0  # [B, 1, ..., 1]
    return jnp.where(greedy | (x >= thresh), x, NEG_INF)


def target_probs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """The distribution tokens are drawn from.

    Args:
      logits: [B, ..., V] f32 raw logits.
      s: the B rows' settings.

    Returns:
      [B, ..., V] f32 probabilities: softmax of `process_logits`, one-hot argmax for greedy rows.
    """
    x = process_logits(logits, s)  # [B, ..., V]
    greedy = _expand(s.temperature, logits.ndim) <= 0  # [B, 1, ..., 1]
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)  # [B, ..., V]
    return jnp.where(greedy, onehot, jax.nn.softmax(x, axis=-1))


def sample(seeds: jax.Array, logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """Draw one token per position from each row's stream.

    Gumbel-max: argmax(x_v - log E_v), E_v = -log u_v, with u from (row seed, position index,
    vocabulary index); masked entries (NEG_INF) never win. The vocabulary-sized draw is skipped at
    run time when every row is greedy.

    Args:
      seeds: [B] uint32, one per row and draw (see `derive`).
      logits: [B, ..., V] f32 raw logits.
      s: the B rows' settings.

    Returns:
      [B, ...] int32 tokens (the argmax for greedy rows).
    """
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, ...]

    def draw(_):  # skipped at run time for all-greedy batches (a vocab-sized random draw)
        mid = logits.shape[1:-1]
        pos = jnp.arange(int(np.prod(mid)), dtype=jnp.int32).reshape((1, *mid, 1))  # [1, ..., 1]
        voc = jnp.arange(logits.shape[-1], dtype=jnp.int32)  # [V]
        u = hash_uniform(_expand(jnp.asarray(seeds, jnp.uint32), logits.ndim), pos, voc)  # [B, ..., V]
        drawn = jnp.argmax(process_logits(logits, s) - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)  # [B, ...]
        return jnp.where(_expand(s.temperature, logits.ndim - 1) <= 0, best, drawn)

    return jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda _: best, None)
