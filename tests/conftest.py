"""Shared fixtures.

Expensive things are built once per session: the default model (GGUF conversion on a cold
cache), the HF transformers reference loaded from the same GGUF, tiny HF checkpoint directories
with the default model's tokenizer (`real_tokenizer_checkpoint`) and the sharp target with its
greedy data and feature store (the drafter tests).

The converted-GGUF cache (`SPECJAX_CACHE`) is a session temp directory, so the suite never
reads or writes the user's `~/.cache/specjax` and exercises the conversion path from a cold
cache. Set `SPECJAX_TEST_CACHE=/some/dir` to reuse a cache across runs (saves the ~30 s
conversion while iterating); the cache tests work either way.
"""

from __future__ import annotations

import os

import pytest

from helpers import (
    OTHER_TARGETS,
    SHARP_LAYERS,
    batch_config,
    batch_job_rows,
    read_rows,
    tiny,
    tiny_checkpoint_with_tokenizer,
    write_jsonl,
)
from helpers import sharp_target as make_sharp_target

# No network here: any hub lookup fails fast instead of retrying. Set at import, before a test
# module imports transformers (huggingface_hub reads it once, when first imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def specjax_cache(tmp_path_factory):
    """SPECJAX_CACHE for the whole session (inherited by CLI subprocesses)."""
    path = os.environ.get("SPECJAX_TEST_CACHE") or str(tmp_path_factory.mktemp("specjax_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECJAX_CACHE", path)
        mp.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
        yield path


def pytest_configure(config):
    import torch

    # One thread: with OpenMP's spin-waiting, two torch threads sharing two cores with XLA's
    # thread pool (or any other load) ran HF decoding ~7x slower than one thread (measured).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_model(specjax_cache):
    """The embedded SmolLM2-135M-Instruct, f32, loaded (and converted) once."""
    import specjax

    return specjax.load_model(dtype="float32", quiet=True)


@pytest.fixture(scope="session")
def default_gguf_path():
    from specjax.models.loading import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf_path):
    """HF transformers' own reading of the same GGUF file: the parity reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf_path),
        gguf_file=os.path.basename(default_gguf_path),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    return model.eval()


@pytest.fixture(scope="session")
def real_tokenizer_checkpoint(tmp_path_factory, default_model):
    """Factory `(name, **config) -> directory`: a tiny random HF Llama checkpoint with the default
    model's tokenizer and chat template (`helpers.tiny_checkpoint_with_tokenizer`), so string
    prompts and the CLI run on it in a second instead of loading the real model. Defaults: the
    tokenizer's vocab (49152), 1 layer, hidden 32, 2 heads / 1 KV head of 16, FFN 64, tied
    embeddings; `config` (HF LlamaConfig fields) overrides them."""

    def make(name: str, **config) -> str:
        base = dict(
            vocab_size=default_model.config.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
        )
        return tiny_checkpoint_with_tokenizer(
            str(tmp_path_factory.mktemp(name)), default_model.tokenizer, **{**base, **config}
        )

    return make


@pytest.fixture(scope="session")
def tiny_tok_dir(real_tokenizer_checkpoint):
    """`real_tokenizer_checkpoint` with a 64-token context: the CLI and error tests' model."""
    return real_tokenizer_checkpoint("tiny_tok", max_position_embeddings=64)


@pytest.fixture(scope="session")
def sharp_target():
    """`helpers.sharp_target()`, shared by the drafter-training tests."""
    return make_sharp_target()


@pytest.fixture(params=sorted(OTHER_TARGETS))
def other_target(request):
    """(a random target unlike the sharp target's shape, the one-line error a drafter trained for
    the sharp target's shape must give on it), one per `helpers.OTHER_TARGETS` entry."""
    from specjax.models.loading import random_model

    change, message = OTHER_TARGETS[request.param]
    return random_model(tiny(**{"num_layers": 4, **change}), seed=0), message


@pytest.fixture(scope="session")
def sharp_seqs(sharp_target):
    """Greedy continuations of the sharp target (like `regen` data): 32 random 6-token prompts."""
    import numpy as np

    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams

    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 256, 6).tolist() for _ in range(32)]
    rows = Engine(sharp_target).generate(prompts, [SamplingParams(max_new_tokens=26)] * 32)
    return [(p + r.token_ids, len(p)) for p, r in zip(prompts, rows)]


@pytest.fixture(scope="session")
def sharp_store(sharp_target, sharp_seqs, tmp_path_factory):
    """Their feature store (layers SHARP_LAYERS + the final hidden state: every drafter's data)."""
    from train.data import extract_features

    return extract_features(sharp_target, sharp_seqs, SHARP_LAYERS, str(tmp_path_factory.mktemp("feat")), 32)


@pytest.fixture(scope="session")
def batch_model_dir(real_tokenizer_checkpoint):
    """A tiny random checkpoint (1 layer, weights with std 0.3 so greedy texts differ from row to
    row) with the default model's tokenizer and chat template: the batch-job tests' model."""
    return real_tokenizer_checkpoint(
        "batch_model",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def batch_model(batch_model_dir):
    import specjax

    return specjax.load_model(batch_model_dir, quiet=True)


@pytest.fixture(scope="session")
def job_input(tmp_path_factory) -> str:
    """The batch-job tests' input: `helpers.batch_job_rows()` as JSONL."""
    return write_jsonl(tmp_path_factory.mktemp("batch_in") / "in.jsonl", batch_job_rows())


@pytest.fixture(scope="session")
def greedy_input(tmp_path_factory) -> str:
    """Its greedy rows only."""
    rows = [r for r in batch_job_rows() if "temperature" not in r]
    return write_jsonl(tmp_path_factory.mktemp("batch_in_greedy") / "in.jsonl", rows)


@pytest.fixture(scope="session")
def reference(batch_model, job_input, tmp_path_factory) -> dict:
    """id -> result row of an uninterrupted one-process, one-device run."""
    from specjax.batch.job import run_batch

    out = tmp_path_factory.mktemp("batch_ref") / "ref.jsonl"
    summary = run_batch(batch_config(batch_model, job_input, out))
    assert summary["written"] == 16 and summary["errors"] == 0
    assert 0 < summary["prefill_seconds"] + summary["decode_seconds"] <= summary["seconds"]
    rows = read_rows(out)
    return {r["id"]: r for r in rows}


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict:
    """Environment of CLI subprocesses: CPU, no inherited XLA_FLAGS, and one persistent JAX
    compilation cache, so a restarted process loads what its predecessor compiled (as a real
    deployment would) instead of spending the test's time compiling it again."""
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    return e
