"""Rejection sampling: exact table cases, statistical losslessness, Pallas == reference, lowering.

Statistical tests use a G-test at alpha = 1e-3 with a Bonferroni correction over every law tested
in this file; each case draws >= 1e5 speculative steps with independent seeds.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels import kernel_plan as kp
from pallas_kernels import rejection_sampling as rs
from pallas_kernels.counter_hash import hash_uniform, unit_float
from pallas_kernels.rejection_sampling import rejection_sample, rejection_sample_pallas, rejection_sample_reference
from specjax.sampling import SamplingArrays, target_probs
from specjax.verify import accept_chain

N_DRAWS = 100_000
N_PALLAS_DRAWS = 20_000  # interpret mode is slow; the exact-agreement test covers the rest
V, K = 12, 3
CASES = ["p_eq_q", "disjoint", "onehot_q", "q_zero_where_p", "temperature", "top_k", "top_p", "generic"]
N_LAWS = len(CASES) * 3 * 2  # first token, accepted count, bonus token; reference and Pallas
ALPHA = 1e-3 / N_LAWS


def g_test_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """G-test of observed counts against probabilities; cells with tiny expectation are pooled."""
    probs = np.asarray(probs, np.float64)
    counts = np.asarray(counts, np.float64)
    assert counts[probs == 0].sum() == 0, "mass observed where the law has none"
    counts, probs = counts[probs > 0], probs[probs > 0]
    exp = probs * counts.sum()
    keep = exp >= 5
    obs_k, exp_k = counts[keep], exp[keep]
    if (~keep).any() and exp[~keep].sum() > 0:
        obs_k = np.append(obs_k, counts[~keep].sum())
        exp_k = np.append(exp_k, exp[~keep].sum())
    if len(obs_k) < 2:
        return 1.0
    exp_k = exp_k * obs_k.sum() / exp_k.sum()
    return stats.power_divergence(obs_k, exp_k, lambda_="log-likelihood").pvalue


def make_case(name: str, seed: int = 0):
    """Returns (p [K+1, V], q [K, V] | None, fixed drafts [K] | None) after identical processing."""
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=(K + 1, V)) * 1.5
    lq = rng.normal(size=(K, V)) * 1.5
    samp = None
    if name == "p_eq_q":
        lq = lp[:K].copy()
    elif name == "disjoint":
        lp[:, : V // 2] = -np.inf
        lq[:, V // 2 :] = -np.inf
    elif name == "q_zero_where_p":
        lq[:, :3] = -np.inf  # tokens the target likes and the drafter never proposes
        lp[:, :3] += 2.0
    elif name == "temperature":
        samp = SamplingArrays(jnp.asarray([0.6]), jnp.asarray([0]), jnp.asarray([1.0]))
    elif name == "top_k":
        samp = SamplingArrays(jnp.asarray([1.3]), jnp.asarray([4]), jnp.asarray([1.0]))
    elif name == "top_p":
        samp = SamplingArrays(jnp.asarray([1.0]), jnp.asarray([0]), jnp.asarray([0.7]))
    samp = samp or SamplingArrays(jnp.asarray([1.0]), jnp.asarray([0]), jnp.asarray([1.0]))
    p = np.asarray(target_probs(jnp.asarray(lp, jnp.float32)[None], samp))[0]
    q = np.asarray(target_probs(jnp.asarray(lq, jnp.float32)[None], samp))[0]
    if name == "onehot_q":
        return p, None, np.array([int(np.argmax(p[0])), 5, 7])
    if name == "p_eq_q":
        # exactly p: softmax over [K+1, V] and over [K, V] may round differently in the last bit,
        # and then u * q < p rejects with probability ~1e-7 per draft
        q = p[:K].copy()
    return p, q, None


def run(impl, p, q, fixed, n, seed=0):
    """n independent speculative steps: drafts drawn from q (or fixed), fresh seed per row."""
    key = jax.random.key(seed)
    pb = jnp.broadcast_to(jnp.asarray(p), (n, K + 1, V))
    if q is None:
        qb, draft = None, jnp.broadcast_to(jnp.asarray(fixed, jnp.int32), (n, K))
    else:
        qb = jnp.broadcast_to(jnp.asarray(q), (n, K, V))
        draft = jax.random.categorical(key, jnp.log(qb), axis=-1).astype(jnp.int32)
    seeds = jax.random.bits(jax.random.fold_in(key, 1), (n,), jnp.uint32)
    if impl == "reference":
        out = rejection_sample_reference(pb, qb, draft, seeds)
    else:
        out = rejection_sample_pallas(pb, qb, draft, seeds, interpret=True)
    return np.asarray(out[0]), np.asarray(out[1])


def accept_probs(p, q, fixed):
    """Per-position acceptance probability alpha_i = sum_v min(p_i, q_i) (q one-hot if fixed)."""
    if q is None:
        q = np.eye(V)[fixed]
    return np.minimum(p[:K], q).sum(axis=1)


def check_laws(n_acc, tokens, p, q, fixed):
    # 1. first emitted token ~ p_0
    first = tokens[:, 0]
    pv1 = g_test_pvalue(np.bincount(first, minlength=V), p[0])
    # 2. accepted count: P(n = j) = prod_{i<j} a_i * (1 - a_j), P(n = K) = prod a_i
    a = accept_probs(p, q, fixed)
    law = np.array([np.prod(a[:j]) * (1 - a[j]) for j in range(K)] + [np.prod(a)])
    pv2 = g_test_pvalue(np.bincount(n_acc, minlength=K + 1), law)
    # 3. bonus token (all accepted) ~ p_K
    bonus = tokens[n_acc == K, K]
    pv3 = g_test_pvalue(np.bincount(bonus, minlength=V), p[K]) if len(bonus) >= 200 else 1.0
    return pv1, pv2, pv3


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_output_law_matches_target(name, impl):
    p, q, fixed = make_case(name)
    n_draws = N_DRAWS if impl == "reference" else N_PALLAS_DRAWS
    # not hash(): salted per process
    n_acc, tokens = run(impl, p, q, fixed, n_draws, seed=zlib.crc32(name.encode()) % 1000)
    pvals = check_laws(n_acc, tokens, p, q, fixed)
    assert min(pvals) > ALPHA, f"{name}/{impl}: p-values {pvals}"
    if name == "p_eq_q":
        assert (n_acc == K).all()  # identical distributions: everything is accepted
    if name == "disjoint":
        assert (n_acc == 0).all()  # nothing in common: nothing is accepted


def lossy_reference(p, q, draft, seeds):
    """A classic bug: on rejection, resample from p instead of the residual max(p - q, 0)."""
    b, kp1, v = p.shape
    k = kp1 - 1
    u = hash_uniform(seeds[:, None], jnp.arange(kp1)[None], jnp.uint32(7))
    pd = jnp.take_along_axis(p[:, :k], draft[:, :, None], axis=2)[..., 0]
    qd = jnp.take_along_axis(q, draft[:, :, None], axis=2)[..., 0]
    acc = u[:, :k] * qd < pd
    n = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1)
    fresh = jax.random.categorical(jax.random.key(0), jnp.log(p), axis=-1)  # [B, K+1] from p
    final = jnp.take_along_axis(fresh, n[:, None], axis=1)[:, 0]
    first = jnp.where(n > 0, draft[:, 0], final)
    return n, jnp.concatenate([first[:, None], fresh[:, 1:]], axis=1)


def test_statistical_test_catches_a_lossy_sampler():
    p, q, fixed = make_case("generic")
    key = jax.random.key(5)
    n = N_DRAWS
    qb = jnp.broadcast_to(jnp.asarray(q), (n, K, V))
    draft = jax.random.categorical(key, jnp.log(qb), axis=-1).astype(jnp.int32)
    seeds = jax.random.bits(key, (n,), jnp.uint32)
    n_acc, tokens = lossy_reference(jnp.broadcast_to(jnp.asarray(p), (n, K + 1, V)), qb, draft, seeds)
    pv_first, _, _ = check_laws(np.asarray(n_acc), np.asarray(tokens), p, q, fixed)
    assert pv_first < ALPHA, "the G-test failed to detect a sampler that ignores the residual"


@pytest.mark.parametrize("name", ["generic", "onehot_q", "top_p", "disjoint"])
def test_pallas_equals_reference_exactly(name):
    p, q, fixed = make_case(name, seed=3)
    for seed in range(2):
        r = run("reference", p, q, fixed, 3000, seed)
        k = run("pallas", p, q, fixed, 3000, seed)
        np.testing.assert_array_equal(r[0], k[0])
        np.testing.assert_array_equal(r[1], k[1])


def test_pallas_equals_reference_large_vocab_and_odd_batch():
    """Several vocab tiles, a vocab that is not a multiple of the tile, rows not a block multiple."""
    b, k, v = 5, 4, 5000
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    p = jax.nn.softmax(jax.random.normal(k1, (b, k + 1, v)) * 3, -1)
    q = jax.nn.softmax(jax.random.normal(k2, (b, k, v)) * 3, -1)
    d = jax.random.randint(k3, (b, k), 0, v)
    seeds = jnp.arange(b, dtype=jnp.uint32) * 977
    for qq in (q, None):
        r = rejection_sample_reference(p, qq, d, seeds)
        pk = rejection_sample_pallas(p, qq, d, seeds, interpret=True, rows_per_block=2)
        np.testing.assert_array_equal(np.asarray(r[0]), np.asarray(pk[0]))
        np.testing.assert_array_equal(np.asarray(r[1]), np.asarray(pk[1]))


def random_step(b, k, v, seed=1, dtype=jnp.float32):
    """Random p [B, K+1, V], q [B, K, V] (peaked, so races are not all near ties), drafts, seeds."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    p = jax.nn.softmax(jax.random.normal(k1, (b, k + 1, v)) * 3, -1).astype(dtype)
    q = jax.nn.softmax(jax.random.normal(k2, (b, k, v)) * 3, -1).astype(dtype)
    d = jax.random.randint(k3, (b, k), 0, v)
    return p, q, d, jnp.arange(b, dtype=jnp.uint32) * 977 + seed


