"""A separate small draft model (Llama-family, same tokenizer) with its own KV cache.

Cache discipline: after every commit the draft cache holds the history up to position
`hist_len - 3`, i.e. its length is `hist_len - 2`, and the first draft forward feeds the two
newest history tokens (positions hist_len - 2 and hist_len - 1). Rewriting position hist_len - 2
is harmless when it is already there, and fills it in when all K drafts were accepted (the K-th
draft is never fed to the draft model while drafting). Rolling back after rejections is thereby
just setting the length: static shapes, no branches. Trees (`with_tree`, dynamic_tree.py) read the
cache without writing it while drafting, so a tree step's commit feeds the accepted tokens from
the history (`catch_up`, one pass of depth + 1 positions).

Checkpoints: any model `load_model` reads (GGUF, HF directory), or a *distilled* draft model
(train/draft_model.py) that borrows its target's embedding and LM head. Those tables are most of
a small model's bytes (49152 x 576 for SmolLM2: 56 MB in bf16, against 21 MB for three layers),
so such a checkpoint is an HF directory without them whose `config.json` carries
`"specjax_draft": {"tables_from_target": true, "target_hidden_size", "target_vocab_size",
"target_num_layers"}`; `load_with_target_tables` fills them in from the target (the same arrays,
no copy) after checking that the target is the one it was trained for.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import checkpoint
from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext, draft_token, head_rows
from specjax.drafters.dynamic_tree import dynamic_tree, tree_candidates
from specjax.errors import DrafterError, ModelLoadError
from specjax.models.llama import linear
from specjax.models.loading import Model

TABLES_KEY = "specjax_draft"
TARGET_FIELDS = ("target_hidden_size", "target_vocab_size", "target_num_layers")


def _read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def borrows_target_tables(path: str) -> bool:
    """Whether `path` is a distilled draft-model directory without its own embedding/head."""
    cfg = os.path.join(str(path), "config.json")
    if not os.path.isfile(cfg):
        return False
    try:
        raw = _read_json(cfg)
    except (OSError, ValueError):
        return False  # the ordinary loader reports it
    return (
        isinstance(raw, dict)
        and isinstance(raw.get(TABLES_KEY), dict)
        and bool(raw[TABLES_KEY].get("tables_from_target"))
    )


def save_with_target_tables(
    model_params: dict, cfg, target_cfg, out_dir: str, dtype=None, metadata: dict | None = None
) -> str:
    """Write a draft model's layers and final norm (pure params dict; no embedding or head) as an
    HF directory marked as borrowing the target's tables."""
    from specjax.models.loading.mapping import params_to_hf
    from specjax.models.loading.safetensors_io import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = params_to_hf(cfg, model_params, tables=False)
    if dtype is not None:
        tensors = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    info = {
        "tables_from_target": True,
        "target_hidden_size": target_cfg.hidden_size,
        "target_vocab_size": target_cfg.vocab_size,
        "target_num_layers": target_cfg.num_layers,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({**cfg.to_hf(), TABLES_KEY: info, **(metadata or {})}, fh, indent=2)
    return out_dir


def load_with_target_tables(path: str, target: Model, dtype: str | None = None) -> Model:
    """A distilled draft model with the target's embedding and LM head; one-line DrafterErrors."""
    from specjax.models.config import LlamaConfig
    from specjax.models.llama import Llama
    from specjax.models.loading import hf as hf_loader
    from specjax.models.loading.mapping import params_from_hf

    cfg_path, source = os.path.join(path, "config.json"), f"draft model {path}"
    try:
        raw = _read_json(cfg_path)
        info = raw[TABLES_KEY]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DrafterError(f"{cfg_path}: not a distilled draft-model config ({e})") from None
    for key in TARGET_FIELDS:
        if key not in info:
            raise DrafterError(f"{cfg_path}: missing key '{TABLES_KEY}.{key}'")
    try:
        cfg = LlamaConfig.from_hf(raw)
    except ModelLoadError as e:
        raise DrafterError(f"{cfg_path}: {e}") from None
    tc = target.config
    checkpoint.check_target(
        [
            ("hidden size", info["target_hidden_size"], tc.hidden_size),
            ("vocab size", info["target_vocab_size"], tc.vocab_size),
            ("layer count", info["target_num_layers"], tc.num_layers),
        ],
        source,
    )
    if (cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) != (
        tc.hidden_size,
        tc.vocab_size,
        tc.tie_word_embeddings,
    ):
        raise DrafterError(
            f"{source} cannot use this target's embedding and head: hidden size, vocab size or "
            f"head tying ({cfg.hidden_size}, {cfg.vocab_size}, {cfg.tie_word_embeddings}) differ "
            f"from the target's ({tc.hidden_size}, {tc.vocab_size}, {tc.tie_word_embeddings})"
        )
    tables = {"model.embed_tokens.weight", "lm_head.weight"}
    try:
        get = hf_loader.open_tensors(path)
        # zero-stride placeholders pass the shape check; the target's arrays replace them below
        fetch = lambda name: (
            np.broadcast_to(np.float32(0), (cfg.vocab_size, cfg.hidden_size)) if name in tables else get(name)
        )
        pure = params_from_hf(cfg, fetch, np.float32)
    except ModelLoadError as e:
        raise DrafterError(f"{source}: {str(e).splitlines()[0]}") from None
    dt = jnp.dtype(dtype or target.dtype)
    t = target.module()
    pure["embed"] = t.embed[...]
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = t.lm_head[...]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dt)))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, dt), pure))  # tables: no copy
    return Model(cfg, graphdef, state, target.tokenizer, os.path.basename(os.path.normpath(path)), path)


