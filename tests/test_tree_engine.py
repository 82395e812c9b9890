"""Token trees in the compiled loop (EAGLE-3, draft-model and MTP dynamic trees, n-gram tries;
`Proposal.parents`): greedy output token-identical to plain decoding for the shipped drafters
(mixed-length batches, several tree shapes, gated and policy-driven rows); the sampled law of
whole tree steps equal to the target's (G-tests over every path on a tiny model, rows gated off
inside verifying batches); the greedy accept equal to the reference walk; bad tree shapes
refused in one line."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_sampled_engine import N_ROWS, PROMPT, SETTINGS, exact_law, law_pvalues

from helpers import sharpen, tiny
from specjax.bench.speculative import parse_tree
from specjax.drafters import make_drafter
from specjax.drafters.base import vocab_maps
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_weights
from specjax.errors import DrafterError
from specjax.models.loading import random_model
from specjax.models.tree import first_children
from specjax.policy.costs import cost_table
from specjax.policy.rows import AUTO
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams
from specjax.verify import accept_tree

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three uses of a hash map.",
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
]


@pytest.fixture(scope="module")
def real(default_model):
    from specjax.prompts import encode_prompt

    engine = Engine(default_model)
    ids = [encode_prompt(default_model, p) for p in PROMPTS[:2]] + [default_model.tokenizer(PROMPTS[2]).input_ids]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 24, 32)]
    plain = engine.generate(ids, params, eos_ids=default_model.config.eos_token_ids)
    return default_model, engine, ids, params, plain


@pytest.mark.parametrize(
    "spec, shape",
    [
        ("eagle3@0", (2, 3, 6)),
        ("eagle3@0", (4, 5, 16)),
        ("eagle3@0.5", (4, 5, 16)),
        ("ngram", (3, 5, 15)),
        ("draft", (3, 4, 12)),
        ("mtp", (3, 3, 9)),
    ],
)
def test_tree_greedy_is_token_identical_to_plain(real, spec, shape):
    model, engine, ids, params, plain = real
    k, depth, n = shape
    drafter = make_drafter(spec, n, model, tree_topk=k, tree_depth=depth)
    rows = engine.generate(ids, params, eos_ids=model.config.eos_token_ids, drafter=drafter)
    for p, r in zip(plain, rows):
        assert r.token_ids == p.token_ids
        assert len(r.checked) == depth and all(a <= c for a, c in zip(r.accepted, r.checked))
    verified = sum(r.checked[0] for r in rows)
    assert verified > 0 and sum(r.steps for r in rows) < sum(len(p.token_ids) for p in plain)
    if spec.endswith("@0"):  # every step verifies; a tree of 16 must beat its own chain sometimes
        assert verified == sum(r.steps for r in rows)
        assert n < 16 or sum(r.off_chain for r in rows) > 0


def test_tree_under_the_speculation_policy_is_token_identical(real):
    """`auto` with a verify that costs 2.5 plain steps: rows switch between tree and plain steps,
    the drafter's commits deferred (`Pending`, K + 1 = depth + 1 wide)."""
    model, engine, ids, params, plain = real
    drafter = make_drafter("eagle3@0", 8, model).with_tree(2, 4)
    rows = engine.generate(
        ids, params, eos_ids=model.config.eos_token_ids, drafter=drafter, spec_mode=AUTO, costs=cost_table(4, 2.5)
    )
    assert [r.token_ids for r in rows] == [p.token_ids for p in plain]
    assert 0 < sum(r.checked[0] for r in rows) < sum(r.steps for r in rows)


