"""EAGLE-3 drafters in their published layouts, in and out.

Two layouts hold the same network (`eagle3.Eagle3`: fc over the fused target features, one decoder
layer whose q/k/v read `[norm(embed) ; norm(feature)]`, a final norm, a reduced-vocabulary head):

* `eagle` — EAGLE / SpecForge (`LlamaForCausalLMEagle3`, what SGLang serves): a Llama config with
  `draft_vocab_size`, optional `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`;
  tensors `fc.weight [D, n·Dt]`, `midlayer.*` (q/k/v `[·, 2D]`, `hidden_norm`), `norm`, `lm_head
  [N, D]`, optional `embed_tokens`.
* `speculators` — vLLM's `Eagle3Speculator`: `transformer_layer_config` (a Llama or Qwen3 layer),
  `speculators_config` (proposal methods, verifier), flags `norm_before_residual`,
  `norm_before_fc`, `norm_output`; the layer under `layers.0.*`, otherwise the same tensors.

Both store `d2t [N]` int64 as offsets (target id = i + d2t[i]) and `t2d [V]` bool; specjax keeps
`d2t` as target ids. Both omit the maps when N = V.

Layer ids. specjax's `target_layers` are decoder-layer outputs (0-based). SpecForge and SGLang
name the same thing (SGLang captures "layer k" before layer k + 1), so `eagle` ids are read as is.
`speculators` ids index HF `hidden_states`, where id k is the input of layer k, i.e. the output of
layer k - 1, as vLLM captures them; they are read as k - 1 and written as k + 1. Absent ids mean
the default of all of them, `eagle3.default_target_layers` (the inputs of layers 2, L/2, L - 3).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.drafters import checkpoint
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Weights, build_weights, default_target_layers
from specjax.errors import DrafterError, ModelLoadError
from specjax.models.config import LlamaConfig
from specjax.models.loading import _flatten
from specjax.models.loading.mapping import checked_getter, layer_from_hf, layer_to_hf

EAGLE, SPECULATORS = "eagle", "speculators"
FORMATS = (EAGLE, SPECULATORS)
LAYER_PREFIX = {EAGLE: "midlayer.", SPECULATORS: "layers.0."}
EAGLE_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"  # the layout written (and tested against `speculators` 0.9.0)
# Published variants specjax does not run: one line naming them.
UNSUPPORTED_FLAGS = {"fc_norm": "per-feature RMSNorms before fc (fc_norm)"}


def detect(path: str) -> str:
    """`specjax` | `eagle` | `speculators`: the layout of an EAGLE-3 drafter directory."""
    raw = _read_json(path)
    if "drafter" in raw:
        return "specjax"
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise DrafterError(f"{path} holds a speculators {kind!r} drafter, not an EAGLE-3 one")
        return SPECULATORS
    if EAGLE_ARCH in (raw.get("architectures") or []) or "draft_vocab_size" in raw:
        return EAGLE
    raise DrafterError(
        f"{path}/config.json is neither a specjax, an EAGLE/SpecForge ({EAGLE_ARCH}) "
        f"nor a speculators ({SPECULATORS_ARCH}) EAGLE-3 config"
    )


def load(path: str, dtype, target_num_layers: int | None = None) -> Eagle3Weights:
    """An EAGLE-3 drafter from a directory in any of the three layouts. `target_num_layers` gives
    the default feature layers when a published config names none."""
    from specjax.drafters import eagle3

    fmt = detect(path)
    if fmt == "specjax":
        return eagle3.load(path, dtype)
    from specjax.models.loading.hf import open_checkpoint

    raw = _read_json(path)
    try:
        get, names = open_checkpoint(path)
    except ModelLoadError as e:
        raise DrafterError(f"EAGLE-3 drafter {path}: {str(e).splitlines()[0]}") from None
    return _from_published(raw, get, names, fmt, path, dtype, target_num_layers)


def _read_json(path: str) -> dict:
    return checkpoint.read_config(path, None, "EAGLE-3")


def _config(raw: dict, fmt: str, source: str, target_num_layers: int | None) -> Eagle3Config:
    """The Eagle3Config a published config describes (one-line errors for what specjax lacks)."""
    layer_raw = raw if fmt == EAGLE else raw.get("transformer_layer_config")
    if not isinstance(layer_raw, dict):
        raise DrafterError(f"{source}: no transformer_layer_config object in the speculators config")
    try:
        lc = LlamaConfig.from_hf({**layer_raw, "architectures": []})
    except ModelLoadError as e:
        raise DrafterError(f"{source}: drafter layer: {e}") from None
    if lc.num_layers != 1:
        raise DrafterError(f"{source}: {lc.num_layers} decoder layers; specjax's EAGLE-3 has one")
    for flag, what in UNSUPPORTED_FLAGS.items():
        if raw.get(flag):
            raise DrafterError(f"{source}: {what} is not supported")
    if fmt == EAGLE:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        layers = None if ids is None else tuple(int(i) for i in ids)
    else:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and min(ids) < 1:
            raise DrafterError(f"{source}: layer id 0 (the token embeddings) as a feature is not supported")
        layers = None if ids is None else tuple(int(i) - 1 for i in ids)
    if layers is None:
        if not target_num_layers:
            raise DrafterError(
                f"{source}: names no target layers (eagle_aux_hidden_state_layer_ids) and "
                "no target is given to take the default ones from"
            )
        layers = default_target_layers(target_num_layers)
    return Eagle3Config(
        hidden_size=lc.hidden_size,
        intermediate_size=lc.intermediate_size,
        num_heads=lc.num_heads,
        num_kv_heads=lc.num_kv_heads,
        head_dim=lc.head_dim,
        target_vocab_size=lc.vocab_size,
        target_num_layers=0,
        draft_vocab_size=int(raw.get("draft_vocab_size") or lc.vocab_size),
        target_layers=layers,
        rope_theta=lc.rope_theta,
        rope_scaling=lc.rope_scaling,
        rms_norm_eps=lc.rms_norm_eps,
        target_hidden_size=raw.get("target_hidden_size") or None,
        attention_bias=lc.attention_bias,
        qk_norm=lc.qk_norm,
        norm_before_residual=bool(raw.get("norm_before_residual")),
        norm_before_fc=bool(raw.get("norm_before_fc")),
        norm_output=bool(raw.get("norm_output")),
    )


def _from_published(raw, get, names, fmt, path, dtype, target_num_layers) -> Eagle3Weights:
    source = f"EAGLE-3 drafter {path}"
    cfg = _config(raw, fmt, source, target_num_layers)
    fetch = checked_getter(get)
    d, n, dt = cfg.hidden_size, len(cfg.target_layers), cfg.feature_size
    v, nd = cfg.target_vocab_size, cfg.draft_vocab_size
    lc = cfg.layer_config()
    prefix = LAYER_PREFIX[fmt]
    try:
        lay = layer_from_hf(lc, fetch, prefix, in_dim=2 * d)
        pure = {
            "attn": lay["attn"],
            "mlp": lay["mlp"],
            "embed_norm": lay["attn_norm"],
            "mlp_norm": lay["mlp_norm"],
            "hidden_norm": {"scale": fetch(prefix + "hidden_norm.weight", (d,))},
            "fc": fetch("fc.weight", (d, n * dt)),
            "head": fetch("lm_head.weight", (nd, d)),
            "norm": {"scale": fetch("norm.weight", (d,))},
        }
        if cfg.norm_before_fc:
            pure["input_norm"] = {"scale": fetch("input_norm.weight", (n * dt,))}
        embed = fetch("embed_tokens.weight", (v, d)) if "embed_tokens.weight" in names else None
    except ModelLoadError as e:
        raise DrafterError(f"{source}: {e}") from None
    arrays = dict(_flatten(pure))
    d2t = _draft_map(get, names, nd, v, source)
    known = {n for n in names if not n.startswith(prefix)} - {
        "fc.weight",
        "lm_head.weight",
        "norm.weight",
        "input_norm.weight",
        "embed_tokens.weight",
        "d2t",
        "t2d",
    }
    if known:
        raise DrafterError(f"{source}: tensors specjax's EAGLE-3 has no place for: {sorted(known)[:3]}")
    return build_weights(cfg, arrays, d2t, embed, source, dtype)


def _draft_map(get, names, nd: int, v: int, source: str) -> np.ndarray:
    """`d2t` offsets (+ `t2d`) -> target ids `[N]`; the identity when N = V and no map is stored."""
    if "d2t" not in names:
        if nd != v:
            raise DrafterError(
                f"{source}: no 'd2t' tensor, but the draft vocabulary ({nd}) is smaller than the target's ({v})"
            )
        return np.arange(v)
    off = np.asarray(get("d2t"))
    if off.shape != (nd,) or not np.issubdtype(off.dtype, np.integer):
        raise DrafterError(f"{source}: 'd2t' must be {nd} integer offsets, got {off.dtype} {off.shape}")
    ids = np.arange(nd) + off.astype(np.int64)
    if ids.min() < 0 or ids.max() >= v:
        raise DrafterError(f"{source}: 'd2t' maps draft tokens to ids outside the target vocabulary [0, {v})")
    if "t2d" in names:
        t2d = np.asarray(get("t2d")).astype(bool)
        if t2d.shape != (v,) or t2d.sum() != nd or not t2d[ids].all():
            raise DrafterError(f"{source}: 't2d' does not mark the {nd} target tokens 'd2t' names")
    return ids


def _published_tensors(w: Eagle3Weights, fmt: str, embed, dtype) -> dict[str, np.ndarray]:
    """The tensors of `w` under `fmt`'s names (d2t as offsets and t2d when the draft vocabulary
    is not the target's); `dtype` casts the float tensors."""
    from flax import nnx

    cfg = w.config
    pure = nnx.to_pure_dict(w.params)
    prefix = LAYER_PREFIX[fmt]
    layer = {"attn": pure["attn"], "mlp": pure["mlp"], "attn_norm": pure["embed_norm"], "mlp_norm": pure["mlp_norm"]}
    tensors = layer_to_hf(cfg.layer_config(), layer, prefix)
    tensors[prefix + "hidden_norm.weight"] = pure["hidden_norm"]["scale"]
    tensors.update({"fc.weight": pure["fc"], "norm.weight": pure["norm"]["scale"], "lm_head.weight": pure["head"]})
    if cfg.norm_before_fc:
        tensors["input_norm.weight"] = pure["input_norm"]["scale"]
    table = w.embed if w.embed is not None else embed
    if table is not None:
        tensors["embed_tokens.weight"] = table
    tensors = {k: np.asarray(a if dtype is None else jnp.asarray(a, dtype)) for k, a in tensors.items()}
    ids = np.asarray(w.d2t, np.int64)  # [N] target id of each draft token
    if cfg.draft_vocab_size != cfg.target_vocab_size or not np.array_equal(ids, np.arange(len(ids))):
        tensors.update(draft_map_tensors(ids, cfg.target_vocab_size))
    return tensors


