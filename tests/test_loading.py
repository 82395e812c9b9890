"""Loading: HF checkpoint directories (single and sharded safetensors, written by transformers
itself), hub ids through the local HF cache only, the safetensors reader/writer, and the
embedded GGUF default model with its on-disk conversion cache."""

from __future__ import annotations

import glob
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import specjax
from helpers import random_hf_model, rel_err
from specjax.errors import ModelLoadError
from specjax.models.config import LlamaConfig, smollm2_135m
from specjax.models.loading import gguf as gguf_loader
from specjax.models.loading.mapping import params_from_hf, params_to_hf
from specjax.models.loading.safetensors_io import SafetensorsFile, save_file

TOL = 1e-5
LLAMA3 = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "rope_theta": 500000.0,
}
TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 16)).astype(np.int32)


def _logits(model, tokens=TOKENS):
    graphdef = model.graphdef

    @jax.jit
    def f(params, tokens):
        mod = nnx.merge(graphdef, params)
        return mod(tokens, mod.new_cache(tokens.shape[0], tokens.shape[1]))[0]

    return np.asarray(f(model.params, jnp.asarray(tokens)))


def _torch_logits(hf, tokens=TOKENS):
    with torch.no_grad():
        return hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _save(hf, path, **kw):
    hf.save_pretrained(str(path), safe_serialization=True, **kw)
    return str(path)


@pytest.mark.parametrize(
    "kw",
    [dict(tie_word_embeddings=False), dict(tie_word_embeddings=True), dict(num_key_value_heads=1, **LLAMA3)],
    ids=["untied", "tied", "mqa-llama3"],
)
def test_hf_dir_round_trip(tmp_path, kw):
    hf = random_hf_model(seed=3, **kw)
    d = _save(hf, tmp_path / "ckpt")
    assert os.path.isfile(os.path.join(d, "model.safetensors"))
    model = specjax.load_model(d, quiet=True)
    assert model.config == LlamaConfig.from_hf(hf.config.to_dict())
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    if "rope_scaling" in kw:
        assert model.config.rope_scaling == (4.0, 1.0, 4.0, 64)
    assert model.tokenizer is None and model.name == "ckpt" and model.dtype == jnp.float32
    assert rel_err(_logits(model), _torch_logits(hf)) <= TOL


def test_hf_dir_bfloat16(tmp_path):
    hf = random_hf_model(seed=4)
    d = _save(hf, tmp_path / "ckpt")
    model = specjax.load_model(d, dtype="bfloat16", quiet=True)
    assert model.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    assert rel_err(_logits(model), _torch_logits(hf)) <= 5e-2


