"""Serving scheduler (issue 6), in-process on a tiny random model: continuous batching over
persistent slots, K switches mid-request, preemption and bucket resizes stay token-identical to
plain decoding; throttling (K falls as the running batch grows and comes back); the acceptance
monitor's fallback and its probes; serve-bench's load sweep. The policy's arithmetic, the monitor,
metrics and the YAML config without a model: test_serving_policy.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from specjax.drafters.base import Proposal
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models.loading import random_model
from specjax.policy.monitor import MonitorConfig
from specjax.runtime.engine import Engine
from specjax.runtime.slots import SlotEngine
from specjax.sampling import SamplingParams
from specjax.server.config import ServingConfig
from specjax.server.scheduler import Request, Scheduler

V = 512
KS = (0, 3)  # few variants: each (bucket, K) chunk compiles at warm-up (the ladder: test_serving_policy.py)
BUCKETS = (1, 2)
# Synthetic step costs (seconds per step): speculation is nearly free at B = 1 and too expensive
# at B = 2 even when every draft is accepted, so the rules policy must drop K as the batch grows.
COSTS = {1: {0: 1.0, 3: 1.1}, 2: {0: 1.0, 3: 5.0}}
FLAT = {b: {0: 1.0, 3: 1.2} for b in BUCKETS}  # speculation cheap at every batch size
MAX_SEQ = 64


class HotRandomDrafter(DraftModelDrafter):
    """The target as its own draft model (greedy drafts all accepted), except for rows sampled
    at temperature > 1, which get uniformly random drafts: a drafter forced to propose poorly
    whenever the traffic runs hot, and perfectly when it cools down."""

    name = "hot-random"

    def propose(self, dparams, state, ctx):
        p, state = super().propose(dparams, state, ctx)
        hot = ctx.sampling.temperature > 1.0  # [B]
        rnd = jax.random.randint(jax.random.key(ctx.seeds[0]), p.draft.shape, 0, V)  # [B, K]
        draft = jnp.where(hot[:, None], rnd, p.draft)
        q = None if p.q is None else jnp.where(hot[:, None, None], jax.nn.one_hot(rnd, V), p.q)
        return Proposal(draft, q), state


@pytest.fixture(scope="module")
def target():
    return random_model(tiny(vocab_size=V, num_layers=2, max_position_embeddings=256), seed=0)


@pytest.fixture(scope="module")
def engine(target):
    e = SlotEngine(
        target, HotRandomDrafter(max(KS), target, target.config), ks=KS, buckets=BUCKETS, max_seq_len=MAX_SEQ
    )
    e.warmup(measure=True)
    return e


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    return [list(map(int, rng.randint(3, V - 3, size=rng.randint(3, 24)))) for _ in range(10)]


def config(**kw) -> ServingConfig:
    # The tests give synthetic step costs (the scenario under test): not calibrated to this machine.
    base = dict(
        buckets=BUCKETS,
        ks=KS,
        chunk_steps=2,
        step_costs=COSTS,
        min_run_steps=2,
        max_seq_len=MAX_SEQ,
        calibrate_costs=False,
    )
    base.update(kw)
    return ServingConfig(**base).validate()


def drain(sched: Scheduler, reqs, limit: int = 2000) -> None:
    for _ in range(limit):
        if all(r.done.is_set() for r in reqs):
            return
        sched.iteration()
    raise AssertionError("requests did not finish")


def test_warmup_times_every_bucket_and_k(engine):
    assert set(engine.step_costs) == set(BUCKETS)
    for b in BUCKETS:
        assert set(engine.step_costs[b]) == set(KS) and min(engine.step_costs[b].values()) > 0
    assert engine.compiles_after_warmup == 0


def test_ngram_warmup_times_verify_steps(target):
    """The n-gram drafter skips verification without a match; the warm-up forces verification
    (same compiled chunk), so K > 0 costs are verify costs."""
    e = SlotEngine(target, NgramDrafter(2), ks=(0, 2), buckets=(1,), max_seq_len=32)
    costs = e.warmup(measure=True, reps=1)
    assert costs[1][0] > 0 and costs[1][2] > 0
    assert e.timing_verified[1][2] == 1.0 and e.compiles_after_warmup == 0


def test_seeded_sampled_requests_equal_their_solo_run(engine, target, prompts):
    """Each row draws from its own seed's stream: seeded sampled requests, served together in
    1-step chunks with preemption and bucket changes (plain steps), emit what each emits alone
    through `Engine.generate`."""
    sps = [
        SamplingParams(
            temperature=1.0 + 0.1 * (i % 3), top_k=(0, 8)[i % 2], max_new_tokens=16, ignore_eos=True, seed=100 + i
        )
        for i in range(len(prompts))
    ]
    solo = [Engine(target).generate([p], [sp])[0].token_ids for p, sp in zip(prompts, sps)]
    sched = Scheduler(engine, config(chunk_steps=1), k_override=lambda b, rows: 0)
    reqs = []
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        reqs.append(sched.submit(Request(p, sp, "interactive" if i % 3 == 2 else "batch")))
        for _ in range(2):
            sched.iteration()
    drain(sched, reqs)
    assert [r.token_ids for r in reqs] == solo
    assert len({tuple(t) for t in solo}) == len(solo)


def test_greedy_identical_across_k_switches_preemption_and_resizes(engine, target, prompts):
    """Random K per chunk, 1-2 step chunks, interactive requests preempting batch rows, buckets
    growing and shrinking, hot sampled rows in the same batches: every greedy row equals plain
    decoding token for token, and (self-drafting) every greedy draft is accepted, so the draft
    model's cache stayed in sync through the K = 0 chunks."""
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ref = [r.token_ids for r in Engine(target).generate(prompts, [sp] * len(prompts))]
    rng = np.random.RandomState(1)
    sched = Scheduler(engine, config(chunk_steps=1), k_override=lambda b, rows: int(rng.choice(KS)))
    greedy, hot = [], []
    for i, p in enumerate(prompts):
        cls = "interactive" if i % 3 == 2 else "batch"
        greedy.append(sched.submit(Request(p, sp, cls)))
        if i % 4 == 0:
            hot.append(sched.submit(Request(p, SamplingParams(temperature=1.5, max_new_tokens=12, seed=i), "batch")))
        for _ in range(3):
            sched.iteration()
    drain(sched, greedy + hot)
    for r, want in zip(greedy, ref):
        assert r.token_ids == want and r.finish_reason == "length"
        assert len(r.k_steps) >= 2, r.k_steps  # the request saw several K
        assert (r.sample.accepted == r.sample.checked).all()
    assert all(len(r.token_ids) == 12 for r in hot)
    kinds = {d["kind"] for d in sched.log.recent()}
    assert {"preempt", "resume", "bucket"} <= kinds, kinds
    assert sum(r.preemptions for r in greedy) > 0
    assert engine.compiles_after_warmup == 0


