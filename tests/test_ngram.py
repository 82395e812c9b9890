"""The n-gram drafter's proposals and `active` flag, and the engine's plain-step path for steps
where no row has drafts worth verifying."""

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from specjax.drafters.base import Drafter, Proposal, StepContext
from specjax.drafters.ngram import NgramDrafter
from specjax.models.loading import random_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams


def propose(drafter, rows, full=False, s=16):
    hist = np.zeros((len(rows), s), np.int32)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    ctx = StepContext(
        jnp.asarray(hist),
        jnp.asarray([len(r) for r in rows], jnp.int32),
        SamplingArrays.from_params([SamplingParams()] * len(rows)),
        jnp.zeros((len(rows),), jnp.uint32),
        True,
    )
    proposal, _ = drafter.propose(None, (), ctx)
    if full:
        return proposal
    return np.asarray(proposal.draft), np.asarray(proposal.active)


def test_longest_most_recent_match_and_active_flag():
    d = NgramDrafter(3, max_n=3, min_n=1, active_n=2)
    draft, active = propose(
        d,
        [
            [7, 8, 9, 1, 7, 8],  # "7 8" matched (n = 2): continue with 9 1 7
            [5, 6, 1, 2, 3, 6],  # only "6" matches (n = 1): a guess, not active
            [1, 2, 3, 4],  # no match at all
            [4, 4, 4, 4],  # the continuation runs into the present: extended periodically
        ],
    )
    assert draft[0].tolist() == [9, 1, 7] and active[0]
    assert draft[1].tolist() == [1, 2, 3] and not active[1]
    assert draft[2].tolist() == [4, 4, 4] and not active[2]  # repeats the last token
    assert draft[3].tolist() == [4, 4, 4] and active[3]


def test_tree_is_the_trie_of_the_best_matches_continuations():
    """k = 3 branches of depth 3: the longest match's continuation first, then the next best by
    (length, recency); a branch agreeing with an earlier one shares its nodes (its own copies
    get parent -2), a branch without a good enough match is dead."""
    rows = [
        [1, 2, 3, 9, 9, 5, 4, 1, 2, 3, 7, 8, 6, 4, 1, 2, 3],  # "4 1 2 3" -> 7 8 6; "1 2 3" -> 9 9 5
        [5, 1, 2, 7, 5, 1, 2, 7, 3, 5, 1, 2],
    ]  # "5 1 2" twice: 7 3 5 and 7 5 1 share the 7
    p = propose(NgramDrafter(9, max_n=4).with_tree(3, 3), rows, full=True, s=32)
    tokens, parents = np.asarray(p.draft), np.asarray(p.parents)
    assert tokens[0, :6].tolist() == [7, 8, 6, 9, 9, 5] and parents[0, :6].tolist() == [-1, 0, 1, -1, 3, 4]
    assert parents[0, 6:].tolist() == [-2, -2, -2] and bool(p.active[0])  # no third match of 2+ tokens
    assert tokens[1, :6].tolist() == [7, 3, 5, 7, 5, 1] and parents[1, :6].tolist() == [-1, 0, 1, -2, 0, 4]
    chain = propose(NgramDrafter(3, max_n=4), rows, full=True, s=32)
    assert np.array_equal(np.asarray(chain.draft), tokens[:, :3])  # branch 0 is the chain


