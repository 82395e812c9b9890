"""Tree verification is lossless: G-tests (alpha = 1e-3, Bonferroni) over whole tree steps,
1e5 draws per case, against the target's law computed exactly; lossy variants fail them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rejection_sampling import g_test_pvalue

from pallas_kernels.tree_sampling import tree_sample_reference, tree_walk

V, LAST, N_DRAWS = 6, 0, 100_000
# A fixed tree of distinct candidates: root -> 0 (tok 1), 1 (tok 2), 2 (tok 3); 0 -> 3 (tok 4), 4 (tok 2)
TOKENS = [1, 2, 3, 4, 2]
PARENTS = [-1, -1, -1, 0, 0]
CASES = ("generic", "truncated", "onehot")
N_LAWS = len(CASES) + 3  # the fixed-tree sequence law per case; iid: first token, second token; disjoint
ALPHA = 1e-3 / N_LAWS


def target_table(name: str, seed: int = 0) -> np.ndarray:
    """P[x] `[V, V]`: the target's next-token law after token x (a one-token-context model)."""
    rng = np.random.RandomState(seed)
    table = rng.dirichlet(np.ones(V), size=V)
    if name == "truncated":  # top-k / top-p style zeros, including candidate tokens
        table[:, [2, 5]] = 0.0
        table /= table.sum(1, keepdims=True)
    if name == "onehot":  # a greedy target
        table = np.eye(V)[rng.randint(0, V, V)]
    return table


def sequence_law(table: np.ndarray) -> dict[tuple, float]:
    """Exact law of the emitted tokens: sample from the target along the tree while the sampled
    token is a child; the first token that is not (or the token after a leaf) ends the step."""
    law: dict[tuple, float] = {}

    def walk(node, prefix, prob, last):
        kids = {TOKENS[j]: j for j in range(len(TOKENS)) if PARENTS[j] == node}
        for x in range(V):
            px = prob * table[last, x]
            if px == 0:
                continue
            if x in kids:
                walk(kids[x], prefix + (x,), px, x)
            else:
                law[prefix + (x,)] = law.get(prefix + (x,), 0.0) + px

    walk(-1, (), 1.0, LAST)
    return law


def run_fixed_tree(table, fn=tree_sample_reference, seed=1):
    n = N_DRAWS
    rows = np.array([LAST] + TOKENS)  # p row i + 1 follows node i
    p = jnp.broadcast_to(jnp.asarray(table[rows], jnp.float32), (n, len(TOKENS) + 1, V))
    tokens = jnp.broadcast_to(jnp.asarray(TOKENS, jnp.int32), (n, len(TOKENS)))
    parents = jnp.broadcast_to(jnp.asarray(PARENTS, jnp.int32), (n, len(TOKENS)))
    seeds = jax.random.bits(jax.random.key(seed), (n,), jnp.uint32)
    out = fn(p, None, tokens, parents, seeds)
    return [np.asarray(x) for x in out]


def sequence_pvalue(emitted: np.ndarray, law: dict) -> float:
    keys = list(law)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    for row in emitted:
        seq = tuple(int(t) for t in row if t >= 0)
        counts[index.get(seq, len(keys))] += 1
    if counts[-1]:
        return 0.0  # a sequence the target never emits
    return g_test_pvalue(counts, np.array([law[k] for k in keys] + [0.0]))


@pytest.mark.parametrize("name", CASES)
def test_fixed_tree_emits_the_targets_law(name):
    table = target_table(name)
    n, path, emitted = run_fixed_tree(table)
    assert sequence_pvalue(emitted, sequence_law(table)) > ALPHA
    # the path names the accepted nodes root first, consistent with the emitted tokens
    for k in range(3):
        ok = n > k
        assert (np.asarray(TOKENS)[path[ok, k]] == emitted[ok, k]).all()
    if name == "generic":  # the cases that matter happened: a later sibling accepted, all rejected
        first = emitted[:, 0]
        assert ((n > 0) & (first == 3)).mean() > 0.05  # node 2, tried after 0 and 1 were rejected
        assert (n == 0).mean() > 0.05


def lossy_no_update(r, q_row):  # test the next sibling against the unchanged residual
    return r


def lossy_unnormalised(r, q_row):  # remove the rejected mass but do not renormalise
    return jnp.maximum(r - q_row, 0.0)


@pytest.mark.parametrize("residual", [lossy_no_update, lossy_unnormalised])
def test_lossy_variants_fail(residual):
    table = target_table("generic")
    _, _, emitted = run_fixed_tree(table, lambda *a: tree_walk(*a, residual=residual))
    assert sequence_pvalue(emitted, sequence_law(table)) < ALPHA


def run_iid(p_table, q_table, k=3, seed=2):
    """Depth-1 trees: k children drawn i.i.d. from the drafter's q (duplicates allowed)."""
    n = N_DRAWS
    key = jax.random.key(seed)
    q0 = jnp.asarray(q_table[LAST], jnp.float32)
    tokens = jax.random.categorical(key, jnp.log(q0), shape=(n, k)).astype(jnp.int32)  # [n, k]
    p = jnp.concatenate(
        [
            jnp.broadcast_to(jnp.asarray(p_table[LAST], jnp.float32), (n, 1, V)),
            jnp.asarray(p_table, jnp.float32)[tokens],
        ],
        axis=1,
    )  # [n, k+1, V]
    q = jnp.broadcast_to(jnp.concatenate([q0[None], jnp.zeros((k, V))]), (n, k + 1, V))
    seeds = jax.random.bits(jax.random.fold_in(key, 1), (n,), jnp.uint32)
    return [np.asarray(x) for x in tree_sample_reference(p, q, tokens, jnp.full((n, k), -1, jnp.int32), seeds)]


