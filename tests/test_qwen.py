"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) targets against HF transformers: full
logits and hidden states from safetensors (single and sharded) and from GGUF files written by
llama.cpp's own converter, greedy decoding equal to HF's, and unsupported features as one line.

The GGUF converter is llama.cpp's `convert_hf_to_gguf.py` from the llama-cpp-python sdist (the
`peers` extra's pin), fetched once with `pip download` (PyPI is reachable in CI; elsewhere the
GGUF tests skip, and fail under CI=true)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from helpers import rel_err

TOL = 1e-4
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"


def random_qwen(kind: str, seed: int = 0, vocab: int = 256, **kw):
    """A tiny random HF Qwen2/Qwen3 with non-trivial norm scales and biases (HF inits them to
    ones / zeros, which would hide a dropped one)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if kind == "qwen3":
        base["head_dim"] = 32  # Qwen3's head_dim is its own (128 at hidden 4096 with 32 heads, etc.)
    base.update(kw)
    cfg = cfg_cls(**base)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def specjax_logits(model, tokens: np.ndarray, collect=()):
    mod = model.module()
    h, _, collected = mod.hidden(jnp.asarray(tokens, jnp.int32), mod.new_cache(*tokens.shape), collect)
    return np.asarray(mod.logits(h)), [np.asarray(c) for c in collected]


def assert_same_as_hf(model, hf, vocab: int) -> None:
    tokens = np.random.default_rng(0).integers(0, vocab, size=(2, 16))
    with torch.no_grad():
        out = hf(torch.from_numpy(tokens), output_hidden_states=True)
    logits, collected = specjax_logits(model, tokens, collect=(0,))
    assert rel_err(logits, out.logits.numpy()) <= TOL
    assert rel_err(collected[0], out.hidden_states[1].numpy()) <= TOL  # layer 0's output


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_hf_from_safetensors(kind, sharded, tied, tmp_path):
    hf = random_qwen(kind, seed=3, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if sharded else "10GB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == sharded
    model = specjax.load_model(str(tmp_path), dtype="float32", quiet=True)
    cfg = model.config
    assert (cfg.attention_bias, cfg.qk_norm) == ((True, False) if kind == "qwen2" else (False, True))
    assert cfg.tie_word_embeddings == tied and ("lm_head" in model.params) != tied
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    assert_same_as_hf(model, hf, 256)
    # the export mapping is the inverse: specjax params back to HF names give HF's state dict
    from flax import nnx

    from specjax.models.loading.mapping import params_to_hf

    back = params_to_hf(cfg, nnx.to_pure_dict(model.params))
    sd = {k: v.numpy() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    assert cfg.to_hf()["model_type"] == kind


def test_greedy_decoding_of_qwen3_equals_hf(tmp_path):
    hf = random_qwen("qwen3", seed=5)
    hf.save_pretrained(tmp_path)
    model = specjax.load_model(str(tmp_path), dtype="float32", quiet=True)
    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams

    prompts = [[5, 17, 99, 3, 42, 8], [200, 1, 7]]
    rows = Engine(model).generate(prompts, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 2)
    for p, row in zip(prompts, rows):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([p]), max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0
            )[0, len(p) :].tolist()
        assert row.token_ids == want


@pytest.fixture(scope="session")
def llama_cpp_converter(tmp_path_factory) -> str:
    """Path of llama.cpp's convert_hf_to_gguf.py (with its gguf-py beside it)."""
    root = tmp_path_factory.mktemp("llama_cpp")
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            LLAMA_CPP_SDIST,
            "-d",
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    sdists = glob.glob(str(root / "llama_cpp_python-*.tar.gz"))
    if got.returncode or not sdists:
        if os.environ.get("CI"):
            pytest.fail(f"cannot download {LLAMA_CPP_SDIST}: {got.stderr[-300:]}")
        pytest.skip(f"cannot download {LLAMA_CPP_SDIST} (no PyPI here)")
    with tarfile.open(sdists[0]) as tar:
        keep = [
            m
            for m in tar.getmembers()
            if "/vendor/llama.cpp/" in m.name
            and any(part in m.name for part in ("/convert_hf_to_gguf.py", "/conversion/", "/gguf-py/"))
        ]
        tar.extractall(root, members=keep, filter="data")
    (script,) = glob.glob(str(root / "*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return script


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_logits_match_hf_from_llama_cpp_gguf(kind, llama_cpp_converter, default_model, tmp_path):
    """A GGUF that llama.cpp's converter wrote (f32) from a tiny random checkpoint with the default
    model's tokenizer (the converter needs a tokenizer whose hash it knows) loads to HF's logits.
    The converter picks its model class from `architectures`; for Qwen2 the directory's
    `model_type` says llama, else transformers would load that tokenizer as Qwen2Tokenizer, whose
    hash the converter does not know."""
    vocab = default_model.config.vocab_size
    hf = random_qwen(kind, seed=7, vocab=vocab)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    default_model.tokenizer.save_pretrained(src)
    if kind == "qwen2":
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(cfg | {"model_type": "llama"}))
    out = tmp_path / f"{kind}.gguf"
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(llama_cpp_converter), "gguf-py"))
    conv = subprocess.run(
        [sys.executable, llama_cpp_converter, str(src), "--outfile", str(out), "--outtype", "f32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert conv.returncode == 0, conv.stderr[-2000:]
    model = specjax.load_model(str(out), dtype="float32", quiet=True)
    assert (model.config.attention_bias, model.config.qk_norm) == (kind == "qwen2", kind == "qwen3")
    assert_same_as_hf(model, hf, vocab)
    text = "def add(a, b):\n    return a + b  # héllo"
    assert model.tokenizer(text).input_ids == default_model.tokenizer(text).input_ids


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"]), "mixture-of-experts layers"),
        (dict(use_sliding_window=True), "sliding-window attention layers are not supported"),
        (
            dict(layer_types=["full_attention", "sliding_attention"]),
            "sliding-window attention layers are not supported",
        ),
    ],
)
def test_unsupported_features_are_one_line_errors(change, message, tmp_path, capsys):
    from specjax.cli import main

    random_qwen("qwen3", seed=1).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
