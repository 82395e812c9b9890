"""HF tensor names -> specjax params (one entry per layer, fused QKV and gate/up).

Both loaders (safetensors and GGUF) produce tensors in HF layout (`[out, in]`) under HF names and
hand them to :func:`params_from_hf`; :func:`params_to_hf` is the inverse, used to export models
(e.g. a draft model) as HF checkpoints.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from specjax.errors import ModelLoadError
from specjax.models.config import LlamaConfig

LAYER = "model.layers.{i}."


def checked_getter(get: Callable[[str], np.ndarray], dtype=np.float32, on_tensor=None):
    """`fetch(name, shape)`: `get(name)` as `dtype`, or a ModelLoadError naming a missing tensor
    or a shape the config does not imply."""

    def fetch(name, shape):
        try:
            a = np.asarray(get(name))
        except KeyError:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}") from None
        if tuple(a.shape) != tuple(shape):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(a.shape)}, config implies {tuple(shape)}")
        if on_tensor is not None:
            on_tensor()
        return a.astype(dtype, copy=False)

    return fetch


def layer_from_hf(cfg: LlamaConfig, fetch, prefix: str, in_dim: int | None = None) -> dict:
    """One decoder layer's pure params from the HF tensors under `prefix` (e.g.
    `model.layers.3.`); `in_dim` is the width q/k/v read (EAGLE-3's layer: 2D)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, kv, din = cfg.num_heads, cfg.num_kv_heads, in_dim or cfg.hidden_size
    p = prefix
    qkv = np.concatenate(
        [
            fetch(p + "self_attn.q_proj.weight", (n * h, din)),
            fetch(p + "self_attn.k_proj.weight", (kv * h, din)),
            fetch(p + "self_attn.v_proj.weight", (kv * h, din)),
        ]
    )
    gate_up = np.concatenate([fetch(p + "mlp.gate_proj.weight", (f, d)), fetch(p + "mlp.up_proj.weight", (f, d))])
    attn = {"qkv": qkv, "o": fetch(p + "self_attn.o_proj.weight", (d, n * h))}
    if cfg.attention_bias:
        attn["qkv_bias"] = np.concatenate(
            [fetch(p + f"self_attn.{x}_proj.bias", (m * h,)) for x, m in (("q", n), ("k", kv), ("v", kv))]
        )
    if cfg.qk_norm:
        attn["q_norm"] = {"scale": fetch(p + "self_attn.q_norm.weight", (h,))}
        attn["k_norm"] = {"scale": fetch(p + "self_attn.k_norm.weight", (h,))}
    return {
        "attn": attn,
        "mlp": {"gate_up": gate_up, "down": fetch(p + "mlp.down_proj.weight", (d, f))},
        "attn_norm": {"scale": fetch(p + "input_layernorm.weight", (d,))},
        "mlp_norm": {"scale": fetch(p + "post_attention_layernorm.weight", (d,))},
    }


def layer_to_hf(cfg: LlamaConfig, lay: dict, prefix: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`layer_from_hf`: the layer's HF-named tensors under `prefix`."""
    f, h = cfg.intermediate_size, cfg.head_dim
    n, kv = cfg.num_heads, cfg.num_kv_heads
    p, out = prefix, {}
    qkv = lay["attn"]["qkv"]
    out[p + "self_attn.q_proj.weight"] = qkv[: n * h]
    out[p + "self_attn.k_proj.weight"] = qkv[n * h : (n + kv) * h]
    out[p + "self_attn.v_proj.weight"] = qkv[(n + kv) * h :]
    out[p + "self_attn.o_proj.weight"] = lay["attn"]["o"]
    if cfg.attention_bias:
        bias = lay["attn"]["qkv_bias"]
        out[p + "self_attn.q_proj.bias"] = bias[: n * h]
        out[p + "self_attn.k_proj.bias"] = bias[n * h : (n + kv) * h]
        out[p + "self_attn.v_proj.bias"] = bias[(n + kv) * h :]
    if cfg.qk_norm:
        out[p + "self_attn.q_norm.weight"] = lay["attn"]["q_norm"]["scale"]
        out[p + "self_attn.k_norm.weight"] = lay["attn"]["k_norm"]["scale"]
    out[p + "mlp.gate_proj.weight"] = lay["mlp"]["gate_up"][:f]
    out[p + "mlp.up_proj.weight"] = lay["mlp"]["gate_up"][f:]
    out[p + "mlp.down_proj.weight"] = lay["mlp"]["down"]
    out[p + "input_layernorm.weight"] = lay["attn_norm"]["scale"]
    out[p + "post_attention_layernorm.weight"] = lay["mlp_norm"]["scale"]
    return out


def params_from_hf(
    cfg: LlamaConfig,
    get: Callable[[str], np.ndarray],
    dtype=np.float32,
    on_tensor: Callable[[], None] | None = None,
) -> dict:
    """Build the pure params dict of :class:`~specjax.models.llama.Llama` from HF tensors.

    `get(name)` returns the HF tensor `name` as a numpy array (raising KeyError if absent).
    """

    fetch = checked_getter(get, dtype, on_tensor)
    d = cfg.hidden_size
    params = {
        "embed": fetch("model.embed_tokens.weight", (cfg.vocab_size, d)),
        "layers": {i: layer_from_hf(cfg, fetch, LAYER.format(i=i)) for i in range(cfg.num_layers)},
        "norm": {"scale": fetch("model.norm.weight", (d,))},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = fetch("lm_head.weight", (cfg.vocab_size, d))
    return params


def params_to_hf(cfg: LlamaConfig, params: dict, tables: bool = True) -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf`: HF-named numpy tensors.

    Layer keys may be ints (`nnx.to_pure_dict`) or strings (params read back from a flat file).
    `tables=False` leaves out the embedding and LM head (a draft model that borrows its target's).
    """
    layers = {int(i): lay for i, lay in params["layers"].items()}
    out = {"model.embed_tokens.weight": params["embed"]} if tables else {}
    out["model.norm.weight"] = params["norm"]["scale"]
    for i in range(cfg.num_layers):
        out.update(layer_to_hf(cfg, layers[i], LAYER.format(i=i)))
    if tables and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = params["lm_head"]
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}