def test_steps_without_active_rows_are_plain_steps():
    """A drafter that is never active: no position is checked, output equals plain decoding."""
    model = random_model(tiny(num_layers=2), seed=0)
    engine = Engine(model)
    prompts = [[1, 2, 3, 1, 2], [9, 8, 7]]
    params = [SamplingParams(max_new_tokens=12)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    rows = engine.generate(prompts, params, drafter=NgramDrafter(3, active_n=99))
    assert [r.token_ids for r in rows] == plain
    assert all(sum(r.checked) == 0 and r.steps == 11 for r in rows)


def test_long_matches_want_all_k_drafts_short_ones_three():
    """K > 3: verify_lengths = (3, K); a row wants all K drafts only with a match of >= long_n
    tokens (the longest match wins, up to max_n)."""
    d = NgramDrafter(7, max_n=8, long_n=5)
    assert d.verify_lengths == (3, 7)
    assert NgramDrafter(3).verify_lengths == (3,) and NgramDrafter(2).verify_lengths == (2,)
    p = propose(
        d,
        [
            [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5],  # "1 2 3 4 5" (n = 5): long
            [1, 2, 3, 9, 1, 2, 3],  # n = 3: short
            [4, 5, 6, 7],  # no match: inactive
        ],
        full=True,
    )
    assert np.asarray(p.length).tolist() == [7, 3, 3] and np.asarray(p.active).tolist() == [True, True, False]
    assert np.asarray(p.draft)[0].tolist() == [9, 1, 2, 3, 4, 5, 9]


class OracleDrafter(Drafter):
    """Proposes the true greedy continuation (from a reference table) and wants `want[b]` drafts
    of row b verified, with verify passes compiled for `lengths`."""

    name = "oracle"

    def __init__(self, ref: np.ndarray, k: int, lengths: tuple, want: list[int]):
        super().__init__(k)
        self.ref, self.lengths, self.want = jnp.asarray(ref), lengths, tuple(want)

    @property
    def verify_lengths(self):
        return self.lengths

    def cache_key(self):
        return super().cache_key() + (id(self.ref), self.want)

    def propose(self, dparams, state, ctx):
        idx = ctx.hist_len[:, None] + jnp.arange(self.num_draft)[None]  # [B, K]
        draft = jnp.take_along_axis(self.ref, jnp.clip(idx, 0, self.ref.shape[1] - 1), axis=1)
        return Proposal(draft, length=jnp.asarray(self.want, jnp.int32)), state


def oracle_run(new: int = 22):
    """A tiny model's engine, two prompts, their sampling params, plain greedy output, and the
    reference table `[2, 64]` (prompt + output) an oracle drafter reads its drafts from."""
    model = random_model(tiny(num_layers=2), seed=0)
    engine = Engine(model)
    prompts = [[1, 2, 3, 1, 2], [9, 8, 7]]
    params = [SamplingParams(max_new_tokens=new)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    ref = np.zeros((2, 64), np.int32)
    for i, (p, t) in enumerate(zip(prompts, plain)):
        ref[i, : len(p) + len(t)] = p + t
    return engine, prompts, params, plain, ref


@pytest.mark.parametrize("want, per_step", [([2, 2], [3, 3]), ([6, 6], [7, 7]), ([2, 6], [3, 7]), ([1, 0], [3, 1])])
def test_engine_verifies_the_shortest_listed_prefix_rows_want(want, per_step):
    """All drafts are right, so a step emits exactly (checked drafts + 1) tokens. Each row checks
    what it would check alone: wanting 2, the 2-draft prefix (3 tokens a step) even when a mate
    wanting 6 makes the batch take the 6-draft pass; wanting 1 rounds up to the shortest listed
    length (2); wanting 0, nothing (a plain step inside the pass). Output = plain."""
    engine, prompts, params, plain, ref = oracle_run()
    new = params[0].max_new_tokens
    rows = engine.generate(prompts, params, drafter=OracleDrafter(ref, 6, (2, 6), want))
    assert [r.token_ids for r in rows] == plain
    for r, n in zip(rows, per_step):
        assert r.steps == -(-(new - 1) // n)  # the prefill emits the first token
        # every step checks the row's own prefix (the last one may run past the reference's end)
        assert all(c >= r.steps - 1 for c in r.checked[: n - 1]) and (n == 1 or r.checked[0] == r.steps)
        assert sum(r.checked[n - 1 :]) == 0


class OracleTreeDrafter(OracleDrafter):
    """A tree of 6 nodes: the true continuation as a spine of 4 (nodes 0-3), then a wrong branch
    of 2 under the root (nodes 4-5); row b wants its first `want[b]` nodes verified."""

    def __init__(self, ref: np.ndarray, want: list[int]):
        super().__init__(ref, 6, (2, 6), want)
        self.tree_topk, self.tree_depth = 2, 4

    def propose(self, dparams, state, ctx):
        idx = ctx.hist_len[:, None] + jnp.arange(4)[None]  # [B, 4]
        spine = jnp.take_along_axis(self.ref, jnp.clip(idx, 0, self.ref.shape[1] - 1), axis=1)
        draft = jnp.concatenate([spine, (spine[:, :2] + 1) % 64], axis=1)  # [B, 6]
        b = draft.shape[0]
        parents = jnp.broadcast_to(jnp.asarray([-1, 0, 1, 2, -1, 4], jnp.int32), (b, 6))
        return Proposal(draft, length=jnp.asarray(self.want, jnp.int32), parents=parents), state


@pytest.mark.parametrize("want, per_step", [([2, 6], [3, 5]), ([6, 2], [5, 3]), ([2, 2], [3, 3])])
def test_tree_rows_verify_the_prefix_of_nodes_they_want(want, per_step):
    """A tree's nodes come parents first, so its first L nodes are a tree: a row wanting 2 nodes
    checks the spine's first 2 (3 tokens a step) even when a mate wanting 6 makes the batch take
    the 6-node pass, which accepts that mate's whole spine of 4 (5 a step). Output = plain."""
    engine, prompts, params, plain, ref = oracle_run()
    new = params[0].max_new_tokens
    rows = engine.generate(prompts, params, drafter=OracleTreeDrafter(ref, want))
    assert [r.token_ids for r in rows] == plain
    for r, n in zip(rows, per_step):
        assert r.steps == -(-(new - 1) // n)
        assert sum(r.checked[n - 1 :]) == 0 and r.checked[0] == r.steps
