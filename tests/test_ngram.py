"""The n-gram drafter's proposals and `active` flag, and the engine's plain-step path for steps
where no row has drafts worth verifying."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import StepContext
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Engine
from specjax.models.config import tiny
from specjax.models.loading import random_model
from specjax.sampling import SamplingArrays, SamplingParams


def propose(drafter, rows):
    s = 16
    hist = np.zeros((len(rows), s), np.int32)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = r
    ctx = StepContext(jnp.asarray(hist), jnp.asarray([len(r) for r in rows], jnp.int32),
                      SamplingArrays.from_params([SamplingParams()] * len(rows)), jax.random.key(0), True)
    proposal, _ = drafter.propose(None, (), ctx)
    return np.asarray(proposal.draft), np.asarray(proposal.active)


def test_longest_most_recent_match_and_active_flag():
    d = NgramDrafter(3, max_n=3, min_n=1, active_n=2)
    draft, active = propose(d, [
        [7, 8, 9, 1, 7, 8],  # "7 8" matched (n = 2): continue with 9 1 7
        [5, 6, 1, 2, 3, 6],  # only "6" matches (n = 1): a guess, not active
        [1, 2, 3, 4],  # no match at all
        [4, 4, 4, 4],  # the continuation runs into the present: extended periodically
    ])
    assert draft[0].tolist() == [9, 1, 7] and active[0]
    assert draft[1].tolist() == [1, 2, 3] and not active[1]
    assert draft[2].tolist() == [4, 4, 4] and not active[2]  # repeats the last token
    assert draft[3].tolist() == [4, 4, 4] and active[3]


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
