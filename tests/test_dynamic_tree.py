"""EAGLE-2 dynamic trees from an EAGLE-3 drafter: k = 1 is chain drafting, and every node's
cumulative score is the drafter's log-probability of its path, computed as a chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from specjax.drafters.base import vocab_maps
from specjax.drafters.dynamic_tree import dynamic_tree
from specjax.drafters.eagle3 import Eagle3Config, init_weights
from specjax.models.loading import random_model

LAYERS = (0, 1, 3)


@pytest.fixture(scope="module")
def setup():
    target = random_model(tiny(num_layers=4), seed=1)
    counts = np.random.RandomState(0).randint(0, 100, target.config.vocab_size)
    d2t, _ = vocab_maps(counts, 64)
    w = init_weights(Eagle3Config.for_target(target.config, draft_vocab_size=64, target_layers=LAYERS), d2t, seed=3)
    net = w.module()
    x = jnp.asarray(np.random.RandomState(1).randint(0, 256, (2, 10)), jnp.int32)
    m = target.module()
    _, _, feats = m.hidden(x, m.new_cache(2, 64), feature_layers=LAYERS)
    embed = target.params["embed"][...]
    emb = jnp.take(embed, jnp.concatenate([x[:, 1:], x[:, -1:]], 1), axis=0)
    g, cache = net.step(emb, net.fuse(feats), net.new_cache(2, 64))
    p = 9  # accepted prefix x_0..x_9: drafter features for positions < 9
    return net, embed, w.d2t, cache.with_lengths(jnp.full((2,), p)), g[:, p - 1]


def tree(net, embed, d2t, cache, g_last, **shape):
    def expand(tok, feat, positions, mask):
        emb = jnp.take(embed, tok, axis=0)
        return net.step(emb, feat, cache, positions=positions, mask=mask)[0]

    return dynamic_tree(expand, net.logits, d2t, g_last, cache.lengths, **shape)


def chain_logp(net, embed, d2t, cache, g_last, path_draft_ids):
    """log q of each token of a forced chain of draft-vocab ids `[B, L]`, summed."""
    total, g = 0.0, g_last
    for i in range(path_draft_ids.shape[1]):
        lp = jax.nn.log_softmax(net.logits(g), -1)
        total = total + jnp.take_along_axis(lp, path_draft_ids[:, i : i + 1], 1)[:, 0]
        e = jnp.take(embed, jnp.take(d2t, path_draft_ids[:, i]), axis=0)[:, None]
        g1, cache = net.step(e, g[:, None], cache)
        cache, g = cache.advance(1), g1[:, 0]
    return total


def test_topk_one_is_chain_drafting(setup):
    net, embed, d2t, cache, g_last = setup
    tokens, parents, depths, _ = tree(net, embed, d2t, cache, g_last, topk=1, depth=4, num_nodes=4)
    assert parents.tolist() == [[-1, 0, 1, 2]] * 2 and depths.tolist() == [[0, 1, 2, 3]] * 2
    g, c, chain = g_last, cache, []
    for _ in range(4):
        t = jnp.argmax(net.logits(g), -1)
        chain.append(jnp.take(d2t, t))
        g1, c = net.step(jnp.take(embed, chain[-1], axis=0)[:, None], g[:, None], c)
        c, g = c.advance(1), g1[:, 0]
    assert np.array_equal(np.asarray(tokens), np.asarray(jnp.stack(chain, 1)))


def test_tree_scores_are_path_log_probs(setup):
    net, embed, d2t, cache, g_last = setup
    tokens, parents, depths, scores = tree(net, embed, d2t, cache, g_last, topk=3, depth=4, num_nodes=16)
    inv = {int(t): i for i, t in enumerate(np.asarray(d2t))}
    tok, par = np.asarray(tokens), np.asarray(parents)
    for row in range(2):
        assert len({(par[row, i], tok[row, i]) for i in range(16)}) == 16  # no repeated child
        for i in range(16):
            path, j = [], i
            while j >= 0:
                path.insert(0, inv[int(tok[row, j])])
                j = par[row, j]
            assert len(path) == int(depths[row, i]) + 1
            ids = jnp.asarray([path, path], jnp.int32)
            want = chain_logp(net, embed, d2t, cache, g_last, ids)[row]
            np.testing.assert_allclose(float(scores[row, i]), float(want), atol=1e-4)
    assert (np.diff(np.sort(np.asarray(scores), axis=1)[:, ::-1], axis=1) <= 0).all()