def assert_same(a, b):
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.parametrize("backend", [None, "mosaic_tpu", "triton", "mosaic_gpu"])
@pytest.mark.parametrize("k,v,tile", [(1, 1000, 128), (4, 1000, 256), (9, 700, 128)])
def test_vocab_tiles_equal_reference(backend, k, v, tile):
    """Several vocab tiles, a ragged last tile (V not a multiple of the tile), ragged row blocks;
    the reduce layout (None, Mosaic TPU) and the split layout (GPU backends), interpreted."""
    p, q, d, seeds = random_step(5, k, v)
    plan = kp.kernel_plan(backend, 5, k, v, p.dtype, rows=2, tile=tile)
    assert plan.n_tiles >= 3 and v % tile
    for qq in (q, None):
        want = rejection_sample_reference(p, qq, d, seeds)
        assert_same(
            want,
            rejection_sample_pallas(
                p, qq, d, seeds, interpret=True, backend=backend, rows_per_block=2, vocab_tile=tile
            ),
        )


def test_vocab_tiles_bf16_inputs_equal_reference():
    """bf16 p and q stay bf16 in the blocks; the kernel computes in f32, like the reference."""
    p, q, d, seeds = random_step(3, 3, 600, dtype=jnp.bfloat16)
    for backend in (None, "triton"):
        assert_same(
            rejection_sample_reference(p, q, d, seeds),
            rejection_sample_pallas(p, q, d, seeds, interpret=True, backend=backend, vocab_tile=128),
        )


