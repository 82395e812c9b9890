"""DFlash drafter (z-lab, arXiv 2602.06036): a block of drafts from one forward pass.

A small stack of decoder layers reads fused target features and drafts a whole block at once:

* **context**: per committed position t the target's hidden states of `target_layers` (decoder
  layer outputs) are concatenated `[n D]`, projected by `fc` and normed (`hidden_norm`) to the
  context feature c_t `[D]`. In every drafter layer, c_t goes through that layer's own k/v
  projections (and k norm, rope at t) into the drafter's KV cache ("KV injection"): the context
  never runs through the layers themselves.
* **block**: from the accepted prefix x_0..x_m (the target has features for t <= m - 1), the block
  is the target's embedding of `[x_m, MASK x K]` at positions m .. m + K. Its queries, keys and
  values come from the block; it attends to the whole cached context and to itself without a
  causal mask. After the final norm, the target's LM head scores positions 1..K: K drafts.

Nothing of the block is kept: `propose` reads the cache only. `commit` writes the context entries
of the verify pass's positions old_m .. old_m + K (only the accepted ones count: lengths become
the new m, as the target's cache rolls back). The drafts are deterministic at temperature 0 and
drawn from the draft distribution q otherwise: lossless under rejection sampling either way.

The block holds K + 1 positions, so a model trained on blocks of `block_size` drafts up to
`block_size - 1` tokens (fewer: a shorter block, as the reference does near the end of a reply).

Token trees (`--tree-topk k --tree-depth D`): the block's top-1 tokens are the tree's spine, and
the best of the other k - 1 candidates at each position hang off the spine node before it (scored
by the spine's log-probability up to there plus their own; `num_draft` nodes in all). The block
drafts every position from the same pass, so an alternative gets no children: it adds one token
where the spine breaks. Candidates are deterministic (q = None, the one-hot scheme).
Embedding and head are the target's; a drafter may restrict the head to a draft vocabulary
(`d2t`, as EAGLE-3 does) to cut the head's cost. Published z-lab checkpoints: dflash_formats.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.drafters import checkpoint
from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext, draft_token, head_rows
from specjax.errors import DrafterError
from specjax.models.config import LlamaConfig
from specjax.models.kv_cache import KVCache, KVUpdate
from specjax.models.llama import DecoderLayer, RMSNorm, linear, rope_tables

KIND = "dflash"


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    layers: LlamaConfig  # the drafter's decoder stack (num_layers of them; vocab_size = the target's V)
    target_layers: tuple[int, ...]  # 0-based target decoder-layer outputs it reads (default_target_layers)
    target_num_layers: int  # L of the target it was trained for
    block_size: int  # positions of a trained block: the anchor + block_size - 1 drafts
    mask_token_id: int  # the target token whose embedding fills the block after the anchor
    draft_vocab_size: int = 0  # N rows of the head it drafts from (0: the whole vocabulary)
    embed_scale: float = 1.0  # block embeddings are the target's times this
    logit_scale: float = 1.0  # draft logits are the head's times this
    logit_softcap: float = 0.0  # > 0: logits = softcap * tanh(logits / softcap)

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def max_num_draft(self) -> int:
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"drafter": KIND, **d, "layers": self.layers.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "DFlashConfig":
        kw = checkpoint.config_fields(cls, d, source, "DFlash")
        try:
            layers = dict(kw["layers"])
            if layers.get("rope_scaling") is not None:
                layers["rope_scaling"] = tuple(layers["rope_scaling"])
            layers["eos_token_ids"] = tuple(layers.get("eos_token_ids") or ())
            kw["layers"] = LlamaConfig(**layers)
        except (TypeError, ValueError) as e:
            raise DrafterError(f"{source}: malformed 'layers' of the DFlash config ({e})") from None
        kw["target_layers"] = tuple(int(x) for x in kw["target_layers"])
        return cls(**kw)

    def check(self, source: str) -> None:
        """One-line errors for configs that cannot draft."""
        if self.block_size < 2:
            raise DrafterError(f"{source}: block_size must be >= 2 (an anchor and one draft), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise DrafterError(
                f"{source}: mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.layers.vocab_size})"
            )
        if not self.target_layers:
            raise DrafterError(f"{source}: names no target layers")

    def check_target(self, target: LlamaConfig, source: str) -> None:
        pairs = [
            ("hidden size", self.hidden_size, target.hidden_size),
            ("vocab size", self.layers.vocab_size, target.vocab_size),
        ]
        if self.target_num_layers:
            pairs.append(("layer count", self.target_num_layers, target.num_layers))
        checkpoint.check_target(pairs, source)
        if max(self.target_layers) >= target.num_layers:
            raise DrafterError(
                f"{source} reads target layer {max(self.target_layers)}, but the target has {target.num_layers} layers"
            )


def default_target_layers(target_num_layers: int, num_layers: int) -> tuple[int, ...]:
    """One target layer per drafter layer, evenly spaced from layer 1 to L - 3 (the middle one
    for a one-layer drafter): the reference's default, in the same layer-output ids."""
    if num_layers == 1:
        return (target_num_layers // 2,)
    lo, hi = 1, target_num_layers - 3
    return tuple(int(round(lo + i * (hi - lo) / (num_layers - 1))) for i in range(num_layers))


class DFlash(nnx.Module):
    """The drafter network. Shapes: D hidden, n = len(target_layers)."""

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        lc, d, n = cfg.layers, cfg.hidden_size, len(cfg.target_layers)
        self.fc = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (d, n * d), dtype))  # [D, nD]
        self.hidden_norm = RMSNorm(d, lc.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(lc, rngs=rngs, dtype=dtype) for _ in range(lc.num_layers)])
        self.norm = RMSNorm(d, lc.rms_norm_eps, dtype=dtype)

    def context(self, feats: jax.Array) -> jax.Array:
        """Target hidden states `[n, B, T, D]` -> context features `[B, T, D]`."""
        x = jnp.concatenate(list(feats), axis=-1).astype(self.fc[...].dtype)  # [B, T, nD]
        return self.hidden_norm(linear(self.fc[...], x))  # [B, T, D]

    def context_kv(self, ctx: jax.Array, positions: jax.Array) -> KVUpdate:
        """Context features `[B, T, D]` at rope `positions [B, T]` -> every layer's keys and values
        of them (`[B, T, KV, H]` each), through that layer's own projections."""
        cos, sin = rope_tables(self.cfg.layers, positions)  # [B, T, H] each
        kvs = [layer.attn.project(ctx, cos, sin, queries=False)[1:] for layer in self.layers]  # (k, v) [B, T, KV, H]
        return KVUpdate(tuple(k for k, _ in kvs), tuple(v for _, v in kvs))

    def block(self, emb: jax.Array, cache: KVCache, positions: jax.Array) -> jax.Array:
        """Block embeddings `[B, T, D]` at `positions [B, T]`, attending to each row's first
        `cache.lengths` context entries and to the whole block (read-only) -> normed hidden `[B, T, D]`."""
        b, t, _ = emb.shape
        cos, sin = rope_tables(self.cfg.layers, positions)  # [B, T, H] each
        full = jnp.ones((b, t, t), bool)  # [B, T, T] non-causal within the block
        x = emb
        for layer, k_l, v_l in zip(self.layers, cache.k, cache.v, strict=True):
            x, _, _ = layer.attend(x, cos, sin, k_l, v_l, cache.lengths, full)  # [B, T, D]
        return self.norm(x)

    def logits(self, head: jax.Array, h: jax.Array) -> jax.Array:
        """Normed hidden `[..., D]` and head rows `[N, D]` -> f32 logits `[..., N]`."""
        y = linear(head, h, jnp.float32) * self.cfg.logit_scale  # [..., N]
        cap = self.cfg.logit_softcap
        return cap * jnp.tanh(y / cap) if cap > 0 else y

    def new_cache(self, batch: int, size: int) -> KVCache:
        """An empty context cache: L x `[B*KV, S, H]` keys and values, lengths 0."""
        lc = self.cfg.layers
        return KVCache.create(lc.num_layers, batch, size, lc.num_kv_heads, lc.head_dim, self.fc[...].dtype)


