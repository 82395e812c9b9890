"""Token trees in the target: ancestor masks and depths, a tree pass equal to causal passes over
each node's path, and the accepted path's keys and values (`KVUpdate.take`, as the engine writes
them) leaving the cache a fresh prefill of the accepted text."""

import jax.numpy as jnp
import numpy as np

from helpers import tiny
from specjax.models.loading import random_model
from specjax.models.tree import ancestor_mask, chain_parents, depths

PARENTS = [-1, 0, 0, 1, -1, 3, 2]  # two children of the prefix (0, 4); 0 -> 1 -> 3 -> 5, 0 -> 2 -> 6


def test_ancestor_mask_and_depths():
    par = jnp.asarray([PARENTS])
    mask = np.asarray(ancestor_mask(par)[0])
    for i in range(len(PARENTS)):
        anc, j = {i}, PARENTS[i]
        while j >= 0:
            anc.add(j)
            j = PARENTS[j]
        assert set(np.flatnonzero(mask[i])) == anc
    assert depths(par)[0].tolist() == [0, 1, 1, 2, 0, 3, 2]
    chain = ancestor_mask(chain_parents(2, 5))
    assert np.array_equal(np.asarray(chain), np.broadcast_to(np.tril(np.ones((5, 5), bool)), (2, 5, 5)))


def _prefilled(model, prefix):
    m = model.module()
    x = jnp.asarray([prefix], jnp.int32)
    _, cache, _ = m.hidden(x, m.new_cache(1, 64))
    return m, cache.advance(len(prefix))


def test_chain_mask_is_the_default_bit_for_bit():
    model = random_model(tiny(num_layers=2), seed=2)
    m, cache = _prefilled(model, [5, 9, 2, 7])
    x = jnp.asarray([[11, 3, 8, 1, 4]], jnp.int32)
    par = chain_parents(1, 5)
    a, ca, _ = m.hidden(x, cache)
    b, cb, _ = m.hidden(x, cache, positions=cache.lengths[:, None] + depths(par), mask=ancestor_mask(par))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(ca.k, cb.k))


def test_tree_pass_equals_each_paths_causal_pass_and_its_path_is_a_prefill():
    model = random_model(tiny(num_layers=2), seed=3)
    prefix = [5, 9, 2, 7, 30]
    tokens = [11, 3, 8, 1, 4, 21, 17]
    m, cache = _prefilled(model, prefix)
    par = jnp.asarray([PARENTS])
    h, new_kv, _ = m.hidden_kv(
        jnp.asarray([tokens], jnp.int32), cache, positions=cache.lengths[:, None] + depths(par), mask=ancestor_mask(par)
    )
    logits = m.logits(h)[0]  # [T, V]
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = PARENTS[j]
        full = jnp.asarray([prefix + [tokens[n] for n in path]], jnp.int32)
        hf, _, _ = m.hidden(full, m.new_cache(1, 64))
        np.testing.assert_allclose(logits[i], m.logits(hf)[0, -1], atol=1e-5, err_msg=f"node {i}")
    # accept 0 -> 1 -> 3 -> 5: the cache with that path written is a fresh prefill of prefix + it
    path = [0, 1, 3, 5]
    kept = cache.write(new_kv.take(jnp.asarray([path]))).advance(len(path))
    text = prefix + [tokens[n] for n in path]
    _, fresh, _ = m.hidden(jnp.asarray([text], jnp.int32), m.new_cache(1, 64))
    n = len(text)
    for got, want in zip(kept.k + kept.v, fresh.k + fresh.v):
        np.testing.assert_allclose(np.asarray(got)[:, :n], np.asarray(want)[:, :n], atol=1e-5)
    nxt = jnp.asarray([[13]], jnp.int32)
    a, _, _ = m.hidden(nxt, kept)
    b, _, _ = m.hidden(nxt, fresh.advance(n))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
