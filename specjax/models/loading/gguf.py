"""Load Llama-family GGUF files (llama.cpp format: `llama`, `qwen2`, `qwen3`) with the `gguf` package.

Tensors are dequantized to f32 and renamed to HF names. For `llama` the Q and K weights are
un-permuted, since llama.cpp's converter reorders their rows for its interleaved rope while specjax
(like HF) uses the rotate-half convention; Qwen files keep HF's order (llama.cpp runs them with
its rotate-half "NEOX" rope). Tokenizer and chat template come from the GGUF metadata, converted by
transformers.
"""

from __future__ import annotations

import numpy as np

from specjax.errors import ModelLoadError
from specjax.models.config import LlamaConfig

NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def open_reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on truncated/corrupt files
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_config(reader, path: str) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{path}: GGUF rope_freqs (Llama-3.1 rope scaling) is not supported; use the HF checkpoint"
        )

    def need(key):
        v = _field(reader, key)
        if v is None:
            raise ModelLoadError(f"{path}: GGUF metadata is missing {key!r}")
        return v

    if _field(reader, f"{arch}.expert_count"):
        raise ModelLoadError(f"{path}: mixture-of-experts layers are not supported")
    hidden = int(need(f"{arch}.embedding_length"))
    heads = int(need(f"{arch}.attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need(f"{arch}.feed_forward_length")),
        num_layers=int(need(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(
            _field(
                reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.rope.dimension_count", hidden // heads)
            )
        ),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q/K: per head, rows (pairs, 2) -> (2, pairs)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader, cfg: LlamaConfig):
    """`get(hf_name) -> np.ndarray` (f32, HF layout) over the GGUF tensors."""
    import gguf

    permuted = _field(reader, "general.architecture") == "llama"  # llama.cpp's interleaved-rope row order
    by_hf_name = {}
    for t in reader.tensors:
        if t.name in NAMES:
            by_hf_name[NAMES[t.name]] = t
        elif t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind in LAYER_NAMES and suffix in ("weight", "bias"):
                by_hf_name[f"model.layers.{i}.{LAYER_NAMES[kind]}.{suffix}"] = t

    def get(name):
        t = by_hf_name[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize GGUF tensor {t.name} ({e})") from None
        w = np.asarray(w, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        if permuted and name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    return get