@dataclasses.dataclass
class DFlashWeights:
    config: DFlashConfig
    graphdef: Any
    params: Any  # nnx.State
    d2t: jax.Array | None  # [N] int32 target ids of the draft vocabulary; None: the whole vocabulary
    source: str = ""

    def module(self) -> DFlash:
        return nnx.merge(self.graphdef, self.params)


def init_weights(
    cfg: DFlashConfig, d2t: np.ndarray | None = None, seed: int = 0, dtype=jnp.float32, net_class=None
) -> DFlashWeights:
    """Random weights of a `net_class` network (default DFlash) with the draft map `d2t [N]` or None."""
    cfg.check("DFlash config")
    graphdef, params = nnx.split((net_class or DFlash)(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
    return DFlashWeights(cfg, graphdef, params, None if d2t is None else jnp.asarray(d2t, jnp.int32), "random")


def save(w: DFlashWeights, out_dir: str, dtype=None, metadata: dict | None = None) -> str:
    """`config.json` + `model.safetensors` (params, optionally cast, and `d2t` when restricted)."""
    extra = {} if w.d2t is None else {"d2t": np.asarray(w.d2t, np.int32)}
    return checkpoint.save(out_dir, w.config.to_dict(), w.params, extra=extra, dtype=dtype, metadata=metadata)


def load(path: str, dtype=jnp.float32) -> DFlashWeights:
    """A drafter directory written by `save`; one-line errors for bad input."""
    raw = checkpoint.read_config(path, KIND, "DFlash")
    cfg = DFlashConfig.from_dict(raw, f"{path}/{checkpoint.CONFIG_FILE}")
    arrays = checkpoint.read_tensors(path, "DFlash")
    return build_weights(cfg, arrays, arrays.pop("d2t", None), f"{path}/{checkpoint.WEIGHTS_FILE}", dtype)


def build_weights(cfg: DFlashConfig, arrays: dict, d2t, source: str, dtype, net_class=None) -> DFlashWeights:
    """Weights of a `net_class` network (default DFlash) from params by NNX path and an optional
    draft vocabulary map, all checked."""
    cfg.check(source)
    v, n = cfg.layers.vocab_size, cfg.draft_vocab_size
    if n:
        d2t = None if d2t is None else np.asarray(d2t)
        if d2t is None or d2t.shape != (n,) or d2t.min() < 0 or d2t.max() >= v or len(np.unique(d2t)) != n:
            raise DrafterError(f"{source}: the draft vocabulary map must hold {n} distinct target ids in [0, {v})")
    elif d2t is not None:
        raise DrafterError(f"{source}: a draft vocabulary map ('d2t') but no draft_vocab_size in the config")
    net_class = net_class or DFlash
    graphdef, params = checkpoint.fill(lambda: net_class(cfg, rngs=nnx.Rngs(0), dtype=dtype), arrays, source, dtype)
    return DFlashWeights(cfg, graphdef, params, None if d2t is None else jnp.asarray(d2t, jnp.int32), source)


@struct.dataclass
class DFlashState:
    cache: KVCache  # every layer's context entries; lengths = m = hist_len - 1 after every commit


class DFlashDrafter(Drafter):
    """Block drafting: K drafts from one drafter pass over `[x_m, MASK x K]`, K < block_size."""

    name = KIND
    narrow_commit = True  # commit writes the context entries of the positions it is given, any count
    proposal_optional = True  # propose reads the cache only
    lazy_commit = True  # so a deferred catch-up is one commit over the positions it missed

    def __init__(self, num_draft: int, weights: DFlashWeights, target):
        super().__init__(num_draft)
        self.source = f"DFlash drafter {weights.source}".strip()
        weights.config.check_target(target.config, self.source)
        self.weights = weights
        self.target = target
        self.feature_layers = weights.config.target_layers

    def check_shape(self) -> None:
        most = self.weights.config.max_num_draft
        if self.accept_width > most:
            got = f"--tree-depth {self.tree_depth}" if self.tree_topk > 1 else f"--num-draft {self.num_draft}"
            raise DrafterError(
                f"{self.source} drafts blocks of {self.weights.config.block_size} positions, so "
                f"1..{most} tokens per step; got {got}"
            )

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return topk * depth  # the spine and k - 1 alternatives at each of its positions

    def default_tree_depth(self) -> int:
        return min(super().default_tree_depth(), self.weights.config.max_num_draft)

    def cache_key(self):
        return super().cache_key() + (id(self.weights),)

    def params(self):
        t = self.target.module()
        head = head_rows(t.head_weight(), self.weights.d2t)  # [N or V, D]
        return {"net": self.weights.params, "embed": t.embed[...], "head": head, "d2t": self.weights.d2t}

    def _net(self, dparams) -> DFlash:
        return nnx.merge(self.weights.graphdef, dparams["net"])

    def init(self, dparams, ctx: InitContext) -> DFlashState:
        net = self._net(dparams)
        b, t = ctx.prompt.shape
        pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))  # [B, T]
        cache = net.new_cache(b, ctx.cache_size).write(net.context_kv(net.context(ctx.features), pos))
        return DFlashState(cache.with_lengths(ctx.prompt_len))  # padding past the prompt: never read

    def block_hidden(self, dparams, st: DFlashState, history: jax.Array, hist_len: jax.Array, width: int) -> jax.Array:
        """The normed hidden `[B, width, D]` of the block `[x_m, MASK x (width - 1)]` at positions
        m .. m + width - 1 after each row's last emitted token x_m."""
        net = self._net(dparams)
        b = history.shape[0]
        m = st.cache.lengths  # [B] = hist_len - 1
        last = jnp.take_along_axis(history, (hist_len - 1)[:, None], axis=1)  # [B, 1]
        block = jnp.concatenate(
            [last, jnp.full((b, width - 1), self.weights.config.mask_token_id, last.dtype)], axis=1
        )  # [B, width]
        emb = jnp.take(dparams["embed"], block, axis=0) * self.weights.config.embed_scale  # [B, width, D]
        return net.block(emb.astype(net.fc[...].dtype), st.cache, m[:, None] + jnp.arange(width)[None])

    def block_logits(self, dparams, st: DFlashState, history: jax.Array, hist_len: jax.Array) -> jax.Array:
        """The draft logits `[B, K, N]` of the block after each row's last emitted token (K: the
        chain's drafts, or a tree's depth): positions 1..K of a K + 1 block."""
        k = self.accept_width
        h = self.block_hidden(dparams, st, history, hist_len, k + 1)  # [B, K+1, D]
        return self._net(dparams).logits(dparams["head"], h[:, 1:])  # [B, K, N]

    def propose(self, dparams, st: DFlashState, ctx: StepContext):
        logits = self.block_logits(dparams, st, ctx.history, ctx.hist_len)  # [B, K, N]
        if self.tree_topk > 1:
            return self._tree(dparams, logits), st
        drafts, qs = zip(
            *(
                draft_token(
                    ctx.seeds,
                    i,
                    logits[:, i],
                    dparams["d2t"],
                    self.target.config.vocab_size,
                    ctx.sampling,
                    ctx.all_greedy,
                )
                for i in range(self.num_draft)
            ),
            strict=True,
        )
        draft = jnp.stack(drafts, axis=1).astype(jnp.int32)  # [B, K]
        q = None if ctx.all_greedy else jnp.stack(qs, axis=1)  # [B, K, V]
        return Proposal(draft, q), st

    def _tree(self, dparams, logits: jax.Array) -> Proposal:
        """Block logits `[B, D, N]` -> the spine tree of `num_draft` nodes: nodes 0..D-1 the spine
        (a chain), then the chosen alternatives in depth order, each a child of the spine node
        above it."""
        b, depth, _ = logits.shape
        k, n_alt = self.tree_topk, self.num_draft - depth
        top, idx = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, D, k]
        tok = idx if dparams["d2t"] is None else jnp.take(dparams["d2t"], idx)  # [B, D, k] target ids
        above = jnp.cumsum(top[:, :, 0], axis=1) - top[:, :, 0]  # [B, D] spine log-prob before depth d
        score = (above[:, :, None] + top[:, :, 1:]).reshape(b, depth * (k - 1))  # [B, D (k-1)]
        pick = jnp.sort(jax.lax.top_k(score, n_alt)[1], axis=1)  # [B, n_alt] depth-major: level order
        d_alt = pick // (k - 1)  # [B, n_alt]
        alt = jnp.take_along_axis(tok.reshape(b, depth * k), d_alt * k + pick % (k - 1) + 1, axis=1)  # [B, n_alt]
        tokens = jnp.concatenate([tok[:, :, 0], alt], axis=1).astype(jnp.int32)  # [B, num_draft]
        spine_par = jnp.broadcast_to(jnp.arange(depth, dtype=jnp.int32)[None] - 1, (b, depth))  # [B, D]
        parents = jnp.concatenate([spine_par, (d_alt - 1).astype(jnp.int32)], axis=1)  # [B, num_draft]
        return Proposal(tokens, None, parents=parents)

    def commit(self, dparams, st: DFlashState, ctx: CommitContext) -> DFlashState:
        net = self._net(dparams)
        w = ctx.tokens.shape[1]  # K + 1 (1 after a plain step)
        pos = st.cache.lengths[:, None] + jnp.arange(w)[None]  # [B, W]: old m + j
        cache = st.cache.write(net.context_kv(net.context(ctx.features), pos))
        return DFlashState(cache.with_lengths(ctx.hist_len - 1))
