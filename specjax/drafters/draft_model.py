"""A separate small draft model (Llama-family, same tokenizer) with its own KV cache.

Cache discipline: after every commit the draft cache holds the history up to position
`hist_len - 3`, i.e. its length is `hist_len - 2`, and the first draft forward feeds the two
newest history tokens (positions hist_len - 2 and hist_len - 1). Rewriting position hist_len - 2
is harmless when it is already there, and fills it in when all K drafts were accepted (the K-th
draft is never fed to the draft model while drafting). Rolling back after rejections is thereby
just setting the length: static shapes, no branches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext
from specjax.errors import DrafterError
from specjax.models.loading import Model
from specjax.sampling import sample, target_probs


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, num_draft: int, model: Model, target_config=None):
        super().__init__(num_draft)
        self.model = model
        if target_config is not None and model.config.vocab_size != target_config.vocab_size:
            raise DrafterError(
                f"draft model vocab size {model.config.vocab_size} does not match the target's "
                f"{target_config.vocab_size} (a draft model must share the target's tokenizer)"
            )

    def cache_key(self):
        return super().cache_key() + (id(self.model),)

    def params(self):
        return self.model.params

    def init(self, dparams, ctx: InitContext):
        m = nnx.merge(self.model.graphdef, dparams)
        cache = m.new_cache(ctx.prompt.shape[0], ctx.cache_size)
        _, cache, _ = m.hidden(ctx.prompt, cache)
        return cache.with_lengths(ctx.hist_len - 2)

    def propose(self, dparams, cache, ctx: StepContext):
        m = nnx.merge(self.model.graphdef, dparams)
        hist, length = ctx.history, ctx.hist_len
        start = length - 2  # == cache.lengths
        two = jnp.take_along_axis(hist, start[:, None] + jnp.arange(2)[None], axis=1)  # [B, 2]
        keys = jax.random.split(ctx.key, self.num_draft)

        h, cache, _ = m.hidden(two, cache)
        logits = m.logits(h[:, 1])  # [B, V]
        cache = cache.advance(2)
        drafts, qs = [], []
        for i in range(self.num_draft):  # K is small and static: unrolled
            if i > 0:
                lg, cache, _ = m(drafts[-1][:, None], cache)
                logits = lg[:, 0]
                cache = cache.advance(1)
            tok = sample(keys[i], logits, ctx.sampling)  # [B]
            drafts.append(tok)
            if not ctx.all_greedy:
                qs.append(target_probs(logits, ctx.sampling))  # [B, V]
        draft = jnp.stack(drafts, axis=1)  # [B, K]
        q = None if ctx.all_greedy else jnp.stack(qs, axis=1)  # [B, K, V]
        return Proposal(draft, q), cache

    def commit(self, dparams, cache, ctx: CommitContext):
        return cache.with_lengths(ctx.hist_len - 2)
