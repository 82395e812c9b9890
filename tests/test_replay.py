"""The offline replay (specjax/bench/replay.py) counts the steps the engine takes at batch 1."""

import pytest

from helpers import tiny
from specjax.bench.replay import replay
from specjax.drafters.ngram import NgramDrafter
from specjax.models.loading import random_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams


@pytest.mark.parametrize("shape", ["chain5", "chain8", "tree3x4"])
def test_replay_counts_the_engines_steps(shape):
    """A random model's greedy text repeats itself, so the n-gram drafter verifies, accepts and is
    rejected along the way; replaying its proposals against the plain replies gives each row's
    step count in the engine exactly, chain or tree."""
    engine = Engine(random_model(tiny(num_layers=2), seed=0))
    prompts = [[1, 2, 3, 1, 2], [9, 8, 7], [5, 5, 6, 5, 5, 6, 5]]
    params = SamplingParams(max_new_tokens=40)
    plain = [engine.generate([p], [params])[0].token_ids for p in prompts]
    drafter = {
        "chain5": NgramDrafter(5),
        "chain8": NgramDrafter(8),
        "tree3x4": NgramDrafter(8).with_tree(3, 4),
    }[shape]
    figures = replay(drafter, list(zip(prompts, plain)))
    for i, p in enumerate(prompts):
        (row,) = engine.generate([p], [params], drafter=drafter)
        assert row.token_ids == plain[i]
        assert figures.steps[i] == row.steps
        assert figures.tokens[i] == len(plain[i]) - 1  # the prefill emits the first token
    assert figures.verify_steps.sum() > 0 and figures.mal > 1.0
