"""Serving policy without a model (issue 6): step costs and their live calibration, the policy's
choice of K (the ladder, trees, hysteresis, lowered acceptance), the acceptance monitor's switches
and probes, the /metrics exposition, the YAML config, and serve-bench's client work and summaries.
The scheduler on a tiny model: test_serving.py."""

import os

import numpy as np
import pytest

from helpers import REPO
from specjax.errors import SpecjaxError
from specjax.policy.chunks import Policy
from specjax.policy.costs import StepCosts
from specjax.policy.monitor import AcceptanceMonitor, DecisionLog, Estimate, MonitorConfig
from specjax.server.config import ServingConfig, load_config
from specjax.server.metrics import ServingMetrics
from specjax.stats import AcceptanceStats


def test_step_costs_interpolate():
    c = StepCosts({1: {0: 1.0, 2: 2.0, 4: 4.0}, 4: {0: 2.0, 4: 6.0}}, "test")
    assert c.cost(1, 3) == pytest.approx(3.0) and c.cost(3, 2) == pytest.approx(4.0)
    assert c.cost(9, 0) == 2.0  # beyond the largest bucket: the largest
    assert c.effective(1, 2, 0.5) == pytest.approx(1.5)


def test_step_costs_live_calibration_changes_the_decision():
    """Warm-up says K=3 costs 1.3 plain steps, so MAL 1.45 would pay; the chunks the scheduler
    times say K=3 steps cost 1.6 (with half of them verifying): the calibrated gain is below 1
    and the policy picks plain decoding. A K not run at a bucket borrows that bucket's run K."""
    costs = StepCosts({1: {0: 1.0, 3: 1.3}, 2: {0: 1.2, 3: 1.8}}, "warm-up")
    pol = Policy(ServingConfig(ks=(0, 3), buckets=(1, 2), margin=0.0).validate(), costs, (0, 3))
    est = {"batch": Estimate(1.0, [0.45, 0.0, 0.0], 100)}
    on = {"batch": True}
    assert pol.gain(est["batch"], 1, 3) == pytest.approx(1.45 / 1.3)
    assert pol.choose(1, {"batch": 1}, 0, est, on, (), 3).k == 3
    for _ in range(40):  # half the steps verify; the chunk costs 8 * 1.6 + 0 instead of 4 * 1.3 + 4 * 1.0
        costs.observe(1, 3, seconds=8 * 1.6, steps=8, verify_steps=4)
        costs.observe(1, 0, seconds=8 * 1.0, steps=8, verify_steps=0)
    assert costs.scale(1, 3) == pytest.approx(12.8 / 9.2, rel=0.02) and costs.scale(1, 0) == pytest.approx(1.0)
    assert costs.cost(1, 3) == pytest.approx(1.3 * 12.8 / 9.2, rel=0.02)
    assert pol.gain(est["batch"], 1, 3) < 1.0 and pol.choose(1, {"batch": 1}, 0, est, on, (), 3).k == 0
    assert costs.to_dict() == {"1": {"0": 1.0, "3": 1.3}, "2": {"0": 1.2, "3": 1.8}}  # the table is kept
    assert costs.to_dict(live=True)["1"]["3"] == pytest.approx(costs.cost(1, 3))
    assert not costs.stale(1, 0, 1) and not costs.stale(1, 3, 2) and costs.stale(1, 3, 1)  # K=3: 1 chunk ago
    assert costs.stale(2, 0, 100)  # never run at bucket 2
    assert costs.scale(2, 3) == 1.0  # nothing run at bucket 2: the table's ratios as they are
    costs.observe(2, 0, seconds=8 * 1.2 * 1.5, steps=8, verify_steps=0)  # bucket 2 runs 1.5x slow
    assert costs.scale(2, 3) == costs.scale(2, 0) > 1.2  # an unrun K borrows the bucket's run K
    fresh = StepCosts({1: {0: 1.0, 3: 1.3}}, "warm-up")
    fresh.observe(1, 3, seconds=16.0, steps=8, verify_steps=8)  # one chunk: shrunk towards the table
    assert 1.0 < fresh.scale(1, 3) < 16.0 / (8 * 1.3)
    # A K run briefly at a bucket whose K=0 runs 1.3x slow is shrunk towards 1.3x, not towards 1:
    # one probe that measured K=3 dearer than the table must not leave it looking cheaper.
    slow = StepCosts({8: {0: 0.15, 3: 0.363}}, "warm-up")
    for _ in range(10):
        slow.observe(8, 0, seconds=8 * 0.15 * 1.3, steps=8, verify_steps=0)
    before = slow.cost(8, 3) / slow.cost(8, 0)
    assert before == pytest.approx(0.363 / 0.15)  # unrun: borrows K=0's calibration
    slow.observe(8, 3, seconds=4 * 0.505, steps=4, verify_steps=4)  # measured 0.505 / 0.195 = 2.59
    after = slow.cost(8, 3) / slow.cost(8, 0)
    assert before < after < 0.505 / (0.15 * 1.3)


