"""Counter-based randomness: uniforms as a pure function of integer counters, no random state.

Every random number of specjax's samplers is `hash_uniform(seed, pos, vocab)`: one U(0, 1) draw
per (row seed, position, vocabulary index). No PRNG key is split and no random tensor is stored, so
a Pallas kernel can compute the uniforms of the lanes it holds, and the kernel and its jnp
reference (or two rows with one seed) draw the same numbers from the same counters.

Contract:
* `mix32`, `hash_uniform` and `unit_float` are elementwise jnp functions: arguments broadcast
  against each other, and they trace in plain jnp and inside Pallas kernels alike (uint32
  multiply, xor and shift only).
* Distinct (seed, pos, vocab) keys give independent-looking uniforms; a given key always gives the
  same float, on every backend (integer arithmetic only, then one exact int -> float conversion).
* Uniforms lie strictly inside (0, 1): `-log(u)` and `u * q < p` never meet u = 0 or u = 1.
* `ACCEPT_STREAM` is the vocabulary index reserved for the samplers' acceptance uniforms
  (vocabularies stay below 2^31 - 1), so acceptance draws never share a key with the
  per-token race draws.

Imports nothing from specjax (kernels sit below it in the layering).
"""

from __future__ import annotations

import jax.numpy as jnp

ACCEPT_STREAM = 0x7FFFFFFF  # vocab index reserved for the acceptance uniforms


def mix32(x):
    """A 32-bit integer finaliser with good avalanche (xor-shift-multiply).

    Args:
      x: uint32 array, any shape.

    Returns:
      uint32 array of x's shape; a bijection on 32-bit words.
    """
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_uniform(seed, pos, vocab):
    """U(0, 1) float32 from a seed, a position and a vocabulary index.

    The key state x = f(seed, pos) enters twice, before and after the vocab mix: with only
    `mix32(x ^ vocab)`, two keys whose states differ by a small c (probability ~V / 2^32 per
    pair of keys, so hundreds of pairs over a row's thousands of steps) gave the same uniforms for
    every vocab index, relabelled v -> v ^ c, and two draws shared their randomness.

    Args:
      seed: integer array (cast to uint32), e.g. `[B, 1, 1]`.
      pos: integer array (cast to uint32), e.g. `[1, P, 1]`.
      vocab: integer array (cast to uint32), e.g. `[1, 1, V]`, or `ACCEPT_STREAM`.

    Returns:
      float32 array of the broadcast shape (e.g. `[B, P, V]`), in (0, 1), never 0 or 1.
    """
    x = mix32(seed.astype(jnp.uint32) ^ mix32(pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B9)))  # seed x pos
    return unit_float(mix32(x ^ vocab.astype(jnp.uint32)) ^ mix32(x + jnp.uint32(0x6A09E667)))


def unit_float(x):
    """uint32 bits -> float32 in (0, 1), uniform on 2^23 midpoints (shape kept).

    23 bits: m + 0.5 is exact in float32 for m < 2^23, so u <= 1 - 2^-24 < 1. (With 24 bits,
    m = 2^24 - 1 rounded to u = 1.0, and `u * q < p` then rejected a draft with p = q.)"""
    return ((x >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
