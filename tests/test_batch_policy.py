"""Batch jobs' speculation policy (`specjax batch --spec-policy`, specjax/policy/batch.py): `auto`
records one measured cost table per class of batch and a resume reuses it, static policies by batch
rows, the policy state file, tree drafting and `--num-draft auto` tree sizes; greedy rows equal
plain decoding throughout.

The model, the inputs and the reference run are test_batch.py's (conftest.py: `batch_model`,
`job_input`, `greedy_input`, `reference`).
"""

from __future__ import annotations

import collections
import json
import os

import pytest

from helpers import BATCH_MAX_NEW as MAX_NEW
from helpers import BATCH_ROWS as BATCH
from helpers import assert_same_rows as assert_same
from helpers import batch_config as config
from helpers import batch_job_rows, read_rows, write_jsonl


def batch_of_line(model, inp: str) -> dict:
    """id -> first input line of its batch, from the job's own plan."""
    from specjax.batch.config import BatchConfig
    from specjax.batch.inputs import parse_input, read_input, tokenize
    from specjax.batch.plan import plan_batches
    from specjax.sampling import SamplingParams

    cfg = BatchConfig(output="unused", input=inp)
    rows = [tokenize(model, r, False) for r in parse_input(read_input(cfg), SamplingParams(max_new_tokens=MAX_NEW))]
    return {r.id: str(b[0].line) for b, _ in plan_batches(rows, BATCH) for r in b}


def test_auto_policy_records_cost_tables_and_resume_reuses_them(batch_model, job_input, reference, tmp_path):
    """`auto` (the default with a drafter): each class of batch (rows, greedy/sampled) gets one
    measured cost table and gain, written to OUTPUT.policy.json and used by every batch of
    the class (speculating per row, or plain decoding where the drafter did not gain); greedy
    rows equal plain decoding. A rerun reads the recorded figures instead of measuring: lost
    sampled rows come back bit for bit, and a greedy class whose figures are replaced by ones under
    which the rows speculate but no verify pays reruns its lost rows with the drafter, verifying
    not once."""
    from specjax.batch.job import run_batch

    out = tmp_path / "res.jsonl"
    summary = run_batch(config(batch_model, job_input, out, drafter="ngram", num_draft=3))
    state_path = str(out) + ".policy.json"
    with open(state_path) as fh:
        state = json.load(fh)
    first = read_rows(out)
    assert set(state["classes"]) == {"4/greedy", "4/sampled"}
    for entry in state["classes"].values():
        assert len(entry["costs"]) == 4 and entry["costs"][0] >= 1.0 and entry["batches"] >= 1
        assert entry["gain"] > 0.0 and entry["speculates"] == (entry["gain"] >= 1.05)
    assert_same(first, reference, list(reference), greedy_only=True)  # lossless
    for cls, entry in summary["speculation"].items():
        assert 0.0 <= entry["verified_share"] <= 1.0 and entry["verify_cost"] >= 1.0, cls
    sampled_ids = {r["id"] for r in batch_job_rows() if "temperature" in r}
    for r in first:
        on = state["classes"]["4/sampled" if r["id"] in sampled_ids else "4/greedy"]["speculates"]
        assert (r["stats"]["num_draft"], r["stats"]["spec_policy"]) == ((3, "auto") if on else (0, "always")), r["id"]

    key_of = batch_of_line(batch_model, job_input)
    lost_greedy = min({key_of[r["id"]] for r in first if r["id"] not in sampled_ids}, key=int)
    state["classes"]["4/greedy"].update(costs=[1.0, 9.0, 9.0, 9.0], speculates=True)  # no width pays per row
    with open(state_path, "w") as fh:
        json.dump(state, fh)
    lost = {r["id"] for r in first if r["id"] in sampled_ids or key_of[r["id"]] == lost_greedy}
    with open(out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in first if r["id"] not in lost)
    again = run_batch(config(batch_model, job_input, out, drafter="ngram", num_draft=3))
    assert again["written"] == len(lost)
    rows = {r["id"]: r for r in read_rows(out)}
    before = {r["id"]: r for r in first}
    for i in lost:
        if i in sampled_ids:  # the same table: the same decisions and samples
            assert rows[i]["token_ids"] == before[i]["token_ids"], i
            assert rows[i]["stats"]["verified_steps"] == before[i]["stats"]["verified_steps"], i
        else:
            assert rows[i]["stats"]["verified_steps"] == 0 and rows[i]["stats"]["num_draft"] == 3, i
    assert_same(list(rows.values()), reference, list(reference), greedy_only=True)
    with open(state_path) as fh:
        assert json.load(fh)["classes"]["4/greedy"]["costs"] == [1.0, 9.0, 9.0, 9.0]  # not measured again