def test_auto_tree_size_is_measured_once_and_lossless(real):
    """`specjax.generate(num_draft="auto:4,8", tree_topk=2)`: both tree sizes are timed on the
    prompts, the faster is kept for this batch bucket (not measured again), and the output is
    token-identical to plain decoding."""
    import specjax
    from specjax.generate import _AUTO_PLAN

    model, engine, ids, params, plain = real
    kw = dict(model=model, sampling=params, drafter="eagle3@0", num_draft="auto:4,8", tree_topk=2)
    out = specjax.generate(ids, **kw)
    assert [r.token_ids for r in out] == [p.token_ids for p in plain]
    ((key, (k, _)),) = [(key, plan) for key, plan in _AUTO_PLAN.items() if key.endswith("|auto:4,8|greedy")]
    assert k in (4, 8) and all(r.stats.num_draft == k and r.stats.tree == f"2x{min(k, 5)}" for r in out)
    _AUTO_PLAN[key] = (12 - k, None)  # a recorded choice is reused, never remeasured
    again = specjax.generate(ids, **kw)
    assert {r.stats.num_draft for r in again} == {12 - k} and not any(r.stats.verified_steps for r in again)
    # `always` picks its K from the same measurement, and verifies every step
    always = specjax.generate(ids, spec_policy="always", **kw)
    assert [r.token_ids for r in always] == [p.token_ids for p in plain]
    assert all(r.stats.num_draft == 12 - k and r.stats.verified_steps == r.stats.steps for r in always)


def test_tree_shapes_a_drafter_cannot_draft_are_refused(default_model):
    eagle = make_drafter("eagle3", 8, default_model)
    assert eagle.with_tree(1, 3) is eagle  # k = 1: the chain
    for k, depth in [(2, 0), (2, 9), (2, 2)]:  # no levels; deeper than the nodes; 8 > 2 + 4 candidates
        with pytest.raises(DrafterError, match="tree"):
            eagle.with_tree(k, depth)
    with pytest.raises(DrafterError, match="chains only"):
        make_drafter("none", 0, default_model).with_tree(2, 3)
    with pytest.raises(DrafterError, match="has 3 modules, so it drafts 1..3 tokens per step; got --tree-depth 4"):
        make_drafter("mtp", 6, default_model, tree_topk=2, tree_depth=4)
    assert make_drafter("mtp", 6, default_model, tree_topk=2).tree_depth == 3  # at most its modules
    assert parse_tree("chain") == (1, 0) and parse_tree("4x5") == (4, 5)
    for bad in ("4", "1x3", "4x0", "ax5"):
        with pytest.raises(DrafterError, match="tree shape"):
            parse_tree(bad)
    assert eagle.with_tree(4, 5).label("eagle3") == "eagle3@0.5/tree4x5"


def test_greedy_tree_accept_equals_the_reference_walk():
    """Random trees with distinct siblings, targets sharp enough that paths go deep: the greedy
    fast path emits what multi-candidate rejection with one-hot target laws emits."""
    rng = np.random.RandomState(0)
    b, t, v, width = 64, 12, 6, 5
    parents = np.zeros((b, t), np.int32)
    tokens = np.zeros((b, t), np.int32)
    for r in range(b):
        depth = {-1: -1}
        used: dict = {}
        for i in range(t):
            cands = [j for j in range(-1, i) if depth[j] + 1 < width]
            par = int(rng.choice(cands))
            free = [x for x in range(v) if x not in used.get(par, set())]
            if not free:
                par, free = -1, [x for x in range(v) if x not in used.get(-1, set())] or [0]
            parents[r, i], tokens[r, i] = par, int(rng.choice(free))
            used.setdefault(par, set()).add(int(tokens[r, i]))
            depth[i] = depth[par] + 1
    logits = jnp.asarray(rng.randn(b, t + 1, v) * 3, jnp.float32)
    par, tok = jnp.asarray(parents), jnp.asarray(tokens)
    samp = SamplingArrays.from_params([SamplingParams()] * b)
    seeds = jnp.arange(b, dtype=jnp.uint32)
    fast = accept_tree(logits, tok, par, samp, seeds, True, width)
    walk = accept_tree(logits, tok, par, samp, seeds, False, width)
    for x, y in zip(fast, walk):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.asarray(fast[0]).max() >= 2
    masked = accept_tree(logits, tok, jnp.full_like(par, -2), samp, seeds, True, width)
    assert np.asarray(masked[0]).max() == 0
    np.testing.assert_array_equal(np.asarray(masked[2])[:, 0], np.asarray(jnp.argmax(logits[:, 0], -1)))


