"""Llama-family decoder in Flax NNX, used functionally under `jax.jit`.

The model is built once, split with `nnx.split` into a static graphdef and a params state, and
every compiled function is a pure function of `(params, tokens, cache)` that merges inside.

Layers are separate modules (an `nnx.List`) run as an unrolled Python loop, each with its own
weight arrays. Batch-1 decoding is bound by reading the weights once per token, and a `lax.scan`
over stacked `[L, ...]` weights (or any slice of them) makes XLA copy each layer's weights into a
fresh buffer before its matmuls (docs/performance.md, "Layers unrolled, not scanned"). Unrolling
costs compile time (roughly linear in depth), not run time.

Weights keep the HF `[out, in]` layout and matmuls are `W @ x` ("OI,MI->OM"), the form XLA CPU
runs fastest at M = 1 (a matrix-vector product); the few verify tokens of speculative decoding
take a fused multiply-reduce on CPU instead (see `linear`). QKV and gate/up
projections are fused into one matmul each. The KV cache layout (per layer, keys and values
`[B*KV, S, H]`) and the `[B*KV, S, M]` score layout are chosen for the same dot kernels; see
kv_cache.py.

Target features: `feature_layers=(i, j, ...)` returns the outputs of decoder layers i, j, ... (0-based;
HF's `hidden_states[i + 1]`), stacked `[n, B, T, D]`. EAGLE-3 fuses a low, middle and high layer;
MTP heads read the final normed hidden state, which `hidden()` always returns.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.platform import target_platform
from specjax.models.config import LlamaConfig
from specjax.models.kv_cache import KVCache, KVUpdate, write_layer

# Few-row matmuls on CPU. XLA runs `[O, I] x [I, 1]` as a matrix-vector product near memory
# bandwidth, but hands M > 1 rows to a GEMM kernel that streams the weight at a fraction of it.
# Written as a broadcast multiply and a reduction over I with output `[M, O]`, XLA emits one fused
# loop nest that reads each weight row once from DRAM and reuses it from L1 for all M rows. Where
# compute bounds a pass (a batch-32 step, a batch-8 verify) it still beats the GEMM up to 64 rows;
# at 128 the two tie. Timings: docs/performance.md, "Few-row matmuls".
FEW_ROWS_MAX = 64


def linear(w: jax.Array, x: jax.Array, out_dtype=None) -> jax.Array:
    """`x @ w^T`: the fused multiply-reduce for 2..FEW_ROWS_MAX rows on CPU, else a dot.

    Both paths accumulate in f32, or f64 for f64 weights (the multiply-reduce upcasts inside its
    fusion rather than round bf16 products before the sum). Logits ask for f32 output: bf16 logits
    (8-bit mantissa, an ulp of 0.06 at 10) tie the top two tokens often. Row counts still change
    the summation order, so a K + 1-row verify pass and a one-row plain step agree to rounding, not
    bit for bit (README, "Lossless, and what precision does to it").

    Args:
      w: [O, I] weight (HF layout).
      x: [..., I] inputs; M = the product of the leading dims.
      out_dtype: dtype of the result (default: the weight's).

    Returns:
      [..., O] in `out_dtype`.
    """
    out = w.dtype if out_dtype is None else out_dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(w.dtype)  # [M, I]
    rows = x2.shape[0]
    if 1 < rows <= FEW_ROWS_MAX and target_platform() == "cpu":
        # M padded to a power of two up to 16 rows (6 cost more than 8), past that to a multiple of 8
        m = 1 << (rows - 1).bit_length() if rows <= 16 else -(-rows // 8) * 8
        acc = jnp.promote_types(w.dtype, jnp.float32)  # f32, f64 for f64 weights
        xp = jnp.pad(x2, ((0, m - rows), (0, 0))).astype(acc)  # [M', I]
        # one barrier over both operands keeps x's producer (a gather, a broadcast) out of the reduce's
        # fusion, which would recompute it for each of the O output columns, and makes w's broadcast
        # this call's own: two calls on one weight would otherwise share it, and XLA materialises a
        # shared [M', O, I] (docs/performance.md, "Few-row matmuls")
        wa, xp = jax.lax.optimization_barrier((w.astype(acc), xp))  # [O, I], [M', I]
        y = jnp.sum(wa[None] * xp[:, None, :], axis=-1)[:rows]  # [M', O, I] -> [M, O], fused
    else:
        acc = jnp.float32 if out == jnp.float32 else w.dtype  # a bf16 dot accumulates in f32 anyway
        y = jnp.einsum("OI,MI->OM", w, x2, preferred_element_type=acc).T  # [M, O]
    return y.astype(out).reshape(*lead, w.shape[0])


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in f32: x `[..., D]`, scale `[D]` -> `[..., D]` in x's dtype."""
    x32 = x.astype(jnp.float32)  # [..., D]
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., D]
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies `[H/2]`, with Llama-3 `rope_scaling` applied when configured."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    if cfg.rope_scaling is None:
        return inv
    factor, lo, hi, orig = cfg.rope_scaling
    wavelen = 2 * math.pi / inv  # [H/2]
    lo_wavelen, hi_wavelen = orig / lo, orig / hi
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = jnp.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
    return jnp.where(is_mid, mid, scaled)