def tpu_interpret_params(**kw):
    from jax.experimental.pallas import tpu as pltpu

    if not hasattr(pltpu, "InterpretParams"):
        pytest.skip("this jax has no TPU interpret mode")
    return pltpu.InterpretParams(**kw)  # out-of-bounds reads raise; buffers start as NaN


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("tile", [256, None])
def test_tpu_interpret_mode_equals_reference(with_q, tile):
    """The Mosaic TPU layout under TPU interpret mode (VMEM, DMAs and the sequential vocab axis
    simulated): blocks overhang the K+1 positions, the last row block and the last vocab tile."""
    visited = []

    def record(token, grid_point, core):
        visited.append(tuple(int(i) for i in grid_point))
        return token

    params = tpu_interpret_params(grid_point_recorder=record)
    p, q, d, seeds = random_step(3, 4, 1000, seed=4)
    qq = q if with_q else None
    got = rejection_sample_pallas(
        p, qq, d, seeds, interpret=params, backend="mosaic_tpu", rows_per_block=2, vocab_tile=tile
    )
    assert_same(rejection_sample_reference(p, qq, d, seeds), got)
    plan = kp.kernel_plan("mosaic_tpu", 3, 4, 1000, p.dtype, with_q, rows=2, tile=tile)
    rows, tiles = plan.grid
    assert sorted(visited) == [(i, j) for i in range(rows) for j in range(tiles)]  # every program once
    for i in range(rows):  # the vocab axis runs in order within a row block
        assert [j for r, j in visited if r == i] == list(range(tiles))


