"""EAGLE-3 drafter (Li et al. 2025): one decoder layer over fused target features, chain drafting.

Per position t the drafter reads the target's hidden states at t from a low, a middle and a high
layer (`target_layers`), concatenates them `[3D]` and projects them to `[D]` (`fc`); with the
embedding of the next token x_{t+1} (the target's own embedding table, frozen) it runs one decoder
layer whose attention input is `[RMSNorm(embed) ; RMSNorm(feature)]` (width 2D) and whose
residual stream starts from the feature. The layer's output g_t goes through a final norm and a
draft LM head over a reduced vocabulary (the N most frequent target tokens; `d2t[i]` is the
target id of draft token i) to predict x_{t+2}.

Drafting K tokens from the accepted prefix x_0..x_m (the target has features for t <= m - 1):

* draft 1 comes from g_{m-1}, computed at commit time from real target features;
* draft i + 1 runs the layer at position m + i - 1 on `[embed(d_i) ; g_prev]`: the drafter's own
  output stands in for the target feature it does not have (EAGLE's feature feedback).

The drafter keeps its own one-layer KV cache. After verification, `commit` rewrites positions
old_m .. old_m + K from the verify pass's target features (only the n + 1 accepted ones count:
the cache length is set to the new m, so the rest is overwritten later, the same rollback as the
target's). Training (train/eagle3.py) unrolls exactly these steps ("training-time test"), so the
drafter learns to read its own features.

Tree drafting (dynamic_tree.py) replaces the K - 1 chain steps by batched steps over a token
tree (`step` takes positions and a tree mask); the cache and commit discipline stay the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallas_kernels.platform import target_platform
from specjax.drafters import checkpoint
from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext, draft_token
from specjax.drafters.dynamic_tree import dynamic_tree, tree_candidates
from specjax.errors import DrafterError
from specjax.models.config import LlamaConfig
from specjax.models.kv_cache import KVCache
from specjax.models.llama import MLP, Attention, RMSNorm, linear, rope_tables
from specjax.models.tree import chain_parents

KIND = "eagle3"


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # D (the target's)
    intermediate_size: int  # F of the drafter's layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_vocab_size: int  # V
    target_num_layers: int  # L of the target it was trained for (0: unknown, as in published drafters)
    draft_vocab_size: int  # N
    target_layers: tuple[int, ...]  # 0-based decoder layer outputs (default_target_layers)
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    # Published variants (eagle3_formats.py reads them from EAGLE/SpecForge and `speculators`):
    target_hidden_size: int | None = None  # Dt of the target when it differs from D (then an own embedding)
    attention_bias: bool = False  # q/k/v biases in the drafter's layer
    qk_norm: bool = False  # per-head q/k RMSNorm (a Qwen3-type layer)
    norm_before_residual: bool = False  # the residual stream starts from hidden_norm(feature)
    norm_before_fc: bool = False  # one RMSNorm over the concatenated target features [nDt] before fc
    norm_output: bool = False  # the fed-back output is norm(g) and the head reads it as is

    @classmethod
    def for_target(
        cls,
        target: LlamaConfig,
        draft_vocab_size: int = 8192,
        target_layers: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
    ):
        """A specjax EAGLE-3 for `target`: its layer shape, a draft vocabulary of at most
        `draft_vocab_size` tokens, `target_layers` (default `default_target_layers`) and an FFN of
        `intermediate_size` (default the target's)."""
        n = target.num_layers
        layers = tuple(target_layers) if target_layers else default_target_layers(n)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            target_vocab_size=target.vocab_size,
            target_num_layers=n,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            target_layers=layers,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            rms_norm_eps=target.rms_norm_eps,
        )

    @property
    def feature_size(self) -> int:  # Dt: width of one target hidden state
        return self.target_hidden_size or self.hidden_size

    def layer_config(self) -> LlamaConfig:
        """The drafter's single layer, described as a one-layer Llama (attention, MLP, rope)."""
        return LlamaConfig.single_layer(self, self.draft_vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"drafter": KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "Eagle3Config":
        kw = checkpoint.config_fields(cls, d, source, "EAGLE-3")
        kw["target_layers"] = tuple(int(x) for x in kw["target_layers"])
        if kw.get("rope_scaling") is not None:
            kw["rope_scaling"] = tuple(kw["rope_scaling"])
        return cls(**kw)

    def check_target(self, target: LlamaConfig, source: str = "EAGLE-3 drafter") -> None:
        """One clear error when the drafter was trained for another target."""
        pairs = [
            ("hidden size", self.feature_size, target.hidden_size),
            ("vocab size", self.target_vocab_size, target.vocab_size),
        ]
        if self.target_num_layers:  # 0: unknown (a published drafter names its target, not its depth)
            pairs.append(("layer count", self.target_num_layers, target.num_layers))
        checkpoint.check_target(pairs, source)
        if max(self.target_layers) >= target.num_layers:
            raise DrafterError(
                f"{source} reads target layer {max(self.target_layers)}, but the target has {target.num_layers} layers"
            )


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Outputs of layers 1, L/2 - 1 and L - 4: the hidden states EAGLE, SpecForge, SGLang and vLLM
    read by default (they name them as the inputs of layers 2, L/2 and L - 3)."""
    n = num_layers
    return (min(1, n - 1), max(n // 2 - 1, 0), max(n - 4, 0))


class Eagle3(nnx.Module):
    """The drafter network. Shapes: D hidden, Dt target hidden, n = len(target_layers), N draft vocab."""

    def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        lc = cfg.layer_config()
        d, n, dt = cfg.hidden_size, len(cfg.target_layers), cfg.feature_size
        init = nnx.initializers.normal(0.02)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n * dt, cfg.rms_norm_eps, dtype=dtype)
        self.fc = nnx.Param(init(rngs.params(), (d, n * dt), dtype))  # [D, nDt]
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.attn = Attention(lc, rngs=rngs, dtype=dtype, in_dim=2 * d)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(lc, rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.head = nnx.Param(init(rngs.params(), (cfg.draft_vocab_size, d), dtype))  # [N, D]

    def fuse(self, feats: jax.Array) -> jax.Array:
        """Target hidden states `[n, B, T, Dt]` -> projected feature `[B, T, D]`."""
        x = jnp.concatenate(list(feats), axis=-1).astype(self.fc[...].dtype)  # [B, T, nDt]
        if self.cfg.norm_before_fc:
            x = self.input_norm(x)  # [B, T, nDt]
        return linear(self.fc[...], x)

    def layer_input(self, emb: jax.Array, feat: jax.Array) -> jax.Array:
        """`[B, T, D]` twice -> the attention input `[B, T, 2D]`."""
        return jnp.concatenate([self.embed_norm(emb), self.hidden_norm(feat)], axis=-1)

    def finish(self, feat: jax.Array, attn_out: jax.Array) -> jax.Array:
        """Residual stream from the feature (or its norm): attention then MLP. Returns the output g
        `[B, T, D]` that is fed back as the next feature (normed when `norm_output`)."""
        h = (self.hidden_norm(feat) if self.cfg.norm_before_residual else feat) + attn_out  # [B, T, D]
        g = h + self.mlp(self.mlp_norm(h))  # [B, T, D]
        return self.norm(g) if self.cfg.norm_output else g

    def step(self, emb: jax.Array, feat: jax.Array, cache: KVCache, positions=None, mask=None, fresh: bool = False):
        """One pass of the drafter's layer over T positions written at `cache.lengths`.

        Args:
          emb: [B, T, D] embeddings of the next tokens.
          feat: [B, T, D] features (fused target features, or the drafter's own fed-back g).
          cache: the one-layer cache; lengths unchanged.
          positions: [B, T] rope positions (default lengths + t).
          mask: [B, T, T] attention among the new positions (default causal; a token tree: its
            ancestor mask).
          fresh: the cache is empty (written from position 0, not read; llama.attention).

        Returns:
          (g [B, T, D], the cache with the new positions written).
        """
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(emb.shape[1])[None]  # [B, T]
        cos, sin = rope_tables(self.cfg.layer_config(), positions)  # [B, T, H] each
        a, k, v = self.attn(
            self.layer_input(emb, feat), cos, sin, cache.k[0], cache.v[0], None if fresh else cache.lengths, mask
        )
        return self.finish(feat, a), cache.replace(k=(k,), v=(v,))

    def logits(self, g: jax.Array) -> jax.Array:
        """g `[..., D]` -> f32 draft-vocab logits `[..., N]`."""
        return linear(self.head[...], g if self.cfg.norm_output else self.norm(g), jnp.float32)

    def new_cache(self, batch: int, size: int) -> KVCache:
        """An empty one-layer cache: `[B*KV, S, H]` keys and values, lengths 0."""
        c = self.cfg
        return KVCache.create(1, batch, size, c.num_kv_heads, c.head_dim, self.fc[...].dtype)


@dataclasses.dataclass
class Eagle3Weights:
    """A loaded drafter: config, split module, and the draft -> target vocabulary map."""

    config: Eagle3Config
    graphdef: Any
    params: Any  # nnx.State
    d2t: jax.Array  # [N] int32 target ids of the draft vocabulary
    source: str = ""
    embed: jax.Array | None = None  # [V, D] an own token embedding; None: the target's (frozen) table

    def module(self) -> Eagle3:
        return nnx.merge(self.graphdef, self.params)


def init_weights(cfg: Eagle3Config, d2t: np.ndarray, seed: int = 0, dtype=jnp.float32) -> Eagle3Weights:
    """Random weights (the start of training) with the draft -> target map `d2t [N]`."""
    graphdef, params = nnx.split(Eagle3(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
    return Eagle3Weights(cfg, graphdef, params, jnp.asarray(d2t, jnp.int32), "random")


def save(w: Eagle3Weights, out_dir: str, dtype=None, metadata: dict | None = None) -> str:
    """Write `config.json` + `model.safetensors` (params, optionally cast, and `d2t`)."""
    extra = {"d2t": np.asarray(w.d2t, np.int32)}
    if w.embed is not None:
        extra["embed"] = np.asarray(jnp.asarray(w.embed, dtype) if dtype is not None else w.embed)
    return checkpoint.save(out_dir, w.config.to_dict(), w.params, extra=extra, dtype=dtype, metadata=metadata)


def load(path: str, dtype=jnp.float32) -> Eagle3Weights:
    """Load a drafter directory written by `save`; clear one-line errors for bad input."""
    raw = checkpoint.read_config(path, KIND, "EAGLE-3")
    cfg = Eagle3Config.from_dict(raw, f"{path}/{checkpoint.CONFIG_FILE}")
    arrays = checkpoint.read_tensors(path, "EAGLE-3")
    w_path = f"{path}/{checkpoint.WEIGHTS_FILE}"
    d2t = arrays.pop("d2t", None)
    if d2t is None or d2t.shape != (cfg.draft_vocab_size,):
        raise DrafterError(f"{w_path}: missing or malformed 'd2t' ({cfg.draft_vocab_size} entries expected)")
    return build_weights(cfg, arrays, d2t, arrays.pop("embed", None), w_path, dtype)


def build_weights(cfg: Eagle3Config, arrays: dict, d2t: np.ndarray, embed, source: str, dtype) -> Eagle3Weights:
    """Weights from the module's params by NNX path (`arrays`), the draft -> target map and an
    optional own embedding; shapes and the map's values checked (one-line DrafterErrors)."""
    d2t = np.asarray(d2t)
    v = cfg.target_vocab_size
    if d2t.shape != (cfg.draft_vocab_size,) or d2t.min(initial=0) < 0 or d2t.max(initial=0) >= v:
        raise DrafterError(
            f"{source}: the draft vocabulary map must hold {cfg.draft_vocab_size} target ids "
            f"in [0, {v}), got shape {d2t.shape} with values in [{d2t.min()}, {d2t.max()}]"
        )
    if len(np.unique(d2t)) != d2t.size:
        raise DrafterError(f"{source}: the draft vocabulary map names a target token twice")
    if embed is not None and tuple(embed.shape) != (v, cfg.hidden_size):
        raise DrafterError(f"{source}: embedding has shape {tuple(embed.shape)}, expected {(v, cfg.hidden_size)}")
    if embed is None and cfg.feature_size != cfg.hidden_size:
        raise DrafterError(
            f"{source}: a drafter of hidden size {cfg.hidden_size} over a target of "
            f"{cfg.feature_size} needs its own token embedding"
        )
    graphdef, params = checkpoint.fill(lambda: Eagle3(cfg, rngs=nnx.Rngs(0), dtype=dtype), arrays, source, dtype)
    own = None if embed is None else jnp.asarray(embed, dtype)
    return Eagle3Weights(cfg, graphdef, params, jnp.asarray(d2t, jnp.int32), source, own)


@struct.dataclass
class Eagle3State:
    cache: KVCache  # one layer; lengths = m = hist_len - 1 after every commit
    g_last: jax.Array  # [B, D] drafter output at position m - 1 (gives draft 1)


# The confidence gate `make_drafter` uses on CPU, where a verify pass costs well over a plain step;
# on GPU/TPU at small batch verifying is nearly free (decoding is bound by reading the weights), so
# the gate is off there. How 0.5 was chosen: docs/drafters.md, "The confidence gate".
CPU_MIN_CONFIDENCE = 0.5


def default_min_confidence() -> float:
    """The gate a bare `eagle3` spec gets: `CPU_MIN_CONFIDENCE` on CPU, 0 (always verify) elsewhere."""
    return CPU_MIN_CONFIDENCE if target_platform() == "cpu" else 0.0


class Eagle3Drafter(Drafter):
    """Chain drafting with a confidence gate: a row is `active` (worth a (K+1)-token verify) only
    when the drafter's probability of its first draft is at least `min_confidence`; when no live
    row is, the engine takes a plain one-token step instead (lossless either way). The drafter's
    first-token probability tracks the chance that the target accepts it, and a verify pass costs
    more than a plain step, so low-confidence steps are cheaper undrafted. 0 = always verify."""

    name = "eagle3"
    needs_final_hidden = False
    narrow_commit = True  # commit reads positions up to the emitted ones only
    proposal_optional = True  # propose writes only scratch entries that commit overwrites
    lazy_commit = True  # commit runs the layer over positions old m .. new m - 1, any count

    def __init__(self, num_draft: int, weights: Eagle3Weights, target, min_confidence: float = 0.0):
        super().__init__(num_draft)
        weights.config.check_target(target.config, f"EAGLE-3 drafter {weights.source}".strip())
        own = weights.embed
        if (
            own is not None
            and own.shape == target.params["embed"].shape
            and bool(jnp.array_equal(own, target.params["embed"][...].astype(own.dtype)))
        ):
            weights = dataclasses.replace(weights, embed=None)  # a copy of the target's table: share it
        self.embed = weights.embed
        self.weights = weights
        self.target = target
        self.feature_layers = weights.config.target_layers
        self.min_confidence = float(min_confidence)

    def cache_key(self):
        return super().cache_key() + (id(self.weights), self.feature_layers, self.min_confidence)

    def label(self, spec: str | None) -> str:
        """The spec with the effective gate and the tree shape (`eagle3@0.5/tree4x5`)."""
        label = (spec or self.name).strip()
        return self.tree_label(label if "@" in label else f"{label}@{self.min_confidence:g}")

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return tree_candidates(topk, depth)

    def params(self):
        embed = self.target.params["embed"][...] if self.embed is None else self.embed  # [V, D]
        return {"net": self.weights.params, "d2t": self.weights.d2t, "embed": embed}

    def _draft_token(self, dparams, logits, i, ctx):
        """Draft i's draft-vocab logits `[B, N]` -> target-vocab token `[B]` and q `[B, V]` (None
        if greedy)."""
        return draft_token(
            ctx.seeds, i, logits, dparams["d2t"], self.target.config.vocab_size, ctx.sampling, ctx.all_greedy
        )

    def init(self, dparams, ctx: InitContext):
        net = nnx.merge(self.weights.graphdef, dparams["net"])
        b, t = ctx.prompt.shape
        # [B, T]: x_{t+1}, the first emitted token at t = P - 1. The history may be no longer than
        # the prompt bucket (S = T when the prompt fills it): the clamped tail is padding.
        nxt = jnp.take(ctx.history, jnp.minimum(jnp.arange(1, t + 1), ctx.history.shape[1] - 1), axis=1)
        emb = jnp.take(dparams["embed"], nxt, axis=0).astype(net.fc[...].dtype)  # [B, T, D]
        cache = net.new_cache(b, ctx.cache_size)
        g, cache = net.step(emb, net.fuse(ctx.features), cache, fresh=True)  # [B, T, D]
        g_last = jnp.take_along_axis(g, (ctx.prompt_len - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
        return Eagle3State(cache.with_lengths(ctx.prompt_len), g_last)

    def propose(self, dparams, st: Eagle3State, ctx: StepContext):
        if self.tree_topk > 1:
            return self._propose_tree(dparams, st, ctx), st
        net = nnx.merge(self.weights.graphdef, dparams["net"])
        logits = net.logits(st.g_last)  # [B, N]
        d1, q1 = self._draft_token(dparams, logits, 0, ctx)
        d1 = d1.astype(jnp.int32)
        active = None
        if self.min_confidence > 0:
            conf = jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)  # [B]
            active = conf >= self.min_confidence

        def rest(cache):
            """Drafts 2..K: each embeds the previous draft with the drafter's own feature."""
            g, drafts, qs = st.g_last, [d1], [q1]
            for i in range(1, self.num_draft):  # K is small and static: unrolled; position m + i - 1
                emb = jnp.take(dparams["embed"], drafts[-1], axis=0)[:, None].astype(g.dtype)  # [B, 1, D]
                g1, cache = net.step(emb, g[:, None], cache)  # [B, 1, D]
                cache, g = cache.advance(1), g1[:, 0]  # g [B, D]
                tok, q = self._draft_token(dparams, net.logits(g), i, ctx)
                drafts.append(tok.astype(jnp.int32))
                qs.append(q)
            q = None if ctx.all_greedy else jnp.stack(qs, axis=1)  # [B, K, V]
            return jnp.stack(drafts, axis=1), q, cache  # [B, K]

        def repeat_first(cache):
            """No verify pass will run: drafts 2..K repeat draft 1 with a point-mass q (still a
            valid proposal, so even a verify of it would stay lossless); no drafter steps."""
            draft = jnp.repeat(d1[:, None], self.num_draft, axis=1)  # [B, K]
            if ctx.all_greedy:
                return draft, None, cache
            point = jax.nn.one_hot(d1, q1.shape[-1], dtype=q1.dtype)[:, None]  # [B, 1, V]
            q = jnp.concatenate([q1[:, None], jnp.repeat(point, self.num_draft - 1, axis=1)], axis=1)
            return draft, q, cache

        # Gated rows: most steps verify nothing, so skip the K - 1 drafter steps on those.
        needed = None if active is None or self.num_draft == 1 else ctx.verifies(active)  # [] bool or None
        if needed is not None:
            draft, q, cache = jax.lax.cond(needed, rest, repeat_first, st.cache)
        else:
            draft, q, cache = rest(st.cache)
        # Scratch entries written past m are overwritten by commit; lengths go back to m.
        return Proposal(draft, q, active), st.replace(cache=cache.with_lengths(st.cache.lengths))

    def _propose_tree(self, dparams, st: Eagle3State, ctx: StepContext) -> Proposal:
        """An EAGLE-2 dynamic tree of K nodes (dynamic_tree.py), its candidates deterministic (the
        drafter's top-k: q = None, lossless under the one-hot scheme). Gated on the drafter's
        probability mass over the root's k children (the chance one of them is accepted)."""
        net = nnx.merge(self.weights.graphdef, dparams["net"])
        k, b = self.tree_topk, st.g_last.shape[0]
        active = None
        if self.min_confidence > 0:
            probs = jax.nn.softmax(net.logits(st.g_last).astype(jnp.float32), axis=-1)  # [B, N]
            active = jnp.sum(jax.lax.top_k(probs, k)[0], axis=-1) >= self.min_confidence  # [B]

        def expand(tok, feat, positions, mask):  # [B, E] target ids, [B, E, D] parents' g
            emb = jnp.take(dparams["embed"], tok, axis=0).astype(feat.dtype)  # [B, E, D]
            return net.step(emb, feat, st.cache, positions=positions, mask=mask)[0]  # cache not kept

        def build():
            tokens, parents, _, _ = dynamic_tree(
                expand, net.logits, dparams["d2t"], st.g_last, st.cache.lengths, k, self.tree_depth, self.num_draft
            )
            return tokens, parents  # [B, K] each

        def idle():  # no verify pass will run: any well-formed tree (a chain of zeros)
            return jnp.zeros((b, self.num_draft), jnp.int32), chain_parents(b, self.num_draft)

        needed = None if active is None else ctx.verifies(active)  # [] bool or None
        if needed is not None:
            tokens, parents = jax.lax.cond(needed, build, idle)
        else:
            tokens, parents = build()
        return Proposal(tokens, None, active, parents=parents)

    def commit(self, dparams, st: Eagle3State, ctx: CommitContext):
        net = nnx.merge(self.weights.graphdef, dparams["net"])
        old_m = st.cache.lengths  # [B]
        kp1 = ctx.tokens.shape[1]
        idx = jnp.minimum(old_m[:, None] + 1 + jnp.arange(kp1)[None], ctx.history.shape[1] - 1)
        nxt = jnp.take_along_axis(ctx.history, idx, axis=1)  # [B, K+1]: x_{t+1} for t = old_m + j
        emb = jnp.take(dparams["embed"], nxt, axis=0).astype(st.g_last.dtype)  # [B, K+1, D]
        g, cache = net.step(emb, net.fuse(ctx.features), st.cache)  # [B, K+1, D]
        new_m = ctx.hist_len - 1
        g_new = jnp.take_along_axis(g, jnp.clip(new_m - old_m - 1, 0, kp1 - 1)[:, None, None], axis=1)[:, 0]
        g_last = jnp.where((new_m > old_m)[:, None], g_new, st.g_last)
        return Eagle3State(cache.with_lengths(new_m), g_last)
