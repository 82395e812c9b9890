"""DSpark drafter (DeepSeek-AI + PKU, `deepseek-ai/DeepSpec`): DFlash's block backbone, every slot
a draft, a Markov head that makes the block's drafts sequential, and a confidence head.

Differences from DFlash (dflash.py, whose context, KV injection and commit it keeps):

* **The anchor slot drafts too.** The block is the target's embedding of `[x_m, MASK x (K - 1)]`
  at positions m .. m + K - 1, and slot j (0-based) drafts x_{m+j+1}: K drafts from K positions,
  K <= `block_size`.
* **Markov head.** Slot j's logits are the backbone's plus a low-rank bias from the token before
  it, `W2 W1[prev_j]` (`W1 [V, r]` over the target vocabulary, `W2 [N, r]` onto the draft
  vocabulary; prev_0 = x_m, prev_j = the draft of slot j - 1). Drafts are drawn left to right,
  so draft j's law q_j given the earlier drafts is exact: rejection sampling stays lossless.
* **Confidence head.** `c_j = sigmoid(w . [h_j; W1[prev_j]] + b)`, the head's estimate that draft
  j survives given the earlier ones did. It reads only what is known before draft j is drawn
  (the block's hidden state and the previous token), which is what keeps a verify length chosen
  from it lossless.
* **Confidence-scheduled verify length.** Under a speculation policy (which hands the drafter its
  measured step costs), each row verifies the prefix that maximises its expected emitted tokens
  per unit of step cost, E(L) / costs[L] with E(L) = 1 + sum_{j <= L} prod_{i <= j} c_i, scanning
  L = 0, 1, ... and stopping at the first L whose successor does not improve (`schedule`). Whether
  draft j is verified then depends only on c_1..c_j, known before draft j is drawn: a stopping
  time, so the output law is the target's. Taking the best L over the whole scan instead would
  let draft j's own value decide whether it is verified (through c_{j+1}), which biases the
  output (DSpark paper, Appendix A; tests/test_sampled_engine.py shows both). The engine verifies
  the shortest of `verify_lengths` that holds each row's L (rounding a stopping time up to a
  bucket keeps it one), and the row policy decides across the batch which rows verify at all.

Published checkpoints (vLLM `speculators`, SpecForge), in and out: dspark_formats.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import checkpoint, dflash
from specjax.drafters.base import Proposal, StepContext, draft_token
from specjax.drafters.dflash import DFlash, DFlashConfig, DFlashDrafter, DFlashState, DFlashWeights
from specjax.errors import DrafterError
from specjax.models.llama import linear

KIND = "dspark"


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256  # r of the Markov bias W2 W1[prev]; 0: none (DFlash's logits, every slot a draft)
    confidence: bool = True  # a confidence head
    confidence_with_markov: bool = True  # the confidence head also reads W1[prev]
    own_head: bool = False  # the drafter stores its head rows (speculators' reduced-vocabulary lm_head)
    # Per-slot temperatures of the confidence logits (sequential temperature scaling, fitted on
    # held-out replies by `specjax train dspark`; train/dspark.py); () = the head as trained.
    confidence_temperatures: tuple[float, ...] = ()

    @property
    def max_num_draft(self) -> int:
        return self.block_size

    @property
    def head_size(self) -> int:
        return self.draft_vocab_size or self.layers.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "drafter": KIND}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "DSparkConfig":
        cfg = super().from_dict(d, source)
        try:
            temps = tuple(float(t) for t in cfg.confidence_temperatures)
        except (TypeError, ValueError):
            raise DrafterError(f"{source}: confidence_temperatures must be a list of numbers") from None
        return dataclasses.replace(cfg, confidence_temperatures=temps)

    def check(self, source: str) -> None:
        super().check(source)
        if self.markov_rank < 0:
            raise DrafterError(f"{source}: markov_rank must be >= 0, got {self.markov_rank}")
        if self.confidence and self.confidence_with_markov and not self.markov_rank:
            raise DrafterError(f"{source}: a confidence head that reads the Markov embedding needs markov_rank > 0")
        temps = self.confidence_temperatures
        if temps and (len(temps) != self.block_size or min(temps) <= 0):
            raise DrafterError(
                f"{source}: confidence_temperatures must be {self.block_size} positive numbers "
                f"(one per slot), got {temps}"
            )


class DSpark(DFlash):
    """DFlash's network plus the Markov and confidence heads. Shapes: D hidden, r rank, N head rows."""

    def __init__(self, cfg: DSparkConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        super().__init__(cfg, rngs=rngs, dtype=dtype)
        d, r, v = cfg.hidden_size, cfg.markov_rank, cfg.layers.vocab_size
        init = nnx.initializers.normal(0.01)
        if r:
            self.markov_w1 = nnx.Param(init(rngs.params(), (v, r), dtype))  # [V, r]
            self.markov_w2 = nnx.Param(init(rngs.params(), (cfg.head_size, r), dtype))  # [N, r]
        if cfg.confidence:
            width = d + (r if cfg.confidence_with_markov else 0)
            self.conf_w = nnx.Param(init(rngs.params(), (1, width), dtype))  # [1, D (+ r)]
            self.conf_b = nnx.Param(jnp.zeros((1,), dtype))  # [1]
        if cfg.own_head:
            self.head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.head_size, d), dtype))  # [N, D]

    def prev_embed(self, prev: jax.Array) -> jax.Array | None:
        """Previous tokens `[...]` (target ids) -> `W1[prev]` `[..., r]` (None without a Markov head)."""
        return jnp.take(self.markov_w1[...], prev, axis=0) if self.cfg.markov_rank else None

    def markov_bias(self, e: jax.Array | None) -> jax.Array | float:
        """`W1[prev]` `[..., r]` -> the logit bias `[..., N]` (0 without a Markov head)."""
        return 0.0 if e is None else linear(self.markov_w2[...], e, jnp.float32)

    def confidence_logit(self, h: jax.Array, e: jax.Array | None) -> jax.Array:
        """Block hidden `[..., D]` and `W1[prev]` `[..., r]` -> the confidence head's logit `[...]`."""
        x = jnp.concatenate([h, e], axis=-1) if self.cfg.confidence_with_markov else h  # [..., D (+ r)]
        return linear(self.conf_w[...], x, jnp.float32)[..., 0] + self.conf_b[...][0]

    def confidence(self, h: jax.Array, e: jax.Array | None, slot: int) -> jax.Array:
        """P(draft `slot` survives | the earlier ones did) `[...]`, with the slot's calibrated
        temperature (1 without a confidence head)."""
        if not self.cfg.confidence:
            return jnp.ones(h.shape[:-1], jnp.float32)
        temps = self.cfg.confidence_temperatures
        return jax.nn.sigmoid(self.confidence_logit(h, e) / (temps[slot] if temps else 1.0))