# ---- block budgets ---------------------------------------------------------------------------

BUDGET_VOCABS = [32000, 49152, 128256, 151936]


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton", "mosaic_gpu"])
@pytest.mark.parametrize("vocab", BUDGET_VOCABS)
def test_blocks_fit_the_budget(backend, vocab):
    """Every program's blocks (double buffered inputs and outputs, scratch, TPU temporaries) fit
    the backend's budget for K = 1..16, f32 and bf16, dense and one-hot q, batch 1..64."""
    budget = kp.memory_budget(backend)
    assert budget <= (8 << 20 if backend == "mosaic_tpu" else 96 << 10)
    for k in range(1, 17):
        for dtype in (jnp.float32, jnp.bfloat16):
            for has_q in (True, False):
                for batch in (1, 8, 64):
                    plan = kp.kernel_plan(backend, batch, k, vocab, dtype, has_q)
                    got = kp.block_bytes(plan)
                    where = (backend, vocab, k, jnp.dtype(dtype).name, has_q, batch, got)
                    assert got["total"] <= budget, where
                    assert plan.n_tiles * plan.tile >= vocab > (plan.n_tiles - 1) * plan.tile, where
                    assert plan.tile % 128 == 0 and plan.tile % plan.chunk == 0, where
                    if backend == "mosaic_tpu":
                        assert plan.positions % 8 == 0 and plan.positions >= k + 1, where
                    else:
                        assert got["largest_block"] <= kp.GPU_MAX_BLOCK_ELEMENTS, where
                        assert plan.tile & (plan.tile - 1) == 0 and plan.positions & (plan.positions - 1) == 0, where