def test_iid_siblings_are_lossless():
    """First token ~ the target's law; after an accepted child, the bonus token ~ the target's
    law after it (SpecInfer's multi-candidate residuals)."""
    p_table, q_table = target_table("generic", 3), target_table("generic", 4)
    n, _, emitted = run_iid(p_table, q_table)
    first = np.bincount(emitted[:, 0], minlength=V)
    assert g_test_pvalue(first, p_table[LAST]) > ALPHA
    acc = n == 1
    assert 0.2 < acc.mean() < 0.95
    joint = np.zeros((V, V))
    np.add.at(joint, (emitted[acc, 0], emitted[acc, 1]), 1)
    expected = (joint.sum(1, keepdims=True) * p_table).ravel()
    assert g_test_pvalue(joint.ravel(), expected / expected.sum()) > ALPHA


def test_disjoint_supports_reject_every_sibling():
    p_table = np.zeros((V, V))
    p_table[:, :3] = target_table("generic", 5)[:, :3]
    p_table /= p_table.sum(1, keepdims=True)
    q_table = np.zeros((V, V))
    q_table[:, 3:] = 1 / 3
    n, _, emitted = run_iid(p_table, q_table)
    assert (n == 0).all()
    assert g_test_pvalue(np.bincount(emitted[:, 0], minlength=V), p_table[LAST]) > ALPHA


def test_chain_tree_is_the_chain_sampler():
    """parents = i - 1 with q: the same accept counts as rejection_sampling's chain rule on
    deterministic draws (acceptance only; the final races use different streams)."""
    rng = np.random.RandomState(7)
    b, k = 2000, 4
    p = jnp.asarray(rng.dirichlet(np.ones(V), size=(b, k + 1)), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(V), size=(b, k)), jnp.float32)
    draft = jnp.asarray(rng.randint(0, V, (b, k)), jnp.int32)
    seeds = jnp.asarray(rng.randint(0, 2**31, b), jnp.uint32)
    qt = jnp.concatenate([q, jnp.zeros((b, 1, V))], axis=1)
    n, path, _ = tree_sample_reference(p, qt, draft, jnp.broadcast_to(jnp.arange(k) - 1, (b, k)), seeds)
    # the walk accepts draft i with probability min(1, p_i / q_i) given the previous accepted:
    # check that against the exact chain probabilities, in distribution
    acc = np.asarray(p)[np.arange(b)[:, None], np.arange(k)[None], np.asarray(draft)]
    qd = np.asarray(q)[np.arange(b)[:, None], np.arange(k)[None], np.asarray(draft)]
    probs = np.minimum(1, acc / qd)
    expected_n = sum(np.prod(probs[:, : i + 1], axis=1) for i in range(k))  # E[n] per row
    assert abs(np.asarray(n).mean() - expected_n.mean()) < 4 * np.sqrt(expected_n.var() / b + 1e-3)
    assert all((np.asarray(path)[r, : n[r]] == np.arange(int(n[r]))).all() for r in range(50))


def test_law_enumeration_sums_to_one():
    for name in CASES:
        assert abs(sum(sequence_law(target_table(name)).values()) - 1) < 1e-12


def _random_trees(b, t, v, seed=0):
    """Trees whose candidates are often the target's likely tokens (so paths get accepted), with
    duplicate siblings, zero-probability candidates and a masked row (parents -2)."""
    rng = np.random.RandomState(seed)
    logits = rng.randn(b, t + 1, v)
    logits[:, :, 9:12] += 9.0  # a few likely tokens per position
    logits[:, :, 5:9] = -np.inf  # truncation: tokens with no mass
    p = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    parents = np.full((b, t), -1, np.int32)
    for r in range(b):
        for i in range(1, t):
            parents[r, i] = rng.randint(-1, i)
    pn = np.asarray(p)
    tokens = np.zeros((b, t), np.int32)
    for r in range(b):
        for i in range(t):
            row = pn[r, parents[r, i] + 1]
            tokens[r, i] = rng.choice(v, p=row / row.sum()) if rng.rand() < 0.7 else rng.randint(0, 12)
    parents[0] = -2
    return p, jnp.asarray(tokens), jnp.asarray(parents), jnp.arange(b, dtype=jnp.uint32) * 7919


def test_pallas_tree_kernel_equals_the_reference_exactly():
    """Interpret mode on CPU, a vocabulary of three ragged tiles: every output bit-identical."""
    from pallas_kernels.tree_sampling import tree_sample_pallas

    p, tokens, parents, seeds = _random_trees(19, 10, 4100)
    ref = tree_sample_reference(p, None, tokens, parents, seeds)
    got = tree_sample_pallas(p, tokens, parents, seeds, interpret=True)
    for x, y in zip(ref, got):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    n = np.asarray(ref[0])
    assert n[0] == 0 and n.max() >= 2 and (n == 0).sum() > 1


def test_one_hot_walk_equals_the_general_walk_in_law():
    """The scalar walk over deterministic candidates and the general walk with q = one-hot at
    each tried sibling (`tree_walk`) draw from one law: the same G-test table for both."""
    table = target_table("generic", seed=3)
    law = sequence_law(table)
    _, _, fast = run_fixed_tree(table, seed=4)
    _, _, general = run_fixed_tree(table, tree_walk, seed=5)
    assert sequence_pvalue(fast, law) > ALPHA and sequence_pvalue(general, law) > ALPHA


@pytest.mark.parametrize("platform, backend", [("tpu", "mosaic_tpu"), ("cuda", "triton")])
def test_tree_kernel_lowers_for_accelerators(platform, backend):
    from pallas_kernels.tree_sampling import tree_kernel_lowers

    assert tree_kernel_lowers(backend, platform, 4, 16, 49152)