def test_eagle3_state_survives_plain_chunks():
    """EAGLE-3's state does not depend on K and its commit runs in plain steps too: after chunks
    at K = 3 and K = 0, its cache and last feature equal those of a fresh prefill of the same
    history."""
    from specjax.drafters.base import vocab_maps
    from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, init_weights

    t = random_model(tiny(num_layers=4), seed=1)
    d2t, _ = vocab_maps(np.random.RandomState(0).randint(0, 100, t.config.vocab_size), 64)
    w = init_weights(Eagle3Config.for_target(t.config, draft_vocab_size=64, target_layers=(0, 1, 3)), d2t, seed=3)
    e = SlotEngine(t, Eagle3Drafter(3, w, t), ks=(0, 3), buckets=(1,), max_seq_len=64)
    e.warmup(measure=False)
    st = e.insert(e.empty(1), 0, e.prefill([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    for k in (3, 0, 0, 3, 0):
        st, _ = e.run_chunk(st, k, 2)
    h = int(st.hist_len[0])
    hist = np.asarray(st.history)[0, :h].tolist()
    fresh = e.prefill(hist[:-1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert int(np.asarray(fresh.history)[0, h - 1]) == hist[-1]
    a, b = st.draft_state, fresh.draft_state
    m = h - 1
    assert int(a.cache.lengths[0]) == int(b.cache.lengths[0]) == m
    np.testing.assert_allclose(a.g_last, b.g_last, atol=2e-4)
    np.testing.assert_allclose(a.cache.k[0][:, :m], b.cache.k[0][:, :m], atol=2e-4)
    np.testing.assert_allclose(a.cache.v[0][:, :m], b.cache.v[0][:, :m], atol=2e-4)


def test_tree_serving_is_token_identical_across_tree_sizes(target, prompts):
    """Trees served: K counts a tree's nodes, each K its own compiled variant (the tree's depth
    clamped to K), random K per chunk over mixed-length rows and resizes: every greedy row equals
    plain decoding, and (self-drafting) every first draft is accepted: the top-1 child is always
    in the tree and is the target's argmax, so the draft model's cache stayed in sync."""
    drafter = DraftModelDrafter(6, target, target.config).with_tree(2, 3)
    e = SlotEngine(target, drafter, ks=(0, 2, 6), buckets=BUCKETS, max_seq_len=MAX_SEQ)
    assert e.accept_widths == {0: 0, 2: 2, 6: 3} and e.stat_width == 3
    assert e.variants[0].tree_topk == 1 and e.variants[2].tree_topk == 2
    e.warmup(measure=False)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = [r.token_ids for r in Engine(target).generate(prompts[:5], [sp] * 5)]
    rng = np.random.RandomState(2)
    costs = {b: {0: 1.0, 2: 1.1, 6: 1.2} for b in BUCKETS}
    sched = Scheduler(
        e, config(chunk_steps=1, ks=(0, 2, 6), step_costs=costs), k_override=lambda b, rows: int(rng.choice((0, 2, 6)))
    )
    reqs = [sched.submit(Request(p, sp, "batch")) for p in prompts[:5]]
    drain(sched, reqs)
    for r, want in zip(reqs, ref):
        assert r.token_ids == want
        acc, chk = r.sample.accepted, r.sample.checked
        assert acc[0] == chk[0] > 0 and (acc <= chk).all()
    # Six nodes of this near-uniform target's top-2 tree are its 2 + 4 best paths, none 3 deep
    # (path probabilities rank depth 3 last): depth 2 is accepted, and depth 3, never drafted, is
    # never counted as checked (a tree row checks as deep as its own nodes go).
    assert sum(r.sample.accepted[1] for r in reqs) > 0 and sum(r.sample.checked[2] for r in reqs) == 0
    assert e.compiles_after_warmup == 0


def test_cancel_frees_the_row(engine, prompts):
    sched = Scheduler(engine, config())
    long = sched.submit(Request(prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True), "batch"))
    other = sched.submit(Request(prompts[1], SamplingParams(max_new_tokens=20, ignore_eos=True), "batch"))
    for _ in range(3):
        sched.iteration()
    assert long in sched.slots
    sched.cancel(long.id)
    sched.iteration()
    assert long.finish_reason == "cancelled" and long not in sched.slots
    drain(sched, [other])
    assert len(other.token_ids) == 20 and not any(sched.slots)
    assert sched.metrics.requests.value(**{"class": "batch"}, status="cancelled") == 1


def test_k_falls_as_the_batch_grows_and_returns(engine, prompts):
    sched = Scheduler(engine, config())
    seen = []
    choose = sched._choose

    def record(rows, queued):
        k, n = choose(rows, queued)
        seen.append((sched.bucket, k))
        return k, n

    sched._choose = record
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first = sched.submit(Request(prompts[0], sp, "batch"))
    for _ in range(3):
        sched.iteration()
    crowd = [sched.submit(Request(p, sp, "batch")) for p in prompts[1:3]]
    drain(sched, [first] + crowd)
    last = sched.submit(Request(prompts[5], sp, "batch"))
    drain(sched, [last])
    ks_at = {b: [k for bb, k in seen if bb == b] for b in BUCKETS}
    assert ks_at[1][0] == 3 and ks_at[1][-1] == 3  # alone: full speculation, before and after
    assert ks_at[2] and set(ks_at[2]) == {0}  # crowded: throttled down to plain decoding
    assert seen.index((2, 0)) < len(seen) - 1 - seen[::-1].index((1, 3))  # ... and it came back
    reasons = [d["reason"] for d in sched.log.recent() if d["kind"] == "k"]
    assert any("expected" in r and "B=2" in r for r in reasons)
    assert sched.monitor.spec_on("batch")  # throttling is not the fallback


def test_step_costs_calibrate_to_the_chunks_run(engine, prompts):
    """With the warm-up table, every chunk recalibrates the (bucket, K) it ran at; the policy's
    costs and the /metrics gauge follow, the table itself is kept."""
    sched = Scheduler(engine, config(step_costs=None, calibrate_costs=True))
    assert sched.costs.source == "warm-up"
    reqs = [sched.submit(Request(p, SamplingParams(max_new_tokens=24, ignore_eos=True), "batch")) for p in prompts[:2]]
    drain(sched, reqs)
    ran = {(b, k) for b in BUCKETS for k in KS if sched.costs._live.get((b, k))}
    assert ran, "no chunk was observed"
    for b, k in ran:
        assert 0.05 < sched.costs.scale(b, k) < 20  # wall time of real chunks against warm-up's
        assert sched.costs.cost(b, k) == pytest.approx(engine.step_costs[b][k] * sched.costs.scale(b, k))
        line = next(
            x
            for x in sched.metrics.render().splitlines()
            if x.startswith(f'specjax_expected_step_seconds{{bucket="{b}",k="{k}"}}')
        )
        assert float(line.split()[-1]) == pytest.approx(sched.costs.cost(b, k), rel=1e-3)
    assert sched.costs.to_dict() == {
        str(b): {str(k): c for k, c in row.items()} for b, row in engine.step_costs.items()
    }


def test_plain_chunk_times_k0_when_it_is_stale(engine, prompts):
    """With calibration on, K > 0 is not run on a K = 0 cost nobody has timed: the first chunk
    at a bucket, and one in every `cost_refresh_chunks` after, runs plain, with its reason."""
    sched = Scheduler(engine, config(step_costs=FLAT, calibrate_costs=True, cost_refresh_chunks=3))
    ks = []
    choose = sched._choose
    sched._choose = lambda rows, queued: ks.append(choose(rows, queued)) or ks[-1]
    req = sched.submit(Request(prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True), "batch"))
    drain(sched, [req])
    k_seq = [k for k, _ in ks]
    assert k_seq[0] == 0 and 3 in k_seq and k_seq.count(0) >= 2, k_seq
    gaps = [i for i, k in enumerate(k_seq) if k == 0]
    assert all(b - a <= 3 + 1 for a, b in zip(gaps, gaps[1:])), k_seq
    assert any("plain chunk to time K=0" in d["reason"] for d in sched.log.recent() if d["kind"] == "k")


def test_fallback_switches_off_and_back_on(engine, prompts):
    """Hot traffic (random drafts) switches speculation off for its class within a bounded
    number of steps; after the traffic cools, a probe switches it back on. /metrics shows both."""
    mon = MonitorConfig(window_steps=16, min_steps=6, probe_every=8, probe_steps=4)
    sched = Scheduler(engine, config(monitor=mon, step_costs=FLAT))
    hot = SamplingParams(temperature=1.5, max_new_tokens=30, ignore_eos=True, seed=3)
    reqs = [sched.submit(Request(p, hot, "batch")) for p in prompts[:2]]
    off_at = None
    for _ in range(60):
        sched.iteration()
        if not sched.monitor.spec_on("batch"):
            off_at = sched.steps
            break
    assert off_at is not None and off_at <= mon.min_steps + sched.cfg.chunk_steps + 2
    text = sched.metrics.render()
    assert 'specjax_speculation_enabled{class="batch"} 0' in text
    assert 'specjax_speculation_switches_total{class="batch",to="off"} 1' in text
    assert sched.monitor.spec_on("interactive")  # per class
    sched.cancel(reqs[0].id)
    sched.cancel(reqs[1].id)
    cool = [sched.submit(Request(p, SamplingParams(max_new_tokens=30, ignore_eos=True), "batch")) for p in prompts[2:4]]
    drain(sched, cool)
    kinds = [d["kind"] for d in sched.log.recent()]
    assert kinds.index("spec_off") < kinds.index("probe") < kinds.index("spec_on"), kinds
    assert sched.monitor.spec_on("batch")
    assert 'specjax_speculation_enabled{class="batch"} 1' in sched.metrics.render()
    off = next(d for d in sched.log.recent() if d["kind"] == "spec_off")
    assert "expected gain" in off["reason"] and "MAL" in off["reason"]


def test_exploration_measures_a_drafter_the_prior_undersells(engine, prompts):
    """Costs where the prior acceptance says speculation does not pay, a drafter that is in fact
    perfect: an exploration probe measures it and the policy switches to K > 0."""
    mon = MonitorConfig(min_steps=4, probe_steps=2, window_steps=16)
    # prior (0.6 per position): MAL(3) 2.18 < 2.3, plain; a good drafter (0.75): 2.73 / 2.3 = 1.19
    # >= probe_gain 1.15, explore
    sched = Scheduler(engine, config(step_costs={1: {0: 1.0, 3: 2.3}, 2: {0: 1.0, 3: 2.3}}, monitor=mon))
    req = sched.submit(Request(prompts[0], SamplingParams(max_new_tokens=40, ignore_eos=True), "interactive"))
    drain(sched, [req])
    kinds = [d["kind"] for d in sched.log.recent()]
    assert kinds.index("probe") < kinds.index("explored"), kinds
    assert req.k_steps[3] > 0 and req.k_steps[0] <= 2, req.k_steps  # plain only before the probe
    assert req.sample.mal > 2.5


def test_interactive_admitted_first(engine, prompts):
    sched = Scheduler(engine, config(buckets=(1,), preempt=False))
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    batch = [sched.submit(Request(p, sp, "batch")) for p in prompts[:3]]
    inter = sched.submit(Request(prompts[3], sp, "interactive"))
    drain(sched, batch + [inter])
    assert inter.first_token_time < min(r.first_token_time for r in batch[1:])


def test_load_sweep_point_and_summary(engine, target, prompts):
    """The serve-bench machinery on the tiny engine: every mode at two loads, nothing lost."""
    from specjax.bench import loadbench

    pool = {"interactive": prompts[:4], "batch": prompts[4:8]}
    scheds = loadbench.start_modes(engine, config(), (), loadbench.MODES)
    points = [loadbench.run_point(scheds[mode], c, 4, pool, 8, 0.5) for c in (1, 2) for mode in loadbench.MODES]
    for sc in scheds.values():
        sc.stop()
    for p in points:
        assert p["requests"] == 4 and p["tokens"] == 4 * 8 and p["tokens_per_second"] > 0
        assert p["compiles"] == 0 and p["chunks"] > 0 and 0 < p["chunk_seconds"] <= p["seconds"]
        assert all(n > 0 and ms > 0 for n, ms in p["steps_ms_by_bucket_k"].values())
    assert set(points[0]["steps_by_k"]) == {"3"} and set(points[1]["steps_by_k"]) == {"0"}  # always / never
    for p in points:  # the JSON carries each decision about speculation with its reason
        assert all(d["kind"] in loadbench.SPEC_DECISIONS and d["reason"] for d in p["decisions"])
        assert p["k_changes"] == sum(d["kind"] == "k" for d in p["decisions"])
    summary = loadbench.summarize(points)
    assert [s["clients"] for s in summary] == [1, 2] and all("rules_vs_best_fixed" in s for s in summary)
    loadbench.print_points({"model": "tiny", "drafter": "ngram", "ks": [3], "buckets": [1, 2], "points": points})


def test_load_sweep_stops_on_failed_requests(engine, prompts):
    """A load point whose requests failed is an error, not a throughput figure."""
    from specjax.bench import loadbench

    sched = Scheduler(engine, config(), k_override=lambda b, rows: 5).start()  # K = 5 was never compiled
    try:
        with pytest.raises(RuntimeError, match=r"4 of 4 requests failed \(rules, 2 clients\): internal error"):
            loadbench.run_point(sched, 2, 4, {"interactive": prompts[:2], "batch": prompts[2:4]}, 8, 0.5)
    finally:
        sched.stop()