def test_block_bytes_follow_the_specs():
    """The calculator reads the BlockSpecs the kernel is built with; a whole-vocab block (the
    untiled layout) would not fit the TPU budget at 128k vocab."""
    plan = kp.kernel_plan("mosaic_tpu", 8, 7, 128256, jnp.float32)
    specs = kp.kernel_specs(plan)
    assert specs.in_specs[2].block_shape == (8, 8, plan.tile) == specs.in_specs[3].block_shape
    assert len(specs.scratch_shapes) == 6 and plan.grid == (1, pl_cdiv(128256, plan.tile))
    assert rs._compiler_params(plan, False).dimension_semantics == ("parallel", "arbitrary")
    got = kp.block_bytes(plan)
    assert got["inputs"] >= 2 * 2 * 8 * 8 * plan.tile * 4
    whole = kp.kernel_plan("mosaic_tpu", 8, 7, 128256, jnp.float32, tile=128256 // 128 * 128 + 128)
    assert kp.block_bytes(whole)["total"] > 16 << 20
    with pytest.raises(ValueError):
        kp.kernel_plan("triton", 8, 7, 128256, jnp.float32, tile=384)


def pl_cdiv(a, b):
    return -(-a // b)


# ---- exact table cases ---------------------------------------------------------------------


def onehot(idx, v=V):
    return np.eye(v, dtype=np.float32)[idx]


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_table_cases(impl):
    """Deterministic p (one-hot) makes every outcome exact."""
    f = (
        (lambda *a: rejection_sample_reference(*a))
        if impl == "reference"
        else (lambda *a: rejection_sample_pallas(*a, interpret=True))
    )
    target = [3, 5, 7, 9]  # target's token at positions 0..3 (K = 3)
    p = jnp.asarray(onehot(target))[None]  # [1, 4, V]
    seeds = jnp.asarray([11], jnp.uint32)
    cases = {  # drafts -> (n_accepted, emitted)
        (3, 5, 7): (3, [3, 5, 7, 9]),  # all accepted + bonus
        (4, 5, 7): (0, [3, -1, -1, -1]),  # first rejected: recovered = target's token
        (3, 5, 8): (2, [3, 5, 7, -1]),  # last rejected
        (3, 6, 7): (1, [3, 5, -1, -1]),  # a later match does not count after a miss
    }
    for drafts, (n_exp, toks) in cases.items():
        d = jnp.asarray([drafts], jnp.int32)
        for q in (None, jnp.asarray(onehot(list(drafts)))[None]):
            n, t = f(p, q, d, seeds)
            assert int(n[0]) == n_exp, (drafts, q is None)
            assert np.asarray(t[0]).tolist() == toks, (drafts, q is None)


def test_k_zero_is_plain_sampling_of_p():
    p = jnp.asarray(onehot([4]))[None]  # [1, 1, V]
    n, t = rejection_sample_reference(p, None, jnp.zeros((1, 0), jnp.int32), jnp.asarray([1], jnp.uint32))
    assert int(n[0]) == 0 and np.asarray(t).tolist() == [[4]]
    n, t = rejection_sample_pallas(p, None, jnp.zeros((1, 0), jnp.int32), jnp.asarray([1], jnp.uint32), interpret=True)
    assert int(n[0]) == 0 and np.asarray(t).tolist() == [[4]]


def test_padded_and_finished_rows_do_not_disturb_others():
    """Rows are independent: a batch gives each row what it gets alone (padding rows included)."""
    b, k, v = 6, 3, 40
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    p = jax.nn.softmax(jax.random.normal(k1, (b, k + 1, v)), -1)
    q = jax.nn.softmax(jax.random.normal(k2, (b, k, v)), -1)
    d = jax.random.randint(k3, (b, k), 0, v)
    seeds = jnp.arange(b, dtype=jnp.uint32) + 100
    full = rejection_sample_reference(p, q, d, seeds)
    for i in range(b):
        one = rejection_sample_reference(p[i : i + 1], q[i : i + 1], d[i : i + 1], seeds[i : i + 1])
        assert int(one[0][0]) == int(full[0][i])
        assert np.asarray(one[1][0]).tolist() == np.asarray(full[1][i]).tolist()
    # a zero-probability ("finished") row is well defined: falls back to argmax, never NaN
    p0 = p.at[0].set(0.0)
    n, t = rejection_sample_reference(p0, q, d, seeds)
    assert int(n[0]) == 0 and 0 <= int(t[0, 0]) < v


def test_greedy_accept_fast_path_matches_sampler():
    """verify.accept's greedy path equals rejection sampling with one-hot p."""
    b, k, v = 8, 4, 30
    logits = jax.random.normal(jax.random.key(0), (b, k + 1, v))
    best = jnp.argmax(logits, -1)
    rng = np.random.default_rng(0)
    drafts = np.asarray(best[:, :k]).copy()
    for i in range(b):  # break the chain at a random place (or not at all)
        j = rng.integers(0, k + 1)
        if j < k:
            drafts[i, j] = (drafts[i, j] + 1) % v
    drafts = jnp.asarray(drafts, jnp.int32)
    samp = SamplingArrays(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b))
    n1, t1 = accept_chain(logits, drafts, None, samp, jnp.arange(b, dtype=jnp.uint32), greedy=True)
    n2, t2 = accept_chain(
        logits, drafts, None, samp, jnp.arange(b, dtype=jnp.uint32), greedy=False, implementation="reference"
    )
    np.testing.assert_array_equal(np.asarray(n1), np.asarray(n2))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))


def test_hash_uniform_is_uniform():
    u = np.asarray(hash_uniform(jnp.uint32(3), jnp.arange(64)[:, None], jnp.arange(4096)[None])).ravel()
    assert 0 < u.min() and u.max() < 1
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    assert stats.chisquare(counts).pvalue > 1e-4