def test_sharded_safetensors(tmp_path):
    hf = random_hf_model(seed=5, tie_word_embeddings=False)
    d = _save(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert not os.path.exists(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json")) as fh:
        weight_map = json.load(fh)["weight_map"]
    shards = sorted(glob.glob(os.path.join(d, "model-*.safetensors")))
    assert len(shards) >= 3 and len(set(weight_map.values())) == len(shards)
    model = specjax.load_model(d, quiet=True)
    assert rel_err(_logits(model), _torch_logits(hf)) <= TOL


def test_hub_id_resolves_through_local_cache_only(tmp_path, monkeypatch):
    """A hub id in the local HF cache loads; one that is not raises ModelLoadError (no network)."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ModelLoadError, match="model not found.*local HF cache"):
        specjax.load_model("specjax-tests/not-cached-anywhere", quiet=True)

    # Lay out the tiny checkpoint as the hub cache would: refs/main -> snapshots/<commit>/
    hf = random_hf_model(seed=6)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--specjax-tests--tiny"
    _save(hf, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = specjax.load_model("specjax-tests/tiny", quiet=True)
    assert rel_err(_logits(model), _torch_logits(hf)) <= TOL


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: None, "model not found"),  # nothing at that path
        (lambda d: os.makedirs(d), "no config.json"),
        (lambda d: (os.makedirs(d), open(os.path.join(d, "config.json"), "w").write("{not json")), "unreadable config"),
        (lambda d: open(d, "w").write("hello"), "not a model"),
    ],
    ids=["missing", "empty-dir", "bad-json", "plain-file"],
)
def test_bad_paths(tmp_path, make, match):
    d = str(tmp_path / "m")
    make(d)
    with pytest.raises(ModelLoadError, match=match):
        specjax.load_model(d, quiet=True)


def test_missing_weights_and_tensors(tmp_path):
    hf = random_hf_model(seed=7)
    d = _save(hf, tmp_path / "ckpt")
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}

    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        specjax.load_model(d, quiet=True)

    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(missing, os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="mlp.up_proj"):
        specjax.load_model(d, quiet=True)

    wrong = dict(sd, **{"model.norm.weight": np.ones(cfg.hidden_size + 1, np.float32)})
    save_file(wrong, os.path.join(d, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        specjax.load_model(d, quiet=True)


def test_unsupported_dtype():
    with pytest.raises(ModelLoadError, match="dtype"):
        specjax.load_model("/nowhere", dtype="int8", quiet=True)


def test_mapping_round_trip():
    hf = random_hf_model(seed=8, num_key_value_heads=1)
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    back = params_to_hf(cfg, params_from_hf(cfg, sd.__getitem__))
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)


def test_safetensors_io_round_trip_and_compat(tmp_path):
    from safetensors.numpy import load_file as st_load
    from safetensors.numpy import save_file as st_save

    tensors = {
        "f32": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32),
        "bf16": np.arange(12, dtype=np.float32).reshape(2, 6).astype(ml_dtypes.bfloat16),
        "i32": np.arange(7, dtype=np.int32),
        "scalar": np.array(2.5, np.float16),
    }
    ours = str(tmp_path / "ours.safetensors")
    save_file(tensors, ours, metadata={"format": "np"})
    st = SafetensorsFile(ours)
    assert st.names() == list(tensors)
    for k, v in tensors.items():
        got = st.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
    # the reference implementation reads our file ...
    ref = st_load(ours)
    np.testing.assert_array_equal(ref["f32"], tensors["f32"])
    np.testing.assert_array_equal(ref["i32"], tensors["i32"])
    # ... and we read its files
    theirs = str(tmp_path / "theirs.safetensors")
    st_save({"a": tensors["f32"], "b": tensors["i32"]}, theirs)
    np.testing.assert_array_equal(SafetensorsFile(theirs).get("a"), tensors["f32"])
    with pytest.raises(KeyError):
        SafetensorsFile(theirs).get("missing")


def test_truncated_safetensors(tmp_path):
    good = str(tmp_path / "good.safetensors")
    save_file({"w": np.ones((64, 64), np.float32)}, good)
    data = open(good, "rb").read()
    for n, match in [(len(data) - 100, "truncated"), (20, "not a valid"), (4, "not a valid"), (0, "not a valid")]:
        bad = str(tmp_path / f"bad{n}.safetensors")
        open(bad, "wb").write(data[:n])
        with pytest.raises(ModelLoadError, match=match):
            SafetensorsFile(bad)


# ---- GGUF: the embedded default model ------------------------------------------------------


def test_default_model_config_matches_design(default_model):
    cfg = default_model.config
    assert cfg.num_layers == 30 and cfg.hidden_size == 576
    assert cfg.num_heads == 9 and cfg.num_kv_heads == 3 and cfg.head_dim == 64
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 49152
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert cfg.tie_word_embeddings and "lm_head" not in default_model.params
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    # the preset agrees with what the file says
    assert cfg == smollm2_135m().__class__(**{**smollm2_135m().to_dict(), "rms_norm_eps": cfg.rms_norm_eps})
    assert default_model.name == "SmolLM2-135M-Instruct.Q4_1" and default_model.dtype == jnp.float32
    tok = default_model.tokenizer
    assert tok is not None and tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    n = sum(x.size for x in jax.tree.leaves(default_model.params))
    assert n == cfg.num_params()


def test_gguf_conversion_cache_used_on_second_load(default_model, specjax_cache, monkeypatch):
    """The first load (session fixture) wrote the converted params to SPECJAX_CACHE; a second load
    must come from there without opening the GGUF reader, and give the same params."""
    from specjax.models.loading import CACHE_FORMAT

    mine = json.loads(json.dumps(default_model.config.to_dict()))  # other tests convert other GGUFs
    entries = [
        e
        for e in glob.glob(os.path.join(specjax_cache, f"gguf-v{CACHE_FORMAT}-*"))
        if json.load(open(os.path.join(e, "config.json"))) == mine
    ]
    assert len(entries) == 1
    for f in ("params.safetensors", "config.json", os.path.join("tokenizer", "tokenizer.json")):
        assert os.path.isfile(os.path.join(entries[0], f)), f

    def no_reader(*a, **k):
        raise AssertionError("GGUF was parsed again instead of read from the cache")

    monkeypatch.setattr(gguf_loader, "open_reader", no_reader)
    again = specjax.load_model(quiet=True)
    assert again.config == default_model.config
    a, b = jax.tree.leaves(again.params), jax.tree.leaves(default_model.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
    text = "def f(x):\n    return x * 2"
    assert again.tokenizer(text).input_ids == default_model.tokenizer(text).input_ids


def test_gguf_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's converter permutes Q/K rows per head as (2, pairs) -> (pairs, 2)."""
    n_heads, head_dim, d = 3, 8, 5
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, d)).astype(np.float32)
    permuted = w.reshape(n_heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(permuted, n_heads), w)


def test_gguf_path_given_explicitly(default_model, default_gguf_path):
    """An explicit .gguf path is the same model (and the same cache entry) as the default."""
    m = specjax.load_model(default_gguf_path, quiet=True)
    assert m.config == default_model.config and m.source == default_gguf_path
    assert np.array_equal(np.asarray(m.params["embed"][...]), np.asarray(default_model.params["embed"][...]))


class _NotAWeight:
    pass


def test_torch_bin_reader_matches_torch_load(tmp_path):
    """pytorch_model.bin read without torch: every dtype, views and non-contiguous tensors as
    torch.load gives them; a pickled object that is not a tensor is refused, not run."""
    from specjax.models.loading import torch_bin

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 2).to(torch.bfloat16),
        "f16": torch.randn(4).half(),
        "i64": torch.arange(-3, 9),
        "bool": torch.rand(10) > 0.5,
        "scalar": torch.tensor(2.5),
        "transposed": base.t(),
        "row": base[2],
        "sliced": base[:, 1:4],
    }
    torch.save(sd, tmp_path / "pytorch_model.bin")
    got = torch_bin.load(str(tmp_path / "pytorch_model.bin"))
    assert set(got) == set(sd)
    for k, t in sd.items():
        want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert got[k].shape == tuple(t.shape), k
        np.testing.assert_array_equal(np.asarray(got[k], want.dtype), want, err_msg=k)
    assert str(got["bf16"].dtype) == "bfloat16"
    torch.save({"w": torch.ones(2), "x": _NotAWeight()}, tmp_path / "evil.bin")
    with pytest.raises(ModelLoadError, match="refused: unpickling it could run code"):
        torch_bin.load(str(tmp_path / "evil.bin"))
