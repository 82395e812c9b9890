"""Token trees as data: a proposal of T nodes is `parents [B, T]` (node i's parent index < i, or -1
for a child of the last committed token). A chain is `parents = i - 1`.

One target pass verifies every node of a tree: node i sits at position `lengths + depth[i]` and
attends to the committed prefix and to its own ancestors (`ancestor_mask`); `Llama.hidden` takes
both. The pass's keys and values of the accepted root-to-leaf path are then written where a chain
would have put them (`KVUpdate.take(path)`, then `KVCache.write`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents `[B, T]` -> `[B, T, T]` bool: entry (i, j) is True when node j is node i or one of
    its ancestors (the attention mask among the tree's own nodes)."""
    b, t = parents.shape
    nodes = jnp.arange(t)
    mask = jnp.broadcast_to(nodes[:, None] == nodes[None, :], (b, t, t))  # [B, T, T] self
    cur = parents  # [B, T] the ancestor reached so far (-1: past the root)
    for _ in range(t - 1):  # depth < T: T - 1 jumps reach every ancestor
        mask = mask | ((cur[:, :, None] == nodes[None, None, :]) & (cur[:, :, None] >= 0))
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
    return mask


def depths(parents: jax.Array) -> jax.Array:
    """parents `[B, T]` -> depth `[B, T]` int32 (0 for children of the committed prefix)."""
    return mask_depths(ancestor_mask(parents))


def mask_depths(mask: jax.Array) -> jax.Array:
    """An `ancestor_mask` `[B, T, T]` -> depth `[B, T]` int32 (its ancestors within the tree)."""
    return jnp.sum(mask, axis=-1).astype(jnp.int32) - 1


def chain_parents(batch: int, t: int) -> jax.Array:
    """`[B, T]` parents of a chain (i - 1)."""
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None] - 1, (batch, t))


def first_children(parents: jax.Array, depth: int) -> jax.Array:
    """parents `[B, T]` -> `[B, depth]` int32: the path that always takes a node's first child
    (lowest index; a dynamic tree's most probable one), root first, -1 where it ends. A tree
    whose accepted path leaves it beat the chain its drafter would have drafted."""
    cur = jnp.full(parents.shape[:1], -1, jnp.int32)  # [B]
    out = []
    for _ in range(depth):
        is_child = (parents == cur[:, None]) & (cur[:, None] >= -1)  # [B, T]
        nxt = jnp.where(jnp.any(is_child, axis=1), jnp.argmax(is_child, axis=1), -1).astype(jnp.int32)  # [B]
        out.append(nxt)
        cur = jnp.where(nxt >= 0, nxt, -3)  # ended
    return jnp.stack(out, axis=1)
