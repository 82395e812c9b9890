"""Per-component parity with HF transformers (PyTorch Llama) at tiny random configs.

Every case builds a random HF `LlamaForCausalLM`, maps its state_dict into specjax through the
real loading path (`params_from_hf` + `build_model`, config via `LlamaConfig.from_hf`), and
compares the same component on the same input. f32 throughout; the error measure is
max|a - b| / max|b| <= 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from helpers import random_hf_model, rel_err, specjax_from_hf
from specjax.models import llama as sj
from specjax.models.config import LlamaConfig

TOL = 1e-5
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head_dim's frequencies fall in all three bands (kept,
    # interpolated, slowed) -- checked in test_rope_llama3_bands.
    "original_max_position_embeddings": 64,
}
B, T = 2, 11


def _rope_kw(scaled: bool) -> dict:
    return {"rope_scaling": dict(LLAMA3_ROPE), "rope_theta": 500000.0} if scaled else {}


def _layer(model, i: int) -> sj.DecoderLayer:
    """Decoder layer i of a specjax model."""
    return model.module().layers[i]


def _empty_layer_cache(cfg, b: int, s: int):
    """One layer's empty K and V buffers (both [B*KV, S, H], see kv_cache.py)."""
    kv, h = cfg.num_kv_heads, cfg.head_dim
    return jnp.zeros((b * kv, s, h)), jnp.zeros((b * kv, s, h))


def _inputs(seed: int, *shape) -> tuple[np.ndarray, torch.Tensor]:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return x, torch.from_numpy(x.copy())


def _causal_mask(t: int) -> torch.Tensor:
    """Additive [1, 1, T, T] mask for HF eager attention."""
    m = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
    return m[None, None]


def _positions(b: int, t: int) -> np.ndarray:
    return np.arange(t, dtype=np.int32)[None].repeat(b, 0)


def _hf_rope(hf, positions: np.ndarray):
    x = torch.zeros(1, dtype=torch.float32)
    return hf.model.rotary_emb(x, torch.from_numpy(positions.astype(np.int64)))


@pytest.fixture(scope="module")
def pair():
    """A (hf, specjax) pair with untied head, GQA (4 heads, 2 KV heads)."""
    hf = random_hf_model(seed=0)
    return hf, specjax_from_hf(hf)


@pytest.fixture(scope="module")
def pair_llama3():
    hf = random_hf_model(seed=1, **_rope_kw(True))
    return hf, specjax_from_hf(hf)


def test_config_from_hf_dict(pair, pair_llama3):
    cfg = pair[1].config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (256, 64, 96, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_groups) == (4, 2, 16, 2)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings
    # transformers >= 5 writes Llama-3 scaling under `rope_parameters`, not `rope_scaling`.
    cfg3 = pair_llama3[1].config
    assert cfg3.rope_theta == 500000.0
    assert cfg3.rope_scaling == (8.0, 1.0, 4.0, 64)
    # to_hf / from_hf round trip
    assert LlamaConfig.from_hf(cfg3.to_hf()) == cfg3


def test_rms_norm(pair):
    hf, model = pair
    for i in range(2):
        x, xt = _inputs(i, B, T, 64)
        x = 3.0 * x + 0.5  # off-centre, non-unit scale
        xt = torch.from_numpy(x.copy())
        layer = _layer(model, i)
        with torch.no_grad():
            want_in = hf.model.layers[i].input_layernorm(xt).numpy()
            want_post = hf.model.layers[i].post_attention_layernorm(xt).numpy()
        assert rel_err(layer.attn_norm(jnp.asarray(x)), want_in) <= TOL
        assert rel_err(layer.mlp_norm(jnp.asarray(x)), want_post) <= TOL
    with torch.no_grad():
        want = hf.model.norm(xt).numpy()
    assert rel_err(model.module().norm(jnp.asarray(x)), want) <= TOL


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "llama3"])
def test_rope_tables(scaled):
    hf = random_hf_model(seed=2, **_rope_kw(scaled))
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    assert (cfg.rope_scaling is not None) == scaled
    inv_hf = hf.model.rotary_emb.inv_freq.numpy()
    assert rel_err(sj.rope_inv_freq(cfg), inv_hf) <= 1e-6
    # Positions beyond the "original" context, in arbitrary order, per row.
    positions = np.random.default_rng(0).integers(0, 500, size=(B, T)).astype(np.int32)
    cos_hf, sin_hf = _hf_rope(hf, positions)
    cos, sin = sj.rope_tables(cfg, jnp.asarray(positions))
    assert cos.shape == (B, T, cfg.head_dim)
    assert rel_err(cos, cos_hf.numpy()) <= TOL
    assert rel_err(sin, sin_hf.numpy()) <= TOL

    # Applying them: HF takes [B, N, T, H], specjax [B, T, N, H].
    q, qt = _inputs(3, B, T, cfg.num_heads, cfg.head_dim)
    k, kt = _inputs(4, B, T, cfg.num_kv_heads, cfg.head_dim)
    q_hf, k_hf = apply_rotary_pos_emb(qt.transpose(1, 2), kt.transpose(1, 2), cos_hf, sin_hf)
    assert rel_err(sj.apply_rope(jnp.asarray(q), cos, sin), q_hf.transpose(1, 2).numpy()) <= TOL
    assert rel_err(sj.apply_rope(jnp.asarray(k), cos, sin), k_hf.transpose(1, 2).numpy()) <= TOL


