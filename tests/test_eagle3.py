"""EAGLE-3: the training unroll equals chain drafting, vocab maps, checkpoints and their errors,
and losslessness in the engine (tiny random target here; the real model in test_speculative)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from specjax.drafters import eagle3, make_drafter
from specjax.drafters.base import vocab_maps
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_weights
from specjax.errors import DrafterError
from specjax.models.loading import random_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams
from train.eagle3 import simulate_acceptance, ttt_logits

LAYERS = (0, 1, 3)


@pytest.fixture(scope="module")
def target():
    return random_model(tiny(num_layers=4), seed=1)


@pytest.fixture(scope="module")
def weights(target):
    counts = np.random.RandomState(0).randint(0, 100, target.config.vocab_size)
    d2t, _ = vocab_maps(counts, 64)
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=64, target_layers=LAYERS)
    return init_weights(cfg, d2t, seed=3)


def features(target, x, layers=LAYERS):
    m = target.module()
    _, _, feats = m.hidden(x, m.new_cache(x.shape[0], 64), feature_layers=layers)
    return feats  # [n, B, T, D]


def test_ttt_unroll_equals_chain_drafting(target, weights):
    """Step j of the training unroll at position t == the j-th chain-drafting step from the
    accepted prefix ending at t - j, with the true tokens as drafts (what acceptance needs)."""
    net = weights.module()
    t = 12
    x = jnp.asarray(np.random.RandomState(1).randint(0, 256, (2, t + 1)), jnp.int32)
    feats = features(target, x[:, :t])
    emb = jnp.take(target.params["embed"][...], x[:, 1 : t + 1], axis=0)  # [B, T, D]: x_{t+1}
    steps = 4
    outs = ttt_logits(net, emb, feats, steps)
    for m in (1, 3, 6):  # the drafter's cache covers positions < m
        cache = net.new_cache(2, 32)
        g, cache = net.step(emb[:, :m], net.fuse(feats[:, :, :m]), cache)
        cache = cache.with_lengths(jnp.full((2,), m))
        g_last = g[:, m - 1]
        np.testing.assert_allclose(net.logits(g_last), outs[0][:, m - 1], atol=1e-5)
        for j in range(1, steps):
            pos = m - 1 + j
            g1, cache = net.step(emb[:, pos : pos + 1], g_last[:, None], cache)
            cache, g_last = cache.advance(1), g1[:, 0]
            np.testing.assert_allclose(net.logits(g_last), outs[j][:, pos], atol=1e-5)


def test_vocab_maps_round_trip():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = vocab_maps(counts, 4)
    assert d2t.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending target ids
    assert (t2d[d2t] == np.arange(4)).all()
    assert (t2d[np.setdiff1d(np.arange(8), d2t)] == -1).all()
    d2t_all, t2d_all = vocab_maps(counts, 8)
    assert (d2t_all == np.arange(8)).all() and (t2d_all == np.arange(8)).all()


def test_simulator_counts_greedy_acceptance(target, weights):
    """The simulator's accepted counts equal running the drafter step by step and comparing."""
    net = weights.module()
    t, k = 16, 3
    x = jnp.asarray(np.random.RandomState(2).randint(0, 256, (1, t)), jnp.int32)
    feats = features(target, x)
    emb_table = target.params["embed"][...]
    argmax = jnp.asarray(np.random.RandomState(3).randint(0, 256, (1, t)), jnp.int32)
    # make some drafts right: the target's "greedy" tokens are the drafter's own greedy choices
    outs = ttt_logits(net, jnp.take(emb_table, jnp.concatenate([x[:, 1:], x[:, -1:]], 1), axis=0), feats, k)
    first = jnp.take(weights.d2t, jnp.argmax(outs[0], -1))  # draft 1 from every start
    argmax = argmax.at[:, 1:].set(first[:, :-1])
    batch = {"tokens": x, "mask": jnp.ones_like(x, bool), "argmax": argmax, "hidden": feats}
    count, starts = simulate_acceptance(net, batch, weights.d2t, emb_table, k)
    for s in range(t - k - 1):
        want = 0
        for i in range(1, k + 1):
            draft = int(weights.d2t[jnp.argmax(outs[i - 1][0, s + i - 1])])
            if draft != int(argmax[0, s + i]):
                break
            want += 1
        assert int(count[0, s]) == want
    assert int(count.sum()) > 0 and bool(starts[0, 0])


def test_greedy_lossless_in_engine(target, weights):
    """Random drafter weights: greedy output equals plain decoding for every K and mixed lengths."""
    engine = Engine(target)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 11, 3)]
    params = [SamplingParams(max_new_tokens=20)] * 3
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    for k in (1, 3, 5):
        rows = engine.generate(prompts, params, drafter=Eagle3Drafter(k, weights, target))
        assert [r.token_ids for r in rows] == plain
        assert all(len(r.checked) == k for r in rows)


def test_prompt_that_fills_the_history_bucket(target, weights):
    """Prompt bucket T = 128 and cache/history size S = 128 (100 + 20 new + K + 2 <= 128)."""
    engine = Engine(target)
    prompt = np.random.RandomState(7).randint(0, 256, 100).tolist()
    params = [SamplingParams(max_new_tokens=20)]
    plain = engine.generate([prompt], params)[0].token_ids
    assert engine.generate([prompt], params, drafter=Eagle3Drafter(3, weights, target))[0].token_ids == plain