def test_policy_prices_k_on_lowered_acceptance():
    """A young window (few checks) that looks good does not buy K > 0 where it would barely pay;
    the same acceptance over a long window does. The prior (no checks) is not lowered."""
    costs = {1: {0: 1.0, 3: 1.8}}
    pol = _policy(costs, margin=0.0, ks=(0, 3), confidence_z=1.0)
    on = {"batch": True}
    young = Estimate(1.0, [0.6, 0.6, 0.6], 16, [16, 10, 6])
    old = Estimate(1.0, [0.6, 0.6, 0.6], 1000, [1000, 600, 360])
    assert young.mal(3) == old.mal(3) == pytest.approx(2.176)
    low = young.lower(1.0)
    assert low.acceptance == pytest.approx([0.6 - (0.24 / 16) ** 0.5, 0.6 - (0.24 / 10) ** 0.5, 0.6 - 0.2])
    assert Estimate(1.0, [0.6], 0).lower(1.0).acceptance == [0.6] and young.lower(0.0) is young
    assert Estimate(1.0, [0.9], 3, [3]).lower(1.0).acceptance == [0.0]  # < 4 checks: nothing
    assert pol.choose(1, {"batch": 1}, 0, {"batch": young}, on, (), 0).k == 0
    assert pol.choose(1, {"batch": 1}, 0, {"batch": old}, on, (), 0).k == 3
    assert (
        _policy(costs, margin=0.0, ks=(0, 3), confidence_z=0.0)
        .choose(1, {"batch": 1}, 0, {"batch": young}, on, (), 0)
        .k
        == 3
    )


def test_load_bench_clients_run_fixed_work_and_summary_takes_medians():
    from specjax.bench import loadbench

    work = loadbench.client_requests(4, 10, 0.5)
    assert [c for c, _ in work] == ["interactive", "interactive", "batch", "batch"]
    assert [len(ix) for _, ix in work] == [3, 3, 2, 2]  # 10 dealt round-robin
    assert sorted(sum((ix for c, ix in work if c == "batch"), [])) == [0, 1, 2, 3]  # each prompt once per class
    assert work == loadbench.client_requests(4, 10, 0.5)
    assert loadbench.client_requests(1, 3, 0.5) == [("batch", [0, 1, 2])]
    modes = ["always", "never", "rules"]
    orders = [loadbench.run_order(modes, r) for r in range(4)]
    assert orders[:2] == [modes, modes[::-1]] and all(sorted(o) == modes for o in orders)
    for m in modes:  # balanced: each mode's mean position over an even number of repeats is the middle
        assert sum(o.index(m) for o in orders) == 4 and sum(o.index(m) for o in orders[:2]) == 2
    pts = [
        {"clients": 2, "mode": m, "tokens_per_second": v, "repeat": r}
        for m, r, v in [
            ("never", 0, 10.0),
            ("never", 1, 12.0),
            ("never", 2, 11.0),
            ("rules", 0, 10.5),
            ("rules", 1, 11.5),
            ("rules", 2, 11.0),
            ("always", 0, 8.0),
            ("always", 1, 12.5),
            ("always", 2, 8.1),
        ]
    ]
    (s,) = loadbench.summarize(pts)
    assert s["never_tok_s"] == 11.0 and s["rules_tok_s"] == 11.0 and s["repeats"] == 3
    assert s["noise"] == pytest.approx(4.5 / 8.1) and s["rules_vs_best_fixed"] == 1.0 and s["rules_vs_plain"] == 1.0
    # paired: per repeat 10.5/10, 11.5/12 (11.5/12.5 against the best fixed), 11/11 -> medians
    assert s["rules_vs_plain_paired"] == pytest.approx(1.0)
    assert s["rules_vs_best_fixed_paired"] == pytest.approx(1.0)
    (s,) = loadbench.summarize([p for p in pts if not (p["mode"] == "rules" and p["repeat"] == 2)])
    assert s["rules_vs_plain_paired"] == pytest.approx((10.5 / 10 + 11.5 / 12) / 2)


