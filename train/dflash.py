"""DFlash training: many blocks per sequence at once, each seeing only its own context.

A block anchored at position a is what `DFlashDrafter.propose` runs once x_a is the last emitted
token: the target embedding of `[x_a, MASK x (B - 1)]` at positions a .. a + B - 1, attending to
the context entries (the fused target features through each layer's k/v projections) at positions
< a and to the whole block, nothing else. Block position k = 1 .. B - 1 drafts x_{a+k}; its label
is the target's distribution at position a + k - 1 (soft cross-entropy over the drafter's head
rows: the whole vocabulary, or the draft vocabulary renormalised), weighted by exp(-(k - 1) / γ)
since a later draft only counts when the earlier ones were accepted.

Each step draws `anchors` block anchors per sequence at random (uniformly among positions whose
token and next token are reply tokens; seeded by the batch's `row_id`, so resume is exact), and
runs them in one pass: queries `[A B]`, keys = the T context entries (shared by every block, each
block masked to positions < its anchor) + its own B block entries. The simulator takes every reply
position as an anchor and counts greedy chain acceptance of the B - 1 drafts (train/common.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.drafters.dflash import DFlash
from specjax.models.llama import linear, rope_tables
from train.common import chain_counts, chunked_argmax, chunked_soft_ce, simulate_store
from train.common import shift_left as _shift_left


def block_states(
    net: DFlash, feats: jax.Array, tokens: jax.Array, anchors: jax.Array, embed: jax.Array, block: int
) -> jax.Array:
    """feats `[n, B, T, D]` target hidden states, tokens `[B, T]`, anchors `[B, A]` positions,
    embed `[V, D]` -> the normed drafter states of every block `[B, A, block, D]` (f32)."""
    cfg = net.cfg
    lc = cfg.layers
    b, t = tokens.shape
    a = anchors.shape[1]
    kv, g, h = lc.num_kv_heads, lc.num_groups, lc.head_dim
    ctx = net.context(feats).astype(jnp.float32)  # [B, T, D]
    cos_c, sin_c = rope_tables(lc, jnp.broadcast_to(jnp.arange(t)[None], (b, t)))
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A] x_a
    blk = jnp.concatenate([first[..., None], jnp.full((b, a, block - 1), cfg.mask_token_id, first.dtype)], axis=-1)
    x = jnp.take(embed, blk, axis=0).astype(jnp.float32) * cfg.embed_scale  # [B, A, Bk, D]
    pos = anchors[..., None] + jnp.arange(block)  # [B, A, Bk]
    cos_b, sin_b = rope_tables(lc, pos.reshape(b, a * block))
    ctx_ok = (jnp.arange(t)[None, None] < anchors[..., None])[:, :, None, None, None, :]  # [B, A, 1, 1, 1, T]
    neg, scale = jnp.finfo(jnp.float32).min, 1.0 / math.sqrt(h)
    for layer in net.layers:
        _, kc, vc = layer.attn.project(ctx, cos_c, sin_c, queries=False)  # [B, T, KV, H] each
        q, kb, vb = layer.attn.project(layer.attn_norm(x).reshape(b, a * block, -1), cos_b, sin_b)
        q = q.reshape(b, a, block, kv, g, h)  # [B, A, Bk, KV, G, H]
        kb, vb = kb.reshape(b, a, block, kv, h), vb.reshape(b, a, block, kv, h)  # [B, A, Bk, KV, H]
        s_c = jnp.einsum("bakvgh,btvh->bavgkt", q, kc) * scale  # [B, A, KV, G, Bk, T]
        s_c = jnp.where(ctx_ok, s_c, neg)
        s_b = jnp.einsum("bakvgh,bajvh->bavgkj", q, kb) * scale  # [B, A, KV, G, Bk, Bk]
        p = jax.nn.softmax(jnp.concatenate([s_c, s_b], axis=-1), axis=-1)  # one softmax over T + Bk
        out = jnp.einsum("bavgkt,btvh->bakvgh", p[..., :t], vc) + jnp.einsum(
            "bavgkj,bajvh->bakvgh", p[..., t:], vb
        )  # [B, A, Bk, KV, G, H]
        x = x + linear(layer.attn.o[...], out.reshape(b, a, block, -1))  # [B, A, Bk, D]
        x = x + layer.mlp(layer.mlp_norm(x))
    return net.norm(x)


def valid_anchors(mask: jax.Array) -> jax.Array:
    """mask `[B, T]` reply tokens -> `[B, T]`: positions a whose x_a and x_{a+1} are reply tokens
    (a block decoding can run there and its first draft has a label)."""
    t = mask.shape[1]
    return mask & _shift_left(mask) & (jnp.arange(t) < t - 1)[None]


def draw_anchors(row_id: jax.Array, ok: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """`n` distinct positions per row, uniformly among `ok [B, T]`, seeded by `row_id [B]`.
    Returns anchors `[B, n]` and whether each is a real one `[B, n]` (rows with fewer valid
    positions than n pad with invalid ones)."""
    t = ok.shape[1]
    noise = jax.vmap(lambda r: jax.random.uniform(jax.random.fold_in(jax.random.key(0), r), (t,)))(row_id)
    top, idx = jax.lax.top_k(jnp.where(ok, noise, -1.0), min(n, t))  # [B, n]
    return idx.astype(jnp.int32), top >= 0


def dflash_loss(net: DFlash, batch: dict, head: jax.Array, embed: jax.Array, block: int, anchors: int, gamma: float):
    """batch: tokens, mask `[B, T]`, hidden `[n, B, T, D]`, final `[B, T, D]`, row_id `[B]`;
    head `[N, D]` the drafter's head rows. Returns (loss, metrics)."""
    tokens, mask = batch["tokens"], batch["mask"]
    b, t = tokens.shape
    anc, anc_ok = draw_anchors(batch["row_id"], valid_anchors(mask), anchors)  # [B, A]
    hs = block_states(net, batch["hidden"], tokens, anc, embed, block)[:, :, 1:]  # [B, A, K, D]
    k = jnp.arange(1, block)  # block positions that draft
    tgt = anc[..., None] + k  # [B, A, K] the drafted token's position
    ok = (
        anc_ok[..., None]
        & (tgt < t)
        & jnp.take_along_axis(mask, jnp.minimum(tgt, t - 1).reshape(b, -1), axis=1).reshape(tgt.shape)
    )
    w = ok * jnp.exp(-(k - 1) / gamma)  # [B, A, K]
    lab = jnp.minimum(tgt - 1, t - 1).reshape(b, -1)  # [B, A K] the labelling target position
    final = jnp.take_along_axis(batch["final"], lab[..., None], axis=1)  # [B, A K, D]
    ce, hits = chunked_soft_ce(hs.reshape(1, b, -1, hs.shape[-1]), final, head, w.reshape(1, b, -1))
    denom = jnp.maximum(jnp.sum(w), 1e-9)
    return ce[0] / denom, {"top1": hits[0] / denom}