@pytest.mark.parametrize("gate", [0.02, 1.01])
def test_confidence_gate_is_lossless(target, weights, gate):
    """Rows below the gate take plain steps (1.01: always); output is plain decoding's either way."""
    engine = Engine(target)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = [SamplingParams(max_new_tokens=16)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    rows = engine.generate(prompts, params, drafter=Eagle3Drafter(3, weights, target, min_confidence=gate))
    assert [r.token_ids for r in rows] == plain
    checked = sum(sum(r.checked) for r in rows)
    assert checked == 0 if gate > 1 else checked > 0


def test_gated_proposal_drafts_past_the_first_token_only_when_a_verify_will_run(target, weights):
    """The engine verifies iff force_verify or some live row is active; otherwise a gated drafter
    skips the K - 1 drafter steps (their drafts would be discarded: the drafter's cache stays
    untouched) and repeats draft 1. Draft 1 is always computed."""
    from specjax.drafters.base import StepContext
    from specjax.drafters.eagle3 import Eagle3State

    b, k = 2, 4
    st = Eagle3State(
        weights.module().new_cache(b, 32).with_lengths(jnp.array([5, 7])),
        jnp.asarray(np.random.RandomState(5).randn(b, target.config.hidden_size), jnp.float32),
    )
    hist, seeds = jnp.zeros((b, 32), jnp.int32), jnp.zeros((b,), jnp.uint32)

    def propose(gate, live, force=False):
        d = Eagle3Drafter(k, weights, target, min_confidence=gate)
        ctx = StepContext(hist, jnp.array([6, 8]), None, seeds, True, live, force)
        prop, new = d.propose(d.params(), st, ctx)
        stepped = any(not np.array_equal(a, c) for a, c in zip(jax.tree.leaves(new.cache), jax.tree.leaves(st.cache)))
        return np.asarray(prop.draft), stepped

    full, stepped = propose(0.0, jnp.array([True, True]))  # ungated: always the whole chain
    assert stepped
    everyone = 1e-9  # every row active
    for live, force in (([False, True], False), ([False, False], True), (None, False)):  # None: who is live unknown
        draft, stepped = propose(everyone, None if live is None else jnp.array(live), force)
        assert stepped and (draft == full).all()
    draft, stepped = propose(everyone, jnp.array([False, False]))  # no live row: no verify pass
    assert not stepped and (draft == full[:, :1]).all()


def test_sampled_run_is_valid(target, weights):
    engine = Engine(target)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=1)] * 2
    rows = engine.generate([[5, 6, 7], [9, 10]], params, drafter=Eagle3Drafter(3, weights, target))
    for r in rows:
        assert len(r.token_ids) == 16 and all(0 <= t < 256 for t in r.token_ids)


def test_save_load_round_trip(target, weights, tmp_path):
    path = eagle3.save(weights, str(tmp_path / "e3"))
    loaded = eagle3.load(path)
    assert loaded.config == weights.config
    assert (np.asarray(loaded.d2t) == np.asarray(weights.d2t)).all()
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(weights.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    drafter = make_drafter(f"eagle3:{path}", 3, target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.feature_layers == LAYERS


def test_drafter_for_another_target_is_one_line(weights, tmp_path, other_target):
    other, message = other_target
    path = eagle3.save(weights, str(tmp_path / "e3"))
    with pytest.raises(DrafterError, match=message) as e:
        make_drafter(f"eagle3:{path}", 3, other)
    assert "\n" not in str(e.value)


def test_missing_config_key_is_named(weights, tmp_path):
    path = eagle3.save(weights, str(tmp_path / "e3"))
    cfg_file = os.path.join(path, "config.json")
    raw = json.load(open(cfg_file))
    del raw["draft_vocab_size"]
    json.dump(raw, open(cfg_file, "w"))
    with pytest.raises(DrafterError, match="missing key 'draft_vocab_size'"):
        eagle3.load(path)


def test_missing_or_corrupt_checkpoint(tmp_path, weights, target):
    with pytest.raises(DrafterError, match="not found"):
        make_drafter(f"eagle3:{tmp_path / 'nope'}", 3, target)
    path = eagle3.save(weights, str(tmp_path / "e3"))
    w = os.path.join(path, "model.safetensors")
    with open(w, "r+b") as fh:
        fh.truncate(os.path.getsize(w) // 2)
    with pytest.raises(DrafterError):
        make_drafter(f"eagle3:{path}", 3, target)


def test_gate_in_the_drafter_spec(target, weights, tmp_path):
    from specjax.drafters import make_drafter
    from specjax.drafters.eagle3 import save

    path = save(weights, str(tmp_path / "d"))
    assert make_drafter(f"eagle3:{path}@0.25", 3, target).min_confidence == 0.25
    assert make_drafter(f"eagle3:{path}@0", 3, target).min_confidence == 0.0
    for bad, msg in (("@high", "must be a number"), ("@1.5", "must be in")):
        with pytest.raises(DrafterError, match=msg):
            make_drafter(f"eagle3:{path}{bad}", 3, target)
