"""End-to-end law of sampled speculative decoding: the engine's first generated tokens have the
target's distribution, for a drafter with soft probabilities and for one without.

A tiny random model with a 16-token vocabulary lets us enumerate the exact law of the first
tokens (every path through the model) and compare it with many independent rows of one batch
by a G-test (alpha = 1e-3, Bonferroni over the laws tested here).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.engine import Engine
from specjax.models.config import tiny
from specjax.models.loading import random_model
from specjax.sampling import SamplingArrays, SamplingParams, target_probs
from test_rejection_sampling import g_test_pvalue

V = 16
N_ROWS = 16_000
PROMPT = [3, 7, 3, 7, 3]
SETTINGS = [SamplingParams(temperature=1.0, max_new_tokens=3, seed=1),
            SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=3, seed=2)]
WHICH = ["draft_model", "draft_vocab", "ngram", "ngram_prefix"]
ALPHA = 1e-3 / (2 * len(SETTINGS) * len(WHICH))
DRAFT_VOCAB = np.array([0, 2, 3, 5, 7, 8, 11, 14])  # draft tokens: half the vocabulary


def sharpen(model, scale=4.0):
    """Scale the head so the law has a few likely paths (random tiny models are near uniform)."""
    pure = nnx.to_pure_dict(model.params)
    pure["lm_head"] = pure["lm_head"] * scale
    nnx.replace_by_pure_dict(model.params, pure)
    return model


@pytest.fixture(scope="module")
def models():
    cfg = tiny(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    target = sharpen(random_model(cfg, seed=0))
    draft = sharpen(random_model(cfg, seed=1), 2.0)
    return target, draft


def exact_law(model, prompt, sp: SamplingParams, n_tokens: int):
    """P(first n generated tokens) by enumerating every path: dict path -> probability.
    All paths of one depth go through the model as one batch."""

    @jax.jit
    def last_probs(params, seqs, samp):
        m = nnx.merge(model.graphdef, params)
        logits, _, _ = m(seqs, m.new_cache(seqs.shape[0], 64))
        return target_probs(logits[:, -1], samp)

    law = {(): 1.0}
    for _ in range(n_tokens):
        paths = list(law)
        seqs = jnp.asarray([prompt + list(p) for p in paths], jnp.int32)  # [P, T]
        samp = SamplingArrays.from_params([sp] * len(paths))
        probs = np.asarray(last_probs(model.params, seqs, samp))  # [P, V]
        law = {
            path + (int(t),): law[path] * float(probs[i, t])
            for i, path in enumerate(paths)
            for t in np.nonzero(probs[i] > 0)[0]
        }
    return law


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_sampled_speculative_output_has_target_law(models, which, setting):
    """`draft_vocab`: a draft model that proposes only from half the vocabulary (q = 0 elsewhere);
    `ngram_prefix`: 5 drafts of which every row wants 3 verified (the engine's shorter verify
    pass, `Drafter.verify_lengths` = (3, 5))."""
    target, draft = models
    sp = SETTINGS[setting]
    if which == "ngram":
        drafter = NgramDrafter(2, max_n=2)
    elif which == "ngram_prefix":
        drafter = NgramDrafter(5, max_n=2, active_n=1, long_n=99)
        assert drafter.verify_lengths == (3, 5)
    else:
        drafter = DraftModelDrafter(2, draft, target.config,
                                    draft_vocab=DRAFT_VOCAB if which == "draft_vocab" else None)
    rows = Engine(target).generate([PROMPT] * N_ROWS, [sp] * N_ROWS, drafter=drafter)
    assert all(len(r.token_ids) == 3 for r in rows)
    law3 = exact_law(target, PROMPT, sp, 3)
    # joint law of the first two tokens (crosses a verify step boundary when drafts are rejected)
    law2: dict = {}
    for path, pr in law3.items():
        law2[path[:2]] = law2.get(path[:2], 0.0) + pr
    cells = sorted(law2)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    for r in rows:
        counts[index[tuple(r.token_ids[:2])]] += 1
    p_joint = g_test_pvalue(counts, np.array([law2[c] for c in cells]))
    # marginal of the third token
    third = np.zeros(V)
    for path, pr in law3.items():
        third[path[2]] += pr
    p_third = g_test_pvalue(np.bincount([r.token_ids[2] for r in rows], minlength=V), third)
    assert min(p_joint, p_third) > ALPHA, (p_joint, p_third)
    if which == "ngram_prefix":  # verified, never past the 3 drafts the rows wanted
        assert sum(r.checked[0] for r in rows) > 0 and all(r.checked[3:] == [0, 0] for r in rows)
    if not which.startswith("ngram"):  # drafts with soft q were actually accepted and rejected
        acc = sum(sum(r.accepted) for r in rows)
        chk = sum(sum(r.checked) for r in rows)
        assert 0 < acc < chk