def test_rope_llama3_bands():
    """The scaled case above really covers all three Llama-3 frequency bands."""
    hf = random_hf_model(seed=2, **_rope_kw(True))
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    factor, lo, hi, orig = cfg.rope_scaling
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    wavelen = 2 * np.pi / inv
    assert (wavelen < orig / hi).any(), "no kept band"
    assert ((wavelen > orig / hi) & (wavelen < orig / lo)).any(), "no interpolated band"
    assert (wavelen > orig / lo).any(), "no slowed band"
    # and the rotary class HF builds for it is the llama3 one
    assert LlamaRotaryEmbedding(hf.config).rope_type == "llama3"


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "llama3"])
def test_attention(num_kv_heads, scaled):
    hf = random_hf_model(seed=10 + num_kv_heads, num_key_value_heads=num_kv_heads, **_rope_kw(scaled))
    model = specjax_from_hf(hf)
    cfg = model.config
    assert cfg.num_kv_heads == num_kv_heads and cfg.num_groups == 4 // num_kv_heads
    x, xt = _inputs(5, B, T, cfg.hidden_size)
    positions = _positions(B, T)
    cos_hf, sin_hf = _hf_rope(hf, positions)
    with torch.no_grad():
        want, _ = hf.model.layers[1].self_attn(xt, position_embeddings=(cos_hf, sin_hf), attention_mask=_causal_mask(T))
    cos, sin = sj.rope_tables(cfg, jnp.asarray(positions))
    # A cache larger than T: the unused tail must be masked out.
    s = T + 5
    kc, vc = _empty_layer_cache(cfg, B, s)
    got, k_cache, v_cache = _layer(model, 1).attn(jnp.asarray(x), cos, sin, kc, vc, jnp.zeros((B,), jnp.int32))
    assert rel_err(got, want.numpy()) <= TOL
    # The cache holds the roped keys and the values; back to HF layout [B, T, KV, H].
    k_cache = k_cache.reshape(B, num_kv_heads, s, -1).transpose(0, 2, 1, 3)
    v_cache = v_cache.reshape(B, num_kv_heads, s, -1).transpose(0, 2, 1, 3)
    attn = hf.model.layers[1].self_attn
    with torch.no_grad():
        k_hf = attn.k_proj(xt).view(B, T, num_kv_heads, -1).transpose(1, 2)
        v_hf = attn.v_proj(xt).view(B, T, num_kv_heads, -1)
        _, k_hf = apply_rotary_pos_emb(k_hf, k_hf, cos_hf, sin_hf)
    assert rel_err(k_cache[:, :T], k_hf.transpose(1, 2).numpy()) <= TOL
    assert rel_err(v_cache[:, :T], v_hf.numpy()) <= TOL
    assert not np.asarray(k_cache[:, T:]).any()


def test_mlp(pair):
    hf, model = pair
    x, xt = _inputs(6, B, T, 64)
    with torch.no_grad():
        want = hf.model.layers[0].mlp(xt).numpy()
    assert rel_err(_layer(model, 0).mlp(jnp.asarray(x)), want) <= TOL


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "llama3"])
def test_decoder_layer(pair, pair_llama3, scaled):
    hf, model = pair_llama3 if scaled else pair
    cfg = model.config
    x, xt = _inputs(7, B, T, cfg.hidden_size)
    positions = _positions(B, T)
    cos_hf, sin_hf = _hf_rope(hf, positions)
    with torch.no_grad():
        want = hf.model.layers[0](xt, attention_mask=_causal_mask(T), position_embeddings=(cos_hf, sin_hf))
    want = want[0] if isinstance(want, tuple) else want
    cos, sin = sj.rope_tables(cfg, jnp.asarray(positions))
    kc, vc = _empty_layer_cache(cfg, B, T)
    got, _, _ = _layer(model, 0)(jnp.asarray(x), cos, sin, kc, vc, jnp.zeros((B,), jnp.int32))
    assert rel_err(got, want.numpy()) <= TOL


def _specjax_forward(model, tokens: np.ndarray, collect=()):
    graphdef = model.graphdef

    @jax.jit
    def fwd(params, tokens):
        m = nnx.merge(graphdef, params)
        cache = m.new_cache(tokens.shape[0], tokens.shape[1])
        h, _, collected = m.hidden(tokens, cache, collect)
        return m.logits(h), h, collected

    return fwd(model.params, jnp.asarray(tokens))


@pytest.mark.parametrize(
    "kw",
    [
        dict(tie_word_embeddings=False),
        dict(tie_word_embeddings=True),
        dict(tie_word_embeddings=True, num_key_value_heads=1, **_rope_kw(True)),
        dict(tie_word_embeddings=False, num_key_value_heads=4, num_hidden_layers=3),
    ],
    ids=["untied", "tied", "tied-mqa-llama3", "untied-mha-3L"],
)
def test_full_model_logits(kw):
    hf = random_hf_model(seed=20, **kw)
    model = specjax_from_hf(hf)
    assert model.config.tie_word_embeddings == kw["tie_word_embeddings"]
    assert ("lm_head" in model.params) != kw["tie_word_embeddings"]
    if kw["tie_word_embeddings"]:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = np.random.default_rng(0).integers(0, 256, size=(B, 16)).astype(np.int32)
    with torch.no_grad():
        out = hf(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True)
    layers = model.config.num_layers
    logits, h, collected = _specjax_forward(model, tokens, collect=tuple(range(layers - 1)))
    assert logits.dtype == jnp.float32 and logits.shape == (B, 16, 256)
    assert rel_err(logits, out.logits.numpy()) <= TOL
    # Hidden-state hook: layer i's output is HF's hidden_states[i + 1].
    for i in range(layers - 1):
        assert rel_err(collected[i], out.hidden_states[i + 1].numpy()) <= TOL
    with torch.no_grad():
        last = hf.model(torch.from_numpy(tokens.astype(np.int64))).last_hidden_state
    assert rel_err(h, last.numpy()) <= TOL
    assert (np.asarray(logits).argmax(-1) == out.logits.numpy().argmax(-1)).all()
