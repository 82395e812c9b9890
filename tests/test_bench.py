"""`specjax bench`: the report arithmetic on a fixed timing table, a tiny end-to-end run (JSON,
plots, peers), the HF peer's greedy tokens against specjax's, bad input, and the accelerator
preset's CPU smoke form. Timings themselves are never asserted (shared, noisy machines)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from helpers import specjax_cli_cmd, tiny
from specjax.bench import peers, report
from specjax.errors import SpecjaxError


def row(suite, b, drafter, k, tps, temp=0.0, **kw):
    label = "plain" if drafter == "none" else report.short_label(drafter)
    return {
        "suite": suite,
        "temperature": temp,
        "batch_size": b,
        "drafter": drafter,
        "label": label,
        "num_draft": k,
        "tokens_per_second": tps,
        **kw,
    }


# Fixed fake timings: suite "code" pays at B=1, 4 and loses at 16; suite "chat" always loses.
TABLE = [
    row("code", 1, "none", 0, 20.0),
    row("code", 1, "ngram", 3, 30.0),
    row("code", 1, "draft:/x/small", 3, 36.0),
    row("code", 4, "none", 0, 60.0),
    row("code", 4, "ngram", 3, 66.0),
    row("code", 4, "draft:/x/small", 3, 54.0),
    row("code", 16, "none", 0, 160.0),
    row("code", 16, "ngram", 3, 150.0),
    row("code", 16, "draft:/x/small", 3, 80.0),
    row("chat", 1, "none", 0, 20.0),
    row("chat", 1, "ngram", 3, 19.0),
    row("chat", 4, "none", 0, 60.0),
    row("chat", 4, "ngram", 3, 60.0),
    # another temperature: its own plain baseline, never code T=0's
    row("code", 1, "none", 0, 10.0, temp=0.7),
    row("code", 1, "ngram", 3, 15.0, temp=0.7),
]


def test_speedup_is_ratio_to_plain_at_same_batch_and_settings():
    rows = report.add_speedups([dict(r) for r in TABLE])
    got = {(r["suite"], r["temperature"], r["batch_size"], r["drafter"]): r["speedup"] for r in rows}
    assert got[("code", 0.0, 1, "ngram")] == pytest.approx(1.5)
    assert got[("code", 0.0, 1, "draft:/x/small")] == pytest.approx(1.8)
    assert got[("code", 0.0, 4, "ngram")] == pytest.approx(1.1)
    assert got[("code", 0.0, 16, "draft:/x/small")] == pytest.approx(0.5)
    assert got[("code", 0.7, 1, "ngram")] == pytest.approx(1.5)
    assert got[("chat", 0.0, 1, "ngram")] == pytest.approx(0.95)
    assert all(got[k] == 1.0 for k in got if k[3] == "none")
    # peers are compared with their own plain decoding, not specjax's
    hf = report.add_speedups(
        [dict(row("code", 1, "none", 0, 8.0), peer="hf"), dict(row("code", 1, "prompt_lookup", 3, 12.0), peer="hf")]
    )
    assert hf[1]["speedup"] == pytest.approx(1.5)


def test_warm_up_runs_every_shape_a_configuration_meets():
    """An executable's first run is slow even after compiling, so warm-up runs each configuration
    once per compiled shape: at K > 0 the cache size (prompt + K + new tokens) splits prompts of
    one bucket that plain decoding runs at one shape."""
    from specjax.bench.speculative import batches_of, warm_batches
    from specjax.drafters.base import NoDrafter
    from specjax.drafters.ngram import NgramDrafter
    from specjax.models.loading import random_model
    from specjax.runtime.engine import Engine

    engine = Engine(random_model(tiny()))
    ids = [[1] * 125, [1] * 82, [1] * 118, [1] * 126]  # one prompt bucket (128)
    batches = batches_of(ids, 1)
    assert warm_batches(engine, batches, 128, NoDrafter()) == [[ids[0]]]  # cache 256 for all
    assert warm_batches(engine, batches, 128, NgramDrafter(3)) == [[ids[0]], [ids[1]]]  # 384, 256, 256, 384
    assert warm_batches(engine, batches_of(ids, 2), 128, NgramDrafter(3)) == [[ids[0], ids[1]]]


def test_recommendation_per_suite():
    recs = {(r["suite"], r["temperature"]): r for r in report.recommend(report.add_speedups([dict(r) for r in TABLE]))}
    code = recs[("code", 0.0)]
    assert [(e["batch_size"], e["drafter"], e["num_draft"]) for e in code["by_batch"]] == [
        (1, "draft:/x/small", 3),
        (4, "ngram", 3),
        (16, "none", 0),
    ]
    assert code["plain_wins_from"] == 16 and code["plain_wins_at"] == [16]
    assert "B=1: draft:small K=3 (1.80x)" in code["text"] and "plain decoding wins from B=16" in code["text"]
    chat = recs[("chat", 0.0)]
    assert chat["plain_wins_from"] == 1  # a tie (1.00x) is not a win for speculation
    assert chat["text"].endswith("plain decoding wins at every measured batch size (B=1, 4)")
    assert "; measured at B=1, 4, 16" in code["text"]
    # one batch size measured: the line says so instead of "every measured batch size"
    assert recs[("code", 0.7)]["text"].endswith("speculation pays at B=1 (the only batch size measured)")
    # plain wins at a small batch but not at the largest: no "from", say where
    mixed = report.recommend(
        report.add_speedups(
            [
                row("s", 1, "none", 0, 10.0),
                row("s", 1, "ngram", 3, 9.0),
                row("s", 2, "none", 0, 10.0),
                row("s", 2, "ngram", 3, 12.0),
            ]
        )
    )[0]
    assert mixed["plain_wins_from"] is None and mixed["text"].endswith(
        "plain decoding wins at B=1 only; measured at B=1, 2"
    )
    # an `auto` configuration that never verified decoded plainly: 1.01x is not speculation paying
    idle = report.recommend(
        report.add_speedups(
            [row("s", 8, "none", 0, 10.0), row("s", 8, "mtp", 3, 10.1, spec_policy="auto", verified_share=0.0)]
        )
    )[0]
    assert idle["plain_wins_from"] == 8 and idle["by_batch"][0]["drafter"] == "none"


def test_peer_comparison_ratio():
    rows = report.add_speedups([dict(r) for r in TABLE])
    hf = report.add_speedups(
        [dict(row("code", 1, "none", 0, 9.0), peer="hf"), dict(row("code", 1, "prompt_lookup", 3, 12.0), peer="hf")]
    )
    (c,) = report.compare_peers(rows, hf)
    assert c["ratio"] == pytest.approx(36.0 / 12.0)
    assert c["specjax_best"]["label"] == "draft:small K=3" and c["peer_best"]["label"] == "prompt_lookup K=3"


def documented_names(doc: str) -> set[str]:
    return set(re.findall(r"`([a-z_0-9]+)`", doc))


@pytest.fixture(scope="module")
def tiny_bench(tiny_tok_dir, tmp_path_factory):
    """One tiny end-to-end run through the CLI entry point: 2 prompts, 4 new tokens, batch
    sizes 1 and 2, a draft model (the tiny checkpoint itself, which also exercises HF's
    assisted generation), both peers. (ngram's speculative path is tested in test_speculative.)"""
    from specjax.cli import main

    d = tmp_path_factory.mktemp("bench")
    prompts = d / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello twice: hello hello"}\n{"prompt": "Count: 1 2 3 4"}\n')
    out = d / "run.json"
    rc = main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--model",
            tiny_tok_dir,
            "--drafters",
            f"draft:{tiny_tok_dir}",
            "--num-draft",
            "2",
            "--batch-sizes",
            "1,2",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--peers",
            "hf,llamacpp",
            "--json-out",
            str(out),
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


def test_tiny_bench_json_fields_are_documented(tiny_bench):
    rep = tiny_bench
    doc = documented_names(report.__doc__)
    assert set(rep) <= doc, set(rep) - doc
    assert {(r["batch_size"], r["label"], r["num_draft"]) for r in rep["results"]} == {
        (b, lab, k) for b in (1, 2) for lab, k in (("plain", 0), ("draft:" + rep["model"], 2))
    }
    for r in rep["results"]:
        assert set(r) <= doc, set(r) - doc
        assert r["tokens_per_second"] > 0 and r["peak_memory_mb"] > 0 and r["warmup_seconds"] > 0
        assert r["prompts"] == 2 and set(r["component_seconds"]) == {"draft", "verify", "accept"}
        if r["drafter"] == "none":
            assert r["speedup"] == 1.0 and r["mean_accepted_length"] == 1.0
        else:
            assert r["speedup"] > 0 and len(r["per_position_acceptance"]) == 2
    # the draft model is the target itself: every greedy draft is accepted; after the prefill's
    # token, one step emits the remaining 3 = K + 1 tokens
    drafted = [r for r in rep["results"] if r["label"].startswith("draft")]
    assert all(r["mean_accepted_length"] == pytest.approx(3.0) for r in drafted)
    for sub in ("peers", "peer_comparison", "recommendations"):
        for r in rep[sub]:
            assert set(r) <= doc, (sub, set(r) - doc)
    assert [r["suite"] for r in rep["recommendations"]] == ["file"]


def test_tiny_bench_writes_plots(tiny_bench):
    paths = tiny_bench["plots"]
    assert [p.rsplit("_", 1)[1] for p in paths] == ["speedup.png", "acceptance.png", "mal.png"]
    for p in paths:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tiny_bench_hf_peer_and_skipped_llamacpp(tiny_bench):
    methods = {(r["method"], r["num_draft"]) for r in tiny_bench["peers"] if r["peer"] == "hf"}
    assert methods == {("plain", 0), ("prompt_lookup", 2), ("assisted", 2)}
    assert all(r["batch_size"] == 1 and r["tokens_per_second"] > 0 for r in tiny_bench["peers"])
    (cmp,) = tiny_bench["peer_comparison"]
    assert cmp["peer"] == "hf" and cmp["ratio"] > 0
    assert tiny_bench["peers_status"]["hf"]["status"] == "ok"  # in a process of its own
    assert tiny_bench["peers_status"]["hf"]["rows"] == len(tiny_bench["peers"])
    why = tiny_bench["peers_skipped"]["llamacpp"]  # the tiny model is an HF directory, not a GGUF
    assert ("not installed" if peers.importlib.util.find_spec("llama_cpp") is None else "reads GGUF files") in why
    assert tiny_bench["peers_status"]["llamacpp"]["status"] == "skipped"


def test_bench_measures_each_spec_policy(tiny_tok_dir, tmp_path, capsys):
    """`--spec-policy always,auto`: the ngram configuration is measured under both (the auto row
    through the per-row fallback and its cost table), each row saying which and how often it
    verified; the printed table tells them apart."""
    from specjax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hello twice: hello hello"}\n{"prompt": "Count: 1 2 3 4"}\n')
    out = tmp_path / "run.json"
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--model",
                tiny_tok_dir,
                "--drafters",
                "ngram",
                "--num-draft",
                "2",
                "--max-new-tokens",
                "6",
                "--repeats",
                "1",
                "--spec-policy",
                "always,auto",
                "--json-out",
                str(out),
                "--plots-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    doc = documented_names(report.__doc__)
    assert rep["spec_policies"] == ["always", "auto"] and set(rep) <= doc
    by = {(r["drafter"], r["spec_policy"]): r for r in rep["results"]}
    assert set(by) == {("none", "none"), ("ngram", "always"), ("ngram", "auto")}
    assert by[("none", "none")]["verified_share"] is None
    for policy in ("always", "auto"):
        r = by[("ngram", policy)]
        assert set(r) <= doc, set(r) - doc
        assert r["num_draft"] == 2 and r["tokens_per_second"] > 0 and r["speedup"] > 0
        assert 0.0 <= r["verified_share"] <= 1.0
    printed = capsys.readouterr().out
    assert "ngram K=2 auto" in printed and "ngram K=2 " in printed.replace("ngram K=2 auto", "")


def test_missing_llamacpp_is_a_skip_line_not_an_error(monkeypatch):
    import types

    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    model = types.SimpleNamespace(config=types.SimpleNamespace(eos_token_ids=(2,)), source="x.gguf")
    run, skipped = peers.plan_peers(["llamacpp", "hf"], model)
    assert run == ["hf"] and "llama_cpp package is not installed" in skipped["llamacpp"]
    assert "specjax[peers]" in skipped["llamacpp"]


def test_hf_peer_needs_torch(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None if name == "torch" else object())
    with pytest.raises(SpecjaxError, match="--peers hf needs torch"):
        peers.check_peers(["hf"])
    with pytest.raises(SpecjaxError, match="unknown peer 'vllm'"):
        peers.check_peers(["vllm"])


def test_hf_peer_greedy_matches_specjax_plain(default_model, hf_gguf_model):
    from specjax.prompts import encode_prompt
    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams

    ids = encode_prompt(default_model, "What is the capital of France?")
    eos = default_model.config.eos_token_ids
    (ours,) = Engine(default_model).generate([ids], [SamplingParams(max_new_tokens=12)], eos)
    theirs = peers.HFPeer(hf_gguf_model, eos).generate(ids, 12)
    assert len(ours.token_ids) >= 6
    assert theirs == ours.token_ids


def test_gated_eagle3_spec_passes_the_name_check():
    from specjax.bench.speculative import check_drafter_names

    check_drafter_names(["eagle3@0", "eagle3:some/dir@0.5", "ngram"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["nosuchsuite"], "unknown suite 'nosuchsuite'"),
        (["humaneval", "--drafters", "ngram,nosuchdrafter"], "unknown drafter 'nosuchdrafter' (known: none, ngram"),
        (["humaneval", "--peers", "hf,vllm"], "unknown peer 'vllm'"),
        (["humaneval", "--limit", "0"], "--limit must be >= 1"),
        (["humaneval", "--spec-policy", "sometimes"], "--spec-policy takes a comma-separated subset of always, auto"),
        (["plain", "--json-out", "/"], "is a directory"),  # refused before measuring, not after
    ],
)
def test_bad_bench_input_is_one_line_exit_2(args, message):
    p = subprocess.run(specjax_cli_cmd() + ["bench", *args], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], p.stderr