@pytest.mark.parametrize(
    "policy, expect", [("2", {4: 0, 1: 3}), ("4", {4: 3, 1: 3}), ("0", {4: 0, 1: 0}), ("always", {4: 3, 1: 3})]
)
def test_static_policy_by_batch_rows(batch_model, greedy_input, reference, tmp_path, policy, expect):
    """`--spec-policy N`: speculate in batches of at most N rows (5 rows: a batch of 4 and one
    of 1); `always`: in every batch, verifying every step. Greedy rows equal plain decoding either
    way; no state file."""
    from specjax.batch.job import run_batch

    with open(greedy_input) as fh:
        inp = write_jsonl(tmp_path / "in.jsonl", [json.loads(line) for line in fh][:5])
    out = tmp_path / "res.jsonl"
    run_batch(config(batch_model, inp, out, drafter="ngram", num_draft=3, spec_policy=policy))
    rows = read_rows(out)
    key_of = batch_of_line(batch_model, inp)
    sizes = collections.Counter(key_of.values())
    for r in rows:
        assert r["stats"]["num_draft"] == expect[sizes[key_of[r["id"]]]], (policy, r["id"])
        assert r["stats"]["spec_policy"] == "always", r["id"]
    assert_same(rows, reference, [r["id"] for r in rows])
    assert not os.path.exists(str(out) + ".policy.json")


def test_batch_policy_state_file(tmp_path):
    """A class's figures are measured once and recorded before use; a class speculates only
    on a measured gain of at least 1.05; the file reloads to the same decisions; another
    drafter or K ignores it; a failed measurement records nothing; a corrupt file is a one-line
    error; bad settings are one-line errors."""
    from specjax.errors import SpecjaxError
    from specjax.policy.batch import BatchPolicy, parse_num_draft, parse_policy

    path = str(tmp_path / "out.jsonl.policy.json")
    calls = []

    def measure(table, gain, k=3):
        calls.append(1)
        return {k: (table, gain)}

    p = BatchPolicy("auto", (3,), "ngram", path)
    assert p.plan(4, False, lambda: None) == (True, None, 3) and not os.path.exists(path)
    cheap, dear = [1.0, 1.2, 1.4, 1.6], [1.0, 1.6, 2.2, 2.8]
    assert p.plan(4, True, lambda: measure(cheap, 1.3)) == (True, cheap, 3) and os.path.exists(path)
    assert p.plan(4, True, lambda: measure(cheap, 0.5)) == (True, cheap, 3) and len(calls) == 1
    assert p.plan(8, True, lambda: measure(dear, 1.02)) == (False, None, 3) and len(calls) == 2
    p.record(4, True, steps=100, verified_steps=25)
    assert p.summary()["4/greedy"] == {
        "batches": 1,
        "num_draft": 3,
        "verify_cost": 1.6,
        "gain": 1.3,
        "gains": {"3": 1.3},
        "speculates": True,
        "verified_share": 0.25,
    }
    assert "1.60 plain steps" in p.describe(4, True) and "plain decoding" in p.describe(8, True)
    again = BatchPolicy("auto", (3,), "ngram", path)
    assert again.plan(4, True, lambda: measure(dear, 0.1)) == (True, cheap, 3) and len(calls) == 2
    assert again.plan(8, True, lambda: measure(cheap, 2.0)) == (False, None, 3) and len(calls) == 2
    assert BatchPolicy("auto", (5,), "ngram", path).classes == {}
    assert BatchPolicy("auto", (3,), "eagle3", path).classes == {}
    assert BatchPolicy("always", (3,), "ngram", path).plan(4, True, lambda: measure(cheap, 1.3)) == (True, None, 3)
    assert BatchPolicy(2, (3,), "ngram", None).plan(4, True, None) == (False, None, 0)
    assert BatchPolicy(4, (3,), "ngram", None).plan(4, True, None) == (True, None, 3)
    # --num-draft auto: every candidate measured once per class, the fastest kept (per batch size)
    auto = str(tmp_path / "auto.policy.json")
    tables = {4: [1.0, 1.1, 1.2, 1.3], 8: [1.0, 1.2, 1.4, 1.6, 1.8], 16: [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]}
    p = BatchPolicy("auto", (4, 8, 16), "eagle3/tree4x5", auto, "auto")
    small = {4: (tables[4], 1.10), 8: (tables[8], 1.25), 16: (tables[16], 1.20)}
    large = {4: (tables[4], 1.02), 8: (tables[8], 0.90), 16: (tables[16], 0.60)}
    assert p.plan(1, True, lambda: small) == (True, tables[8], 8)
    assert p.plan(16, True, lambda: large) == (False, None, 4)
    assert "K=8" in p.describe(1, True) and "16: 1.20x" in p.describe(1, True)
    reread = BatchPolicy("auto", (4, 8, 16), "eagle3/tree4x5", auto, "auto")
    assert reread.plan(1, True, lambda: large) == (True, tables[8], 8)
    assert BatchPolicy("auto", (4, 8), "eagle3/tree4x5", auto, "auto:4,8").classes == {}
    with pytest.raises(SpecjaxError, match="needs --spec-policy auto"):
        BatchPolicy("always", (4, 8), "eagle3/tree4x5", None, "auto")
    assert parse_num_draft("auto") == ((), False) and parse_num_draft("auto:16,4") == ((4, 16), True)
    assert parse_num_draft(" 7 ") == 7
    for bad in ("-1", "auto:", "auto:0,4", "many"):
        with pytest.raises(SpecjaxError, match="--num-draft"):
            parse_num_draft(bad)
    with open(path, "w") as fh:
        fh.write("{not json")
    with pytest.raises(SpecjaxError, match="unreadable speculation state"):
        BatchPolicy("auto", (3,), "ngram", path)
    for bad in ("fast", "-1", "1.5", "off"):
        with pytest.raises(SpecjaxError, match="--spec-policy"):
            parse_policy(bad)
    assert parse_policy("AUTO") == "auto" and parse_policy(" 8 ") == 8 and parse_policy("always") == "always"


