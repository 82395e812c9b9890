"""MTP heads: drafting (with its cache discipline, through commits with rejections) computes
exactly the teacher-forced training forward; the simulator counts greedy chain acceptance;
training lowers the loss; greedy output with the drafter equals plain decoding; checkpoints
round-trip and fail in one line for another target or a missing key."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.drafters import make_drafter, mtp
from specjax.drafters.base import CommitContext, InitContext
from specjax.drafters.mtp import MTPConfig, MTPDrafter, init_weights
from specjax.errors import DrafterError
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams
from train.loop import OptimConfig, fit, read_log
from train.mtp import MTPTask, mtp_hidden, simulate_acceptance

DEPTH = 3


def sharpen(w: mtp.MTPWeights, seed: int = 0) -> mtp.MTPWeights:
    """Larger random weights and non-unit norm scales, so attention is peaked and a key read
    from the wrong position changes the logits far beyond float noise."""
    rng = np.random.RandomState(seed)
    pure = nnx.to_pure_dict(w.params)
    pure = jax.tree.map(lambda a: a * 6.0 if a.ndim == 2 else a * (1.0 + 0.3 * rng.randn(*a.shape)), pure)
    nnx.replace_by_pure_dict(w.params, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), pure))
    return w


@pytest.fixture(scope="module")
def weights(sharp_target):
    return sharpen(init_weights(MTPConfig.for_target(sharp_target.config, DEPTH, intermediate_size=96), seed=3))


@pytest.mark.parametrize("k", [1, 3])
def test_drafting_equals_training_forward_through_commits(sharp_target, weights, k):
    """At every step, draft j (given true earlier drafts) has exactly the training logits of
    module j at position m - 1, across commits of 0..K accepted drafts, rows that do not advance,
    junk verify states for rejected positions and junk history past hist_len."""
    rng = np.random.RandomState(k)
    b, n, s = 2, 48, 64
    x = jnp.asarray(rng.randint(0, 256, (b, n)), jnp.int32)  # the true sequence
    tm = sharp_target.module()
    final, _, _ = tm.hidden(x, tm.new_cache(b, s))  # [B, N, D]
    drafter = MTPDrafter(k, weights, sharp_target)
    dparams = drafter.params()
    net = weights.module()
    train = jax.jit(
        lambda: [
            net.logits(j, h, dparams["head"])  # [B, N, V] per depth
            for j, h in enumerate(mtp_hidden(net, dparams["embed"], x, final, k), 1)
        ]
    )()

    def history_of(m):  # true tokens x_0..x_m, junk after
        junk = rng.randint(0, 256, (b, s))
        pos = np.arange(s)[None]
        xs = np.pad(np.asarray(x), ((0, 0), (0, s - n)))
        return jnp.asarray(np.where(pos <= m[:, None], xs, junk), jnp.int32)

    m = np.array([1, 6])  # prompt lengths 1 and 6 (shorter than and longer than the window)
    t = 8
    prompt_final = np.asarray(final[:, :t]).copy()
    prompt_final[0, m[0] :] = rng.randn(t - m[0], final.shape[-1])  # padded prompt positions: junk
    samp = SamplingArrays.from_params([SamplingParams()] * b)
    ictx = InitContext(
        jnp.where(jnp.arange(t)[None] < m[:, None], x[:, :t], 0),
        jnp.asarray(m),
        history_of(m),
        jnp.asarray(m + 1),
        samp,
        None,
        jnp.asarray(prompt_final),
        s,
        True,
    )
    st = drafter.init(dparams, ictx)
    draft_fn = jax.jit(
        lambda st, hist, mm: drafter.draft_chain(
            dparams, st, hist, lambda j, lg: jnp.take_along_axis(x, (mm + j)[:, None], axis=1)[:, 0]
        )
    )
    commit_fn = jax.jit(lambda st, ctx: drafter.commit(dparams, st, ctx))
    accepted_total = 0
    for _ in range(10):
        _, logits, scratch = draft_fn(st, history_of(m), jnp.asarray(m))
        for j in range(1, k + 1):
            want = np.asarray(train[j - 1])[np.arange(b), m - 1]  # [B, V]
            np.testing.assert_allclose(np.asarray(logits[j - 1]), want, rtol=2e-4, atol=2e-4)
        st = st.replace(cache=scratch)  # what propose hands on
        n_acc = rng.randint(0, k + 1, b)
        live = rng.rand(b) < 0.85
        new_m = np.where(live, np.minimum(m + n_acc + 1, n - k - 2), m)
        verify = np.array(jax.vmap(lambda f, i: jax.lax.dynamic_slice_in_dim(f, i, k + 1))(final, jnp.asarray(m)))
        for r in range(b):  # states of rejected drafts are junk
            verify[r, new_m[r] - m[r] :] = rng.randn(*verify[r, new_m[r] - m[r] :].shape)
        ctx = CommitContext(
            jnp.asarray(n_acc),
            jnp.zeros((b, k + 1), jnp.int32),
            history_of(new_m),
            jnp.asarray(new_m + 1),
            jnp.asarray(live),
            None,
            jnp.asarray(verify),
        )
        st = commit_fn(st, ctx)
        accepted_total += int((new_m - m).sum())
        m = new_m
    assert accepted_total > 10


def test_simulator_counts_greedy_acceptance(sharp_target, weights):
    """Simulated counts == walking the chain by hand over the training logits."""
    k, t = DEPTH, 24
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.randint(0, 256, (1, t)), jnp.int32)
    tm = sharp_target.module()
    final, _, _ = tm.hidden(x, tm.new_cache(1, t))
    net, embed, head = weights.module(), tm.embed[...], tm.head_weight()
    greedy = [jnp.argmax(net.logits(j, h, head), -1)[0] for j, h in enumerate(mtp_hidden(net, embed, x, final, k), 1)]
    argmax = np.asarray(rng.randint(0, 256, t))
    argmax[1:] = np.asarray(greedy[0])[:-1]  # draft 1 right from every start m (module 1 at m - 1)
    argmax[5], argmax[6] = int(greedy[1][3]), int(greedy[2][3])  # and drafts 2, 3 from start 4
    batch = {"tokens": x, "mask": jnp.ones_like(x, bool), "argmax": jnp.asarray(argmax)[None], "final": final}
    count, starts = simulate_acceptance(net, batch, embed, head, k)
    for m in range(1, t - k + 1):
        want = 0
        for j in range(1, k + 1):
            if int(greedy[j - 1][m - 1]) != argmax[m + j - 1]:
                break
            want += 1
        assert int(count[0, m]) == want and bool(starts[0, m])
    assert not bool(starts[0, 0]) and int(count[0, 4]) == 3 and int((count[0] >= 1).sum()) > t // 2


@pytest.fixture(scope="module")
def trained(sharp_target, sharp_store, tmp_path_factory):
    task = MTPTask(sharp_target, num_modules=DEPTH, intermediate_size=96, loss_chunk=16)
    o = OptimConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=4, checkpoint_every=40, eval_every=40)
    before = task.evaluate(task.init_params(o.seed), sharp_store)
    out = str(tmp_path_factory.mktemp("mtp_run"))
    params = fit(task, sharp_store, o, out, eval_store=sharp_store)
    return task, params, before, read_log(out)


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    _, _, before, log = trained
    assert len(log) == 40
    first, last = np.mean([r["loss"] for r in log[:4]]), np.mean([r["loss"] for r in log[-4:]])
    assert last < 0.7 * first, (first, last)
    after = log[-1]["eval"]
    assert after["sim_mal"] > before["sim_mal"] + 0.1, (before, after)
    assert len(after["sim_per_position"]) == DEPTH and set(after) == {
        "sim_mal",
        "sim_per_position",
        "sim_starts",
        "path_mal",
        "path_per_position",
        "path_steps",
    }
    assert {"ce_depth1", "top1_depth3"} <= set(log[-1])


def test_export_load_round_trip_and_greedy_lossless(sharp_target, trained, tmp_path):
    """The trained heads, exported in bf16 and loaded through make_drafter, accept drafts in the
    engine, and greedy output equals plain decoding for several K and mixed prompt lengths."""
    task, params, _, _ = trained
    path = task.export(params, str(tmp_path / "mtp"), jnp.bfloat16, {"note": "test"})
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 700_000  # no embedding, no head
    loaded = mtp.load(path)
    assert loaded.config == task.cfg
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(jnp.asarray(b, jnp.bfloat16), np.float32))
    engine = Engine(sharp_target)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 11, 1)]
    sp = [SamplingParams(max_new_tokens=24)] * 3
    plain = [r.token_ids for r in engine.generate(prompts, sp)]
    accepted = 0
    for k in (1, 3):
        d = make_drafter(f"mtp:{path}", k, sharp_target)
        assert isinstance(d, MTPDrafter) and d.num_draft == k
        rows = engine.generate(prompts, sp, drafter=d)
        assert [r.token_ids for r in rows] == plain
        accepted += sum(sum(r.accepted) for r in rows)
    assert accepted > 0  # both the accept and the reject paths ran
    assert make_drafter(f"mtp:{path}", 0, sharp_target).num_draft == DEPTH  # default K: every module


def test_sampled_run_is_valid(sharp_target, weights):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, seed=1)] * 2
    rows = Engine(sharp_target).generate([[5, 6, 7], [9, 10]], params, drafter=MTPDrafter(2, weights, sharp_target))
    for r in rows:
        assert len(r.token_ids) == 12 and all(0 <= t < 256 for t in r.token_ids)


def test_more_drafts_than_modules_is_one_line(sharp_target, weights, tmp_path):
    path = mtp.save(weights, str(tmp_path / "m"))
    with pytest.raises(DrafterError, match="has 3 modules, so it drafts 1..3 tokens per step; got --num-draft 4"):
        make_drafter(f"mtp:{path}", 4, sharp_target)


def test_drafter_for_another_target_is_one_line(weights, tmp_path, other_target):
    other, message = other_target
    path = mtp.save(weights, str(tmp_path / "m"))
    with pytest.raises(DrafterError, match=message) as e:
        make_drafter(f"mtp:{path}", 2, other)
    assert "\n" not in str(e.value)


def test_missing_config_key_and_bad_checkpoints(weights, sharp_target, tmp_path):
    path = mtp.save(weights, str(tmp_path / "m"))
    cfg_file = tmp_path / "m" / "config.json"
    raw = json.loads(cfg_file.read_text())
    del raw["num_modules"]
    cfg_file.write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match="missing key 'num_modules'") as e:
        make_drafter(f"mtp:{path}", 2, sharp_target)
    assert "\n" not in str(e.value)
    with pytest.raises(DrafterError, match="not found"):
        make_drafter(f"mtp:{tmp_path / 'nope'}", 2, sharp_target)
    path = mtp.save(weights, str(tmp_path / "m2"))
    w = os.path.join(path, "model.safetensors")
    with open(w, "r+b") as fh:
        fh.truncate(os.path.getsize(w) // 2)
    with pytest.raises(DrafterError, match="truncated"):
        make_drafter(f"mtp:{path}", 2, sharp_target)


def test_draft_vocabulary_export_and_greedy_lossless(sharp_target, sharp_store, trained, tmp_path):
    """With `draft_vocab_size` the heads draft from the most frequent reply tokens' head rows
    only (the export carries `d2t`); greedy output equals plain decoding, sampling stays valid."""
    from specjax.drafters.checkpoint import VOCAB_FILE

    _, params, _, _ = trained
    task = MTPTask(
        sharp_target, sharp_store.counts, num_modules=DEPTH, intermediate_size=96, loss_chunk=16, draft_vocab_size=48
    )
    path = task.export(params, str(tmp_path / "mtp"), None, {"note": "test"})
    assert os.path.isfile(os.path.join(path, VOCAB_FILE))
    d = make_drafter(f"mtp:{path}", 3, sharp_target)
    assert d.d2t is not None and d.d2t.shape == (48,)
    sim = task.evaluate(params, sharp_store)
    engine = Engine(sharp_target)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 11, 1)]
    sp = [SamplingParams(max_new_tokens=24)] * 3
    plain = [r.token_ids for r in engine.generate(prompts, sp)]
    rows = engine.generate(prompts, sp, drafter=d)
    assert [r.token_ids for r in rows] == plain
    assert sim["sim_mal"] > 1.0 and sum(sum(r.accepted) for r in rows) > 0
    sampled = engine.generate(
        prompts[:2], [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12, seed=1)] * 2, drafter=d
    )
    assert all(len(r.token_ids) == 12 for r in sampled)


def test_tree_scores_are_the_training_log_probs_of_each_path(sharp_target, weights):
    """A tree's node scores = sum over its path of module j's teacher-forced log-probability of
    draft j at m - 1, on the sequence whose continuation is that path (each of the k windows of a
    level reads its own path's drafts), for prompts shorter and longer than the window."""
    rng = np.random.RandomState(7)
    b, s, t, k, n = 2, 64, 8, 3, 9
    x = jnp.asarray(rng.randint(0, 256, (b, 16)), jnp.int32)
    tm = sharp_target.module()
    drafter = MTPDrafter(n, weights, sharp_target).with_tree(k, DEPTH)
    dparams, net = drafter.params(), weights.module()
    m = np.array([1, 6])
    final, _, _ = tm.hidden(x, tm.new_cache(b, s))
    hist = jnp.pad(x, ((0, 0), (0, s - 16)))
    samp = SamplingArrays.from_params([SamplingParams()] * b)
    ictx = InitContext(
        jnp.where(jnp.arange(t)[None] < m[:, None], x[:, :t], 0),
        jnp.asarray(m),
        hist,
        jnp.asarray(m + 1),
        samp,
        None,
        final[:, :t],
        s,
        True,
    )
    st = drafter.init(dparams, ictx)
    tokens, parents, depths, scores = jax.jit(lambda st: drafter.draft_tree(dparams, st, hist))(st)

    @jax.jit
    def path_logp(seq, mm, path, length):  # seq [1, 16]: x_0..x_m, then the path
        fin, _, _ = tm.hidden(seq, tm.new_cache(1, 16))
        logp = [
            jax.nn.log_softmax(net.logits(j, h, dparams["head"]), -1)[0, mm - 1]
            for j, h in enumerate(mtp_hidden(net, dparams["embed"], seq, fin, DEPTH), 1)
        ]
        return sum(jnp.where(j < length, logp[j][path[j]], 0.0) for j in range(DEPTH))

    tok, par, dep = np.asarray(tokens), np.asarray(parents), np.asarray(depths)
    for r in range(b):
        assert len({(par[r, i], tok[r, i]) for i in range(n)}) == n and dep[r].max() == DEPTH - 1
        for i in range(n):
            path, j = [], i
            while j >= 0:
                path.insert(0, int(tok[r, j]))
                j = par[r, j]
            seq = np.asarray(x[r : r + 1]).copy()
            seq[0, m[r] + 1 : m[r] + 1 + len(path)] = path
            want = path_logp(jnp.asarray(seq), int(m[r]), jnp.asarray(path + [0] * (DEPTH - len(path))), len(path))
            np.testing.assert_allclose(float(scores[r, i]), float(want), atol=2e-4)


def test_served_with_plain_chunks_stays_lossless_and_current(sharp_target, trained, tmp_path):
    """The server serves MTP at one K and plain steps (ks 0..3 -> [0, 3]); its plain chunks run
    its K = 3 variant with no row verifying and its commits deferred: over K switches (runs of
    plain chunks long enough for the wide catch-up), preemption and bucket resizes, greedy rows
    equal plain decoding and keep accepting drafts; after a catch-up the drafter's state equals a
    fresh prefill's of the same history."""
    from specjax.runtime.slots import SlotEngine
    from specjax.runtime.step import catch_up, pending_width
    from specjax.server.config import ServingConfig
    from specjax.server.scheduler import Request, Scheduler, build_scheduler

    task, params, _, _ = trained
    path = task.export(params, str(tmp_path / "mtp"))
    costs = {b: {k: 1.0 for k in range(DEPTH + 1)} for b in (1, 2)}
    cfg = ServingConfig(buckets=(1, 2), chunk_steps=4, max_seq_len=96, step_costs=costs).validate()
    said = []
    e = build_scheduler(sharp_target, f"mtp:{path}", cfg, log=said.append).engine
    assert cfg.ks == (0, 1, 2, 3) and e.ks == (0, DEPTH) and f"K in [0, {DEPTH}]" in said[0]
    drafter = e.drafter
    with pytest.raises(DrafterError, match="one K > 0 and 0 for plain steps"):
        SlotEngine(sharp_target, drafter, ks=(0, 2, 3))
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 11, 3, 8)]
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
    plain = [r.token_ids for r in Engine(sharp_target).generate(prompts, [sp] * 4)]
    ks = iter(([0] * 9 + [DEPTH, 0, DEPTH, DEPTH]) * 100)  # 36 plain steps in a row: a wide catch-up
    sched = Scheduler(e, cfg, k_override=lambda b, rows: next(ks))
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(sched.submit(Request(p, sp, "interactive" if i == 3 else "batch")))
        for _ in range(3):
            sched.iteration()
    for _ in range(500):
        if all(r.done.is_set() for r in reqs):
            break
        sched.iteration()
    assert [r.token_ids for r in reqs] == plain
    assert all(set(r.k_steps) == {0, DEPTH} for r in reqs) and sum(r.sample.accepted.sum() for r in reqs) > 0
    assert sum(r.preemptions for r in reqs) > 0 and e.compiles_after_warmup == 0

    st = e.insert(e.empty(1), 0, e.prefill(prompts[1], SamplingParams(max_new_tokens=80, ignore_eos=True)))
    for k, n in ((DEPTH, 3), (0, 40), (DEPTH, 2), (0, 5)):
        st, _ = e.run_chunk(st, k, n)
    assert int(st.pending.count[0]) >= 6  # the last verify step's tokens and 5 plain ones
    p = pending_width(drafter)
    dstate, _ = catch_up(drafter, e.dparams, st.draft_state, st.pending, st.history, st.hist_len, p)
    h = int(st.hist_len[0])
    hist = np.asarray(st.history)[0, :h].tolist()
    fresh = e.prefill(hist[:-1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert int(np.asarray(fresh.history)[0, h - 1]) == hist[-1]
    a, b = dstate, fresh.draft_state
    assert int(a.m[0]) == int(b.m[0]) == h - 1
    c = int(a.cache.lengths[0])
    assert c == int(b.cache.lengths[0]) == h - 1 - drafter.window
    for j in range(DEPTH):
        np.testing.assert_allclose(a.cache.k[j][:, :c], b.cache.k[j][:, :c], atol=2e-4)
        np.testing.assert_allclose(a.cache.v[j][:, :c], b.cache.v[j][:, :c], atol=2e-4)
    np.testing.assert_allclose(a.fin[:, : h - 1 - c], b.fin[:, : h - 1 - c], atol=2e-4)
