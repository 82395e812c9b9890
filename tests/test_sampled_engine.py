"""End-to-end law of sampled speculative decoding: the engine's first generated tokens have the
target's distribution, for a drafter with soft probabilities and for one without.

A tiny random model with a 16-token vocabulary lets us enumerate the exact law of the first
tokens (every path through the model) and compare it with many independent rows of one batch
by a G-test (alpha = 1e-3, Bonferroni over the laws tested here).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_rejection_sampling import g_test_pvalue

from helpers import sharpen, tiny
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models.loading import random_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams, target_probs

V = 16
N_ROWS = 16_000
PROMPT = [3, 7, 3, 7, 3]
SETTINGS = [
    SamplingParams(temperature=1.0, max_new_tokens=3, seed=1),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=3, seed=2),
]
WHICH = ["draft_model", "draft_vocab", "draft_gated", "ngram", "ngram_prefix", "dflash", "dflash_tree", "dspark"]
ALPHA = 1e-3 / (2 * len(SETTINGS) * len(WHICH))
DRAFT_VOCAB = np.array([0, 2, 3, 5, 7, 8, 11, 14])  # draft tokens: half the vocabulary


class GatedDraftModel(DraftModelDrafter):
    """Soft drafts that a row believes in at even lengths only: rows that accepted different
    numbers of drafts part, so batches verify while some rows are inactive, whose drafts (and q)
    the engine masks."""

    def propose(self, dparams, state, ctx):
        p, state = super().propose(dparams, state, ctx)
        active = ctx.hist_len % 2 == 0  # [B]
        return p.replace(active=active), state


def tiny_dflash(target):
    """A random one-layer DFlash drafter for the target: K = 2 drafts from a 3-position block,
    drawn from q (its logits scaled up so q is neither flat nor a point mass)."""
    from specjax.drafters import dflash

    c = target.config
    cfg = dflash.DFlashConfig(
        dataclasses.replace(c, num_layers=1, qk_norm=True),
        dflash.default_target_layers(c.num_layers, 1),
        c.num_layers,
        3,
        V - 1,
        logit_scale=3.0,
    )
    return dflash.DFlashDrafter(2, dflash.init_weights(cfg, seed=2), target)


def tiny_dspark(target):
    """A random one-layer DSpark drafter: K = 2 drafts from a 2-position block, each drawn from
    its Markov-biased q (the bias scaled up so that the second draft's law depends on the first)."""
    from specjax.drafters import dflash, dspark

    c = target.config
    cfg = dspark.DSparkConfig(
        dataclasses.replace(c, num_layers=1, qk_norm=True),
        dflash.default_target_layers(c.num_layers, 1),
        c.num_layers,
        2,
        V - 1,
        logit_scale=3.0,
        markov_rank=4,
    )
    w = dspark.init_weights(cfg, seed=3)
    pure = nnx.to_pure_dict(w.params)
    pure["markov_w1"], pure["markov_w2"] = pure["markov_w1"] * 60.0, pure["markov_w2"] * 60.0
    nnx.replace_by_pure_dict(w.params, pure)
    return dspark.DSparkDrafter(2, w, target)


def independent_rows(target, sp: SamplingParams, **generate_kw):
    """N_ROWS copies of PROMPT under `sp`, each row its own seed (one random stream each)."""
    seeded = [dataclasses.replace(sp, seed=sp.seed * N_ROWS + i) for i in range(N_ROWS)]
    return Engine(target).generate([PROMPT] * N_ROWS, seeded, **generate_kw)


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


def law_pvalues(rows, law: dict) -> list[float]:
    """G-test p-values of the rows' first tokens against the exact `law` of paths of n >= 3
    tokens: the joint law of the first two (it crosses a verify step boundary when drafts are
    rejected), then the marginal of each later token."""
    n = len(next(iter(law)))
    law2: dict = {}
    marginals = np.zeros((n, V))
    for path, pr in law.items():
        law2[path[:2]] = law2.get(path[:2], 0.0) + pr
        for i in range(2, n):
            marginals[i, path[i]] += pr
    cells = sorted(law2)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    for r in rows:
        counts[index[tuple(r.token_ids[:2])]] += 1
    out = [g_test_pvalue(counts, np.array([law2[c] for c in cells]))]
    for i in range(2, n):
        out.append(g_test_pvalue(np.bincount([r.token_ids[i] for r in rows], minlength=V), marginals[i]))
    return out


@pytest.mark.parametrize("which", WHICH)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_sampled_speculative_output_has_target_law(models, which, setting):
    """`draft_vocab`: a draft model that proposes only from half the vocabulary (q = 0 elsewhere);
    `draft_gated`: soft drafts, rows inactive on alternate steps inside verifying batches;
    `ngram_prefix`: 5 drafts of which every row wants 3 verified (the engine's shorter verify
    pass, `Drafter.verify_lengths` = (3, 5))."""
    target, draft = models
    sp = SETTINGS[setting]
    if which == "ngram":
        drafter = NgramDrafter(2, max_n=2)
    elif which == "ngram_prefix":
        drafter = NgramDrafter(5, max_n=2, active_n=1, long_n=99)
        assert drafter.verify_lengths == (3, 5)
    elif which == "draft_gated":
        drafter = GatedDraftModel(2, draft, target.config)
    elif which == "dflash":  # a block of drafts from one pass, each drawn from its own q
        drafter = tiny_dflash(target)
    elif which == "dflash_tree":  # its spine tree: 2 levels, 2 candidates each, deterministic
        drafter = tiny_dflash(target).with_num_draft(4).with_tree(2, 2)
    elif which == "dspark":  # drafts drawn left to right, each q given the draft before it
        drafter = tiny_dspark(target)
    else:
        drafter = DraftModelDrafter(
            2, draft, target.config, draft_vocab=DRAFT_VOCAB if which == "draft_vocab" else None
        )
    # independent rows: one stream each
    rows = independent_rows(target, sp, drafter=drafter)
    assert all(len(r.token_ids) == 3 for r in rows)
    pvalues = law_pvalues(rows, exact_law(target, PROMPT, sp, 3))
    assert min(pvalues) > ALPHA, pvalues
    if which == "ngram_prefix":  # verified, never past the 3 drafts the rows wanted
        assert sum(r.checked[0] for r in rows) > 0 and all(r.checked[3:] == [0, 0] for r in rows)
    if not which.startswith("ngram"):  # drafts with soft q were actually accepted and rejected
        acc = sum(sum(r.accepted) for r in rows)
        chk = sum(sum(r.checked) for r in rows)
        assert 0 < acc < chk


def test_a_dflash_drafter_with_the_wrong_q_fails_the_law(models):
    """Teeth: the same DFlash drafts handed to the sampler with q sharpened (q^3, renormalised),
    not the law they were drawn from, bias the output, and the G-test above sees it."""
    from specjax.drafters import dflash

    class WrongQ(dflash.DFlashDrafter):
        def propose(self, dparams, st, ctx):
            p, st = super().propose(dparams, st, ctx)
            q = p.q**3
            return p.replace(q=q / jnp.sum(q, axis=-1, keepdims=True)), st

    target, _ = models
    good = tiny_dflash(target)
    sp = SETTINGS[0]
    rows = independent_rows(target, sp, drafter=WrongQ(2, good.weights, target))
    assert min(law_pvalues(rows, exact_law(target, PROMPT, sp, 3))) < ALPHA


def test_a_dspark_drafter_that_reports_q_without_its_markov_bias_fails_the_law(models):
    """Teeth for DSpark's exact per-draft q: the same drafts (drawn with the Markov bias) handed to
    the sampler with the backbone's q alone bias the output."""
    from specjax.drafters import dspark
    from specjax.drafters.base import draft_token

    class NoBiasQ(dspark.DSparkDrafter):
        def draft_chain(self, dparams, h, anchor, ctx):
            draft, _, conf = super().draft_chain(dparams, h, anchor, ctx)
            base = self._net(dparams).logits(dparams["head"], h)  # [B, K, N]
            qs = [
                draft_token(ctx.seeds, j, base[:, j], dparams["d2t"], V, ctx.sampling, False)[1]
                for j in range(self.num_draft)
            ]
            return draft, jnp.stack(qs, axis=1), conf

    target, _ = models
    good = tiny_dspark(target)
    sp = SETTINGS[0]
    rows = independent_rows(target, sp, drafter=NoBiasQ(2, good.weights, target))
    assert min(law_pvalues(rows, exact_law(target, PROMPT, sp, 3))) < ALPHA


def scheduled_dspark(target, lossy: bool = False):
    """`tiny_dspark` with a confidence head that reads the token before each draft alone:
    c = 0.73 after tokens t = 0 mod 3, ~1 after t = 1 mod 3, ~0 after t = 2 mod 3. Under costs
    [1, 1.9, 2.0] the early stop verifies nothing after an anchor of the first class, while the
    best L over the whole scan verifies both drafts there unless the first draft is of the third
    class: the first draft's value then decides whether it is verified (`lossy`)."""
    from specjax.drafters import dspark

    base = tiny_dspark(target)
    w = base.weights
    pure = nnx.to_pure_dict(w.params)
    score = np.array([1.0, 6.0, -6.0])[np.arange(V) % 3]  # [V]
    w1 = np.array(pure["markov_w1"])
    w1[:, 0] = score
    pure["markov_w1"] = jnp.asarray(w1)
    conf_w = np.zeros(pure["conf_w"].shape, np.float32)
    conf_w[0, w.config.hidden_size] = 1.0  # reads W1[prev][0] = score[prev]
    pure["conf_w"], pure["conf_b"] = jnp.asarray(conf_w), jnp.zeros((1,), jnp.float32)
    nnx.replace_by_pure_dict(w.params, pure)

    class GlobalBest(dspark.DSparkDrafter):
        @staticmethod
        def schedule(conf, costs):
            b, k = conf.shape
            expect = 1.0 + jnp.concatenate([jnp.zeros((b, 1)), jnp.cumsum(jnp.cumprod(conf, axis=1), axis=1)], 1)
            return jnp.argmax(expect / costs[None], axis=1).astype(jnp.int32)

    return (GlobalBest if lossy else dspark.DSparkDrafter)(2, w, target)


@pytest.mark.parametrize("lossy", [False, True])
def test_dspark_confidence_scheduled_length_keeps_the_law_only_with_the_early_stop(models, lossy):
    """The verify length chosen from DSpark's confidences under a cost table: lossless with the
    paper's early stop; choosing the best length over the whole scan fails the G-test."""
    from specjax.policy.rows import ALWAYS

    target, _ = models
    drafter = scheduled_dspark(target, lossy)
    sp = SETTINGS[0]
    rows = independent_rows(target, sp, drafter=drafter, spec_mode=ALWAYS, costs=np.array([1.0, 1.9, 2.0], np.float32))
    pvalues = law_pvalues(rows, exact_law(target, PROMPT, sp, 3))
    checked = np.sum([r.checked for r in rows], axis=0)
    assert checked[0] > 0 and checked[1] > 0  # both lengths were verified
    if lossy:
        assert min(pvalues) < ALPHA
    else:
        assert min(pvalues) > ALPHA, pvalues


# ---- per-row random streams (specjax/sampling.py) ----------------------------------------------


def test_a_sampled_row_depends_on_its_seed_not_on_its_batch(models):
    """A row draws from its own seed's stream and checks the drafts it would check alone: at
    another index of a larger batch, beside other prompts, settings and seeds and a greedy mate
    whose n-gram matches make the batch verify, it emits what it emits alone; plain, with a draft
    model, a gated one and the n-gram drafter (two verify lengths). Rows with one prompt and one
    seed agree; other seeds give other texts."""
    target, draft = models
    engine = Engine(target)
    row = SamplingParams(temperature=1.0, max_new_tokens=12, seed=77)
    mates = [SamplingParams(temperature=0.7, top_k=6, max_new_tokens=5, seed=3), SamplingParams(max_new_tokens=24)]
    repetitive = [1, 2, 3] * 4  # the greedy mate's n-gram matches make its batches verify
    drafters = (
        None,
        DraftModelDrafter(2, draft, target.config),
        GatedDraftModel(2, draft, target.config),
        NgramDrafter(5, max_n=2, long_n=4),
    )
    for drafter in drafters:
        alone = engine.generate([PROMPT], [row], drafter=drafter)[0]
        batch = engine.generate([[1, 2, 3], repetitive, PROMPT, PROMPT], mates + [row, row], drafter=drafter)
        assert batch[2].token_ids == alone.token_ids and batch[3].token_ids == alone.token_ids
        assert batch[2].checked == alone.checked
        others = engine.generate([PROMPT] * 8, [dataclasses.replace(row, seed=s) for s in range(8)], drafter=drafter)
        assert len({tuple(r.token_ids) for r in others}) > 1


def test_unseeded_rows_draw_fresh_streams(models):
    """`seed=None` (the default) draws a fresh seed per row, so copies of one prompt differ, as in
    vLLM; an explicit seed reproduces the text across calls."""
    import specjax

    target, _ = models
    free = SamplingParams(temperature=1.0, max_new_tokens=12)
    assert free.seed is None
    texts = {tuple(r.token_ids) for r in specjax.generate([PROMPT] * 6, model=target, sampling=free)}
    assert len(texts) > 1
    seeded = dataclasses.replace(free, seed=9)
    again = [specjax.generate([PROMPT], model=target, sampling=seeded)[0].token_ids for _ in range(2)]
    assert again[0] == again[1]


def test_sampled_law_holds_across_rows_switching_speculation_off_and_on(models):
    """`--spec-policy auto` with a verify that costs 1.45 plain steps: a row whose first draft is
    rejected expects 1.44 tokens a verify (acceptance 1/3 with the prior), too few, but loses so
    little that it waits one plain step (PROBE_LOSS) and probes again; one whose drafts are
    accepted keeps verifying. Over the first four tokens rows mix verify and plain steps in every order
    the policy allows; the first two tokens' joint law and the third's and fourth's marginals are
    the target's."""
    from specjax.policy.costs import cost_table
    from specjax.policy.rows import AUTO

    target, draft = models
    sp = SETTINGS[0]
    seeded = [dataclasses.replace(sp, seed=7 * N_ROWS + i, max_new_tokens=4) for i in range(N_ROWS)]
    rows = Engine(target).generate(
        [PROMPT] * N_ROWS,
        seeded,
        drafter=DraftModelDrafter(2, draft, target.config),
        spec_mode=AUTO,
        costs=cost_table(2, 1.45),
    )
    assert all(len(r.token_ids) == 4 for r in rows)
    switched = sum(1 for r in rows if r.checked[0] >= 2 and r.steps > r.checked[0])  # verify, plain, verify
    stayed_on = sum(1 for r in rows if r.checked[0] == r.steps >= 2)  # accepted enough to keep verifying
    assert switched > N_ROWS // 20 and stayed_on > N_ROWS // 20, (switched, stayed_on)
    pvalues = law_pvalues(rows, exact_law(target, PROMPT, sp, 4))
    assert min(pvalues) > 1e-3 / len(pvalues), pvalues