def test_tree_drafting_batch_job_equals_plain(batch_model, greedy_input, reference, tmp_path):
    """`specjax batch --tree-topk 3 --tree-depth 3`: n-gram tries of 6 nodes verified every step;
    greedy rows equal plain decoding and their stats name the tree."""
    from specjax.batch.job import run_batch

    out = tmp_path / "res.jsonl"
    run_batch(
        config(
            batch_model,
            greedy_input,
            out,
            drafter="ngram",
            num_draft=6,
            tree_topk=3,
            tree_depth=3,
            spec_policy="always",
        )
    )
    rows = read_rows(out)
    assert rows and all((r["stats"]["num_draft"], r["stats"]["tree"]) == (6, "3x3") for r in rows)
    assert_same(rows, reference, [r["id"] for r in rows])


def test_auto_tree_size_batch_job_equals_plain(batch_model, greedy_input, reference, tmp_path):
    """`specjax batch --num-draft auto:2,6 --tree-topk 3`: the class's first batch times both tree
    sizes on its own rows and keeps the faster; the choice is in the policy file and the summary,
    every row ran at it, and greedy rows equal plain decoding."""
    from specjax.batch.job import run_batch

    out = tmp_path / "res.jsonl"
    summary = run_batch(
        config(batch_model, greedy_input, out, drafter="ngram", num_draft="auto:2,6", tree_topk=3, tree_depth=2)
    )
    classes = summary["speculation"]
    assert classes
    for entry in classes.values():
        assert entry["num_draft"] in (2, 6) and set(entry["gains"]) == {"2", "6"}
        assert entry["gain"] == max(entry["gains"].values())
    with open(str(out) + ".policy.json") as fh:
        assert json.load(fh)["num_draft"] == "auto:2,6"
    rows = read_rows(out)
    chosen = {e["num_draft"] for e in classes.values()}
    assert all(r["stats"]["num_draft"] in chosen | {0} for r in rows)
    assert_same(rows, reference, [r["id"] for r in rows])