def test_first_children():
    par = jnp.asarray([[-1, 0, 0, 1, -1, 3, 2], [-1, -1, 1, 1, 0, 2, 5]])
    assert first_children(par, 5).tolist() == [[0, 1, 3, 5, -1], [0, 4, -1, -1, -1]]


# ---- the sampled law of whole tree steps ------------------------------------------------------

V = 16
TREES = ["tree", "tree_gated", "draft_tree"]
ALPHA = 1e-3 / (2 * len(SETTINGS) * len(TREES))


class GatedTree(Eagle3Drafter):
    """Rows believe in their tree at even history lengths only: verifying batches hold rows that
    accept nothing (their tree masked off)."""

    def propose(self, dparams, state, ctx):
        p, state = super().propose(dparams, state, ctx)
        return p.replace(active=ctx.hist_len % 2 == 0), state


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = tiny(vocab_size=V, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    target = sharpen(random_model(cfg, seed=0))
    d2t, _ = vocab_maps(np.arange(V)[::-1], 12)  # a draft vocabulary of 12 of the 16 tokens
    weights = init_weights(Eagle3Config.for_target(cfg, draft_vocab_size=12), d2t, seed=4)
    pure = weights.params  # sharpen the drafter's head too: its top-k then carries most of its mass
    pure["head"][...] = pure["head"][...] * 8.0
    return target, weights, sharpen(random_model(dataclasses.replace(cfg, num_layers=1), seed=5))


@pytest.mark.parametrize("which", TREES)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_sampled_tree_steps_have_the_target_law(tiny_pair, which, setting):
    """Trees of 6 nodes, 3 children per expanded node over 2 levels: a step emits up to 3 tokens,
    so the first three tokens' law covers whole tree steps: paths where the first child is
    rejected and a later sibling accepted (counted: `off_chain`), all children rejected, and
    rows gated off."""
    target, weights, small = tiny_pair
    if which == "draft_tree":  # a separate one-layer draft model's top-3 tree
        drafter = DraftModelDrafter(6, small, target.config).with_tree(3, 2)
    else:
        drafter = (GatedTree if which == "tree_gated" else Eagle3Drafter)(6, weights, target).with_tree(3, 2)
    sp = SETTINGS[setting]
    seeded = [dataclasses.replace(sp, seed=sp.seed * N_ROWS + 11 + i) for i in range(N_ROWS)]
    rows = Engine(target).generate([PROMPT] * N_ROWS, seeded, drafter=drafter)
    assert all(len(r.token_ids) == 3 for r in rows)
    pvalues = law_pvalues(rows, exact_law(target, PROMPT, sp, 3))
    assert min(pvalues) > ALPHA, pvalues
    acc, chk = sum(sum(r.accepted) for r in rows), sum(sum(r.checked) for r in rows)
    assert 0 < acc < chk
    assert sum(r.off_chain for r in rows) > N_ROWS // 100


def test_sampled_tree_steps_through_the_pallas_kernel_equal_the_reference(tiny_pair):
    """The engine with the tree kernel (interpret mode) emits what it emits with the reference."""
    target, weights, _ = tiny_pair
    drafter = Eagle3Drafter(6, weights, target).with_tree(3, 2)
    params = [dataclasses.replace(SETTINGS[1], seed=i, max_new_tokens=12) for i in range(16)]
    ref, ker = (
        Engine(target, implementation=impl).generate([PROMPT] * 16, params, drafter=drafter)
        for impl in ("reference", "pallas")
    )
    assert [r.token_ids for r in ref] == [r.token_ids for r in ker]
    assert sum(sum(r.accepted) for r in ref) > 0
