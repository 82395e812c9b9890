"""DSpark drafters in their published layouts, in and out: vLLM `speculators` and SpecForge.

Both layouts hold the same tensors: DFlash's backbone under z-lab's names (dflash_formats.py)
plus `markov_head.markov_w1.weight [V, r]`, `markov_head.markov_w2.weight [N, r]` and
`confidence_head.proj.{weight [1, D (+ r)], bias [1]}`. They differ in the config:

* **speculators** (`speculators_model_type: dspark`): a Qwen3 `transformer_layer_config`,
  `aux_hidden_state_layer_ids` (HF `hidden_states` ids: specjax's target layer + 1), `block_size`,
  `mask_token_id`, `markov_rank`, `markov_head_type`, `enable_confidence_head` (default true),
  `confidence_head_with_markov` (default true), `sample_from_anchor`, `draft_vocab_size`, and a
  `speculators_config` naming the verifier. A draft vocabulary adds `lm_head.weight [N, D]`,
  `d2t` offsets and `t2d`.
* **SpecForge** (`architectures: ["DSparkDraftModel"]`, or `["Qwen3DSparkModel"]` after its
  export is normalised for SGLang): z-lab's DFlash config whose `dflash_config` holds
  `projector_type: "dspark"` and the head fields (`markov_rank`, default 0; `markov_head_type`;
  `enable_confidence_head`, default `confidence_head_alpha > 0`; `confidence_head_with_markov`,
  default false), nested or at the top level. Its `target_layer_ids` index decoder-layer outputs,
  as specjax's do. The target's whole vocabulary only. Heads saved under `logit_head.` (early
  SpecForge checkpoints) load too.

Both draft from the anchor slot (speculators `sample_from_anchor: true`; SpecForge's labels are
anchor + 1 .. anchor + block_size), as specjax's DSpark does. `sample_from_anchor: false`, gated
or rnn Markov heads, and SpecForge's causal or sliding-window layers are one-line errors.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.drafters import checkpoint, dflash_formats
from specjax.drafters.dflash import DFlashWeights
from specjax.drafters.dspark import KIND, DSparkConfig, build_weights
from specjax.drafters.dspark import load as load_specjax
from specjax.drafters.eagle3_formats import SPECULATORS_VERSION, _draft_map, draft_map_tensors, proposal_config
from specjax.errors import DrafterError, ModelLoadError

SPECULATORS = "speculators"
SPECFORGE = "specforge"
FORMATS = (SPECULATORS, SPECFORGE)
SPECFORGE_ARCHS = ("DSparkDraftModel", "Qwen3DSparkModel")
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def detect(raw: dict) -> str | None:
    """The published layout of a config.json dict (`speculators`, `specforge`), or None."""
    if raw.get("speculators_model_type") == KIND:
        return SPECULATORS
    sub = raw.get("dflash_config") or {}
    if sub.get("projector_type") == KIND or set(raw.get("architectures") or []) & set(SPECFORGE_ARCHS):
        return SPECFORGE
    return None


def load(path: str, dtype=jnp.float32) -> DFlashWeights:
    """A DSpark drafter from a specjax, speculators or SpecForge directory."""
    raw = checkpoint.read_config(path, None, "DSpark")
    fmt = detect(raw)
    if fmt is None:
        if raw.get("drafter") == KIND:
            return load_specjax(path, dtype)
        raise DrafterError(f"{path}/config.json is neither a specjax, a speculators nor a SpecForge DSpark config")
    source = f"DSpark drafter {path}"
    from specjax.models.loading.hf import open_checkpoint
    from specjax.models.loading.mapping import checked_getter

    try:
        get, names = open_checkpoint(path)
        alias = {n.removeprefix("logit_head."): n for n in names}  # early SpecForge head names
        read = {"embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"}  # verifier's, unused
        fetch = checked_getter(lambda name: read.add(alias.get(name, name)) or get(alias.get(name, name)))
        if fmt == SPECULATORS:
            cfg = _speculators_config(raw, "lm_head.weight" in names, source)
        else:
            cfg = _specforge_config(raw, source)
        pure = dflash_formats.backbone_from_hf(cfg, fetch)
        pure.update(_heads_from_hf(cfg, fetch))
        if cfg.draft_vocab_size:
            read |= {"d2t", "t2d"}
            d2t = _draft_map(get, names, cfg.draft_vocab_size, cfg.layers.vocab_size, source)
        else:
            d2t = None
    except ModelLoadError as e:
        raise DrafterError(f"{source}: {str(e).splitlines()[0]}") from None
    extra = sorted(set(names) - read)
    if extra:
        raise DrafterError(f"{source}: tensors specjax's DSpark has no place for: {extra[:3]}")
    from specjax.models.loading import _flatten

    return build_weights(cfg, dict(_flatten(pure)), d2t, source, dtype)


def _check_markov(kind, source: str) -> None:
    if str(kind or "vanilla").lower() != "vanilla":
        raise DrafterError(f"{source}: markov_head_type {kind!r} is not supported (vanilla only)")


def _speculators_config(raw: dict, own_head: bool, source: str) -> DSparkConfig:
    """The DSparkConfig a speculators config describes (`own_head`: it stores `lm_head`)."""
    _check_markov(raw.get("markov_head_type"), source)
    if not raw.get("sample_from_anchor", True):
        raise DrafterError(f"{source}: sample_from_anchor false is DFlash's block layout; load it as dflash")
    lc = dflash_formats.drafter_layers(raw.get("transformer_layer_config") or {}, source)
    v, n = lc.vocab_size, int(raw.get("draft_vocab_size") or lc.vocab_size)
    ids, mask = raw.get("aux_hidden_state_layer_ids"), raw.get("mask_token_id")
    if not ids or mask is None:
        raise DrafterError(f"{source}: needs aux_hidden_state_layer_ids and mask_token_id")
    if min(int(i) for i in ids) < 1:  # speculators' id k is HF hidden_states[k]: layer k - 1's output
        raise DrafterError(f"{source}: aux_hidden_state_layer_ids {ids} include 0, the embedding output")
    return DSparkConfig(
        layers=lc,
        target_layers=tuple(int(i) - 1 for i in ids),
        target_num_layers=0,
        block_size=int(raw.get("block_size", 8)),
        mask_token_id=int(mask),
        draft_vocab_size=0 if n == v and not own_head else n,
        markov_rank=int(raw.get("markov_rank", 256)),
        confidence=bool(raw.get("enable_confidence_head", True)),
        confidence_with_markov=bool(raw.get("confidence_head_with_markov", True)),
        own_head=own_head,
    )


def _specforge_config(raw: dict, source: str) -> DSparkConfig:
    """The DSparkConfig a SpecForge config describes (its DFlash part read as z-lab's)."""
    sub = raw.get("dflash_config") or {}
    if sub.get("projector_type", KIND) != KIND:
        raise DrafterError(f"{source}: dflash_config.projector_type {sub['projector_type']!r} is not dspark")
    if raw.get("sliding_window_non_causal") or any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise DrafterError(f"{source}: sliding-window drafter layers are not supported")
    head = {k: sub.get(k, raw.get(k)) for k in HEAD_FIELDS}
    _check_markov(head["markov_head_type"], source)
    base = dflash_formats.config_from_zlab(raw, source)
    alpha = float(sub.get("confidence_head_alpha", raw.get("confidence_head_alpha", 0.0)) or 0.0)
    conf = head["enable_confidence_head"]
    return DSparkConfig(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
        markov_rank=int(head["markov_rank"] or 0),
        confidence=bool(alpha > 0 if conf is None else conf),
        confidence_with_markov=bool(head["confidence_head_with_markov"] or False),
    )


def _heads_from_hf(cfg: DSparkConfig, fetch) -> dict:
    """The Markov, confidence and own head params (pure dict entries), read through `fetch`."""
    d, r, v = cfg.hidden_size, cfg.markov_rank, cfg.layers.vocab_size
    pure = {}
    if r:
        pure["markov_w1"] = fetch("markov_head.markov_w1.weight", (v, r))
        pure["markov_w2"] = fetch("markov_head.markov_w2.weight", (cfg.head_size, r))
    if cfg.confidence:
        pure["conf_w"] = fetch("confidence_head.proj.weight", (1, d + (r if cfg.confidence_with_markov else 0)))
        pure["conf_b"] = fetch("confidence_head.proj.bias", (1,))
    if cfg.own_head:
        pure["head"] = fetch("lm_head.weight", (cfg.head_size, d))
    return pure


def _tensors(w: DFlashWeights, head) -> dict:
    """Published tensor names -> arrays of `w`; `head [N, D]`: the rows its drafts are scored by,
    written as `lm_head` when it drafts from a draft vocabulary."""
    from flax import nnx

    cfg, pure = w.config, nnx.to_pure_dict(w.params)
    out = dflash_formats._zlab_tensors(cfg, pure)
    if cfg.markov_rank:
        out["markov_head.markov_w1.weight"] = pure["markov_w1"]
        out["markov_head.markov_w2.weight"] = pure["markov_w2"]
    if cfg.confidence:
        out["confidence_head.proj.weight"] = pure["conf_w"]
        out["confidence_head.proj.bias"] = pure["conf_b"]
    if cfg.draft_vocab_size:
        out["lm_head.weight"] = pure["head"] if cfg.own_head else head
    return out


def to_published(w: DFlashWeights, fmt: str, head=None, verifier: dict | None = None, dtype=None):
    """(config, tensors) of `w` in layout `fmt`. `head [N, D]`: the target's head rows at the draft
    vocabulary (needed when `w` drafts from one without its own rows); `verifier` =
    {"name_or_path", "architectures"} for speculators; `dtype` casts the float tensors."""
    cfg = w.config
    if fmt not in FORMATS:
        raise DrafterError(f"unknown DSpark layout {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == SPECFORGE and cfg.draft_vocab_size:
        raise DrafterError("a DSpark drafter with a draft vocabulary has no SpecForge layout; use --format speculators")
    if not cfg.layers.qk_norm or cfg.layers.attention_bias:
        raise DrafterError("published DSpark layers are Qwen3 layers (q/k norms, no q/k/v biases)")
    if cfg.embed_scale != 1.0 or cfg.logit_scale != 1.0 or cfg.logit_softcap:
        raise DrafterError("embedding or logit scaling has no place in a published DSpark config")
    tensors = _tensors(w, head)
    floats = {k: np.asarray(a if dtype is None else jnp.asarray(a, dtype)) for k, a in tensors.items()}
    dtype_name = str(floats["fc.weight"].dtype)
    fields = {
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": cfg.confidence,
        "confidence_head_with_markov": cfg.confidence and cfg.confidence_with_markov,
    }
    if fmt == SPECFORGE:
        z = dflash_formats.zlab_config(cfg)
        lc = cfg.layers
        mode = "mha" if lc.num_kv_heads == lc.num_heads else "gqa"
        sub = {**z["dflash_config"], "projector_type": KIND, "attention_mode": mode, **fields}
        return {**z, "architectures": [SPECFORGE_ARCHS[0]], "dflash_config": sub, "dtype": dtype_name}, floats
    if cfg.draft_vocab_size:
        floats.update(draft_map_tensors(np.asarray(w.d2t, np.int64), cfg.layers.vocab_size))
    layer = cfg.layers.to_hf()
    for key in ("bos_token_id", "eos_token_id", "architectures"):
        layer.pop(key, None)
    config = {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": KIND,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**layer, "model_type": "qwen3"},
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layers],
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": cfg.head_size,
        "sample_from_anchor": True,
        **fields,
        "speculators_config": proposal_config(KIND, cfg.block_size, verifier),
        "dtype": dtype_name,
    }
    return config, floats


def export(w: DFlashWeights, out_dir: str, fmt: str, **kw) -> str:
    """Write `w` to `out_dir` in layout `fmt` (`config.json` + `model.safetensors`); see to_published."""
    return checkpoint.write(out_dir, *to_published(w, fmt, **kw))
