"""Functional KV cache: fixed-size buffers plus per-row lengths.

`k` and `v` are `[L, B, S, KV, H]` (layer axis first so the layer scan slices it). `lengths[b]`
is the number of valid positions of row b. A forward pass over T new tokens writes them at
positions `lengths[b] .. lengths[b] + T - 1` of each row and attends causally by absolute position,
but does *not* advance `lengths`: the caller commits what it keeps with :meth:`KVCache.advance`.
Rolling back rejected draft tokens is therefore free: a row that is not advanced past them will
overwrite them on its next write, and until then they sit at positions no query can see.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KV, H]
    v: jax.Array  # [L, B, S, KV, H]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, num_layers, batch, size, num_kv_heads, head_dim, dtype=jnp.float32):
        shape = (num_layers, batch, size, num_kv_heads, head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def size(self) -> int:  # S, the static capacity
        return self.k.shape[2]

    def advance(self, n: jax.Array) -> "KVCache":
        """Commit `n[b]` more positions of row b (`n` is `[B]` or a scalar)."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return self.replace(lengths=jnp.asarray(lengths, jnp.int32))


def write_rows(buf: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Write `new [B, T, ...]` into `buf [B, S, ...]` at per-row offsets `starts [B]`."""

    def one(b, n, s):
        idx = (s,) + (0,) * (b.ndim - 1)
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), idx)

    return jax.vmap(one)(buf, new, starts)