def test_cpu_smoke_preset_writes_json(tmp_path):
    from specjax.bench import accel
    from specjax.cli import main

    mal = tmp_path / "cpu_bench.json"  # a (fake) CPU bench report to take MALs from
    mal.write_text(
        json.dumps(
            {
                "results": [
                    row("code", 1, "none", 0, 10.0, mean_accepted_length=1.0),
                    row("code", 1, "ngram", 1, 12.0, mean_accepted_length=1.5),
                    row("chat", 1, "ngram", 1, 12.0, mean_accepted_length=1.7),
                ]
            }
        )
    )
    out = tmp_path / "smoke.json"
    assert main(["bench", "--preset", "cpu-smoke", "--mal-from", str(mal), "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    doc = documented_names(accel.__doc__)
    assert set(rep) <= doc, set(rep) - doc
    (m,) = rep["models"]
    assert set(m) <= doc and m["weights"] == "random" and m["decode_tokens_per_second"] > 0
    assert set(m["forward_cost_vs_t1"]) == {"1", "2", "4"} and m["forward_cost_vs_t1"]["1"] == 1.0
    assert rep["bandwidth_gbs"] > 0 and 0 < m["roofline_fraction"]
    impls = {(r["implementation"], r["q"]) for r in rep["sampler"]["rows"] if r["batch_size"] == 1}
    assert {("pallas", "dense"), ("reference", "dense"), ("pallas", "one-hot"), ("reference", "one-hot")} <= impls
    for r in rep["sampler"]["rows"]:
        assert set(r) <= doc and "error" not in r, r
    assert rep["mals"]["assumed"] is False
    assert rep["mals"]["entries"] == [{"drafter": "ngram", "num_draft": 1, "mal": pytest.approx(1.6)}]
    # K = 1 verifies 2 tokens per row: B = 1, 2 fit the measured T <= 4, B = 4 does not
    assert sorted(p["batch_size"] for p in rep["projections"]) == [1, 2]
    assert all(set(p) <= doc and p["projected_speedup"] > 0 for p in rep["projections"])
    kc = rep["checks"]["kernel"]
    assert kc["bit_exact"] and kc["rows"] == 2 * kc["batch_size"] == kc["rows_equal"]  # interpret mode, exact
    assert [(c["dtype"], c["identical"]) for c in rep["checks"]["lossless"]] == [("float32", True), ("bfloat16", True)]
    assert all(c["mean_accepted_length"] > 1 for c in rep["checks"]["lossless"])  # drafts were accepted
    assert rep["skipped"] == []


def test_bad_mal_file_is_bad_input(tmp_path):
    from specjax.bench.accel import load_mals

    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(SpecjaxError, match="not a `specjax bench --json-out` report"):
        load_mals(str(bad))
    assert load_mals(None)["assumed"] is True
