"""Greedy speculative decoding is token-identical to plain greedy decoding, on the real default
model, for every drafter and K, in batches of mixed-length prompts."""

import pytest

import specjax
from specjax.drafters import make_drafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.errors import DrafterError
from specjax.models.loading.export import save_hf, truncate_layers
from specjax.prompts import encode_prompt
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",  # code
    "What are three tips for staying healthy?",  # chat
    'Repeat the sentence "the cat sat on the mat" five times.',  # makes the model repeat itself
    "def quicksort(arr):",  # short, raw code
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(default_model)


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    ids = [encode_prompt(default_model, p) for p in PROMPTS[:3]]
    ids.append(encode_prompt(default_model, PROMPTS[3], raw=True))
    assert len({len(x) for x in ids}) == len(ids)  # mixed lengths
    return ids


@pytest.fixture(scope="module")
def plain(engine, prompt_ids, default_model):
    rows = engine.generate(
        prompt_ids,
        [SamplingParams(max_new_tokens=MAX_NEW)] * len(prompt_ids),
        eos_ids=default_model.config.eos_token_ids,
    )
    return [r.token_ids for r in rows]


@pytest.fixture(scope="module")
def draft_dir(default_model, tmp_path_factory):
    """A real small checkpoint sharing the tokenizer: the default model's first 4 layers."""
    return save_hf(truncate_layers(default_model, 4), str(tmp_path_factory.mktemp("draft4")))


def run(engine, prompt_ids, default_model, drafter):
    rows = engine.generate(
        prompt_ids,
        [SamplingParams(max_new_tokens=MAX_NEW)] * len(prompt_ids),
        eos_ids=default_model.config.eos_token_ids,
        drafter=drafter,
    )
    return rows


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_ngram_greedy_is_lossless(engine, prompt_ids, plain, default_model, k):
    rows = run(engine, prompt_ids, default_model, make_drafter("ngram", k, default_model))
    for r, ref in zip(rows, plain):
        assert r.token_ids == ref
    # the repetitive prompt must actually exercise acceptance
    assert sum(rows[2].accepted) > 0
    for r in rows:
        assert len(r.checked) == k and all(a <= c for a, c in zip(r.accepted, r.checked))


@pytest.mark.parametrize("k", [1, 8])
def test_draft_model_greedy_is_lossless(engine, prompt_ids, plain, default_model, draft_dir, k):
    drafter = make_drafter(f"draft:{draft_dir}", k, default_model)
    assert isinstance(drafter, DraftModelDrafter)
    rows = run(engine, prompt_ids, default_model, drafter)
    for r, ref in zip(rows, plain):
        assert r.token_ids == ref
    assert sum(sum(r.accepted) for r in rows) > 0


@pytest.mark.parametrize("kind, k", [("eagle3", 5), ("mtp", 3), ("draft", 4), ("dspark", 8)])
def test_shipped_drafters_are_lossless_and_accept(engine, prompt_ids, plain, default_model, kind, k):
    """The drafters trained for the default model and shipped in the package (bare names)."""
    rows = run(engine, prompt_ids, default_model, make_drafter(kind, k, default_model))
    for r, ref in zip(rows, plain):
        assert r.token_ids == ref
    emitted, steps = sum(len(r.token_ids) for r in rows), sum(r.steps for r in rows)
    assert emitted / steps > 1.2, (kind, emitted, steps)  # trained: well above plain decoding's 1.0


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "draft", "dflash", "dspark"])
def test_shipped_drafters_are_small_and_say_how_they_were_trained(kind):
    import json
    import os

    from specjax.drafters import shipped_path

    path = shipped_path(kind)
    assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 25 * 2**20
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    assert f"train {kind} --config configs/{kind}-smollm2.yaml" in cfg["trained_with"]
    assert cfg["final_eval"]["sim_mal"] > 1.0


def test_full_draft_model_accepts_everything(engine, prompt_ids, default_model):
    """The target as its own drafter: every greedy draft is accepted (MAL = K + 1)."""
    k = 3
    drafter = DraftModelDrafter(k, default_model, default_model.config)
    rows = run(engine, prompt_ids[:1], default_model, drafter)
    r = rows[0]
    assert r.accepted == r.checked
    assert (len(r.token_ids) - 1) / r.steps > k  # the last step may be cut by max_new / EOS
    # Statistics count only drafts that were emitted: max_new = 1 + 9 (K + 1) + 2 cuts the last
    # step after 2 of its 3 accepted drafts, and the third is not counted.
    cut = engine.generate(prompt_ids[:1], [SamplingParams(max_new_tokens=39, ignore_eos=True)], drafter=drafter)[0]
    assert len(cut.token_ids) == 39 and cut.steps == 10
    assert sum(cut.accepted) == 9 * k + 2 and cut.checked[:2] == [10, 10] and cut.checked[2] == 9


def test_stats_through_the_api(default_model):
    out = specjax.generate(PROMPTS[2], model=default_model, max_new_tokens=24, drafter="ngram", num_draft=3)[0]
    s = out.stats
    assert s.drafter == "ngram" and s.num_draft == 3
    assert len(s.per_position_acceptance) == 3
    assert s.steps >= 1 and 1.0 <= s.mean_accepted_length <= 4.0
    assert s.acceptance_rate is None or 0.0 <= s.acceptance_rate <= 1.0
    assert s.tokens_per_second > 0


def test_drafter_that_does_not_fit(default_model, tmp_path, monkeypatch):
    import dataclasses

    from specjax import drafters
    from specjax.models.loading import random_model

    other = random_model(dataclasses.replace(default_model.config, vocab_size=1000, num_layers=1))
    with pytest.raises(DrafterError, match="vocab"):
        DraftModelDrafter(3, other, default_model.config)
    with pytest.raises(DrafterError, match="unknown drafter"):
        make_drafter("medusa", 3, default_model)
    monkeypatch.setattr(drafters, "SHIPPED_DIR", str(tmp_path))  # bare `draft` = the shipped one: none here
    with pytest.raises(DrafterError, match="no draft drafter is shipped"):
        make_drafter("draft", 3, default_model)


def test_cli_compare_plain_reports_speedup_and_identity(default_model, capsys):
    """What `make demo` runs: the shipped EAGLE-3 drafter, then plain decoding in the same run."""
    from specjax.cli import main

    rc = main(["generate", "--drafter", "eagle3", "--compare-plain", "--max-new-tokens", "24", PROMPTS[0]])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip(), err
    assert "drafter eagle3@0.5 K=5" in err and "acceptance" in err  # the CPU default gate
    line = [s for s in err.splitlines() if "plain decoding, same prompts" in s]
    assert len(line) == 1 and "speedup" in line[0] and "greedy output identical" in line[0], err