class DraftModelDrafter(Drafter):
    """Drafts with a small model's greedy or sampled tokens. `draft_vocab` (`d2t [N]`, optional):
    the target ids it may propose; its head is then restricted to those rows, which cuts the cost
    of a draft token (docs/drafters.md, "Draft vocabulary")."""

    name = "draft"
    # A plain step's one-position commit feeds the draft model the token drafting would have fed,
    # so its cache stays current whether or not `propose` ran.
    narrow_commit = True
    proposal_optional = True
    lazy_commit = True  # `catch_up` feeds the deferred tokens from the history

    def __init__(self, num_draft: int, model: Model, target_config=None, draft_vocab=None):
        super().__init__(num_draft)
        self.model = model
        if target_config is not None and model.config.vocab_size != target_config.vocab_size:
            raise DrafterError(
                f"draft model vocab size {model.config.vocab_size} does not match the target's "
                f"{target_config.vocab_size} (a draft model must share the target's tokenizer)"
            )
        self.d2t = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)

    def cache_key(self):
        return super().cache_key() + (id(self.model), id(self.d2t))

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return tree_candidates(topk, depth)

    def params(self):
        head = head_rows(self.model.module().head_weight(), self.d2t)  # [N or V, D]
        return {"model": self.model.params, "head": head, "d2t": self.d2t}

    def init(self, dparams, ctx: InitContext):
        m = nnx.merge(self.model.graphdef, dparams["model"])
        cache = m.new_cache(ctx.prompt.shape[0], ctx.cache_size)
        _, cache, _ = m.hidden(ctx.prompt, cache, fresh=True)
        return cache.with_lengths(ctx.hist_len - 2)

    def catch_up(self, dparams, cache, ctx: CommitContext):
        """Feed the positions from the cache's length up to hist_len - 3 (at most T, the context's
        width, after deferred plain steps) in one pass; entries written past them are scratch."""
        m = nnx.merge(self.model.graphdef, dparams["model"])
        start = cache.lengths  # [B]
        idx = jnp.minimum(start[:, None] + jnp.arange(ctx.tokens.shape[1])[None], ctx.history.shape[1] - 1)  # [B, T]
        _, cache, _ = m.hidden(jnp.take_along_axis(ctx.history, idx, axis=1), cache)  # [B, T] tokens
        return cache.with_lengths(ctx.hist_len - 2)

    def propose(self, dparams, cache, ctx: StepContext):
        m = nnx.merge(self.model.graphdef, dparams["model"])
        hist, length = ctx.history, ctx.hist_len
        start = length - 2  # == cache.lengths
        two = jnp.take_along_axis(hist, start[:, None] + jnp.arange(2)[None], axis=1)  # [B, 2]
        h, cache, _ = m.hidden(two, cache)  # [B, 2, D]
        h = h[:, 1]  # [B, D]
        cache = cache.advance(2)
        head = lambda x: linear(dparams["head"], x, jnp.float32)  # [..., D] -> [..., N or V]
        if self.tree_topk > 1:
            # An EAGLE-2 dynamic tree of K nodes, its candidates the model's top-k (q = None: the
            # one-hot scheme keeps sampling lossless); the hidden state plays the feature's part.
            def expand(tok, _parent_h, positions, mask):  # [B, E] -> [B, E, D]; cache read only
                return m.hidden_kv(tok, cache, positions=positions, mask=mask)[0]

            tokens, parents, _, _ = dynamic_tree(
                expand, head, dparams["d2t"], h, cache.lengths, self.tree_topk, self.tree_depth, self.num_draft
            )  # [B, K] each
            return Proposal(tokens, None, parents=parents), cache
        drafts, qs = [], []
        for i in range(self.num_draft):  # K is small and static: unrolled
            if i > 0:
                h1, cache, _ = m.hidden(drafts[-1][:, None], cache)  # [B, 1, D]
                h = h1[:, 0]  # [B, D]
                cache = cache.advance(1)
            logits = head(h)  # [B, N or V]
            tok, q = draft_token(
                ctx.seeds, i, logits, dparams["d2t"], self.model.config.vocab_size, ctx.sampling, ctx.all_greedy
            )  # [B], [B, V] | None
            drafts.append(tok.astype(jnp.int32))
            qs.append(q)
        draft = jnp.stack(drafts, axis=1)  # [B, K]
        q = None if ctx.all_greedy else jnp.stack(qs, axis=1)  # [B, K, V]
        return Proposal(draft, q), cache

    def commit(self, dparams, cache, ctx: CommitContext):
        if ctx.tokens.shape[1] == 1:
            # A plain step (K = 0, or a plain step of a K > 0 loop: `narrow_commit`). Drafting may
            # not have fed this step's tokens, so write position hist_len - 3 (new) to keep the
            # discipline above; a row that did not advance rewrites the same token in place.
            m = nnx.merge(self.model.graphdef, dparams["model"])
            pos = jnp.maximum(ctx.hist_len - 3, 0)  # [B]
            tok = jnp.take_along_axis(ctx.history, pos[:, None], axis=1)  # [B, 1]
            _, cache, _ = m.hidden(tok, cache.with_lengths(pos))
            return cache.with_lengths(jnp.maximum(ctx.hist_len - 2, 0))
        if self.tree_topk > 1:  # the tree's nodes were never written: feed the accepted path
            return self.catch_up(dparams, cache, ctx)
        return cache.with_lengths(ctx.hist_len - 2)
