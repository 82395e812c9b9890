"""Native multi-token-prediction (MTP) heads, DeepSeek-V3 style (DeepSeek-AI 2024, §2.2).

Network. N = `num_modules` sequential modules on a frozen target. Module k (1-based) at position
i reads the previous hidden h^{k-1}_i (h^0_i: the target's final normed hidden at i; module
k - 1's output otherwise) and the embedding of the token x_{i+k} (the target's table, frozen):

    u     = proj [RMSNorm_e(embed(x_{i+k})) ; RMSNorm_h(h^{k-1}_i)]     [2D] -> [D]
    h^k_i = Block_k(u)                    one Llama decoder layer, causal attention over i
    logit = head(RMSNorm_k(h^k_i))        the target's LM head (frozen); predicts x_{i+k+1}

Drafting. After a step the accepted prefix is x_0..x_m (m = hist_len - 1); the target has final
hidden states for positions <= m - 1. All K <= N drafts are read at the single position m - 1:
draft k is module k there, reading x_{m-1+k} (x_m for k = 1, draft k - 1 after that) and
predicting x_{m+k}. One target forward gives K drafts.

Cache discipline. Module k's key/value at position j depends on h^0_j and x_{j+1}..x_{j+k}
(through modules 1..k at j), so it is *true* (what teacher-forced training computes) only when
x_{j+k} is committed: j <= m - k. With the window W = max(K - 1, 1):

* each module keeps a one-layer cache holding positions j < c = max(m - W, 0), all true
  (j + k <= m for k <= K);
* `propose` recomputes the window c .. c + W - 1 (= m - W .. m - 1: every position whose inputs
  involve drafts, and the read position m - 1) for modules 1..K in turn, module k reading the
  tokens e[j + k] of e = x_0..x_m, d_1..d_{k-1}. Window entries are scratch (lengths stay c);
* `commit` stores the verify pass's final hidden states (positions old_m .. old_m + K) in `fin`,
  reruns modules 1..K over positions c .. c + K with committed tokens only, and sets the length
  to c' = max(new_m - W, 0) <= c + K + 1. Entries past c' are rolled back by not advancing, as
  in the target's cache.

So module k at m - 1 attends to true entries below c and to window entries computed from
d_1..d_{k-1}; when those drafts were accepted (equal to the true tokens) this is exactly the
teacher-forced training forward of train/mtp.py, which is what the acceptance of draft k needs
(tests/test_mtp.py checks it step by step, with rejections).

State: `cache` K layers (module k in layer k - 1, keys and values [B*KV, S, H]) with
lengths c [B]; `fin [B, L, D]` the target's final hidden at positions c .. c + L - 1 with
L = W + K + 1 (valid below m); `m [B]`. Cost per step: K modules over W positions to propose
and over K + 1 positions to commit, plus K LM-head products.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from specjax.drafters import checkpoint
from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext, draft_token, head_rows
from specjax.drafters.dynamic_tree import best_nodes, tree_candidates
from specjax.errors import DrafterError
from specjax.models.config import LlamaConfig
from specjax.models.kv_cache import KVCache
from specjax.models.llama import DecoderLayer, RMSNorm, linear, rope_tables

KIND = "mtp"


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    hidden_size: int  # D (the target's)
    intermediate_size: int  # F of each module's block
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_vocab_size: int  # V
    target_num_layers: int  # L of the target it was trained for
    num_modules: int  # N, the most drafts per step
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    # Published variants (mtp_formats.py reads MTP layers out of target checkpoints):
    attention_bias: bool = False  # the block's layer kind: q/k/v biases (Qwen2, MiMo)
    qk_norm: bool = False  # ... per-head q/k norms (Qwen3)
    hidden_first: bool = False  # proj reads [hnorm(h) ; enorm(embed)] (MiMo) instead of [embed ; h]
    norm_feedback: bool = False  # a module's output is norm(block(u)), fed on and read by the head as is
    # Draft k > N runs module (k - 1) mod N again, as vLLM runs a checkpoint's 1-3 MTP layers for
    # any number of speculative tokens; 0 (specjax's own, trained per depth): at most N drafts.
    max_drafts: int = 0

    @property
    def draft_limit(self) -> int:
        """The most drafts a step may ask for: `max_drafts`, else one per module."""
        return self.max_drafts or self.num_modules

    @classmethod
    def for_target(cls, target: LlamaConfig, num_modules: int = 3, intermediate_size: int | None = None):
        """specjax's own MTP for `target`: `num_modules` modules with its layer shape and an FFN of
        `intermediate_size` (default the target's)."""
        if num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {num_modules}")
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            target_vocab_size=target.vocab_size,
            target_num_layers=target.num_layers,
            num_modules=num_modules,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            rms_norm_eps=target.rms_norm_eps,
        )

    def layer_config(self) -> LlamaConfig:
        """One module's block, described as a one-layer Llama (attention, MLP, rope)."""
        return LlamaConfig.single_layer(self, self.target_vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return {"drafter": KIND, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> MTPConfig:
        kw = checkpoint.config_fields(cls, d, source, "MTP")
        if kw.get("rope_scaling") is not None:
            kw["rope_scaling"] = tuple(kw["rope_scaling"])
        if not isinstance(kw["num_modules"], int) or kw["num_modules"] < 1:
            raise DrafterError(f"{source}: num_modules must be a positive integer, got {kw['num_modules']!r}")
        return cls(**kw)

    def check_target(self, target: LlamaConfig, source: str = "MTP drafter") -> None:
        """One clear DrafterError when the drafter was trained for another target."""
        pairs = [
            ("hidden size", self.hidden_size, target.hidden_size),
            ("vocab size", self.target_vocab_size, target.vocab_size),
        ]
        if self.target_num_layers:  # 0: read out of the target's own checkpoint
            pairs.append(("layer count", self.target_num_layers, target.num_layers))
        checkpoint.check_target(pairs, source)


class MTPModule(nnx.Module):
    """One depth: input norms, the [2D] -> [D] projection, a decoder block, its output norm."""

    def __init__(self, cfg: MTPConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps, dtype=dtype)
        self.hnorm = RMSNorm(d, eps, dtype=dtype)
        self.proj = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (d, 2 * d), dtype))  # [D, 2D]
        self.block = DecoderLayer(cfg.layer_config(), rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(d, eps, dtype=dtype)

    def __call__(self, emb, h_prev, cos, sin, k_cache, v_cache, starts, mask=None, write: bool = True):
        """emb, h_prev `[B, T, D]` at positions starts + t -> h `[B, T, D]` and both caches (with
        `write`; else the cache is only read and the new keys and values come back), the T
        positions attending among themselves as `mask [B, T, T]` says (default causal)."""
        parts = [self.enorm(emb), self.hnorm(h_prev)]
        u = jnp.concatenate(parts[::-1] if self.cfg.hidden_first else parts, axis=-1)  # [B, T, 2D]
        run = self.block if write else self.block.attend
        h, kc, vc = run(linear(self.proj[...], u), cos, sin, k_cache, v_cache, starts, mask)  # h [B, T, D]
        return (self.norm(h) if self.cfg.norm_feedback else h), kc, vc

    def head_input(self, h: jax.Array) -> jax.Array:
        """The output `[..., D]` as the LM head reads it: normed (once)."""
        return h if self.cfg.norm_feedback else self.norm(h)


class MTP(nnx.Module):
    """The N modules. Embedding and LM head are the target's and are passed in, never owned."""

    def __init__(self, cfg: MTPConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.heads = nnx.List([MTPModule(cfg, rngs=rngs, dtype=dtype) for _ in range(cfg.num_modules)])

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin `[B, T, H]` for positions `[B, T]`."""
        return rope_tables(self.cfg.layer_config(), positions)

    def run(self, k: int, emb, h_prev, cache: KVCache, cos, sin, fresh: bool = False) -> tuple[jax.Array, KVCache]:
        """Draft depth k (1-based: module (k - 1) mod N) over T positions at `cache.lengths`,
        writing cache layer k - 1 (lengths unchanged). emb, h_prev `[B, T, D]` -> h^k `[B, T, D]`.
        `fresh`: the cache layer is empty (written from position 0, not read; llama.attention)."""
        h, kc, vc = self.module_for(k)(
            emb.astype(self.dtype),
            h_prev.astype(self.dtype),
            cos,
            sin,
            cache.k[k - 1],
            cache.v[k - 1],
            None if fresh else cache.lengths,
        )
        ks, vs = list(cache.k), list(cache.v)
        ks[k - 1], vs[k - 1] = kc, vc
        return h, cache.replace(k=tuple(ks), v=tuple(vs))

    def run_read_only(self, k: int, emb, h_prev, cache: KVCache, cos, sin, mask) -> jax.Array:
        """`run` attending to cache layer k - 1 without writing it, the T positions among
        themselves as `mask [B, T, T]` says (independent windows of a token tree)."""
        return self.module_for(k)(
            emb.astype(self.dtype),
            h_prev.astype(self.dtype),
            cos,
            sin,
            cache.k[k - 1],
            cache.v[k - 1],
            cache.lengths,
            mask,
            write=False,
        )[0]

    def logits(self, k: int, h: jax.Array, head: jax.Array) -> jax.Array:
        """Module k's output `[..., D]` -> f32 target-vocab logits `[..., V]` (head `[V, D]`)."""
        return linear(head, self.module_for(k).head_input(h), jnp.float32)

    def module_for(self, k: int) -> MTPModule:
        """The module that drafts depth k (1-based): module (k - 1) mod N."""
        return self.heads[(k - 1) % self.cfg.num_modules]

    @property
    def dtype(self):
        return self.heads[0].proj[...].dtype

    def new_cache(self, num_modules: int, batch: int, size: int) -> KVCache:
        """An empty cache, one layer per module: `[B*KV, S, H]` keys and values, lengths 0."""
        c = self.cfg
        return KVCache.create(num_modules, batch, size, c.num_kv_heads, c.head_dim, self.dtype)


@dataclasses.dataclass
class MTPWeights:
    config: MTPConfig
    graphdef: Any
    params: Any  # nnx.State
    source: str = ""

    def module(self) -> MTP:
        return nnx.merge(self.graphdef, self.params)


def init_weights(cfg: MTPConfig, seed: int = 0, dtype=jnp.float32) -> MTPWeights:
    """Random weights: the start of training."""
    graphdef, params = nnx.split(MTP(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
    return MTPWeights(cfg, graphdef, params, "random")


def save(w: MTPWeights, out_dir: str, dtype=None, metadata: dict | None = None) -> str:
    """Write `config.json` + `model.safetensors` (the modules only: no embedding, no head)."""
    return checkpoint.save(out_dir, w.config.to_dict(), w.params, dtype=dtype, metadata=metadata)


def load(path: str, dtype=jnp.float32) -> MTPWeights:
    """Load a directory written by `save`; one-line DrafterErrors for bad input."""
    raw = checkpoint.read_config(path, KIND, "MTP")
    cfg = MTPConfig.from_dict(raw, f"{path}/{checkpoint.CONFIG_FILE}")
    arrays = checkpoint.read_tensors(path, "MTP")
    graphdef, params = checkpoint.fill(
        lambda: MTP(cfg, rngs=nnx.Rngs(0), dtype=dtype), arrays, f"{path}/{checkpoint.WEIGHTS_FILE}", dtype
    )
    return MTPWeights(cfg, graphdef, params, path)


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x `[B, S, ...]`, idx `[B, T]` (clamped to 0..S-1) -> `[B, T, ...]`."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)  # [B, T]
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@struct.dataclass
class MTPState:
    cache: KVCache  # K one-layer caches (module k in layer k - 1); lengths c = max(m - W, 0)
    fin: jax.Array  # [B, L, D] target final hidden at positions c .. c + L - 1 (valid below m)
    m: jax.Array  # [B] int32 = hist_len - 1


class MTPDrafter(Drafter):
    name = "mtp"
    needs_final_hidden = True
    proposal_optional = True  # propose writes only scratch entries that commit overwrites
    lazy_commit = True  # commit stores T new finals and reruns the modules over c .. c + T - 1, any T

    def __init__(self, num_draft: int, weights: MTPWeights, target, draft_vocab=None):
        """`draft_vocab` (`d2t [N]`, optional): the target ids the modules may propose; the head
        is then restricted to those rows (for SmolLM2 the full head is ~87% of a module's cost)."""
        super().__init__(num_draft)
        source = f"MTP drafter {weights.source}".strip()
        if num_draft < 1:
            raise DrafterError(f"{source} drafts at least 1 token per step; got --num-draft {num_draft}")
        weights.config.check_target(target.config, source)
        self.weights, self.target = weights, target
        self.d2t = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)

    k_dependent_state = True  # one cache per draft depth, and the window W follows K

    @property
    def window(self) -> int:  # W (K: the depth of a tree)
        return max(self.accept_width - 1, 1)

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return tree_candidates(topk, depth)

    def default_tree_depth(self) -> int:
        return min(super().default_tree_depth(), self.weights.config.draft_limit)

    def check_shape(self) -> None:
        n, limit = self.weights.config.num_modules, self.weights.config.draft_limit
        if self.accept_width > limit:
            source = f"MTP drafter {self.weights.source}".strip()
            got = f"--tree-depth {self.tree_depth}" if self.tree_topk > 1 else f"--num-draft {self.num_draft}"
            raise DrafterError(f"{source} has {n} modules, so it drafts 1..{limit} tokens per step; got {got}")

    def cache_key(self):
        return super().cache_key() + (id(self.weights), id(self.d2t))

    def params(self):
        t = self.target.module()
        head = head_rows(t.head_weight(), self.d2t)  # [N or V, D]
        return {"net": self.weights.params, "embed": t.embed[...], "head": head, "d2t": self.d2t}

    def _net(self, dparams) -> MTP:
        return nnx.merge(self.weights.graphdef, dparams["net"])

    def init(self, dparams, ctx: InitContext) -> MTPState:
        net, k_max = self._net(dparams), self.accept_width
        b, t = ctx.prompt.shape
        m = ctx.prompt_len  # [B]
        c = jnp.maximum(m - self.window, 0)  # [B]
        pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))  # [B, T]
        cos, sin = net.rope(pos)
        cache = net.new_cache(k_max, b, ctx.cache_size)
        h = ctx.final_hidden  # [B, T, D]
        for k in range(1, k_max + 1):  # entries j < c read x_{j+k} with j + k <= m: committed
            emb = jnp.take(dparams["embed"], gather_rows(ctx.history, pos + k), axis=0)  # [B, T, D]
            h, cache = net.run(k, emb, h, cache, cos, sin, fresh=True)
        length = self.window + k_max + 1  # L
        fin = gather_rows(ctx.final_hidden, c[:, None] + jnp.arange(length)[None]).astype(net.dtype)  # [B, L, D]
        return MTPState(cache.with_lengths(c), fin, m)

    def draft_chain(self, dparams, st: MTPState, history: jax.Array, choose):
        """Drafts 1..K from the state. `choose(k, logits [B, V]) -> token [B]` picks draft k
        (sampling in `propose`; the true tokens in the consistency test); with a draft vocabulary
        the logits are `[B, N]` and `choose` returns target ids. Returns drafts `[B, K]`, the K
        logits and the cache with the window's scratch entries."""
        net, k_max, w = self._net(dparams), self.accept_width, self.window
        c, m = st.cache.lengths, st.m  # [B] each
        pos = c[:, None] + jnp.arange(w)[None]  # [B, W] window positions
        cos, sin = net.rope(pos)
        read = jnp.clip(m - 1 - c, 0, w - 1)[:, None, None]  # [B, 1, 1] window index of m - 1
        h, cache = st.fin[:, :w], st.cache  # [B, W, D] h^0 over the window
        drafts = jnp.zeros((history.shape[0], k_max), jnp.int32)  # [B, K]
        all_logits = []
        for k in range(1, k_max + 1):  # K is small and static: unrolled
            p = pos + k  # [B, W] token positions module k reads: committed, or drafts < k
            tok = jnp.where(p <= m[:, None], gather_rows(history, p), gather_rows(drafts, p - m[:, None] - 1))  # [B, W]
            h, cache = net.run(k, jnp.take(dparams["embed"], tok, axis=0), h, cache, cos, sin)  # [B, W, D]
            logits = net.logits(k, jnp.take_along_axis(h, read, axis=1)[:, 0], dparams["head"])  # [B, V or N]
            drafts = drafts.at[:, k - 1].set(choose(k, logits).astype(jnp.int32))
            all_logits.append(logits)
        return drafts, all_logits, cache

    def propose(self, dparams, st: MTPState, ctx: StepContext):
        if self.tree_topk > 1:
            tokens, parents, _, _ = self.draft_tree(dparams, st, ctx.history)
            return Proposal(tokens, None, parents=parents), st
        qs = []  # [B, V] per draft, None when greedy

        def choose(k, logits):
            tok, q = draft_token(
                ctx.seeds, k - 1, logits, dparams["d2t"], self.target.config.vocab_size, ctx.sampling, ctx.all_greedy
            )
            qs.append(q)
            return tok

        drafts, _, cache = self.draft_chain(dparams, st, ctx.history, choose)
        q = None if ctx.all_greedy else jnp.stack(qs, axis=1)
        return Proposal(drafts, q), st.replace(cache=cache)  # [B, K], [B, K, V] | None

    def draft_tree(self, dparams, st: MTPState, history: jax.Array):
        """An EAGLE-2 dynamic tree of K nodes over D <= N levels, its candidates the modules'
        top-k (q = None: the one-hot scheme). Level d runs module d at the read position m - 1, whose
        window reads the path's drafts 1..d - 1: each of the k frontier nodes of level d - 1 gets its
        own window (module d over W positions, h^{d-1} from the window its parent's module ran), all
        k in one pass, each window causal and blind to the others; nothing is written to the caches
        (commit reruns the modules over the accepted path, as for a chain). Returns `best_nodes`'
        tokens (target ids), parents, depths and cumulative log-probabilities, `[B, K]` each."""
        net, depth, w, k = self._net(dparams), self.tree_depth, self.window, self.tree_topk
        c, m = st.cache.lengths, st.m  # [B] each
        b = m.shape[0]
        to_target = (lambda t: t) if dparams["d2t"] is None else (lambda t: jnp.take(dparams["d2t"], t))
        pos = c[:, None] + jnp.arange(w)[None]  # [B, W] window positions
        read = jnp.clip(m - 1 - c, 0, w - 1)  # [B] window index of m - 1

        def log_probs(d, h):  # module d's windows [B, ..., W, D] -> log q at m - 1 [B, ..., N]
            at = jnp.take_along_axis(h, read.reshape((b,) + (1,) * (h.ndim - 1)), axis=-2)[..., 0, :]
            return jax.nn.log_softmax(net.logits(d, at, dparams["head"]), axis=-1)

        cos, sin = net.rope(pos)
        tok = gather_rows(history, pos + 1)  # [B, W]: committed (j + 1 <= m)
        h1 = net.run_read_only(
            1, jnp.take(dparams["embed"], tok, axis=0), st.fin[:, :w], st.cache, cos, sin, None
        )  # [B, W, D]
        c_score, c_tok = jax.lax.top_k(log_probs(1, h1), k)  # [B, k] level 1
        c_par = jnp.full((b, k), -1, jnp.int32)  # [B, C] parent candidate index
        c_depth = jnp.zeros((b, k), jnp.int32)  # [B, C]
        c_src = jnp.zeros((b, k), jnp.int32)  # [B, C] the window run each candidate was read from
        c_path = jnp.zeros((b, k, depth), jnp.int32).at[:, :, 0].set(to_target(c_tok))  # [B, C, D] target ids
        windows = h1[:, None]  # [B, 1 + runs, W, D]
        t_pos = jnp.tile(pos, (1, k))  # [B, k W]: k windows side by side
        cos, sin = net.rope(t_pos)
        blocks = jnp.arange(k * w) // w  # [k W] window of each position
        causal = (blocks[:, None] == blocks[None, :]) & (jnp.arange(k * w)[:, None] >= jnp.arange(k * w)[None, :])
        mask = jnp.broadcast_to(causal, (b, k * w, k * w))  # [B, k W, k W]
        level_start = 0
        for d in range(2, depth + 1):
            level = jnp.arange(level_start, c_tok.shape[1])
            _, pick = jax.lax.top_k(c_score[:, level], k)
            front = level[pick]  # [B, k] frontier: the k best of level d - 1
            f_path = jnp.take_along_axis(c_path, front[..., None], axis=1)  # [B, k, D]
            h_prev = jnp.take_along_axis(
                windows, jnp.take_along_axis(c_src, front, axis=1)[..., None, None], axis=1
            )  # [B, k, W, D]
            p = pos + d  # [B, W] token positions module d reads: committed, or the path's drafts < d
            drafted = jnp.take_along_axis(f_path, jnp.clip(p - m[:, None] - 1, 0, depth - 1)[:, None], axis=2)
            tok = jnp.where((p <= m[:, None])[:, None], gather_rows(history, p)[:, None], drafted)  # [B, k, W]
            emb = jnp.take(dparams["embed"], tok.reshape(b, k * w), axis=0)  # [B, k W, D]
            h = net.run_read_only(d, emb, h_prev.reshape(b, k * w, -1), st.cache, cos, sin, mask)
            h = h.reshape(b, k, w, -1)  # [B, k, W, D]
            s, t = jax.lax.top_k(log_probs(d, h), k)  # [B, k, k]
            front_score = jnp.take_along_axis(c_score, front, axis=1)  # [B, k]
            level_start = c_tok.shape[1]
            runs = windows.shape[1] + jnp.arange(k, dtype=jnp.int32)  # [k] these windows' indices
            windows = jnp.concatenate([windows, h], axis=1)  # [B, 1 + runs, W, D]
            paths = jnp.repeat(f_path, k, axis=1).at[:, :, d - 1].set(to_target(t.reshape(b, k * k)))  # [B, k k, D]
            c_tok = jnp.concatenate([c_tok, t.reshape(b, k * k)], axis=1)  # [B, C]
            c_score = jnp.concatenate([c_score, (front_score[..., None] + s).reshape(b, k * k)], axis=1)
            c_par = jnp.concatenate([c_par, jnp.repeat(front, k, axis=1)], axis=1)
            c_depth = jnp.concatenate([c_depth, jnp.full((b, k * k), d - 1, jnp.int32)], axis=1)
            c_src = jnp.concatenate([c_src, jnp.broadcast_to(jnp.repeat(runs, k), (b, k * k))], axis=1)
            c_path = jnp.concatenate([c_path, paths], axis=1)
        tokens, parents, depths, scores = best_nodes(c_tok, c_score, c_par, c_depth, self.num_draft)
        return to_target(tokens).astype(jnp.int32), parents, depths, scores

    def commit(self, dparams, st: MTPState, ctx: CommitContext) -> MTPState:
        """Store the T new finals (T = K + 1 after a verify step, wider in a deferred catch-up) and
        rerun the modules over positions c .. c + T - 1, which hold every entry below the new c."""
        net, w = self._net(dparams), self.window
        c, old_m, new_m = st.cache.lengths, st.m, ctx.hist_len - 1  # [B] each
        length, t = st.fin.shape[1], ctx.tokens.shape[1]  # L = W + K + 1, T
        # the pass's finals sit at old_m .. old_m + T - 1, i.e. fin offsets from old_m - c <= W
        fin = jnp.pad(st.fin, ((0, 0), (0, t), (0, 0)))  # [B, L + T, D]
        fin = jax.vmap(lambda f, new, s: jax.lax.dynamic_update_slice(f, new.astype(f.dtype), (s, 0)))(
            fin, ctx.final_hidden, old_m - c
        )  # [B, L + T, D]
        pos = c[:, None] + jnp.arange(t)[None]  # [B, T] positions c .. c + T - 1
        cos, sin = net.rope(pos)
        h, cache = fin[:, :t], st.cache  # [B, T, D]
        for k in range(1, self.accept_width + 1):  # entries kept (< c') read x_{j+k}, j + k <= new_m: committed
            emb = jnp.take(dparams["embed"], gather_rows(ctx.history, pos + k), axis=0)  # [B, T, D]
            h, cache = net.run(k, emb, h, cache, cos, sin)
        c_new = jnp.maximum(new_m - w, 0)  # [B], c_new - c <= T
        shifted = gather_rows(fin, (c_new - c)[:, None] + jnp.arange(length)[None])  # [B, L, D]
        return MTPState(cache.with_lengths(c_new), shifted, new_m)