def _policy(costs, **kw):
    cfg = ServingConfig(**{"ks": (0, 1, 2, 3, 4), "buckets": tuple(costs), "step_costs": costs, **kw}).validate()
    return Policy(cfg, StepCosts(costs, "test"), cfg.ks)


def test_policy_ladder_is_monotone_and_smooth():
    """K steps down one rung at a time as the verify cost grows, and the chosen expected
    throughput is continuous across the switch points (no cliff)."""
    est = {"batch": Estimate(1.0, [0.7] * 4, 100), "interactive": Estimate(1.0, [0.7] * 4, 100)}
    on = {"batch": True, "interactive": True}
    prev_k, prev_v, ks = None, None, []
    for s in np.linspace(0.0, 1.0, 201):  # cost of a verified token relative to a plain step
        costs = {1: {k: 1.0 + s * k for k in range(5)}}
        pol = _policy(costs, margin=0.0)
        d = pol.choose(1, {"batch": 1, "interactive": 0}, 0, est, on, (), prev_k if prev_k is not None else 4)
        if prev_v is not None:
            assert abs(d.value - prev_v) / prev_v < 0.02  # a step of s moves value by < 2 %
        prev_k, prev_v = d.k, d.value
        ks.append(d.k)
    assert ks[0] == 4 and ks[-1] == 0 and ks == sorted(ks, reverse=True)
    assert set(ks) == {0, 1, 2, 3, 4}  # every rung used on the way down


def test_policy_prices_a_tree_over_its_depth_and_shrinks_it_with_load():
    """With trees K is a node count and MAL is priced over the tree's depth (widths): a 16-node
    tree of depth 5 is worth what 5 chain positions are, not 16; as the verify cost grows with
    the batch the choice steps 16 -> 8 -> 4 -> 0."""
    est = {"batch": Estimate(1.0, [0.7] * 5, 100), "interactive": Estimate(1.0, [0.7] * 5, 100)}
    on = {"batch": True, "interactive": True}
    ks, widths = (0, 4, 8, 16), {0: 0, 4: 3, 8: 4, 16: 5}
    cfg = ServingConfig(ks=ks, buckets=(1,), margin=0.0, tree_topk=4).validate()
    picks = []
    for s in np.linspace(0.0, 0.6, 241):  # cost of one verified node relative to a plain step
        costs = {1: {k: 1.0 + s * k for k in ks}}
        pol = Policy(cfg, StepCosts(costs, "test"), ks, widths)
        d = pol.choose(1, {"batch": 1, "interactive": 0}, 0, est, on, (), 16)
        assert d.value == pytest.approx(est["batch"].mal(widths[d.k]) / costs[1][d.k])
        picks.append(d.k)
    assert picks[0] == 16 and picks[-1] == 0 and picks == sorted(picks, reverse=True)
    assert set(picks) == set(ks)


def test_policy_prices_the_batch_verify_share():
    """A drafter that proposes on a fifth of its row's steps, accepted at 0.9: one row verifies on
    a fifth of the steps and K=2 pays (MAL 1.34 for 1.1 plain steps); at 32 rows some row proposes
    on nearly every step, so every step pays the verify pass (1.5) for the same MAL, and the
    policy decodes plainly (serve-bench at 32 clients ran K=2 at 0.85x plain pricing f = 0.2)."""
    pol = _policy({1: {0: 1.0, 2: 1.5}}, margin=0.0, ks=(0, 2), confidence_z=0.0)
    est = {"batch": Estimate(0.2, [0.9, 0.9], 1000)}
    on = {"batch": True}
    one = pol.choose(1, {"batch": 1}, 0, est, on, (), 0)
    assert one.k == 2 and one.gain == pytest.approx(1.342 / 1.1)
    many = pol.choose(1, {"batch": 32}, 0, est, on, (), 2)
    assert many.k == 0 and "f=1.00" in pol.choose(1, {"batch": 32}, 0, est, on, (), 0).reason


