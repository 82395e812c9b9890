"""DSpark training: DFlash's many-blocks-per-sequence pass (train/dflash.py), every block slot a
draft, the Markov bias teacher-forced, a confidence head fitted to the drafts' acceptance rate.

A block anchored at position a drafts x_{a+k+1} at slot k = 0 .. B - 1, from the backbone's state
there plus the Markov bias of the token before it, x_{a+k} (the text's own token: at inference
that is the previous draft, and a chain only goes on while its drafts are the text). Its label is
the target's distribution at position a + k over the head rows, p. Per slot, with q the draft
distribution and weight exp(-k / γ) (a later draft counts only when the earlier ones survive):

    loss = ce_weight * CE(p, q) + tv_weight * TV(p, q) + conf_weight * BCE(c, 1 - TV(p, q))

1 - TV(p, q) = sum_v min(p_v, q_v) is the probability that rejection sampling accepts a draft
drawn from q, so the confidence head c learns what the verify-length schedule needs (the target
of its BCE is not differentiated). The simulator counts greedy chain acceptance of the B drafts
from every reply position (teacher forcing is exact there: a chain goes on only while its drafts
equal the target's greedy text).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.dspark import DSpark
from specjax.models.llama import linear
from train.calibration import fit_temperatures
from train.common import chain_counts
from train.common import shift_left as _shift_left
from train.dflash import DFlashTask, block_states, draw_anchors, valid_anchors


def slot_logits(net: DSpark, hs: jax.Array, prev: jax.Array, head: jax.Array):
    """Block states `[..., D]`, previous tokens `[...]` -> (draft logits `[..., N]` with the Markov
    bias, confidence logits `[...]`)."""
    e = net.prev_embed(prev)  # [..., r]
    z = net.logits(head, hs) + net.markov_bias(e)  # [..., N]
    conf = net.confidence_logit(hs, e) if net.cfg.confidence else jnp.zeros(hs.shape[:-1], jnp.float32)
    return z, conf


def dspark_loss(
    net: DSpark,
    batch: dict,
    head: jax.Array,
    embed: jax.Array,
    block: int,
    anchors: int,
    gamma: float,
    ce_weight: float,
    tv_weight: float,
    conf_weight: float,
):
    """batch: tokens, mask `[B, T]`, hidden `[n, B, T, D]`, final `[B, T, D]`, row_id `[B]`;
    head `[N, D]` the head rows. Returns (loss, metrics)."""
    tokens, mask = batch["tokens"], batch["mask"]
    b, t = tokens.shape
    anc, anc_ok = draw_anchors(batch["row_id"], valid_anchors(mask), anchors)  # [B, A]
    hs = block_states(net, batch["hidden"], tokens, anc, embed, block)  # [B, A, Bk, D]
    k = jnp.arange(block)
    pos = anc[..., None] + k  # [B, A, Bk] the labelling position a + k; slot k drafts pos + 1
    flat = jnp.minimum(pos, t - 1).reshape(b, -1)  # [B, A Bk]
    nxt = jnp.minimum(pos + 1, t - 1).reshape(b, -1)
    ok = anc_ok[..., None] & (pos + 1 < t) & jnp.take_along_axis(mask, nxt, axis=1).reshape(pos.shape)  # [B, A, Bk]
    w = ok * jnp.exp(-k / gamma)  # [B, A, Bk]
    prev = jnp.take_along_axis(tokens, flat, axis=1).reshape(pos.shape)  # [B, A, Bk] x_{a+k}
    final = jnp.take_along_axis(batch["final"], flat[..., None], axis=1).reshape(*pos.shape, -1)  # [B, A, Bk, D]
    p = jax.nn.softmax(linear(head, final, jnp.float32), axis=-1)  # [B, A, Bk, N] target over the head rows
    z, conf = slot_logits(net, hs, prev, head)  # [B, A, Bk, N], [B, A, Bk]
    logq = jax.nn.log_softmax(z, axis=-1)
    ce = -jnp.sum(p * logq, axis=-1)  # [B, A, Bk]
    accept = jnp.sum(jnp.minimum(p, jnp.exp(logq)), axis=-1)  # [B, A, Bk] = 1 - TV(p, q)
    c_star = jax.lax.stop_gradient(accept)
    bce = jnp.maximum(conf, 0) - conf * c_star + jnp.log1p(jnp.exp(-jnp.abs(conf)))  # BCE with logits
    per = ce_weight * ce + tv_weight * (1.0 - accept) + (conf_weight * bce if net.cfg.confidence else 0.0)
    denom = jnp.maximum(jnp.sum(w), 1e-9)
    top1 = jnp.argmax(z, axis=-1) == jnp.argmax(p, axis=-1)
    return jnp.sum(w * per) / denom, {
        "top1": jnp.sum(w * top1) / denom,
        "accept": jnp.sum(w * accept) / denom,
        "conf_abs_err": jnp.sum(w * jnp.abs(jax.nn.sigmoid(conf) - c_star)) / denom,
    }


def chain_view(net: DSpark, batch: dict, head: jax.Array, d2t, embed: jax.Array, block: int):
    """The block's B drafts from every anchor, teacher-forced (the previous token of slot k is the
    text's, which a greedy chain's drafts are while it lasts): whether each equals the target's
    greedy token `[B, T, Bk]`, the confidence logits `[B, T, Bk]`, valid starts `[B, T]`."""
    tokens, mask, target_next = batch["tokens"], batch["mask"], batch["argmax"]  # [B, T] each
    b, t = tokens.shape
    anc = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))  # [B, T] every position
    hs = block_states(net, batch["hidden"], tokens, anc, embed, block)  # [B, T, Bk, D]
    prev = jnp.stack([_shift_left(tokens, i) for i in range(block)], axis=-1)  # [B, T, Bk] x_{a+k}
    z, conf = slot_logits(net, hs, prev, head)  # [B, T, Bk, N], [B, T, Bk]
    drafts = jnp.argmax(z, axis=-1)  # [B, T, Bk]
    drafts = drafts if d2t is None else jnp.take(d2t, drafts)
    hits = jnp.stack([drafts[:, :, i] == _shift_left(target_next, i) for i in range(block)], axis=-1)  # [B, T, Bk]
    starts = valid_anchors(mask) & (jnp.arange(t) + block + 1 < t)[None]
    return hits, conf, starts


def simulate_acceptance(net: DSpark, batch: dict, head: jax.Array, d2t, embed: jax.Array, block: int):
    """Greedy acceptance of the block's B drafts from every anchor: count `[B, T]` and valid
    starts `[B, T]`."""
    hits, _, starts = chain_view(net, batch, head, d2t, embed, block)
    return chain_counts([hits[..., i] for i in range(block)]), starts


class DSparkTask(DFlashTask):
    """DSpark as a training task for `train.loop.fit` (DFlashTask's data, anchors, evaluation and export)."""

    simulate = staticmethod(simulate_acceptance)

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
        markov_rank: int = 256,
        confidence: bool = True,
        ce_weight: float = 0.1,
        tv_weight: float = 0.9,
        conf_weight: float = 1.0,
    ):
        import dataclasses

        from specjax.drafters.dspark import DSparkConfig

        super().__init__(
            target,
            counts,
            num_layers,
            block_size,
            mask_token_id,
            draft_vocab_size,
            target_layers,
            intermediate_size,
            anchors,
            gamma,
        )
        fields = {f.name: getattr(self.cfg, f.name) for f in dataclasses.fields(self.cfg)}
        self.cfg = DSparkConfig(**fields, markov_rank=int(markov_rank), confidence=bool(confidence))
        self.cfg.check("model section")
        self.weights = (float(ce_weight), float(tv_weight), float(conf_weight))

    def init_params(self, seed: int):
        from flax import nnx

        net = DSpark(self.cfg, rngs=nnx.Rngs(seed))
        net.norm.scale[...] = jnp.array(self.final_norm, net.norm.scale[...].dtype, copy=True)  # own buffer: donated
        self.graphdef, params = nnx.split(net)
        return params

    def loss(self, params, frozen, batch):
        return dspark_loss(
            self.net(params),
            batch,
            frozen["head"],
            frozen["embed"],
            self.cfg.block_size,
            self.anchors,
            self.gamma,
            *self.weights,
        )

    def calibrate(self, params, store, max_rows: int = 64, batch_size: int = 4) -> dict:
        """Sequential temperature scaling of the confidence head on `store`'s rows (held-out
        replies), against greedy acceptance (train/calibration.fit_temperatures: adopted only when
        it lowers the cross-validated survival ECE). Adopted temperatures go into this task's
        config, so `export` writes them."""
        import dataclasses

        import numpy as np

        if not self.cfg.confidence:
            return {}
        if not hasattr(self, "_chain"):
            self._chain = jax.jit(
                lambda p, f, b: chain_view(self.net(p), b, f["head"], f["d2t"], f["embed"], self.cfg.block_size)
            )
        frozen, rows = self.frozen(), min(len(store), max_rows)
        parts = []  # per row: (confidence logits [S, Bk], hits [S, Bk]) at its valid starts
        for s in range(0, rows, batch_size):
            b = store.batch(np.arange(s, min(s + batch_size, rows)))
            names = ("tokens", "mask", "argmax", "hidden")
            hits, conf, starts = map(np.asarray, self._chain(params, frozen, {n: jnp.asarray(b[n]) for n in names}))
            parts += [(c[ok], h[ok]) for c, h, ok in zip(conf, hits, starts)]
        report = fit_temperatures(parts)
        self.cfg = dataclasses.replace(self.cfg, confidence_temperatures=tuple(report["temperatures"]))
        return report
