"""The per-row speculation fallback (`--spec-policy auto`, specjax/policy/rows.py): greedy output
token-identical to plain decoding for every shipped drafter on the real default model; a drafter
whose drafts are never accepted verifies on a few percent of steps; a well-accepted one keeps
verifying; the policy's own rule on hand-made observations; the measured cost table and its cache.
The sampled law over rows that switch speculation off and on is in test_sampled_engine.py."""

from __future__ import annotations

import importlib
import json

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from helpers import tiny
from specjax.drafters import make_drafter
from specjax.drafters.base import Drafter, Proposal
from specjax.models.loading import random_model
from specjax.policy import costs as policy_costs
from specjax.policy import rows as policy_rows
from specjax.prompts import encode_prompt
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying healthy?",
    'Repeat the sentence "the cat sat on the mat" five times.',
]


class RandomDrafter(Drafter):
    """Drafts uniformly random tokens: accepted about 1/V of the time."""

    name = "random"

    def __init__(self, num_draft: int, vocab: int):
        super().__init__(num_draft)
        self.vocab = vocab

    def propose(self, dparams, state, ctx):
        mix = ctx.seeds[:, None] * jnp.uint32(2654435761) + jnp.arange(self.num_draft, dtype=jnp.uint32)[None]
        return Proposal((mix % jnp.uint32(self.vocab)).astype(jnp.int32)), state  # [B, K]


@pytest.fixture(scope="module")
def real(default_model):
    """(engine, prompt ids, plain greedy rows) on the default model."""
    engine = Engine(default_model)
    ids = [encode_prompt(default_model, p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=40)] * len(ids)
    return engine, ids, engine.generate(ids, params, eos_ids=default_model.config.eos_token_ids)


@pytest.mark.parametrize("kind, k", [("ngram", 5), ("eagle3", 5), ("mtp", 3), ("draft", 4)])
def test_auto_policy_greedy_is_token_identical_to_plain(default_model, real, kind, k):
    """A cost table under which rows switch (a verify of K drafts costs 2 plain steps)."""
    engine, ids, plain = real
    rows = engine.generate(
        ids,
        [SamplingParams(max_new_tokens=40)] * len(ids),
        eos_ids=default_model.config.eos_token_ids,
        drafter=make_drafter(kind, k, default_model),
        spec_mode=policy_rows.AUTO,
        costs=policy_costs.cost_table(k, 2.0),
    )
    for r, p in zip(rows, plain):
        assert r.token_ids == p.token_ids
        assert 0 <= r.checked[0] <= r.steps


def test_never_accepted_drafter_verifies_on_a_few_percent_of_steps():
    cfg = tiny(
        vocab_size=64,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=1024,
    )
    engine = Engine(random_model(cfg, seed=0))
    costs = policy_costs.cost_table(4, 1.8)
    params = [SamplingParams(max_new_tokens=600, ignore_eos=True)] * 2
    rows = engine.generate(
        [[1, 2, 3], [4, 5]], params, drafter=RandomDrafter(4, 64), spec_mode=policy_rows.AUTO, costs=costs
    )
    always = engine.generate([[1, 2, 3], [4, 5]], params, drafter=RandomDrafter(4, 64))
    for r, a in zip(rows, always):
        assert r.token_ids == a.token_ids  # greedy: the policy never changes the text
        assert r.checked[0] / r.steps <= 0.03, (r.checked[0], r.steps)
        assert a.checked[0] == a.steps  # without the policy, every step verifies


def test_a_batch_whose_drafter_does_not_pay_decodes_plainly(tmp_path, monkeypatch):
    """`plan_call` (generate's and the bench's `auto`): at 2 rows a never-accepted drafter's
    measured gain is under 1 + MARGIN, so the batch decodes plainly (no cost table); one row
    with one K gets the per-row rule's cost table without a gain check."""
    from specjax.policy.batch import plan_call

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setattr(policy_costs, "_COSTS", {})
    cfg = tiny(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    engine = Engine(random_model(cfg, seed=0))
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * 2
    variants, labels = {4: RandomDrafter(4, 64)}, {4: "random"}
    assert plan_call(engine, [[1, 2, 3], [4, 5]], params, (), variants, labels) == (4, None)
    k, table = plan_call(engine, [[1, 2, 3]], params[:1], (), variants, labels)
    assert k == 4 and len(table) == 5 and table[-1] > 1.0


def test_well_accepted_drafter_keeps_verifying():
    """The target as its own draft model: every draft accepted, so every step verifies."""
    from specjax.drafters.draft_model import DraftModelDrafter

    cfg = tiny(vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    target = random_model(cfg, seed=0)
    engine = Engine(target)
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)]
    ref = engine.generate([[1, 2]], params)[0].token_ids
    row = engine.generate(
        [[1, 2]],
        params,
        drafter=DraftModelDrafter(3, target, target.config),
        spec_mode=policy_rows.AUTO,
        costs=policy_costs.cost_table(3, 2.5),
    )[0]
    assert row.token_ids == ref
    assert row.checked[0] == row.steps and sum(row.accepted) == sum(row.checked)