def test_policy_hysteresis_and_fallback_inputs():
    costs = {1: {0: 1.0, 1: 1.1, 2: 1.4, 3: 1.7, 4: 2.0}}
    pol = _policy(costs, margin=0.05)
    est = {"batch": Estimate(1.0, [0.5, 0.5, 0.5, 0.5], 100), "interactive": Estimate(1.0, [0.5] * 4, 100)}
    on = {"batch": True, "interactive": True}
    best = pol.choose(1, {"batch": 1, "interactive": 0}, 0, est, on, (), 0)
    assert best.k == 1  # MAL(1) / cost = 1.5 / 1.1 beats 1.75 / 1.4 and plain's 1 / 1
    assert "expected" in best.reason
    # hysteresis: a clear gain switches (1.36 > 1.25 * 1.05), a near-tie keeps the current K
    assert pol.choose(1, {"batch": 1, "interactive": 0}, 0, est, on, (), 2).k == 1
    tie = _policy({1: {0: 1.0, 1: 1.1, 2: 1.27}}, margin=0.05)
    assert tie.choose(1, {"batch": 1}, 0, est, on, (), 0).k == 2  # 1.378 / 1.364 / 1.0
    assert tie.choose(1, {"batch": 1}, 0, est, on, (), 1).k == 1  # K=2 only 1 % better: kept
    # a class switched off counts MAL 1: plain decoding unless another class gains
    off = {"batch": False, "interactive": True}
    assert pol.choose(1, {"batch": 1, "interactive": 0}, 0, est, off, (), 1).k == 0
    assert pol.choose(1, {"batch": 1, "interactive": 1}, 0, est, off, (), 0).k == 1
    assert _policy(costs, policy="never").choose(1, {"batch": 1}, 0, est, on, (), 0).k == 0
    assert _policy(costs, policy="always").choose(1, {"batch": 1}, 0, est, on, (), 0).k == 4
    sched = _policy(costs, policy="schedule", schedule=((1, 3), (8, 0)))
    assert sched.choose(1, {"batch": 1}, 0, est, on, (), 0).k == 3
    assert sched.choose(1, {"batch": 2}, 0, est, on, (), 0).k == 0


def test_monitor_bounded_switch_off_probe_and_on():
    cfg = MonitorConfig(window_steps=16, min_steps=8, probe_every=10, probe_steps=4)
    log = DecisionLog()
    mon = AcceptanceMonitor(cfg, ("interactive", "batch"), "ngram", log)
    bad = AcceptanceStats(4, 4, 4, np.array([4, 0]), np.array([0, 0]))
    mon.record("batch", 2, bad)
    mon.evaluate("batch", Estimate(1.0, [0.0], 4).mal(2), "d", 4)  # 4 row-steps < min_steps
    assert mon.spec_on("batch")
    mon.record("batch", 2, bad)
    mon.evaluate("batch", 0.8, "d", 8)
    assert not mon.spec_on("batch") and mon.spec_on("interactive")
    assert not mon.probe_due("batch", 12) and mon.probe_due("batch", 18)
    # A failed probe: it runs until it holds min_steps row-steps, then the interval doubles.
    assert mon.probe_steps("batch", rows=1) == 8  # enough steps for min_steps row-steps
    mon.start_probe("batch", 18, 2, 8)
    mon.record("batch", 2, bad)
    mon.evaluate("batch", 1.5, "d", 22)  # 4 row-steps: not judged on so little
    assert mon.probing("batch") and not mon.spec_on("batch") and not mon.probe_due("batch", 100)
    mon.record("batch", 2, bad)
    mon.evaluate("batch", 0.9, "d", 26)
    assert not mon.probing("batch") and not mon.spec_on("batch")
    assert not mon.probe_due("batch", 26 + 19) and mon.probe_due("batch", 26 + 20)  # backoff: 10 -> 20
    mon.start_probe("batch", 46, 2, 4)
    mon.record("batch", 2, AcceptanceStats(8, 24, 8, np.array([8, 8]), np.array([8, 8])))
    mon.evaluate("batch", 2.9, "d", 54)
    assert mon.spec_on("batch")
    assert [d["kind"] for d in log.recent()] == ["spec_off", "probe", "probe_failed", "probe", "spec_on"]
    assert mon.estimate("batch", 2, measured=True).acceptance == [1.0, 1.0]
    mon.record("batch", 2, bad)
    mon.record("batch", 2, bad)
    mon.evaluate("batch", 0.8, "d", 70)  # off again soon after a lucky probe: the backoff goes on, 20 -> 40
    assert not mon.spec_on("batch") and not mon.probe_due("batch", 109) and mon.probe_due("batch", 110)
    # A probe is switched on by its pessimistic gain (acceptance lowered), not its point estimate.
    mon.start_probe("batch", 110, 2, 8)
    mon.record("batch", 2, AcceptanceStats(8, 24, 8, np.array([8, 8]), np.array([8, 8])))
    mon.evaluate("batch", 2.9, "d", 118, gain_on=1.0)
    assert not mon.spec_on("batch") and "lower bound 1.00" in log.recent()[-1]["reason"]
    assert not mon.probe_due("batch", 118 + 79) and mon.probe_due("batch", 118 + 80)  # failed: 40 -> 80
    mon.start_probe("batch", 198, 2, 8)
    mon.record("batch", 2, AcceptanceStats(8, 24, 8, np.array([8, 8]), np.array([8, 8])))
    mon.evaluate("batch", 2.9, "d", 206, gain_on=2.0)
    assert mon.spec_on("batch")
    mon.record("batch", 2, bad)
    mon.record("batch", 2, bad)
    mon.evaluate("batch", 0.8, "d", 206 + 768)  # on for probe_every_max steps: the ladder restarts
    assert not mon.spec_on("batch") and mon.probe_due("batch", 206 + 768 + 10)
    mon2 = AcceptanceMonitor(cfg, ("batch",), "ngram", DecisionLog())
    mon2.record("batch", 2, AcceptanceStats(4, 12, 4, np.array([4, 4]), np.array([4, 4])))
    assert mon2.estimate("batch", 2).acceptance == [0.6, 0.6]  # 4 row-steps < min_steps: the prior
    est = mon2.estimate("batch", 2, measured=True)
    assert est.acceptance == [1.0, 1.0] and est.mal(2) == 3.0


