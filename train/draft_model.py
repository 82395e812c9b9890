"""A small draft model distilled from its target: a few Llama layers of the target's width that
borrow the target's embedding and LM head (frozen; see specjax/drafters/draft_model.py).

Initialisation: the target's embedding, first `num_layers` decoder layers and final norm
(`truncate_layers`): the truncated target already predicts the next token far better than a
random network, so distillation starts from a useful draft. Only the layers and the final norm
are trained; the tables arrive through `frozen()`, as jit arguments.

Loss: soft cross-entropy (= KL up to the target's entropy, a constant) from the draft's
next-token distribution at every position to the target's full-vocabulary distribution there,
`softmax(head(final))` from the FeatureStore, on positions whose next token is a response token.
The sequence is processed in chunks (train/common.py) so `[B, T, V]` logits never exist whole.

Simulator: from start m (x_m the last accepted token) the draft chain is the draft's greedy
token at m, m + 1, ... teacher forced; draft i is accepted when it equals the target's greedy
token at m + i - 1 (`argmax`) and drafts < i were accepted, exactly the engine's greedy acceptance
on the target's own greedy text (regen data).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import head_rows
from specjax.models.llama import Llama
from train.common import (
    chain_counts,
    chunked_argmax,
    chunked_soft_ce,
    draft_vocab,
    save_draft_vocab_if_any,
    shift_left,
    simulate_store,
)

# Target tables: embedding and (untied) LM head. Everything else is the draft's own.
TABLES = nnx.Any(nnx.PathContains("embed"), nnx.PathContains("lm_head"))


def draft_hidden(model: Llama, tokens: jax.Array) -> jax.Array:
    """Teacher-forced causal pass: tokens `[B, T]` -> final normed hidden `[B, T, D]`."""
    h, _, _ = model.hidden(tokens, model.new_cache(tokens.shape[0], tokens.shape[1]), fresh=True)
    return h


def distill_loss(model: Llama, batch: dict, head: jax.Array, chunk: int = 32, positions: int | None = None):
    """batch: `tokens [B, T]`, `mask [B, T]` (response tokens), `final [B, T, D]`. `positions`: see
    `chunked_soft_ce`. Returns (mean soft CE, metrics)."""
    tokens, mask, final = batch["tokens"], batch["mask"], batch["final"]
    t = tokens.shape[1]
    valid = shift_left(mask) & (jnp.arange(t) < t - 1)[None]  # [B, T]: x_{t+1} is a response token
    h = draft_hidden(model, tokens)  # [B, T, D]
    ce, hits = chunked_soft_ce(h[None], final, head, valid[None], chunk, positions)  # [1] each
    count = jnp.maximum(valid.sum(), 1)
    return ce[0] / count, {"top1": hits[0] / count}


def simulate_acceptance(model: Llama, batch: dict, head: jax.Array, k: int, chunk: int = 32, d2t=None):
    """Greedy chain acceptance of K drafts from every start m (see the module docstring). With a
    draft vocabulary `d2t [N]`, `head` holds its rows `[N, D]` (what the drafter proposes from).
    Returns accepted counts `[B, T]` and the valid-start mask `[B, T]`."""
    tokens, mask, target_next = batch["tokens"], batch["mask"], batch["argmax"]  # [B, T] each
    t = tokens.shape[1]
    greedy = chunked_argmax(draft_hidden(model, tokens)[None], head, chunk, d2t)[0]  # [B, T] target ids
    right = greedy == target_next  # [B, T]: the draft's token after x_p is the target's
    hits = [shift_left(right, i) for i in range(k)]  # draft i + 1 from start m: position m + i
    starts = mask & (jnp.arange(t) + k - 1 < t)[None]
    return chain_counts(hits), starts


class DraftDistillTask:
    """Draft-model distillation as a training task for `train.loop.fit`."""

    batch_axes = {"tokens": 0, "mask": 0, "argmax": 0, "final": 0}

    @staticmethod
    def feature_layers(target, target_layers=None) -> tuple[int, ...]:
        return ()  # reads the final hidden state only

    def __init__(
        self,
        target,
        counts=None,
        num_layers: int = 3,
        eval_k: int = 5,
        loss_chunk: int = 32,
        loss_positions: int | None = None,
        draft_vocab_size: int = 0,
    ):
        from specjax.models.loading.export import truncate_layers

        if not 1 <= num_layers <= target.config.num_layers:
            raise ValueError(f"num_layers must be 1..{target.config.num_layers}, got {num_layers}")
        self.target, self.eval_k, self.chunk, self.positions = target, eval_k, loss_chunk, loss_positions
        small = truncate_layers(target, num_layers)  # [embed, first layers, final norm, head]
        self.cfg = small.config
        self.graphdef, _, self._init = nnx.split(small.module(), TABLES, ...)
        # the target's own arrays (truncate_layers copied them): no second embedding in memory
        _, self.tables, _ = nnx.split(target.module(), TABLES, ...)
        self.head = target.module().head_weight()
        self.d2t = draft_vocab(counts, draft_vocab_size, target.config.vocab_size)

    def init_params(self, seed: int):
        """The truncated target's layers and final norm (deterministic; `seed` is unused). A copy:
        training donates its params."""
        return jax.tree.map(jnp.copy, self._init)

    def model(self, params, frozen) -> Llama:
        return nnx.merge(self.graphdef, frozen["tables"], params)

    def frozen(self) -> dict:
        """Target tables the loss reads but never trains (jit arguments, not baked-in constants);
        `rows`: the head rows drafts are chosen from (all of them without a draft vocabulary)."""
        return {"tables": self.tables, "head": self.head, "rows": head_rows(self.head, self.d2t), "d2t": self.d2t}

    def loss(self, params, frozen, batch):
        return distill_loss(self.model(params, frozen), batch, frozen["head"], self.chunk, self.positions)

    def evaluate(self, params, store, max_rows: int = 64, batch_size: int = 8) -> dict:
        """Simulated greedy MAL and per-position acceptance (K = eval_k) on held-out rows."""
        k = self.eval_k
        if not hasattr(self, "_sim"):
            self._sim = jax.jit(
                lambda p, f, b: simulate_acceptance(self.model(p, f), b, f["rows"], k, self.chunk, f["d2t"])
            )
        return simulate_store(
            self._sim, params, self.frozen(), store, ("tokens", "mask", "argmax", "final"), k, max_rows, batch_size
        )

    def export(self, params, out_dir: str, dtype=None, metadata=None) -> str:
        """An HF directory of the layers and final norm only (`--drafter draft:out_dir`)."""
        import numpy as np

        from specjax.drafters.draft_model import save_with_target_tables

        pure = jax.tree.map(np.asarray, nnx.to_pure_dict(params))
        save_with_target_tables(pure, self.cfg, self.target.config, out_dir, dtype, metadata)
        return save_draft_vocab_if_any(out_dir, self.d2t)
