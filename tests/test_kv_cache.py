"""The functional KV cache: incremental decoding equals one full forward, rows of a batch are
independent (mixed prompt lengths, different per-row advances, rollback by not advancing).

Tiny random model from `random_model(tiny())`, weights scaled up so that greedy continuations
are diverse (at the default 0.02 init a 2-layer model quickly falls into 2-cycles, which would
make token comparisons weak).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specjax
from helpers import rel_err, tiny
from specjax.models.kv_cache import KVCache, write_rows
from specjax.models.loading import random_model

TOL = 1e-5
S = 64  # cache size of the model-level tests


@pytest.fixture(scope="module")
def model():
    m = random_model(tiny(), seed=0)
    m.params = jax.tree.map(lambda a: a * 20.0, m.params)
    return m


@pytest.fixture(scope="module")
def fwd(model):
    """Jitted `(tokens [B, T], cache) -> (logits [B, T, V], cache)`; the cache is not advanced."""
    graphdef = model.graphdef

    @jax.jit
    def f(params, tokens, cache):
        logits, cache, _ = nnx.merge(graphdef, params)(tokens, cache)
        return logits, cache

    return lambda tokens, cache: f(model.params, jnp.asarray(tokens, jnp.int32), cache)


def _tokens(seed, *shape):
    return np.random.default_rng(seed).integers(0, 256, size=shape).astype(np.int32)


# Every model-level forward below is [B=4, T] with T in (1, 6, 12, 32): four compiles in all.
B = 4
W = 32  # width of the reference full forwards


def _full_logits(model, fwd, seqs):
    """Logits of each row's whole sequence in one forward from an empty cache, right-padded to
    W (causality makes the padding invisible). Returns one [len(seq), V] array per row."""
    assert len(seqs) <= B
    buf = np.zeros((B, W), np.int32)
    for r, seq in enumerate(seqs):
        buf[r, : len(seq)] = seq
    logits, _ = fwd(buf, model.module().new_cache(B, S))
    logits = np.asarray(logits)
    return [logits[r, : len(seq)] for r, seq in enumerate(seqs)]


def test_write_rows_per_row_offsets():
    buf = jnp.zeros((3, 8, 2))
    new = jnp.arange(3 * 2 * 2, dtype=jnp.float32).reshape(3, 2, 2) + 1
    out = np.asarray(write_rows(buf, new, jnp.asarray([0, 3, 6])))
    for b, s in enumerate([0, 3, 6]):
        np.testing.assert_array_equal(out[b, s : s + 2], np.asarray(new[b]))
        mask = np.ones(8, bool)
        mask[s : s + 2] = False
        assert not out[b, mask].any()


def test_cache_create_and_advance():
    c = KVCache.create(num_layers=2, batch=3, size=16, num_kv_heads=2, head_dim=4)
    assert len(c.k) == len(c.v) == 2 and c.size == 16
    assert all(k.shape == (6, 16, 4) for k in c.k) and all(v.shape == (6, 16, 4) for v in c.v)
    assert c.lengths.dtype == jnp.int32 and not np.asarray(c.lengths).any()
    c = c.advance(jnp.asarray([1, 0, 5])).advance(2)
    np.testing.assert_array_equal(np.asarray(c.lengths), [3, 2, 7])
    np.testing.assert_array_equal(np.asarray(c.with_lengths([4, 4, 4]).lengths), [4, 4, 4])


def test_step_by_step_equals_full_forward(model, fwd):
    t = 12
    tokens = _tokens(0, B, t)
    full, full_cache = fwd(tokens, model.module().new_cache(B, S))
    assert not np.asarray(full_cache.lengths).any()  # a forward never advances

    cache = model.module().new_cache(B, S)
    steps = []
    for i in range(t):
        logits, cache = fwd(tokens[:, i : i + 1], cache)
        cache = cache.advance(1)
        steps.append(logits[:, 0])
    np.testing.assert_array_equal(np.asarray(cache.lengths), [t] * B)
    assert rel_err(jnp.stack(steps, 1), full) <= TOL
    # the cache built token by token holds the same K/V as the one-pass cache
    for k, full_k in zip(cache.k, full_cache.k):  # [B*KV, S, H]
        assert rel_err(k[:, :t], full_k[:, :t]) <= TOL
    for v, full_v in zip(cache.v, full_cache.v):  # [B*KV, S, H]
        assert rel_err(v[:, :t], full_v[:, :t]) <= TOL


def test_chunked_prefill_equals_full_forward(model, fwd):
    tokens = _tokens(1, B, 12)
    full, _ = fwd(tokens, model.module().new_cache(B, S))
    cache = model.module().new_cache(B, S)
    got = []
    for lo, hi in [(0, 6), (6, 12)]:  # the second chunk attends to the first through the cache
        logits, cache = fwd(tokens[:, lo:hi], cache)
        cache = cache.advance(hi - lo)
        got.append(logits)
    assert rel_err(jnp.concatenate(got, 1), full) <= TOL


def test_rows_advanced_by_different_amounts(model, fwd):
    """Write T tokens in every row, commit a different prefix per row (the rest is "rejected"),
    continue, and compare each row with a full forward of exactly its committed tokens."""
    first = _tokens(2, B, 6)
    cache = model.module().new_cache(B, S)
    _, cache = fwd(first, cache)
    keep1 = np.array([6, 2, 0, 5])  # all accepted / some rejected / all rolled back / ...
    cache = cache.advance(jnp.asarray(keep1))
    np.testing.assert_array_equal(np.asarray(cache.lengths), keep1)

    second = _tokens(3, B, 6)
    logits2, cache = fwd(second, cache)
    seqs = [list(first[r, : keep1[r]]) + list(second[r]) for r in range(B)]
    for r, want in enumerate(_full_logits(model, fwd, seqs)):
        assert rel_err(logits2[r], want[-6:]) <= TOL, f"row {r}"

    keep2 = np.array([1, 6, 3, 0])
    cache = cache.advance(jnp.asarray(keep2))
    third = _tokens(4, B, 6)
    logits3, _ = fwd(third, cache)
    seqs = [list(first[r, : keep1[r]]) + list(second[r, : keep2[r]]) + list(third[r]) for r in range(B)]
    for r, want in enumerate(_full_logits(model, fwd, seqs)):
        assert rel_err(logits3[r], want[-6:]) <= TOL, f"row {r}"


def test_rows_start_at_different_lengths(model, fwd):
    """Right-padded prefill (as the engine does) then per-row lengths: row r continues at its own
    prompt length and never sees the padding written after it."""
    lens = np.array([3, 12, 1, 7])
    prompts = _tokens(5, B, 12)
    _, cache = fwd(prompts, model.module().new_cache(B, S))
    cache = cache.with_lengths(lens)
    nxt = _tokens(6, B, 1)
    logits, _ = fwd(nxt, cache)
    seqs = [list(prompts[r, : lens[r]]) + [nxt[r, 0]] for r in range(B)]
    for r, want in enumerate(_full_logits(model, fwd, seqs)):
        assert rel_err(logits[r, 0], want[-1]) <= TOL, f"row {r}"


def _naive_greedy(model, fwd, prompts, n):
    """Greedy continuations recomputing every whole sequence each step (no cache reuse)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        for seq, logits in zip(seqs, _full_logits(model, fwd, seqs)):
            seq.append(int(logits[-1].argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


PROMPT_LENS = [3, 9, 16, 14]  # one prompt bucket (16): two compiles, batch of 4 and alone
NEW = 12


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size=n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def batch_result(model, prompts):
    sp = specjax.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return specjax.generate(prompts, model=model, sampling=sp)


def test_mixed_length_batch_equals_each_alone(model, fwd, prompts, batch_result):
    sp = specjax.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    together = [r.token_ids for r in batch_result]
    assert [len(t) for t in together] == [NEW] * len(prompts)
    assert all(r.finish_reason == "length" for r in batch_result)
    assert [r.prompt_token_ids for r in batch_result] == prompts
    assert len({tuple(t) for t in together}) == len(prompts)
    assert all(len(set(t)) > 3 for t in together), together  # diverse, not a 1- or 2-cycle
    for p, got in zip(prompts, together):
        assert specjax.generate([p], model=model, sampling=sp)[0].token_ids == got
    assert _naive_greedy(model, fwd, prompts, NEW) == together


def test_per_row_max_new_tokens_and_stop_ids(model, prompts, batch_result):
    """Rows finishing at different steps (length / stop id) leave the other rows untouched."""
    ref = [r.token_ids for r in batch_result]
    stop_tok = ref[2][4]
    first_stop = ref[2].index(stop_tok)
    params = [
        specjax.SamplingParams(max_new_tokens=3, ignore_eos=True),
        specjax.SamplingParams(max_new_tokens=1, ignore_eos=True),
        specjax.SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=(stop_tok,)),
        specjax.SamplingParams(max_new_tokens=NEW, ignore_eos=True),
    ]
    out = specjax.generate(prompts, model=model, sampling=params)
    assert out[0].token_ids == ref[0][:3] and out[0].finish_reason == "length"
    assert out[1].token_ids == ref[1][:1] and out[1].finish_reason == "length"
    assert out[2].token_ids == ref[2][: first_stop + 1] and out[2].finish_reason == "stop"
    assert out[3].token_ids == ref[3] and out[3].finish_reason == "length"


def test_first_call_decode_seconds_excludes_compile(model):
    prompts = [[1, 2, 3], [4, 5]]  # B = 2: a shape no other test compiled
    sp = specjax.SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = specjax.generate(prompts, model=model, sampling=sp)[0].stats
    again = specjax.generate(prompts, model=model, sampling=sp)[0].stats
    assert first.decode_seconds < 10 * again.decode_seconds + 0.5, (first.decode_seconds, again.decode_seconds)


def test_engine_prefill_in_chunks_equals_one_pass(model, monkeypatch):
    """A batch of long prompts is prefilled in chunks when one pass's scores would pass the
    budget: same cache, last logits, collected and final hidden states as one pass.

    Compared in float64. This model's weights are scaled up (module docstring), so its residual
    stream reaches ~1e5 and amplifies float32 rounding: the chunked pass's differently shaped dots
    round differently, and on some CPUs (AVX-512 here) that moved the float32 hidden states by a
    relative 3e-4 at scattered positions, none at a chunk boundary. In float64 the two passes
    agree to rounding (exactly, on this machine), which a masking or position bug would not.
    """
    from functools import partial

    from specjax.runtime import engine

    lens = np.array([64, 5, 40, 47])  # rows ending in the last, first and middle chunks
    static = dict(cache_size=S, feature_layers=(0, 1), want_final=True)
    with jax.enable_x64(True):
        params = jax.tree.map(
            lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, model.params
        )
        prompt, lengths = jnp.asarray(_tokens(4, B, 64)), jnp.asarray(lens, jnp.int32)
        one = jax.jit(partial(engine._prefill, model.graphdef, **static))(params, prompt, lengths)
        assert engine.prefill_chunk(B, 64, S, model.config.num_heads) == 64
        monkeypatch.setattr(engine, "PREFILL_SCORE_BYTES", B * model.config.num_heads * S * 16 * 4)
        assert engine.prefill_chunk(B, 64, S, model.config.num_heads) == 16
        chunked = jax.jit(partial(engine._prefill, model.graphdef, **static))(params, prompt, lengths)
    (c1, l1, h1, f1), (c2, l2, h2, f2) = one, chunked
    assert h1.dtype == f1.dtype == c1.k[0].dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(c2.lengths), lens)

    def rel64(a, b):  # max|a - b| / max|b| in float64 (rel_err rounds to float32 first)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.max(np.abs(a - b)) / np.max(np.abs(b))

    assert rel64(l2, l1) <= 1e-9 and rel64(h2, h1) <= 1e-9 and rel64(f2, f1) <= 1e-9
    for a, b in zip(c1.k + c1.v, c2.k + c2.v):  # [B*KV, S, H]; both wrote all 64 positions
        assert rel64(b, a) <= 1e-9
