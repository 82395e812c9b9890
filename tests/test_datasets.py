"""The packaged prompt suites: sizes, the held-out ShareGPT bench sample, raw HumanEval."""

import pytest

from specjax import datasets
from specjax.errors import SpecjaxError
from specjax.prompts import encode_prompt


def test_suite_sizes_and_formats():
    assert len(datasets.load_suite("humaneval")) == 164
    assert len(datasets.load_suite("mtbench")) == 80
    assert len(datasets.load_suite("sharegpt")) == 200
    chat = datasets.load_suite("humaneval", 1)[0]
    assert chat[0]["role"] == "user" and "def has_close_elements" in chat[0]["content"]
    raw = datasets.load_suite("humaneval-raw", 3)
    assert len(raw) == 3 and all(isinstance(p, datasets.RawText) for p in raw)


def test_sharegpt_bench_sample_is_held_out_of_training():
    bench, train = datasets.sharegpt_split()
    assert len(bench) == 200 and len(train) > 10_000
    key = lambda conv: conv[0]["content"]  # noqa: E731
    assert not {key(c) for c in bench} & {key(c) for c in train}


def test_raw_prompts_skip_the_chat_template(default_model):
    raw = datasets.load_suite("humaneval-raw", 1)[0]
    assert encode_prompt(default_model, raw) == default_model.tokenizer(str(raw)).input_ids
    assert encode_prompt(default_model, str(raw)) != encode_prompt(default_model, raw)  # str: chat template


def test_unknown_suite_is_one_line():
    with pytest.raises(SpecjaxError, match="unknown suite 'nope'"):
        datasets.load_suite("nope")