def test_policy_rule_on_observations():
    """A rejected probe waits b, then 2b, ... steps (at most 2 * MAX_WAIT), b at least the wait
    that keeps failed probes under PROBE_LOSS of the steps, resuming on a multiple of its wait, so
    rows that wait as long probe together; a paying verify keeps a row on; a row
    whose drafter declines counts that step at the table's declined-step cost; a done row never
    verifies; a table under which no width can pay never verifies."""
    b = 4
    pol = policy_rows.new_policy(b, policy_costs.cost_table(4, 2.0, 1.3), policy_rows.AUTO)
    live = jnp.array([True, True, True, False])
    steps = jnp.zeros(b, jnp.int32)
    on = policy_rows.plan(pol, live, steps)
    assert on.tolist() == [True, True, True, False]
    width = jnp.array([4, 4, 0, 0])
    pol = policy_rows.update(pol, on, steps, width, jnp.array([1, 4, 0, 0]), jnp.array([0, 4, 0, 0]))
    # Row 0: acceptance 1/3 (prior included), 1.49 tokens for 2 plain steps: a loss of 0.51, so
    # it waits 32 (the power of two below 0.51 / PROBE_LOSS) and resumes at 64. Row 2 declined: a
    # fifth of its steps (prior) verify at the prior acceptance 1/2, 1.94 tokens for 2 plain
    # steps, the others emit 1 token for 1.3: 1.19 tokens for 1.44, a loss of 0.25 (wait 16).
    assert pol.resume.tolist() == [64, 0, 32, 0] and pol.backoff.tolist() == [64, 1, 32, 1]
    probes = [0]
    for t in range(1, 700):
        steps = jnp.full(b, t, jnp.int32)
        on = policy_rows.plan(pol, live, steps)
        if bool(on[0]):
            probes.append(t)
        pol = policy_rows.update(pol, on, steps, jnp.where(on, 4, 0), jnp.where(on, 1, 0), jnp.zeros(b, jnp.int32))
    gaps = np.diff(probes)
    assert probes[:5] == [0, 64, 192, 384, 640], probes
    assert np.all(np.diff(gaps) >= 0) and gaps.max() <= 2 * policy_rows.MAX_WAIT
    assert all(p % min(2**i, policy_rows.MAX_WAIT) == 0 for i, p in enumerate(probes[1:]))
    assert len(probes) / 700 < 0.02
    assert not bool(on[3])  # a done row never verifies
    assert policy_rows.plan(pol.replace(mode=jnp.asarray(policy_rows.ALWAYS)), live, steps).tolist() == live.tolist()
    never = policy_rows.new_policy(b, policy_costs.cost_table(4, 5.5), policy_rows.AUTO)
    assert not policy_rows.can_pay(policy_costs.cost_table(4, 5.5)) and policy_rows.can_pay(
        policy_costs.cost_table(4, 5.0)
    )
    assert not bool(jnp.any(policy_rows.plan(never, live, jnp.zeros(b, jnp.int32))))
    forced = policy_rows.new_policy(b, policy_costs.cost_table(4, 5.5), policy_rows.FORCE)
    assert policy_rows.plan(forced, live, jnp.zeros(b, jnp.int32)).tolist() == live.tolist()
    idle = policy_rows.new_policy(b, policy_costs.cost_table(4, 5.5), policy_rows.IDLE)
    assert not bool(jnp.any(policy_rows.plan(idle, live, jnp.zeros(b, jnp.int32))))


def probe_steps(pol, n_steps: int) -> list[int]:
    """The steps on which one row, whose probes all fail (one of 4 drafts checked, none
    accepted), verifies over `n_steps` steps."""
    live, probes = jnp.array([True]), []
    for t in range(n_steps):
        steps = jnp.full(1, t, jnp.int32)
        on = policy_rows.plan(pol, live, steps)
        probes += [t] if bool(on[0]) else []
        pol = policy_rows.update(pol, on, steps, jnp.where(on, 4, 0), jnp.where(on, 1, 0), jnp.zeros(1, jnp.int32))
    return probes


