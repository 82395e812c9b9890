"""Functional KV cache: fixed-size per-layer buffers plus per-row lengths.

`k` and `v` are tuples with one buffer per layer (not one `[L, ...]` array: the decoder runs its
layers as an unrolled Python loop, and any slice of a stacked buffer would be a copy under XLA).
Per layer, keys and values are both `[B*KV, S, H]`, row b's KV heads at rows
`b*KV .. b*KV + KV - 1`: batch and KV heads are one leading dim, the attention dots' batch dim as
stored (with `[B, KV, ...]` the dot reads a reshaped view, and at B = 1 XLA then duplicates the
in-place cache update into a second full-size buffer). Sequence-major values with scores laid
out `[B*KV, S, M]` (llama.py) let XLA CPU stream both buffers, much faster than head-major values
`[B*KV, H, S]` at large batch and no slower at B = 1 (docs/performance.md, "KV cache layout and
batched decoding").

`lengths[b]` is the number of valid positions of row b. A forward pass over T new tokens writes
them at positions `lengths[b] .. lengths[b] + T - 1` of each row and attends causally by absolute
position, but does *not* advance `lengths`: the caller commits what it keeps with
:meth:`KVCache.advance`. Rolling back rejected draft tokens is therefore free: a row that is not
advanced past them will overwrite them on its next write, and until then they sit at positions no
query can see. A pass may also leave the cache untouched (`Llama.hidden_kv`) and return its new
keys and values as a `KVUpdate` for `KVCache.write`: the decode step picks one of several passes
under `lax.switch` and writes the chosen one's afterwards, which XLA does in place (writes inside
the branches make it copy every buffer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B*KV, S, H]
    v: tuple[jax.Array, ...]  # L x [B*KV, S, H]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, num_layers, batch, size, num_kv_heads, head_dim, dtype=jnp.float32):
        """An empty cache.

        Args:
          num_layers: L. batch: B. size: S positions per row. num_kv_heads: KV. head_dim: H.
          dtype: of the key and value buffers.

        Returns:
          A KVCache of L x `[B*KV, S, H]` zero keys and values and lengths `[B]` = 0.
        """
        shape = (batch * num_kv_heads, size, head_dim)  # [B*KV, S, H]
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def size(self) -> int:  # S, the static capacity
        return self.k[0].shape[1]

    def advance(self, n: jax.Array) -> "KVCache":
        """Commit `n[b]` more positions of row b (`n` is `[B]` or a scalar)."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        """The same buffers with lengths `[B]` replaced (as int32)."""
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

    def write(self, new: "KVUpdate") -> "KVCache":
        """The cache with `new`'s T positions (L x `[B, T, KV, H]`) written at each row's
        `lengths` (not advanced)."""
        kv = [
            write_layer(kb, vb, k, v, self.lengths) for kb, vb, k, v in zip(self.k, self.v, new.k, new.v, strict=True)
        ]
        return self.replace(k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv))


@struct.dataclass
class KVUpdate:
    """The new keys and values of a pass over T positions, not yet written (`Llama.hidden_kv`)."""

    k: tuple[jax.Array, ...]  # L x [B, T, KV, H]
    v: tuple[jax.Array, ...]  # L x [B, T, KV, H]

    def pad_to(self, t: int) -> "KVUpdate":
        """Zero entries after the T positions up to `t` (written past what a row keeps: scratch)."""

        def pad(x):  # [B, T, KV, H] -> [B, t, KV, H]
            return jnp.pad(x, ((0, 0), (0, t - x.shape[1]), (0, 0), (0, 0)))

        return KVUpdate(tuple(pad(k) for k in self.k), tuple(pad(v) for v in self.v))

    def take(self, idx: jax.Array) -> "KVUpdate":
        """Positions `idx [B, P]` of each row, in that order (a token tree's accepted path, root
        first: it is then written where a chain would have put it)."""

        def pick(x):  # [B, T, KV, H] -> [B, P, KV, H]
            return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)

        return KVUpdate(tuple(pick(k) for k in self.k), tuple(pick(v) for v in self.v))


def write_rows(buf: jax.Array, new: jax.Array, starts: jax.Array, axis: int = 1) -> jax.Array:
    """Write `new` into `buf` at per-row offsets along `axis`.

    Args:
      buf: [B, ...] the buffer (e.g. `[B, S, ...]` with axis 1).
      new: [B, ...] of buf's rank, agreeing on every dim but `axis`, where it holds the T entries to
        write (e.g. `[B, T, ...]`).
      starts: [B] int offsets along `axis`.
      axis: the written axis (>= 1).

    Returns:
      buf's shape and dtype, row b's entries `starts[b] .. starts[b] + T - 1` replaced.
    """

    def one(b, n, s):
        zero = jnp.zeros((), s.dtype)  # one index dtype, also under jax_enable_x64
        idx = tuple(s if d == axis - 1 else zero for d in range(b.ndim))
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), idx)

    return jax.vmap(one)(buf, new, starts)


def write_layer(k_buf, v_buf, k, v, starts):
    """Write one layer's new keys and values at per-row offsets.

    Args:
      k_buf, v_buf: [B*KV, S, H] the layer's buffers.
      k, v: [B, T, KV, H] the new entries.
      starts: [B] int32 offsets (the rows' cache lengths).

    Returns:
      (k_buf, v_buf) updated, [B*KV, S, H] each.
    """
    b, _, kv, _ = k.shape

    def put(buf, new):  # buf [B*KV, S, H], new [B, T, KV, H]
        rows = buf.reshape(b, kv, *buf.shape[1:])  # [B, KV, S, H]
        return write_rows(rows, new.transpose(0, 2, 1, 3), starts, axis=2).reshape(buf.shape)

    return put(k_buf, k), put(v_buf, v)