def test_metrics_exposition_format():
    m = ServingMetrics()
    m.steps.inc(5, k=2)
    m.ttft.observe(0.03, **{"class": "interactive"})
    m.itl.observe(0.004, count=3, **{"class": "batch"})
    m.mal.set(2.5, **{"class": 'a"b'}, drafter="ngram")
    text = m.render()
    assert 'specjax_steps_total{k="2"} 5' in text
    assert "# TYPE specjax_time_to_first_token_seconds histogram" in text
    assert 'specjax_time_to_first_token_seconds_bucket{class="interactive",le="0.025"} 0' in text
    assert 'specjax_time_to_first_token_seconds_bucket{class="interactive",le="0.05"} 1' in text
    assert 'specjax_inter_token_latency_seconds_count{class="batch"} 3' in text
    assert 'specjax_mean_accepted_length{class="a\\"b",drafter="ngram"} 2.5' in text
    with pytest.raises(ValueError):
        m.steps.inc(-1, k=0)


def test_policy_yaml_example_loads(tmp_path):
    cfg = load_config(os.path.join(REPO, "configs", "serving-policy.yaml"))
    assert cfg.policy in ("rules", "schedule") and cfg.schedule and 0 in cfg.ks
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: rules\nbukets: [1, 2]\n")
    with pytest.raises(SpecjaxError, match="unknown keys"):
        load_config(str(bad))
    with pytest.raises(SpecjaxError, match="schedule uses K=3"):
        load_config(None, ks=[0, 2], policy="schedule", schedule=[{"max_batch": 4, "k": 3}])
    assert cfg.monitor.probe_gain >= cfg.monitor.on_above
    with pytest.raises(SpecjaxError, match="tree_topk >= 1"):
        load_config(None, tree_topk=0)
    for policy in ("rules", "never"):  # both run plain chunks (serve-bench modes are checked the same way)
        with pytest.raises(SpecjaxError, match=f"policy '{policy}' runs plain chunks, so ks must include 0"):
            load_config(None, ks=[3], policy=policy)
    assert load_config(None, ks=[3], policy="always").ks == (3,)
    with pytest.raises(SpecjaxError, match="probe_gain >= on_above"):
        ServingConfig(monitor=MonitorConfig(on_above=1.2, probe_gain=1.1)).validate()