def draft_map_tensors(ids: np.ndarray, v: int) -> dict[str, np.ndarray]:
    """A draft vocabulary's target ids `[N]` as the published tensors: `d2t` offsets `[N]` (draft
    token i is target token i + d2t[i]) and the `t2d` membership mask `[V]`."""
    t2d = np.zeros(v, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


def proposal_config(algorithm: str, num_draft: int, verifier: dict | None) -> dict:
    """A `speculators` config's `speculators_config`: greedy proposals of `num_draft` tokens and
    the verifier {"name_or_path", "architectures"}."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": num_draft,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": verifier or {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
    }


def _speculators_config(cfg, hf: dict, nd: int, num_draft: int, verifier: dict | None, dtype_name: str) -> dict:
    """The `speculators` Eagle3Speculator config (its layer ids index HF `hidden_states`: ours + 1)."""
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": hf,
        "draft_vocab_size": nd,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": False,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layers],
        "speculators_config": proposal_config("eagle3", num_draft, verifier),
        "dtype": dtype_name,
    }


def to_published(
    w: Eagle3Weights,
    fmt: str,
    embed=None,
    verifier: dict | None = None,
    num_draft: int = 3,
    dtype=None,
    max_positions: int | None = None,
) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, tensors) of `w` in layout `fmt`. `embed [V, D]` is written as `embed_tokens`
    (the drafter's own table wins); `verifier` = {"name_or_path", "architectures"} for
    `speculators`; `dtype` casts the float tensors; `max_positions`: the target's context."""
    if fmt not in FORMATS:
        raise DrafterError(f"unknown EAGLE-3 layout {fmt!r} (known: {', '.join(FORMATS)})")
    cfg = w.config
    if fmt == EAGLE and cfg.qk_norm:
        raise DrafterError(
            "a drafter with a Qwen3-type layer (q/k norms) has no EAGLE/SpecForge layout; use --format speculators"
        )
    tensors = _published_tensors(w, fmt, embed, dtype)
    lc = cfg.layer_config()
    v, nd = cfg.target_vocab_size, cfg.draft_vocab_size
    hf = dataclasses.replace(lc, vocab_size=v, max_position_embeddings=max_positions or lc.max_position_embeddings)
    hf = hf.to_hf()
    dtype_name = str(np.dtype(dtype)) if dtype is not None else str(tensors["fc.weight"].dtype)
    if fmt == EAGLE:
        config = {
            **hf,
            "architectures": [EAGLE_ARCH],
            "model_type": "llama",
            "draft_vocab_size": nd,
            "torch_dtype": dtype_name,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.target_layers), "use_aux_hidden_state": True},
        }
        for flag in ("norm_before_residual", "norm_before_fc", "norm_output"):
            if getattr(cfg, flag):
                config[flag] = True
    else:
        config = _speculators_config(cfg, hf, nd, num_draft, verifier, dtype_name)
    if cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    return config, tensors


def export(w: Eagle3Weights, out_dir: str, fmt: str, **kw) -> str:
    """Write `w` to `out_dir` in layout `fmt` (`config.json` + `model.safetensors`); see to_published."""
    return checkpoint.write(out_dir, *to_published(w, fmt, **kw))