def test_the_drafter_sets_the_wait_between_probes():
    """The engine builds each row's rule with its drafter's `probe_wait`: the n-gram drafter's
    (4, 0.2) makes a row whose probes keep failing look again every 8 steps at most (whether its
    drafts are accepted switches with the text); the default waits up to 128."""
    costs = policy_costs.cost_table(4, 2.0, 1.3)
    engine = Engine(random_model(tiny(), seed=0))
    ngram = make_drafter("ngram", 4, engine.model)
    assert ngram.probe_wait == (4, 0.2) and Drafter.probe_wait is None
    short = probe_steps(policy_rows.new_policy(1, costs, policy_rows.AUTO, ngram.probe_wait), 400)
    # the first failure's loss 0.51 / 0.2 gives a wait of 2 (resume at 4), then 4 for good
    assert short[:4] == [0, 4, 12, 20] and max(np.diff(short)) == 8, short
    default = probe_steps(policy_rows.new_policy(1, costs, policy_rows.AUTO), 400)
    assert default == [0, 64, 192, 384], default
    _, pol = engine._rows([[1, 2, 3]], 8, [SamplingParams(max_new_tokens=4)], (), ngram, None, policy_rows.AUTO, None)
    assert int(pol.max_wait) == 4 and float(pol.probe_loss) == pytest.approx(0.2)


@pytest.mark.parametrize("idle_cost", [1.0, 1.1])
def test_declined_steps_turn_a_gated_row_off_when_they_cost(idle_cost):
    """A row whose verifies pay (all 4 drafts accepted) but whose drafter then declines on every
    step: when a declined step costs what a plain one does it stays on (nothing is lost by
    asking), when it costs 10% more the row switches off and probes with backoff."""
    pol = policy_rows.new_policy(1, policy_costs.cost_table(4, 2.0, idle_cost), policy_rows.AUTO)
    live, ones = jnp.array([True]), jnp.ones(1, jnp.int32)
    pol = policy_rows.update(pol, live, 0 * ones, 4 * ones, 4 * ones, 4 * ones)
    on_steps = 0
    for t in range(1, 1000):
        on = policy_rows.plan(pol, live, t * ones)
        on_steps += int(on[0])
        pol = policy_rows.update(pol, on, t * ones, 0 * ones, 0 * ones, 0 * ones)
    if idle_cost == 1.0:
        assert on_steps == 999
    else:
        assert on_steps / 999 <= 0.03, on_steps


def test_skipping_proposals_leaves_every_decision_unchanged(default_model, real):
    """On steps where no row may verify the engine skips the drafter's proposal and, for
    `lazy_commit` drafters, defers its commits (caught up before the next proposal, or once P
    have gathered, in one pass P wide); every later draft (and so each row's checks, accepts and
    decisions) equals a run that proposed and committed on every step. Greedy, the real model,
    every shipped drafter; MTP and the draft model under a table where only full acceptance pays,
    so that rows wait 12 and 24 steps between probes and catch up 4 .. 16 tokens at once."""
    import copy

    engine, ids, plain = real
    params = [SamplingParams(max_new_tokens=48)] * len(ids)
    for kind, k, verify in [("ngram", 5, 2.0), ("eagle3", 5, 2.0), ("mtp", 3, 3.9), ("draft", 4, 4.9)]:
        d = make_drafter(kind, k, default_model)
        assert d.proposal_optional
        always_proposes = copy.copy(d)
        always_proposes.proposal_optional = False
        table = policy_costs.cost_table(k, verify)
        got = engine.generate(
            ids, params, eos_ids=default_model.config.eos_token_ids, drafter=d, spec_mode=policy_rows.AUTO, costs=table
        )
        ref = engine.generate(
            ids,
            params,
            eos_ids=default_model.config.eos_token_ids,
            drafter=always_proposes,
            spec_mode=policy_rows.AUTO,
            costs=table,
        )
        for g, r, p in zip(got, ref, plain):
            assert g.token_ids == r.token_ids and g.token_ids[: len(p.token_ids)] == p.token_ids, kind  # plain: 40
            assert (g.steps, g.checked, g.accepted) == (r.steps, r.checked, r.accepted), kind
        assert any(g.checked[0] < g.steps for g in got), kind  # some steps were plain (skipped)
    # A table under which no width can pay: rows never verify, and their deferred commits are dropped.
    rows = engine.generate(
        ids,
        params,
        eos_ids=default_model.config.eos_token_ids,
        drafter=make_drafter("mtp", 3, default_model),
        spec_mode=policy_rows.AUTO,
        costs=policy_costs.cost_table(3, 4.5),
    )
    for g, p in zip(rows, plain):
        assert g.token_ids[: len(p.token_ids)] == p.token_ids and g.checked[0] == 0


