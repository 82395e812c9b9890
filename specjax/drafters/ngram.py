"""Prompt-lookup (n-gram) drafting, vectorised over the batch.

For each row, find the most recent earlier occurrence of the last n tokens of the history (prompt
+ generated), trying n = max_n down to min_n, and propose the K tokens that followed it. When the
continuation runs into the present, it is extended periodically (the text that matched is
assumed to keep repeating with the same period), which is what repetitive output does. Rows
without any match propose a repeat of their last token.

A row is `active` (its drafts worth a verify pass) only when its match is at least `active_n`
tokens long: single-token matches are found almost everywhere and are usually wrong. An inactive
row checks no drafts, even in a batch that verifies for others (the engine masks them).

How far to trust a match also grows with its length, so for K > 3 the engine verifies either the
first 3 drafts (`verify_lengths` = (3, K)) or all K: a row wants all K only when its match is
at least `long_n` tokens. Matches are searched up to `max_n` = 8 tokens (the longest wins, then
the most recent). The replays and engine runs that chose `active_n` = 2, `long_n` = 5 and
`max_n` = 8: docs/performance.md, "Verify only when a draft is worth it" and "Verify as many
drafts as the match supports".

Trees (`with_tree(k, D)`, suffix/lookup decoding's several continuations): the k best match
ends (longest match first, then the most recent; one entry per end) each propose the D tokens
that followed them, merged into a trie: continuations that agree on their first d tokens share
those nodes, so branch j's node at depth d hangs under the first branch that agrees with it up
to there. Nodes are laid out branch by branch (`num_draft` <= k D of them), so the first D are
the best match's continuation, the chain's drafts; a node that repeats an earlier branch's, or
belongs to a branch without a match (or, past the first, one shorter than `active_n`), gets
parent -2: verified by no one, accepted never. A tree row wants its leading nodes verified as a
chain row wants its leading drafts: the first 3 (the chain's first 3 when D >= 3) unless its best
match is at least `long_n` tokens long, then all.

Vocabulary-free and parameter-free: q is one-hot, so rejection sampling is exact for any
temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.drafters.base import Drafter, Proposal, StepContext


class NgramDrafter(Drafter):
    name = "ngram"
    proposal_optional = True  # stateless
    # Short waits between probes: whether its drafts are accepted switches with the text (a
    # repeated span starts or ends), so a row turned off after a few wrong matches should look
    # again soon, and a probe is cheap (it drafts only on a match; docs/spec-policy.md, "Waits").
    probe_wait = (4, 0.2)

    SHORT = 3  # drafts verified for a match shorter than long_n (when K > SHORT)

    def __init__(self, num_draft: int, max_n: int = 8, min_n: int = 1, active_n: int = 2, long_n: int = 5):
        super().__init__(num_draft)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.active_n, self.long_n = max_n, min_n, active_n, long_n

    def cache_key(self):
        return super().cache_key() + (self.max_n, self.min_n, self.active_n, self.long_n)

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        k = self.num_draft
        return (self.SHORT, k) if k > self.SHORT else ((k,) if k else ())

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        return topk * depth

    def match_lengths(self, hist, length):
        """Match lengths at every candidate end.

        Args:
          hist: [B, S] int32 history (prompt + emitted tokens).
          length: [B] int32 tokens of each row's history.

        Returns:
          [B, S] int32: at index e, the longest n in [min_n, max_n] such that the n tokens ending
          just before e equal the history's last n, with e <= length - 1 (the match has a
          continuation); 0 where none.
        """
        b, s = hist.shape
        e = jnp.arange(s)[None]  # [1, S] candidate match ends
        best = jnp.zeros((b, s), jnp.int32)  # [B, S]
        for n in range(self.min_n, self.max_n + 1):  # longer n overwrite shorter ones
            suffix = jnp.take_along_axis(hist, jnp.clip(length[:, None] - n + jnp.arange(n), 0, s - 1), axis=1)
            ok = (e >= n) & (e <= length[:, None] - 1) & (length[:, None] > n)  # [B, S]
            for t in range(n):  # hist[e - n + t] == suffix[t]
                ok &= jnp.roll(hist, n - t, axis=1) == suffix[:, t : t + 1]
            best = jnp.where(ok, n, best)
        return best

    def continuation(self, hist, length, end, width: int):
        """The `width` tokens after each row's match end, extended periodically into the present.

        Args:
          hist: [B, S] int32 history; length: [B] int32 its lengths; end: [B] int32 match ends.
          width: W, tokens wanted.

        Returns:
          [B, W] int32 tokens.
        """
        period = jnp.maximum(length - end, 1)  # [B]
        idx = end[:, None] + jnp.arange(width)[None] % period[:, None]  # [B, W]
        return jnp.take_along_axis(hist, jnp.clip(idx, 0, hist.shape[1] - 1), axis=1)

    def propose(self, dparams, state, ctx: StepContext):
        hist, length = ctx.history, ctx.hist_len  # [B, S], [B]
        b, s = hist.shape
        k = self.num_draft
        n_at = self.match_lengths(hist, length)  # [B, S]
        score = jnp.where(n_at > 0, n_at * s + jnp.arange(s)[None], -1)  # longest, then most recent
        if self.tree_topk > 1:
            return self._tree(hist, length, score), state
        best_end = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
        best_n = jnp.take_along_axis(n_at, best_end[:, None], axis=1)[:, 0]  # [B] (0: no match)
        last = jnp.take_along_axis(hist, (length - 1)[:, None], axis=1)  # [B, 1]
        draft = jnp.where((best_n > 0)[:, None], self.continuation(hist, length, best_end, k), last)  # [B, K]
        return Proposal(draft.astype(jnp.int32), active=best_n >= self.active_n, length=self._want(best_n)), state

    def _tree(self, hist, length, score) -> Proposal:
        """The trie of the `tree_topk` best matches' continuations (module doc)."""
        k, d = self.tree_topk, self.tree_depth
        top, ends = jax.lax.top_k(score, k)  # [B, k] best first
        s = hist.shape[1]
        n = jnp.where(top >= 0, top // s, 0)  # [B, k] match lengths
        alive = (n > 0) & ((jnp.arange(k)[None] == 0) | (n >= self.active_n))  # [B, k]
        cont = jnp.stack([self.continuation(hist, length, ends[:, j], d) for j in range(k)], axis=1)  # [B, k, D]
        same = cont[:, :, None, :] == cont[:, None, :, :]  # [B, k, k, D]
        both = alive[:, :, None, None] & alive[:, None, :, None]  # [B, k, k, 1]
        agree = jnp.cumprod(same.astype(jnp.int32), axis=-1).astype(bool) & both  # agree through depth d
        earlier = jnp.arange(k)[:, None] < jnp.arange(k)[None, :]  # [k, k]: j' < j
        dup = jnp.any(agree & earlier[None, :, :, None], axis=1)  # [B, k, D]: (j, d) repeats an earlier branch's node
        # parent of (j, d >= 1): the first branch agreeing with j through d - 1, its node d - 1
        first = jnp.argmax(agree, axis=1)  # [B, k, D]: first j' agreeing through each depth (j itself at least)
        node = lambda j, dd: j * d + dd  # noqa: E731
        parents = jnp.where(
            jnp.arange(d)[None, None] == 0,
            -1,
            node(jnp.pad(first, ((0, 0), (0, 0), (1, 0)))[:, :, :-1], jnp.arange(d)[None, None] - 1),
        )
        dead = dup | ~alive[:, :, None]  # [B, k, D]
        parents = jnp.where(dead, -2, parents).reshape(-1, k * d)[:, : self.num_draft]  # [B, N]
        tokens = cont.reshape(-1, k * d)[:, : self.num_draft]  # [B, N]
        return Proposal(
            tokens.astype(jnp.int32),
            active=alive[:, 0] & (n[:, 0] >= self.active_n),
            length=self._want(n[:, 0]),
            parents=parents.astype(jnp.int32),
        )

    def _want(self, best_n):
        """[B] match lengths -> [B] int32 drafts (a tree: leading nodes) each row wants verified."""
        k = self.num_draft
        return jnp.where(best_n >= self.long_n, k, min(k, self.SHORT)).astype(jnp.int32)