# ---- lowering for accelerators without the hardware ---------------------------------------


@pytest.mark.parametrize("platform,backend", [("tpu", "mosaic_tpu"), ("cuda", "triton")])
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("b,k,v,dtype", [(2, 5, 49152, jnp.float32), (8, 16, 151936, jnp.bfloat16)])
def test_kernel_lowers_for_accelerators(platform, backend, with_q, b, k, v, dtype):
    """The tiled kernel lowers to Mosaic (TPU) and Triton (GPU) IR from this CPU-only machine."""
    from jax import export

    args = [
        jax.ShapeDtypeStruct((b, k + 1, v), dtype),
        jax.ShapeDtypeStruct((b, k, v), dtype),
        jax.ShapeDtypeStruct((b, k), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.uint32),
    ]

    def f(p, q, d, s):
        return rejection_sample_pallas(p, q if with_q else None, d, s, backend=backend)

    target = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}[platform]
    exp = export.export(
        jax.jit(f), platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
    )(*args)
    assert target in exp.mlir_module()


def test_gpu_backend_follows_the_jax_version():
    """Pallas Triton is deprecated from jax 0.11: Mosaic GPU first there, Triton first before."""
    assert rs.gpu_kernel_backends("0.10.2") == ("triton", "mosaic_gpu")
    assert rs.gpu_kernel_backends("0.11.2") == ("mosaic_gpu", "triton")
    assert rs.gpu_kernel_backends("0.12.0.dev20260801") == ("mosaic_gpu", "triton")
    assert rs.gpu_kernel_backends("1.0") == ("mosaic_gpu", "triton")


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2"])
def test_backend_choice_is_the_first_that_lowers(version):
    """By lowering on this jax: the choice is the first backend in the version's order whose
    `jax.export` for cuda succeeds (Triton lowers on 0.10 and 0.11; see docs/accelerators.md
    for Mosaic GPU)."""
    shape, order = (2, 8, 49152), rs.gpu_kernel_backends(version)
    lowers = {be: rs.kernel_lowers(be, "cuda", shape, "float32", True) for be in order}
    assert lowers["triton"]
    assert rs.choose_kernel_backend("cuda", shape, "float32", True, version) == next(be for be in order if lowers[be])
    assert rs.choose_kernel_backend("tpu", shape, "float32", True, version) == "mosaic_tpu"


def test_auto_falls_back_to_the_reference_when_no_backend_lowers(monkeypatch):
    p, q, d, seeds = random_step(2, 3, 300)
    monkeypatch.setattr(rs, "target_platform", lambda: "gpu")
    monkeypatch.setattr(rs, "kernel_lowers", lambda *a: False)
    assert rs.choose_kernel_backend("gpu", p.shape, "float32", True) is None
    assert_same(rejection_sample_reference(p, q, d, seeds), rejection_sample(p, q, d, seeds, "auto"))


def test_implementation_switch():
    p = jnp.asarray(onehot([1, 2]))[None]
    d = jnp.asarray([[1]], jnp.int32)
    s = jnp.asarray([0], jnp.uint32)
    for impl in ("auto", "pallas", "reference"):
        n, t = rejection_sample(p, None, d, s, implementation=impl)
        assert int(n[0]) == 1 and np.asarray(t[0]).tolist() == [1, 2]
    with pytest.raises(ValueError):
        rejection_sample(p, None, d, s, implementation="cuda-magic")


def test_uniforms_are_strictly_inside_zero_one():
    """The acceptance uniforms at the extreme bit patterns: never 0 or 1 (u = 1 would reject a
    draft whose p equals q), and u * q < q for every q > 0, so p = q always accepts."""
    u = np.asarray(unit_float(jnp.asarray([0, 511, 0xFFFFFFFF], jnp.uint32)))
    assert 0 < u.min() and u.max() < 1 and u[-1] == np.float32(1 - 2**-24)
    q = np.float32([0.5, 0.3, 1e-30, 0.999999, 2**-20 * 1.7])
    assert (u[-1] * q < q).all()
