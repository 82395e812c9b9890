"""EAGLE-3 training: the training-time test (TTT) unroll, its loss, and the acceptance simulator.

TTT unrolls the drafter `steps` times over a whole sequence in parallel, exactly as chain drafting
runs it (specjax/drafters/eagle3.py):

* step 0 at position t reads `[embed(x_{t+1}) ; fc(target features at t)]` and attends causally
  to the step-0 keys at positions <= t (the drafter's cache of the accepted prefix);
* step j >= 1 at position t reads `[embed(x_{t+1}) ; g^{j-1}_{t-1}]`, the drafter's own output of
  the previous step one position back, and attends to the step-0 keys at positions <= t - j
  plus, for each i = 1..j, the single step-i key at position t - j + i (the scratch entries chain
  drafting wrote for drafts 2..j+1).

Every step at position t predicts x_{t+2}; its label is the target's distribution at position
t + 1 over the draft vocabulary (target logits restricted to `d2t`, renormalised). The loss is
the soft cross-entropy, step j weighted by `decay ** j`. Teacher forcing with the true tokens is
what acceptance needs: draft j only matters when drafts 1..j-1 were accepted, i.e. equal to the
true tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.drafters.eagle3 import Eagle3
from specjax.models.llama import linear, rope_tables
from train.common import shift_left as _shift_left
from train.common import shift_right as _shift
from train.common import simulate_store


def ttt_logits(net: Eagle3, emb: jax.Array, feats: jax.Array, steps: int) -> list[jax.Array]:
    """emb `[B, T, D]` (embedding of x_{t+1} at t); feats `[n, B, T, D]` target hidden states.
    Returns `steps` draft-vocab logits `[B, T, N]` (f32)."""
    cfg = net.cfg
    b, t, _ = emb.shape
    kv, h = cfg.num_kv_heads, cfg.head_dim
    g_heads = cfg.num_heads // kv
    cos, sin = rope_tables(cfg.layer_config(), jnp.broadcast_to(jnp.arange(t)[None], (b, t)))
    pos = jnp.arange(t)
    neg = jnp.finfo(jnp.float32).min
    ks, vs, outs = [], [], []
    g_prev = None
    for j in range(steps):
        feat = net.fuse(feats) if j == 0 else _shift(g_prev, 1)  # [B, T, D]
        q, k, v = net.attn.project(net.layer_input(emb, feat), cos, sin)  # [B,T,N,H], [B,T,KV,H] x2
        ks.append(k)
        vs.append(v)
        qg = q.reshape(b, t, kv, g_heads, h).astype(jnp.float32)  # [B, T, KV, G, H]
        scale = 1.0 / math.sqrt(h)
        s0 = jnp.einsum("BTKGH,BSKH->BKGTS", qg, ks[0].astype(jnp.float32)) * scale  # [B, KV, G, T, S]
        s0 = jnp.where(pos[None, :] <= pos[:, None] - j, s0, neg)
        diag = []
        for i in range(1, j + 1):  # the step-i key at position t - (j - i)
            d = jnp.einsum("BTKGH,BTKH->BKGT", qg, _shift(ks[i], j - i).astype(jnp.float32)) * scale
            diag.append(jnp.where(pos >= j - i, d, neg))
        scores = jnp.concatenate([s0] + [d[..., None] for d in diag], axis=-1)  # [B, KV, G, T, T + j]
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs[..., :t], vs[0].astype(jnp.float32))
        for i in range(1, j + 1):
            w = probs[..., t + i - 1].transpose(0, 3, 1, 2)[..., None]  # [B, T, KV, G, 1]
            out = out + w * _shift(vs[i], j - i).astype(jnp.float32)[:, :, :, None, :]
        attn = linear(net.attn.o[...], out.reshape(b, t, -1).astype(emb.dtype))  # [B, T, D]
        g_prev = net.finish(feat, attn)
        outs.append(net.logits(g_prev))
    return outs


def target_draft_logits(final: jax.Array, head: jax.Array, d2t: jax.Array) -> jax.Array:
    """Target logits over the draft vocabulary: final normed hidden `[B, T, D]` x head rows
    `head[d2t]` `[N, D]` -> `[B, T, N]` f32."""
    return linear(jnp.take(head, d2t, axis=0), final, jnp.float32)


def ttt_loss(
    net: Eagle3, batch: dict, head: jax.Array, d2t: jax.Array, embed: jax.Array, steps: int, decay: float = 0.8
):
    """Soft cross-entropy over TTT steps.

    batch: `tokens [B, T]`, `mask [B, T]` (positions whose next token is trained on, i.e.
    response tokens), `hidden [n, B, T, D]`, `final [B, T, D]`. Returns (loss, metrics).
    """
    tokens, mask = batch["tokens"], batch["mask"]
    t = tokens.shape[1]
    emb = jnp.take(embed, _shift_left(tokens), axis=0).astype(net.fc[...].dtype)  # [B, T, D]: x_{t+1}
    labels = jax.nn.softmax(_shift_left(target_draft_logits(batch["final"], head, d2t)), axis=-1)  # [B, T, N]
    # position t is trained when x_{t+2}'s distribution exists (t + 1 < T) and is in the response
    base = _shift_left(mask) & (jnp.arange(t) < t - 1)[None]  # [B, T]
    total, weight, metrics = 0.0, 0.0, {}
    for j, logits in enumerate(ttt_logits(net, emb, batch["hidden"], steps)):
        valid = base & (jnp.arange(t) >= j)[None]  # the chain started at t - j >= 0
        ce = -jnp.sum(labels * jax.nn.log_softmax(logits, axis=-1), axis=-1)  # [B, T]
        denom = jnp.maximum(valid.sum(), 1)
        step_loss = jnp.sum(ce * valid) / denom
        hit = jnp.argmax(logits, -1) == jnp.argmax(labels, -1)
        metrics[f"top1_step{j}"] = jnp.sum(hit * valid) / denom
        total += decay**j * step_loss
        weight += decay**j
    return total / weight, metrics


def simulate_acceptance(net: Eagle3, batch: dict, d2t: jax.Array, embed: jax.Array, k: int):
    """Greedy chain acceptance of K drafts from every start position, without generation.

    Draft i from start t (the last accepted position is t + 1... the drafter's cache ends at t) is
    TTT step i - 1 at position t + i - 1, and is accepted when it equals the target's greedy token
    there (`batch["argmax"][t + i]`: the target's argmax at position t + i), given drafts < i were
    accepted. Returns per-start accepted counts `[B, T]` and the valid-start mask `[B, T]`.
    """
    tokens, mask, target_next = batch["tokens"], batch["mask"], batch["argmax"]  # [B, T] each
    t = tokens.shape[1]
    emb = jnp.take(embed, _shift_left(tokens), axis=0).astype(net.fc[...].dtype)
    steps = ttt_logits(net, emb, batch["hidden"], k)
    ok = jnp.ones(tokens.shape, bool)
    count = jnp.zeros(tokens.shape, jnp.int32)
    for i in range(1, k + 1):
        draft = jnp.take(d2t, jnp.argmax(steps[i - 1], axis=-1))  # [B, T] at position s = t + i - 1
        hit = draft == _shift_left(target_next)  # compares with the target's argmax at s + 1
        hit_from_start = jnp.concatenate([hit[:, i - 1 :], jnp.zeros((hit.shape[0], i - 1), bool)], axis=1)
        ok = ok & hit_from_start
        count = count + ok
    starts = _shift_left(mask) & (jnp.arange(t) + k + 1 < t)[None]  # every checked position exists
    return count, starts


class Eagle3Task:
    """EAGLE-3 as a training task for `train.loop.fit` (see there for the interface)."""

    batch_axes = {"tokens": 0, "mask": 0, "argmax": 0, "final": 0, "hidden": 1}

    @staticmethod
    def feature_layers(target, target_layers=None) -> tuple[int, ...]:
        """The target layers whose outputs the feature store keeps (the recipe's, or the default)."""
        from specjax.drafters.eagle3 import Eagle3Config

        return Eagle3Config.for_target(target.config, target_layers=target_layers).target_layers

    def __init__(
        self,
        target,
        counts,
        draft_vocab_size: int = 8192,
        target_layers=None,
        ttt_steps: int = 3,
        decay: float = 0.8,
        eval_k: int = 5,
        intermediate_size: int | None = None,
    ):
        from specjax.drafters.base import vocab_maps
        from specjax.drafters.eagle3 import Eagle3Config

        self.target = target
        self.cfg = Eagle3Config.for_target(target.config, draft_vocab_size, target_layers, intermediate_size)
        d2t, self.t2d = vocab_maps(counts, self.cfg.draft_vocab_size)
        self.d2t = jnp.asarray(d2t)
        self.ttt_steps, self.decay, self.eval_k = ttt_steps, decay, eval_k
        m = target.module()
        self.embed, self.head = m.embed[...], m.head_weight()  # frozen target tables
        self.final_norm = m.norm.scale[...]
        self.graphdef = None

    def init_params(self, seed: int):
        from flax import nnx

        net = Eagle3(self.cfg, rngs=nnx.Rngs(seed))
        # Start from the target's output space: the draft head is the target's LM head restricted
        # to the draft vocabulary, the final norm the target's. Only the mapping from features
        # to the next-next token's hidden state is learned from scratch.
        net.head[...] = jnp.take(self.head, self.d2t, axis=0).astype(net.head[...].dtype)
        net.norm.scale[...] = jnp.array(self.final_norm, net.norm.scale[...].dtype, copy=True)  # own buffer: donated
        self.graphdef, params = nnx.split(net)
        return params

    def net(self, params) -> Eagle3:
        from flax import nnx

        return nnx.merge(self.graphdef, params)

    def frozen(self) -> dict:
        """Target tables the loss reads but never trains (jit arguments, not baked-in constants)."""
        return {"embed": self.embed, "head": self.head, "d2t": self.d2t}

    def loss(self, params, frozen, batch):
        return ttt_loss(
            self.net(params), batch, frozen["head"], frozen["d2t"], frozen["embed"], self.ttt_steps, self.decay
        )

    def evaluate(self, params, store, max_rows: int = 64, batch_size: int = 8) -> dict:
        """Simulated greedy MAL and per-position acceptance (K = eval_k) on held-out rows."""
        k = self.eval_k
        if not hasattr(self, "_sim"):
            self._sim = jax.jit(lambda p, f, b: simulate_acceptance(self.net(p), b, f["d2t"], f["embed"], k))
        return simulate_store(
            self._sim, params, self.frozen(), store, ("tokens", "mask", "argmax", "hidden"), k, max_rows, batch_size
        )

    def export(self, params, out_dir: str, dtype=None, metadata=None) -> str:
        from specjax.drafters.eagle3 import Eagle3Weights, save

        return save(Eagle3Weights(self.cfg, self.graphdef, params, self.d2t), out_dir, dtype, metadata)