def test_generate_auto_measures_costs_once_and_caches_them_on_disk(default_model, real, tmp_path, monkeypatch):
    """`specjax.generate` (spec_policy="auto" by default) measures the cost table on the batch's
    own shapes, writes it to $SPECJAX_CACHE/step-costs.json, reuses it without measuring, and
    still gives plain decoding's greedy text."""
    engine, ids, plain = real
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setattr(policy_costs, "_COSTS", {})
    monkeypatch.setattr(importlib.import_module("specjax.generate"), "_AUTO_PLAN", {})  # a new process
    out = specjax.generate(
        PROMPTS[:1], model=default_model, sampling=SamplingParams(max_new_tokens=40), drafter="ngram", num_draft=4
    )
    assert out[0].token_ids == plain[0].token_ids
    assert out[0].stats.spec_policy == "auto" and 0 <= out[0].stats.verified_steps <= out[0].stats.steps
    stored = json.loads((tmp_path / "step-costs.json").read_text())
    (key,) = stored
    assert default_model.name in key and "ngram" in key and "B1" in key
    verify_cost, idle_cost = stored[key]
    assert 1.0 < verify_cost < 5.0  # a 5-token verify costs more than a plain step and less than five
    assert 0.5 < idle_cost < verify_cost  # a declined n-gram step costs about a plain step
    monkeypatch.setattr(policy_costs, "_COSTS", {})  # a new process: only the file remains
    monkeypatch.setattr(engine, "generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured again")))
    drafter = make_drafter("ngram", 4, default_model)
    table = policy_costs.measure_costs(
        engine, ids[:1], [SamplingParams(max_new_tokens=40)], default_model.config.eos_token_ids, drafter, "ngram"
    )
    assert table.shape == (5,) and table[0] == max(idle_cost, 1.0) and table[-1] == pytest.approx(verify_cost)
    assert np.all(np.diff(table[1:]) >= 0) and table[1] > 1.0
    with pytest.raises(specjax.InvalidSamplingError, match="spec_policy"):
        specjax.generate(PROMPTS[:1], model=default_model, drafter="ngram", spec_policy="sometimes")


def test_held_prefills_are_reused_and_give_the_same_rows(default_model, real, monkeypatch):
    """The measuring runs' `Engine.holding_prefills`: one prefill per prompts and cache size,
    however many decodes reuse it (each on its own copy of the donated cache; plain decoding also
    from a prefill that returned a drafter's features), the same rows as fresh prefills, nested
    uses share the outer one's outputs, and nothing is held after it."""
    engine, ids, plain = real
    runs = []
    get = engine._get

    class Counted:  # a compiled prefill that logs its runs
        def __init__(self, exe):
            self.exe, self.out_info = exe, exe.out_info

        def __call__(self, *args):
            runs.append("prefill")
            return self.exe(*args)

    def counting(name, *args):
        exe = get(name, *args)
        return Counted(exe) if name == "prefill" else exe

    monkeypatch.setattr(engine, "_get", counting)
    params = [SamplingParams(max_new_tokens=40)] * len(ids)
    eos = default_model.config.eos_token_ids
    drafter = make_drafter("eagle3", 3, default_model)
    fresh = engine.generate(ids, params, eos_ids=eos, drafter=drafter, spec_mode=policy_rows.ALWAYS)
    assert runs == ["prefill"]
    with engine.holding_prefills():
        got = [engine.generate(ids, params, eos_ids=eos, drafter=drafter, spec_mode=policy_rows.ALWAYS)]
        with engine.holding_prefills():
            got += [engine.generate(ids, params, eos_ids=eos) for _ in range(2)]
        got += [engine.generate(ids, params, eos_ids=eos, drafter=drafter, spec_mode=policy_rows.FORCE)]
    assert runs == ["prefill"] * 2  # plain decoding reads the cache of the prefill with the drafter's features
    for rows in got:
        assert [r.token_ids for r in rows] == [p.token_ids for p in plain]
    assert [(r.steps, r.accepted) for r in got[0]] == [(r.steps, r.accepted) for r in fresh]
    with engine.holding_prefills():
        engine.generate(ids, params, eos_ids=eos)
        engine.generate(ids, params, eos_ids=eos, drafter=drafter, spec_mode=policy_rows.ALWAYS)
    engine.generate(ids, params, eos_ids=eos)
    assert runs == ["prefill"] * 5 and engine._held is None  # plain first: the drafter needs its own
