"""Logit processing (temperature, top-k, top-p) and sampling: exact cases, then the law of
`sample` by a chi-square test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import sampling
from specjax.errors import InvalidSamplingError
from specjax.sampling import NEG_INF, SamplingArrays, SamplingParams

V = 32
ROWS = 8  # the exact-case tests pad their batches to 8 rows so that they share compiled code
_process = jax.jit(sampling.process_logits)
_target = jax.jit(sampling.target_probs)
_sample = jax.jit(sampling.sample)


def _pad(logits, s: SamplingArrays):
    """Pad the batch to ROWS rows with greedy rows (which do not affect the other rows)."""
    b = logits.shape[0]
    if b >= ROWS:
        return logits, s, b
    n = ROWS - b
    logits = jnp.concatenate([jnp.asarray(logits), jnp.zeros((n,) + logits.shape[1:], jnp.float32)])
    s = SamplingArrays(
        temperature=jnp.concatenate([s.temperature, jnp.zeros(n, jnp.float32)]),
        top_k=jnp.concatenate([s.top_k, jnp.zeros(n, jnp.int32)]),
        top_p=jnp.concatenate([s.top_p, jnp.ones(n, jnp.float32)]),
    )
    return logits, s, b


def process_logits(logits, s):
    logits, s, b = _pad(logits, s)
    return _process(logits, s)[:b]


def target_probs(logits, s):
    logits, s, b = _pad(logits, s)
    return _target(logits, s)[:b]


def sample(seeds, logits, s):
    logits, s, b = _pad(logits, s)
    return _sample(jnp.pad(seeds, (0, logits.shape[0] - b)), logits, s)[:b]


def arrays(temperature, top_k=0, top_p=1.0, n=None):
    """SamplingArrays from scalars or per-row lists."""
    t, k, p = (np.atleast_1d(np.asarray(x)) for x in (temperature, top_k, top_p))
    n = n or max(len(t), len(k), len(p))
    return SamplingArrays(
        temperature=jnp.broadcast_to(jnp.asarray(t, jnp.float32), (n,)),
        top_k=jnp.broadcast_to(jnp.asarray(k, jnp.int32), (n,)),
        top_p=jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n,)),
    )


def distinct_logits(seed, *shape):
    """Logits with no ties (a random permutation of spread-out values per row)."""
    rng = np.random.default_rng(seed)
    base = np.linspace(-4.0, 4.0, shape[-1], dtype=np.float32)
    out = np.empty(shape, np.float32)
    for idx in np.ndindex(*shape[:-1]):
        out[idx] = rng.permutation(base) + rng.uniform(-0.01, 0.01, shape[-1]).astype(np.float32)
    return out


def kept(x) -> np.ndarray:
    return np.asarray(x) > NEG_INF / 2


def softmax_np(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def minimal_nucleus(logits, p) -> set[int]:
    """Smallest set of most likely tokens whose probability mass is >= p."""
    probs = softmax_np(logits.astype(np.float32))
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    n = int(np.searchsorted(mass, p - 1e-7)) + 1  # first prefix with mass >= p
    return set(order[:n].tolist())


def test_greedy_rows_are_argmax():
    logits = jnp.asarray(distinct_logits(0, 4, V))
    # greedy regardless of top-k/top-p settings in the row
    s = arrays(0.0, [0, 3, 0, 5], [1.0, 1.0, 0.2, 0.5])
    want = np.asarray(logits).argmax(-1)
    for seed in range(3):
        np.testing.assert_array_equal(np.asarray(sample(jnp.full((4,), seed, jnp.uint32), logits, s)), want)
    probs = np.asarray(target_probs(logits, s))
    np.testing.assert_array_equal(probs, np.eye(V, dtype=np.float32)[want])
    # greedy rows pass through process_logits unchanged (callers take the argmax)
    np.testing.assert_array_equal(np.asarray(process_logits(logits, s)), np.asarray(logits))


@pytest.mark.parametrize("k", [1, 2, 5, V - 1, V])
def test_top_k_keeps_exactly_k(k):
    logits = distinct_logits(1, 3, V)
    x = np.asarray(process_logits(jnp.asarray(logits), arrays(1.0, k, 1.0, n=3)))
    for r in range(3):
        assert kept(x[r]).sum() == k
        assert set(np.flatnonzero(kept(x[r]))) == set(np.argsort(-logits[r])[:k].tolist())
        shifted = logits[r] - logits[r].max()  # T = 1: processed logits are shifted by the max
        np.testing.assert_array_equal(x[r][kept(x[r])], shifted[kept(x[r])])


def test_top_p_keeps_minimal_nucleus_exact_case():
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04], np.float32)
    perm = np.array([3, 0, 4, 1, 2])  # token i has probability probs[perm[i]]
    logits = np.log(probs[perm])[None]
    for p, want in [
        (0.45, {0.5}),
        (0.5, {0.5}),
        (0.75, {0.5, 0.3}),
        (0.85, {0.5, 0.3, 0.1}),
        (0.95, {0.5, 0.3, 0.1, 0.06}),
        (1.0, set(probs.tolist())),
    ]:
        x = np.asarray(process_logits(jnp.asarray(logits), arrays(1.0, 0, p, n=1)))[0]
        got = {float(probs[perm[i]]) for i in np.flatnonzero(kept(x))}
        assert got == {float(np.float32(v)) for v in want}, p


def test_top_p_keeps_minimal_nucleus_random():
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((64, V)) * 2).astype(np.float32)
    ps = rng.uniform(0.05, 0.99, 64).astype(np.float32)
    x = np.concatenate(
        [
            np.asarray(process_logits(jnp.asarray(logits[i : i + ROWS]), arrays(1.0, 0, ps[i : i + ROWS])))
            for i in range(0, 64, ROWS)
        ]
    )
    checked = 0
    for r in range(64):
        mass = np.cumsum(np.sort(softmax_np(logits[r]))[::-1])
        if np.min(np.abs(mass - ps[r])) < 1e-4:
            continue  # too close to a boundary for an f32 verdict
        assert set(np.flatnonzero(kept(x[r]))) == minimal_nucleus(logits[r], ps[r]), r
        checked += 1
    assert checked > 50


def test_top_k_then_top_p_on_the_truncated_distribution():
    """Top-p is computed on the distribution left by top-k (HF warper order)."""
    logits = distinct_logits(3, 1, V)[0]
    k, p = 6, 0.7
    top = np.argsort(-logits)[:k]
    sub = np.full(V, -np.inf, np.float32)
    sub[top] = logits[top]
    want = minimal_nucleus(np.where(np.isinf(sub), -1e30, sub).astype(np.float32), p)
    x = np.asarray(process_logits(jnp.asarray(logits[None]), arrays(1.0, k, p, n=1)))[0]
    assert set(np.flatnonzero(kept(x))) == want
    assert len(want) < k


@pytest.mark.parametrize("t", [0.25, 0.7, 1.0, 2.5])
def test_temperature_scaling(t):
    logits = distinct_logits(4, 2, V)
    x = np.asarray(process_logits(jnp.asarray(logits), arrays(t, 0, 1.0, n=2)))
    shifted = (logits - logits.max(-1, keepdims=True)) / np.float32(t)  # the law is shift-invariant
    np.testing.assert_allclose(x, shifted, rtol=1e-6, atol=1e-6)
    probs = np.asarray(target_probs(jnp.asarray(logits), arrays(t, 0, 1.0, n=2)))
    np.testing.assert_allclose(probs, softmax_np(logits / np.float32(t)), rtol=1e-5, atol=1e-7)
    # temperature is applied before top-p: a colder distribution needs fewer tokens
    cold = np.asarray(process_logits(jnp.asarray(logits), arrays(t, 0, 0.9, n=2)))
    for r in range(2):
        assert set(np.flatnonzero(kept(cold[r]))) == minimal_nucleus(logits[r] / np.float32(t), 0.9)


def test_tiny_temperature_does_not_overflow():
    """Any T > 0 is valid; logits / T must not overflow to inf (which made categorical pick the
    first overflowed token and target_probs NaN)."""
    logits = jnp.asarray([[1.0, 8.0, 10.0, -3.0]], jnp.float32)
    for t in (1e-6, 1e-30, 2e-38, 1e-40):
        s = arrays(t, 0, 1.0, n=1)
        np.testing.assert_array_equal(np.asarray(target_probs(logits, s))[0], [0, 0, 1, 0])
        assert {int(sample(jnp.full((1,), i, jnp.uint32), logits, s)[0]) for i in range(5)} == {2}


def test_top_p_one_keeps_the_whole_tail_beside_a_truncating_row():
    """top_p = 1 is off even when a batch-mate's top-p makes the batch sort: the f32 cumulative
    mass reaches 1 before a long, light tail ends, and those tokens must stay."""
    logits = jnp.asarray(np.stack([np.linspace(30.0, -30.0, V)] * 2), jnp.float32)
    x = np.asarray(process_logits(logits, arrays([1.0, 1.0], 0, [1.0, 0.5])))
    assert kept(x[0]).all()
    assert kept(x[1]).sum() == 1


def test_per_row_settings_in_one_batch():
    logits = jnp.asarray(distinct_logits(5, 5, V))
    rows = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.8)]
    batch = arrays(*[list(c) for c in zip(*rows)])
    x = np.asarray(process_logits(logits, batch))
    probs = np.asarray(target_probs(logits, batch))
    for r, (t, k, p) in enumerate(rows):
        one = arrays(t, k, p, n=1)
        np.testing.assert_array_equal(x[r], np.asarray(process_logits(logits[r : r + 1], one))[0])
        np.testing.assert_allclose(probs[r], np.asarray(target_probs(logits[r : r + 1], one))[0], rtol=1e-6)
    assert kept(x[2]).sum() == 3
    # a batch where no row truncates takes the no-sort branch and gives the same rows
    plain = arrays([0.0, 0.7], 0, 1.0)
    np.testing.assert_array_equal(np.asarray(process_logits(logits[:2], plain)), x[:2])


def test_extra_axes_and_greedy_sample_shape():
    """Settings are per row [B]; logits may carry extra axes [B, T, V] (verify positions)."""
    logits = jnp.asarray(distinct_logits(6, 2, 3, V))
    s = arrays([0.0, 1.0], [0, 4], [1.0, 1.0])
    tok = np.asarray(sample(jnp.zeros((2,), jnp.uint32), logits, s))
    assert tok.shape == (2, 3) and tok.dtype == np.int32
    np.testing.assert_array_equal(tok[0], np.asarray(logits[0]).argmax(-1))
    for j in range(3):
        assert tok[1, j] in set(np.argsort(-np.asarray(logits[1, j]))[:4].tolist())


CASES = [  # (temperature, top_k, top_p): each row of one batched draw
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.5, 7, 1.0),
    (1.0, 0, 0.8),
    (0.8, 10, 0.9),
]
N_DRAWS = 100_000


def test_sample_law_chi_square():
    """`sample`'s frequencies match `target_probs` (all rows in one batched call; Bonferroni
    over rows, alpha 1e-3). The statistic itself is computed in float64: scipy requires the
    observed and expected totals to agree to 1.5e-8."""
    rng = np.random.default_rng(7)
    base = (rng.standard_normal((len(CASES), V)) * 1.2).astype(np.float32)
    logits = jnp.broadcast_to(jnp.asarray(base)[:, None], (len(CASES), N_DRAWS, V))  # [B, N, V]
    s = arrays(*[list(c) for c in zip(*CASES)])
    draws = np.asarray(_sample(jnp.full((len(CASES),), 123, jnp.uint32), logits, s))  # [B, N]
    probs = np.asarray(_target(jnp.asarray(base), s)).astype(np.float64)  # [B, V]
    alpha = 1e-3 / len(CASES)
    for r in range(len(CASES)):
        counts = np.bincount(draws[r], minlength=V)
        support = probs[r] > 0
        assert counts[~support].sum() == 0, f"row {r} drew truncated tokens"
        expected = probs[r][support] / probs[r][support].sum() * N_DRAWS
        assert expected.min() >= 5, "cell too small for chi-square"
        _, pval = stats.chisquare(counts[support], expected)
        assert pval > alpha, (r, CASES[r], pval)

    # The test has power: row 1's draws (T = 0.6) fail against the law with T forgotten.
    wrong = softmax_np(base[1]).astype(np.float64)
    _, pval = stats.chisquare(np.bincount(draws[1], minlength=V), wrong / wrong.sum() * N_DRAWS)
    assert pval < 1e-12


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=-0.2),
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
    ],
)
def test_invalid_params(kw):
    with pytest.raises(InvalidSamplingError):
        SamplingParams(**kw)


def test_valid_params_edges():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
