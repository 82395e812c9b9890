"""MTP training on a frozen target: per-depth distillation, teacher forced, parallel over the sequence.

Module k at position i reads h^{k-1}_i and the true token x_{i+k} and predicts x_{i+k+1}
(specjax/drafters/mtp.py). One causal pass per module over the whole sequence computes every
position at once: module 1 from the target's final hidden states (`final` in the FeatureStore),
module k from module k - 1's outputs. Its label is the target's full-vocabulary distribution at
position i + k (the target's next-token law after x_{i+k}), computed from `final` through the
target's LM head. Loss: soft cross-entropy, depth k weighted by `depth_weights[k-1]` (default
`decay ** (k - 1)`: later depths only matter once earlier drafts were accepted).

Teacher forcing with the true tokens is exactly what inference computes when drafts 1..k-1 were
accepted (the drafter's cache discipline makes it so; tests/test_mtp.py checks it), and draft k
only counts in that case.

Simulator: from start m (x_m the last accepted token), draft k is module k at position m - 1,
accepted when it equals the target's greedy token after x_{m+k-1} (`argmax[m+k-1]`) and drafts
< k were accepted. On the target's own greedy text (regen data) this is the engine's greedy
acceptance, without generating.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import head_rows
from specjax.drafters.mtp import MTP, MTPConfig, MTPWeights, save
from train.common import (
    chain_counts,
    chunked_argmax,
    chunked_soft_ce,
    draft_vocab,
    save_draft_vocab_if_any,
    shift_left,
    shift_right,
    simulate_store,
)


def mtp_hidden(net: MTP, embed: jax.Array, tokens: jax.Array, final: jax.Array, depth: int) -> list[jax.Array]:
    """tokens `[B, T]`, final `[B, T, D]` (target's final normed hidden) -> outputs h^k `[B, T, D]`
    of modules 1..depth at every position (module k reading x_{i+k}; positions with i + k >= T
    read a repeated last token and are masked by the callers)."""
    b, t = tokens.shape
    cos, sin = net.rope(jnp.broadcast_to(jnp.arange(t)[None], (b, t)))  # [B, T, H] each
    cache = net.new_cache(depth, b, t)  # fresh: each module's attention is plain causal attention
    h, outs = final, []
    for k in range(1, depth + 1):
        emb = jnp.take(embed, shift_left(tokens, k), axis=0)  # [B, T, D]: x_{i+k}
        h, cache = net.run(k, emb, h, cache, cos, sin, fresh=True)  # [B, T, D]
        outs.append(h)
    return outs


def mtp_loss(
    net: MTP, batch: dict, embed: jax.Array, head: jax.Array, weights, chunk: int = 32, positions: int | None = None
):
    """batch: `tokens [B, T]`, `mask [B, T]` (response tokens), `final [B, T, D]`. `positions`: see
    `chunked_soft_ce`. Returns (weighted mean soft CE, metrics with per-depth CE and top-1 agreement)."""
    tokens, mask, final = batch["tokens"], batch["mask"], batch["final"]
    t = tokens.shape[1]
    depth = len(weights)
    outs = mtp_hidden(net, embed, tokens, final, depth)
    # Align depth k's output at i with its label position p = i + k.
    draft = jnp.stack([shift_right(net.heads[k - 1].head_input(h), k) for k, h in enumerate(outs, 1)])  # [N, B, T, D]
    p = jnp.arange(t)
    # label p is trained when module k had a position (p >= k) and predicts a response token x_{p+1}
    predicted_is_response = shift_left(mask) & (p < t - 1)[None]  # [B, T]
    valid = jnp.stack([predicted_is_response & (p >= k)[None] for k in range(1, depth + 1)])  # [N, B, T]
    ce, hits = chunked_soft_ce(draft, final, head, valid, chunk, positions)  # [N] each
    count = jnp.maximum(valid.sum(axis=(1, 2)), 1)  # [N]
    w = jnp.asarray(weights, jnp.float32)
    per_depth = ce / count
    metrics = {f"ce_depth{k}": per_depth[k - 1] for k in range(1, depth + 1)}
    metrics.update({f"top1_depth{k}": (hits / count)[k - 1] for k in range(1, depth + 1)})
    return jnp.sum(w * per_depth) / jnp.sum(w), metrics


def simulate_acceptance(net: MTP, batch: dict, embed: jax.Array, head: jax.Array, k: int, chunk: int = 32, d2t=None):
    """Greedy acceptance of K drafts from every start m, teacher forced (see the module docstring).
    With a draft vocabulary `d2t [N]`, `head` holds its rows `[N, D]` (what the drafter proposes
    from). Returns accepted counts `[B, T]` and the valid-start mask `[B, T]`."""
    tokens, mask, target_next = batch["tokens"], batch["mask"], batch["argmax"]  # [B, T] each
    t = tokens.shape[1]
    outs = mtp_hidden(net, embed, tokens, batch["final"], k)
    greedy = chunked_argmax(
        jnp.stack([net.heads[j].head_input(h) for j, h in enumerate(outs)]), head, chunk, d2t
    )  # [K, B, T] target ids
    # draft j from start m: module j at m - 1 vs the target's greedy token after x_{m+j-1}
    hits = [shift_right(greedy[j - 1], 1) == shift_left(target_next, j - 1) for j in range(1, k + 1)]
    m = jnp.arange(t)
    starts = mask & ((m >= 1) & (m + k - 1 < t))[None]  # x_m is a response token; all checks exist
    return chain_counts(hits), starts


class MTPTask:
    """MTP heads as a training task for `train.loop.fit` (see there for the interface)."""

    batch_axes = {"tokens": 0, "mask": 0, "argmax": 0, "final": 0}

    @staticmethod
    def feature_layers(target, target_layers=None) -> tuple[int, ...]:
        return ()  # reads the final hidden state only

    def __init__(
        self,
        target,
        counts=None,
        num_modules: int = 3,
        intermediate_size: int | None = None,
        depth_weights: list[float] | None = None,
        decay: float = 0.8,
        eval_k: int | None = None,
        loss_chunk: int = 32,
        loss_positions: int | None = None,
        draft_vocab_size: int = 0,
    ):
        self.cfg = MTPConfig.for_target(target.config, num_modules, intermediate_size)
        self.weights = list(depth_weights) if depth_weights else [decay**j for j in range(num_modules)]
        if len(self.weights) != num_modules:
            raise ValueError(f"depth_weights has {len(self.weights)} entries for {num_modules} modules")
        self.eval_k = eval_k or num_modules
        if not 1 <= self.eval_k <= num_modules:
            raise ValueError(f"eval_k must be 1..num_modules ({num_modules}), got {self.eval_k}")
        self.chunk, self.positions = loss_chunk, loss_positions
        m = target.module()
        self.embed, self.head = m.embed[...], m.head_weight()  # frozen target tables
        self.d2t = draft_vocab(counts, draft_vocab_size, target.config.vocab_size)
        self.graphdef, _ = nnx.split(nnx.eval_shape(lambda: MTP(self.cfg, rngs=nnx.Rngs(0))))

    def init_params(self, seed: int):
        self.graphdef, params = nnx.split(MTP(self.cfg, rngs=nnx.Rngs(seed)))
        return params

    def net(self, params) -> MTP:
        return nnx.merge(self.graphdef, params)

    def frozen(self) -> dict:
        """Target tables the loss reads but never trains (jit arguments, not baked-in constants)."""
        return {"embed": self.embed, "head": self.head, "rows": head_rows(self.head, self.d2t), "d2t": self.d2t}

    def loss(self, params, frozen, batch):
        return mtp_loss(
            self.net(params), batch, frozen["embed"], frozen["head"], self.weights, self.chunk, self.positions
        )

    def evaluate(self, params, store, max_rows: int = 64, batch_size: int = 8) -> dict:
        """Simulated greedy MAL and per-position acceptance (K = eval_k) on held-out rows."""
        k = self.eval_k
        if not hasattr(self, "_sim"):
            self._sim = jax.jit(
                lambda p, f, b: simulate_acceptance(self.net(p), b, f["embed"], f["rows"], k, self.chunk, f["d2t"])
            )
        return simulate_store(
            self._sim, params, self.frozen(), store, ("tokens", "mask", "argmax", "final"), k, max_rows, batch_size
        )

    def export(self, params, out_dir: str, dtype=None, metadata=None) -> str:
        save(MTPWeights(self.cfg, self.graphdef, params), out_dir, dtype, metadata)
        return save_draft_vocab_if_any(out_dir, self.d2t)