def simulate_acceptance(net: DFlash, batch: dict, head: jax.Array, d2t, embed: jax.Array, block: int):
    """Greedy acceptance of the block's drafts from every anchor: count `[B, T]` and valid
    starts `[B, T]` (the anchor is a reply position and every checked position exists)."""
    tokens, mask, target_next = batch["tokens"], batch["mask"], batch["argmax"]  # [B, T] each
    b, t = tokens.shape
    anc = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))  # [B, T] every position
    hs = block_states(net, batch["hidden"], tokens, anc, embed, block)[:, :, 1:]  # [B, T, K, D]
    drafts = chunked_argmax(hs.reshape(1, b, -1, hs.shape[-1]), head, d2t=d2t)[0].reshape(b, t, block - 1)
    hits = [drafts[:, :, i] == _shift_left(target_next, i) for i in range(block - 1)]  # target argmax at a + i
    starts = valid_anchors(mask) & (jnp.arange(t) + block < t)[None]
    return chain_counts(hits), starts


class DFlashTask:
    """DFlash as a training task for `train.loop.fit` (see there for the interface)."""

    batch_axes = {"tokens": 0, "mask": 0, "argmax": 0, "final": 0, "hidden": 1, "row_id": 0}
    simulate = staticmethod(simulate_acceptance)  # (net, batch, head, d2t, embed, block) -> counts, starts
    NUM_FEATURES = 3  # target layers read by default, evenly spaced from 1 to L - 3

    @staticmethod
    def feature_layers(target, target_layers=None) -> tuple[int, ...]:
        from specjax.drafters.dflash import default_target_layers

        if target_layers:
            return tuple(int(i) for i in target_layers)
        return default_target_layers(target.config.num_layers, DFlashTask.NUM_FEATURES)

    def __init__(
        self,
        target,
        counts,
        num_layers: int = 2,
        block_size: int = 8,
        mask_token_id: int = 0,
        draft_vocab_size: int = 8192,
        target_layers=None,
        intermediate_size: int | None = None,
        anchors: int = 64,
        gamma: float = 4.0,
    ):
        import dataclasses

        from specjax.drafters.dflash import DFlashConfig
        from train.common import draft_vocab

        tc = target.config
        layers = dataclasses.replace(
            tc,
            num_layers=int(num_layers),
            qk_norm=True,
            attention_bias=False,
            intermediate_size=intermediate_size or tc.intermediate_size,
            tie_word_embeddings=False,
            eos_token_ids=(),
            bos_token_id=None,
        )
        n = min(int(draft_vocab_size), tc.vocab_size) if draft_vocab_size else 0
        self.cfg = DFlashConfig(
            layers,
            self.feature_layers(target, target_layers),
            tc.num_layers,
            int(block_size),
            int(mask_token_id),
            draft_vocab_size=0 if n == tc.vocab_size else n,
        )
        self.cfg.check("model section")
        self.target = target
        self.d2t = draft_vocab(counts, self.cfg.draft_vocab_size, tc.vocab_size)
        self.anchors, self.gamma = int(anchors), float(gamma)
        m = target.module()
        self.embed, self.head = m.embed[...], m.head_weight()  # frozen target tables
        self.final_norm = m.norm.scale[...]
        self.graphdef = None

    def init_params(self, seed: int):
        from flax import nnx

        net = DFlash(self.cfg, rngs=nnx.Rngs(seed))
        # The output space starts as the target's: its final norm in front of its head.
        net.norm.scale[...] = jnp.array(self.final_norm, net.norm.scale[...].dtype, copy=True)  # own buffer: donated
        self.graphdef, params = nnx.split(net)
        return params

    def net(self, params) -> DFlash:
        from flax import nnx

        return nnx.merge(self.graphdef, params)

    def frozen(self) -> dict:
        from specjax.drafters.base import head_rows

        return {"embed": self.embed, "head": head_rows(self.head, self.d2t), "d2t": self.d2t}

    def loss(self, params, frozen, batch):
        return dflash_loss(
            self.net(params), batch, frozen["head"], frozen["embed"], self.cfg.block_size, self.anchors, self.gamma
        )

    def evaluate(self, params, store, max_rows: int = 64, batch_size: int = 4) -> dict:
        """Simulated greedy MAL and per-position acceptance of the drafts on held-out rows."""
        if not hasattr(self, "_sim"):
            self._sim = jax.jit(
                lambda p, f, b: self.simulate(self.net(p), b, f["head"], f["d2t"], f["embed"], self.cfg.block_size)
            )
        return simulate_store(
            self._sim,
            params,
            self.frozen(),
            store,
            ("tokens", "mask", "argmax", "hidden"),
            self.cfg.max_num_draft,
            max_rows,
            batch_size,
        )

    def export(self, params, out_dir: str, dtype=None, metadata=None) -> str:
        from specjax.drafters.dflash import DFlashWeights, save

        return save(DFlashWeights(self.cfg, self.graphdef, params, self.d2t), out_dir, dtype, metadata)