def rope_tables(cfg: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[B, T, H]` for absolute positions `[B, T]` (HF rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, H]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x `[B, T, N, H]` by cos/sin `[B, T, H]` (`rope_tables`) -> `[B, T, N, H]` in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)  # [B, T, N, H]
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)  # [B, T, N, H]
    return (x32 * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


class RMSNorm(nnx.Module):
    """`rms_norm` with a learned scale `[D]`."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention over a per-row KV cache."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, in_dim: int | None = None):
        """`in_dim` (default D) is the width of the input; EAGLE-3's layer reads 2D."""
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * h
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.Param(init(rngs.params(), (qkv_out, in_dim or d), dtype))  # [(N+2KV)H, Din]
        self.o = nnx.Param(init(rngs.params(), (d, cfg.num_heads * h), dtype))  # [D, NH]
        if cfg.attention_bias:
            self.qkv_bias = nnx.Param(jnp.zeros((qkv_out,), dtype))  # [(N+2KV)H]
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)  # over each head's H
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype)

    def project(self, x, cos, sin, queries: bool = True):
        """The fused QKV projection, q/k norms (Qwen3) and rotary embedding.

        Args:
          x: [B, T, Din] inputs.
          cos, sin: [B, T, H] (`rope_tables`).
          queries: False: q is None and only the fused weight's k/v rows are multiplied (context
            that is attended to but never attends, as DFlash's injected target features).

        Returns:
          (q [B, T, N, H] rotated or None, k [B, T, KV, H] rotated, v [B, T, KV, H]).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        n, kv, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lo = 0 if queries else n * h  # first output row computed
        w = self.qkv[...] if queries else self.qkv[...][lo:]  # [(N+2KV)H - lo, Din]
        qkv = linear(w, x)  # [B, T, (N+2KV)H - lo]
        if cfg.attention_bias:
            bias = self.qkv_bias[...] if queries else self.qkv_bias[...][lo:]
            qkv = qkv + bias.astype(qkv.dtype)
        k = qkv[..., n * h - lo : (n + kv) * h - lo].reshape(b, t, kv, h)  # [B, T, KV, H]
        v = qkv[..., (n + kv) * h - lo :].reshape(b, t, kv, h)  # [B, T, KV, H]
        q = qkv[..., : n * h].reshape(b, t, n, h) if queries else None  # [B, T, N, H]
        if cfg.qk_norm:
            k = self.k_norm(k)  # [B, T, KV, H]
            q = None if q is None else self.q_norm(q)  # [B, T, N, H]
        return (None if q is None else apply_rope(q, cos, sin)), apply_rope(k, cos, sin), v

    def attend(self, x, cos, sin, k_cache, v_cache, starts, mask=None):
        """Attention over the cache, read only: the new keys and values are returned, not
        written. A caller that picks one of several passes under `lax.cond` writes the chosen
        one's afterwards, and XLA then updates the cache in place (a write inside a branch makes
        XLA copy every cache buffer).

        Args:
          x: [B, T, Din] inputs.
          cos, sin: [B, T, H] (`rope_tables`).
          k_cache, v_cache: [B*KV, S, H] (kv_cache.py).
          starts: [B] int32 cache lengths: the positions each row attends to before the new ones.
          mask: [B, T, T] bool among the new positions (None: causal).

        Returns:
          (output [B, T, D], new k [B, T, KV, H], new v [B, T, KV, H]).
        """
        q, k, v = self.project(x, cos, sin)
        return attention(self.cfg, self.o[...], q, k, v, k_cache, v_cache, starts, mask), k, v

    def __call__(self, x, cos, sin, k_cache, v_cache, starts, mask=None):
        """`attend` with the new keys and values written at `starts` first (a read of the cache
        after its in-place update needs no copy).

        Args:
          x, cos, sin, k_cache, v_cache, mask: as `attend`.
          starts: [B] int32 cache lengths, or None: a fresh cache (a prefill from position 0),
            written at 0 and not read.

        Returns:
          (output [B, T, D], k_cache [B*KV, S, H], v_cache [B*KV, S, H]) with the new entries written.
        """
        q, k, v = self.project(x, cos, sin)  # [B, T, N, H], [B, T, KV, H] x2
        at = jnp.zeros(x.shape[:1], jnp.int32) if starts is None else starts  # [B]
        k_cache, v_cache = write_layer(k_cache, v_cache, k, v, at)
        fresh = starts is None
        out = attention(
            self.cfg, self.o[...], q, k, v, None if fresh else k_cache, None if fresh else v_cache, starts, mask
        )
        return out, k_cache, v_cache


def attention(cfg: LlamaConfig, o_weight, q, k, v, k_cache, v_cache, starts, mask=None):
    """Grouped-query attention of T new queries over the cached positions and the new ones: one
    softmax over both parts.

    Args:
      cfg: the model config (N, KV, H, G).
      o_weight: [D, N*H] output projection.
      q: [B, T, N, H] rotated queries.
      k, v: [B, T, KV, H] the new positions' keys (rotated) and values.
      k_cache, v_cache: [B*KV, S, H]; only each row's first `starts` positions are attended
        (entries at `starts` and past are ignored, written or not). None: nothing is cached before
        the new positions (a fresh prefill), so only they are attended. (An empty cache created
        inside the same jit would be all constants, and XLA would constant-fold the score
        reductions at compile time: docs/performance.md, "Compile time of a fresh prefill".)
      starts: [B] int32 cache lengths (unused when k_cache is None).
      mask: [B, T, T] bool, query i sees new key j (a token tree: its ancestor mask); None: causal.

    Returns:
      [B, T, D] the output projection.
    """
    b, t = q.shape[:2]
    n, kv, h, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_groups
    # Queries grouped by KV head: row (b, j) of the cache serves M = T*G query vectors. Scores are
    # `[B*KV, S, M]` (S major, softmax over S): XLA CPU then streams K and V.
    m = t * g
    dtype = v.dtype if v_cache is None else v_cache.dtype
    q = q.reshape(b, t, kv, g, h).transpose(0, 2, 1, 3, 4).reshape(b * kv, m, h)  # [B*KV, M, H]
    k_new = k.transpose(0, 2, 1, 3).reshape(b * kv, t, h).astype(dtype)  # [B*KV, T, H]
    v_new = v.transpose(0, 2, 1, 3).reshape(b * kv, t, h).astype(dtype)  # [B*KV, T, H]
    acc = jnp.promote_types(dtype, jnp.float32)  # scores, softmax and sums: f32 (f64 for f64)
    scale, lowest = 1.0 / math.sqrt(h), jnp.finfo(acc).min
    if mask is None:
        new_ok = jnp.repeat(jnp.arange(t)[:, None] <= jnp.arange(t)[None, :], g, axis=1)[None]  # [1, T, M]
    else:  # [B, Tq, Tk] -> keys major, queries x groups: [B*KV, Tk, M]
        new_ok = jnp.repeat(jnp.repeat(jnp.swapaxes(mask, 1, 2), g, axis=2), kv, axis=0)
    s_new = jnp.einsum("NTH,NMH->NTM", k_new, q, preferred_element_type=acc) * scale
    s_new = jnp.where(new_ok, s_new, lowest)  # [B*KV, T, M]
    if k_cache is None:
        top = jnp.max(s_new, axis=1, keepdims=True)  # [B*KV, 1, M]
        p_new = jnp.exp(s_new - top)
        total = jnp.sum(p_new, axis=1)  # [B*KV, M]
        out = jnp.einsum("NTM,NTH->NMH", p_new.astype(dtype), v_new, preferred_element_type=acc)  # [B*KV, M, H]
    else:
        s = k_cache.shape[1]
        old_ok = jnp.repeat(jnp.arange(s)[None, :] < starts[:, None], kv, axis=0)[:, :, None]  # [B*KV, S, 1]
        s_old = jnp.einsum("NSH,NMH->NSM", k_cache, q, preferred_element_type=acc) * scale
        s_old = jnp.where(old_ok, s_old, lowest)  # [B*KV, S, M]
        top = jnp.maximum(jnp.max(s_old, axis=1, keepdims=True), jnp.max(s_new, axis=1, keepdims=True))  # [B*KV, 1, M]
        p_old, p_new = jnp.exp(s_old - top), jnp.exp(s_new - top)  # one softmax over S + T, unnormalised
        total = jnp.sum(p_old, axis=1) + jnp.sum(p_new, axis=1)  # [B*KV, M]
        out = jnp.einsum("NSM,NSH->NMH", p_old.astype(dtype), v_cache, preferred_element_type=acc) + jnp.einsum(
            "NTM,NTH->NMH", p_new.astype(dtype), v_new, preferred_element_type=acc
        )  # [B*KV, M, H]
    out = (out / total[:, :, None]).astype(q.dtype)  # [B*KV, M, H]
    out = out.reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4)  # [B, T, KV, G, H]
    return linear(o_weight, out.reshape(b, t, n * h))


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, gate and up fused into one `[2F, D]` weight."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        init = nnx.initializers.normal(0.02)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_up = nnx.Param(init(rngs.params(), (2 * f, d), dtype))  # [2F, D]
        self.down = nnx.Param(init(rngs.params(), (d, f), dtype))  # [D, F]

    def __call__(self, x):
        """x `[B, T, D]` -> `[B, T, D]`."""
        gu = linear(self.gate_up[...], x)  # [B, T, 2F]
        gate, up = jnp.split(gu, 2, axis=-1)  # [B, T, F] each
        return linear(self.down[...], jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `+ mlp(norm(.))`."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, rngs=rngs, dtype=dtype)

    def attend(self, x, cos, sin, k_cache, v_cache, starts, mask=None):
        """x `[B, T, D]` -> (output `[B, T, D]`, new k, v `[B, T, KV, H]`, not written); the
        other arguments as `Attention.attend`."""
        return self._run(self.attn.attend, x, cos, sin, k_cache, v_cache, starts, mask)

    def __call__(self, x, cos, sin, k_cache, v_cache, starts, mask=None):
        """`attend` with the new keys and values written: (output `[B, T, D]`, k_cache, v_cache
        `[B*KV, S, H]`); `starts` None: a fresh cache (`Attention.__call__`)."""
        return self._run(self.attn, x, cos, sin, k_cache, v_cache, starts, mask)

    def _run(self, attn, x, cos, sin, k_cache, v_cache, starts, mask):
        a, k, v = attn(self.attn_norm(x), cos, sin, k_cache, v_cache, starts, mask)  # a [B, T, D]
        x = x + a  # [B, T, D]
        return x + self.mlp(self.mlp_norm(x)), k, v


class Llama(nnx.Module):
    """The decoder: embedding `[V, D]`, `cfg.num_layers` `DecoderLayer`s, final norm, LM head
    `[V, D]` (the embedding when tied)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype)
            )

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens `[B, T]` int32 -> embeddings `[B, T, D]`."""
        return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]

    def head_weight(self) -> jax.Array:  # [V, D]
        return self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits(self, h: jax.Array) -> jax.Array:
        """Final normed hidden `[..., D]` -> f32 logits `[..., V]`."""
        return linear(self.head_weight(), h, jnp.float32)

    def hidden(
        self,
        tokens,
        cache: KVCache,
        feature_layers: tuple[int, ...] = (),
        positions=None,
        mask=None,
        fresh: bool = False,
    ):
        """Run the decoder over new tokens written at `cache.lengths`.

        Args:
          tokens: [B, T] int32.
          cache: the KV cache (S positions); rows attend to their first `lengths` entries.
          feature_layers: decoder layer indices (0-based) whose outputs to return.
          positions: [B, T] int32 rope positions (default: lengths + t; a token tree passes
            lengths + depth, tree.py).
          mask: [B, T, T] bool attention among the new tokens (default: causal; a token tree
            passes its ancestor mask).
          fresh: the cache holds nothing yet (a prefill from position 0): written at 0, never read.

        Returns:
          (final normed hidden [B, T, D], the cache with the new K/V written (lengths unchanged),
          the `feature_layers` layers' outputs [n, B, T, D] or None).
        """
        h, ks, vs, features = self._layers(tokens, cache, feature_layers, positions, mask, write=True, fresh=fresh)
        return h, cache.replace(k=ks, v=vs), features

    def hidden_kv(self, tokens, cache: KVCache, feature_layers: tuple[int, ...] = (), positions=None, mask=None):
        """`hidden` with the cache read only (same arguments but `fresh`; same arithmetic).

        Returns:
          (final normed hidden [B, T, D], the new keys and values as a `KVUpdate` (L x
          [B, T, KV, H], for `KVCache.write`), the `feature_layers` layers' outputs [n, B, T, D] or None).
        """
        h, ks, vs, features = self._layers(tokens, cache, feature_layers, positions, mask, write=False)
        return h, KVUpdate(ks, vs), features

    def _layers(self, tokens, cache, feature_layers, positions, mask, write: bool, fresh: bool = False):
        """-> (final normed hidden, keys and values per layer: the written buffers `[B*KV, S, H]`
        with `write`, else the new entries `[B, T, KV, H]`, target features)."""
        x = self.embed_tokens(tokens)  # [B, T, D]
        b, t = tokens.shape
        if positions is None:
            positions = (
                jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
                if fresh
                else (cache.lengths[:, None] + jnp.arange(t)[None, :])
            )  # [B, T]
        starts = None if fresh else cache.lengths  # [B]
        cos, sin = rope_tables(self.cfg, positions)  # [B, T, H] each
        outs, ks, vs = [], [], []
        for layer, k_l, v_l in zip(self.layers, cache.k, cache.v, strict=True):
            run = layer if write else layer.attend
            x, k, v = run(x, cos, sin, k_l, v_l, starts, mask)  # x [B, T, D]; k, v [B*KV, S, H] | [B, T, KV, H]
            outs.append(x)
            ks.append(k)
            vs.append(v)
        features = jnp.stack([outs[i] for i in feature_layers]) if feature_layers else None  # [n, B, T, D]
        return self.norm(x), tuple(ks), tuple(vs), features

    def __call__(self, tokens, cache: KVCache, feature_layers: tuple[int, ...] = ()):
        """`hidden` then `logits`: tokens `[B, T]` -> (f32 logits `[B, T, V]`, the cache with the
        new K/V written, target features `[n, B, T, D]` or None)."""
        h, cache, features = self.hidden(tokens, cache, feature_layers)  # [B, T, D]
        return self.logits(h), cache, features

    def new_cache(self, batch: int, size: int) -> KVCache:
        """An empty cache for `batch` rows of `size` positions: L x `[B*KV, S, H]` zeros, lengths 0."""
        c = self.cfg
        return KVCache.create(c.num_layers, batch, size, c.num_kv_heads, c.head_dim, self.embed[...].dtype)