def init_weights(cfg: DSparkConfig, d2t: np.ndarray | None = None, seed: int = 0, dtype=jnp.float32) -> DFlashWeights:
    """Random DSpark weights (`dflash.init_weights` of a `DSpark` network), `d2t [N]` or None."""
    return dflash.init_weights(cfg, d2t, seed, dtype, net_class=DSpark)


def load(path: str, dtype=jnp.float32) -> DFlashWeights:
    """A DSpark drafter from a specjax directory (`save` of dflash.py)."""
    raw = checkpoint.read_config(path, KIND, "DSpark")
    cfg = DSparkConfig.from_dict(raw, f"{path}/{checkpoint.CONFIG_FILE}")
    arrays = checkpoint.read_tensors(path, "DSpark")
    return build_weights(cfg, arrays, arrays.pop("d2t", None), f"{path}/{checkpoint.WEIGHTS_FILE}", dtype)


def build_weights(cfg: DSparkConfig, arrays: dict, d2t, source: str, dtype) -> DFlashWeights:
    """`dflash.build_weights` of a `DSpark` network: params by NNX path, checked."""
    return dflash.build_weights(cfg, arrays, d2t, source, dtype, net_class=DSpark)


class DSparkDrafter(DFlashDrafter):
    """K <= block_size sequential drafts from one backbone pass over `[x_m, MASK x (K - 1)]`."""

    name = KIND

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return 0  # the Markov head makes each draft depend on the one before: chains

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        k = self.num_draft
        return tuple(sorted({1 << i for i in range(k.bit_length()) if 1 << i < k} | {k})) if k else ()

    def params(self):
        p = super().params()
        return {**p, "head": None} if self.weights.config.own_head else p  # its own rows: `net.head`

    def draft_chain(self, dparams, h: jax.Array, anchor: jax.Array, ctx: StepContext):
        """Block hidden `[B, K, D]`, anchor tokens `[B]` -> drafts `[B, K]`, q `[B, K, V]` (None when
        greedy), confidences `[B, K]`: slot j's logits get the Markov bias of the token before it."""
        net = self._net(dparams)
        base = net.logits(net.head[...] if self.weights.config.own_head else dparams["head"], h)  # [B, K, N]
        prev, drafts, qs, confs = anchor, [], [], []
        for j in range(self.num_draft):
            e = net.prev_embed(prev)  # [B, r]
            tok, q = draft_token(
                ctx.seeds,
                j,
                base[:, j] + net.markov_bias(e),
                dparams["d2t"],
                self.target.config.vocab_size,
                ctx.sampling,
                ctx.all_greedy,
            )  # [B], [B, V]
            confs.append(net.confidence(h[:, j], e, j))  # [B]
            drafts.append(tok)
            qs.append(q)
            prev = tok
        q = None if ctx.all_greedy else jnp.stack(qs, axis=1)  # [B, K, V]
        return jnp.stack(drafts, axis=1).astype(jnp.int32), q, jnp.stack(confs, axis=1)

    def propose(self, dparams, st: DFlashState, ctx: StepContext):
        h = self.block_hidden(dparams, st, ctx.history, ctx.hist_len, self.num_draft)  # [B, K, D]: all draft
        anchor = jnp.take_along_axis(ctx.history, (ctx.hist_len - 1)[:, None], axis=1)[:, 0]  # [B]
        draft, q, conf = self.draft_chain(dparams, h, anchor, ctx)
        if ctx.costs is None or not self.weights.config.confidence:
            return Proposal(draft, q), st
        want = self.schedule(conf, ctx.costs)  # [B]
        return Proposal(draft, q, active=want > 0, length=want), st

    @staticmethod
    def schedule(conf: jax.Array, costs: jax.Array) -> jax.Array:
        """Confidences `[B, K]` and step costs `[K + 1]` -> drafts each row verifies `[B]`: the
        first L (from 0) at which verifying one more draft does not raise the expected emitted
        tokens per unit of cost (module doc: the early stop that keeps it lossless)."""
        b, k = conf.shape
        expect = 1.0 + jnp.concatenate(
            [jnp.zeros((b, 1)), jnp.cumsum(jnp.cumprod(conf, axis=1), axis=1)], axis=1
        )  # [B, K+1] E(L) for L = 0..K
        rate = expect / costs[None, : k + 1]  # [B, K + 1]
        stop = rate[:, 1:] <= rate[:, :-1]  # [B, K]: L + 1 is no better than L
        return jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1), k).astype(jnp.int32)
