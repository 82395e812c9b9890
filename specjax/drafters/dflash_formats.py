"""DFlash drafters in z-lab's published layout, in and out.

z-lab's `DFlashDraftModel` (what vLLM, SGLang and the `dflash` package load) is a Qwen3 config
(`num_hidden_layers` = the drafter's layers, `vocab_size` = the target's) with `block_size`,
`num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`; tensors
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`,
`norm.weight`, `fc.weight [D, n D]`, `hidden_norm.weight`; no embedding and no head (the target's).
Its `target_layer_ids` index decoder-layer outputs (the reference reads `hidden_states[id + 1]`),
as specjax's `target_layers` do. DFlash2 (dynamic convolutions, a candidate selector) and causal or
sliding-window drafter layers are one-line errors.
"""

from __future__ import annotations

import numpy as np

from specjax.drafters import checkpoint
from specjax.drafters.dflash import DFlashConfig, DFlashWeights, build_weights, default_target_layers
from specjax.errors import DrafterError, ModelLoadError
from specjax.models.config import LlamaConfig
from specjax.models.loading import _flatten
from specjax.models.loading.mapping import checked_getter, layer_from_hf, layer_to_hf

ARCH = "DFlashDraftModel"
UNSUPPORTED_ARCHS = {"DFlash2DraftModel": "DFlash2 (dynamic convolutions and a candidate selector)"}


def is_zlab(raw: dict) -> bool:
    """Whether a config.json dict is z-lab's (`DFlashDraftModel`) rather than specjax's."""
    return ARCH in (raw.get("architectures") or []) or "dflash_config" in raw


def load(path: str, dtype) -> DFlashWeights:
    """A DFlash drafter from a specjax or a z-lab directory."""
    from specjax.drafters import dflash

    raw = checkpoint.read_config(path, None, "DFlash")
    if "drafter" in raw:
        return dflash.load(path, dtype)
    for arch, what in UNSUPPORTED_ARCHS.items():
        if arch in (raw.get("architectures") or []):
            raise DrafterError(f"DFlash drafter {path}: {what} is not supported")
    if not is_zlab(raw):
        raise DrafterError(f"{path}/config.json is neither a specjax nor a z-lab ({ARCH}) DFlash config")
    from specjax.models.loading.hf import open_checkpoint

    source = f"DFlash drafter {path}"
    cfg = config_from_zlab(raw, source)
    try:
        get, names = open_checkpoint(path)
        read = set()
        fetch = checked_getter(lambda name: read.add(name) or get(name))
        pure = backbone_from_hf(cfg, fetch)
    except ModelLoadError as e:
        raise DrafterError(f"{source}: {str(e).splitlines()[0]}") from None
    arrays = dict(_flatten(pure))
    extra = sorted(set(names) - read)
    if extra:
        raise DrafterError(f"{source}: tensors specjax's DFlash has no place for: {extra[:3]}")
    return build_weights(cfg, arrays, None, source, dtype)


def backbone_from_hf(cfg: DFlashConfig, fetch) -> dict:
    """The pure params of DFlash's network (`fc`, `hidden_norm`, `norm`, `layers`) from the tensor
    names z-lab and speculators share, read through `fetch(name, shape)`."""
    lc, d = cfg.layers, cfg.hidden_size
    return {
        "fc": fetch("fc.weight", (d, len(cfg.target_layers) * d)),
        "hidden_norm": {"scale": fetch("hidden_norm.weight", (d,))},
        "norm": {"scale": fetch("norm.weight", (d,))},
        "layers": {i: layer_from_hf(lc, fetch, f"layers.{i}.") for i in range(lc.num_layers)},
    }


def drafter_layers(raw: dict, source: str) -> LlamaConfig:
    """The drafter layers' config from a published Qwen3 config dict (z-lab's whole config, or
    speculators' `transformer_layer_config`): no token ids of its own."""
    try:
        lc = LlamaConfig.from_hf({**raw, "architectures": [], "model_type": "qwen3"})
    except ModelLoadError as e:
        raise DrafterError(f"{source}: drafter layers: {e}") from None
    return LlamaConfig(**{**lc.to_dict(), "eos_token_ids": (), "bos_token_id": None})


def config_from_zlab(raw: dict, source: str) -> DFlashConfig:
    """The DFlashConfig a z-lab config describes."""
    sub = raw.get("dflash_config") or {}
    if raw.get("is_causal") or sub.get("is_causal"):
        raise DrafterError(f"{source}: causal drafter layers are not supported (DFlash blocks are bidirectional)")
    lc = drafter_layers(raw, source)
    mask = sub.get("mask_token_id", raw.get("mask_token_id"))
    if mask is None:
        raise DrafterError(f"{source}: no mask_token_id in dflash_config")
    n_target = int(raw.get("num_target_layers") or 0)
    ids = sub.get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is None:
        if not n_target:
            raise DrafterError(f"{source}: names neither target_layer_ids nor num_target_layers")
        ids = default_target_layers(n_target, lc.num_layers)
    cap = sub.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
    return DFlashConfig(
        layers=lc,
        target_layers=tuple(int(i) for i in ids),
        target_num_layers=n_target,
        block_size=int(sub.get("block_size", raw.get("block_size", 16))),
        mask_token_id=int(mask),
        embed_scale=float(sub.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))),
        logit_scale=float(sub.get("output_multiplier", raw.get("output_multiplier", 1.0))),
        logit_softcap=float(cap or 0.0),
    )


def _zlab_tensors(cfg: DFlashConfig, pure: dict) -> dict:
    """z-lab tensor names -> arrays of `pure`, the module's pure params dict."""
    out = {
        "fc.weight": pure["fc"],
        "hidden_norm.weight": pure["hidden_norm"]["scale"],
        "norm.weight": pure["norm"]["scale"],
    }
    for i in range(cfg.layers.num_layers):
        out.update(layer_to_hf(cfg.layers, pure["layers"][i], f"layers.{i}."))
    return out


def zlab_config(cfg: DFlashConfig) -> dict:
    """The z-lab config.json dict describing `cfg` (the inverse of `config_from_zlab`)."""
    lc = cfg.layers
    hf = lc.to_hf()
    for key in ("bos_token_id", "eos_token_id"):
        hf.pop(key, None)
    sub = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layers)}
    if cfg.embed_scale != 1.0:
        sub["input_embedding_scale"] = cfg.embed_scale
    if cfg.logit_scale != 1.0:
        sub["output_multiplier"] = cfg.logit_scale
    if cfg.logit_softcap:
        sub["final_logit_softcapping"] = cfg.logit_softcap
    return {
        **hf,
        "architectures": [ARCH],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers,
        "dflash_config": sub,
        "layer_types": ["full_attention"] * lc.num_layers,
        "use_sliding_window": False,
    }


def export(w: DFlashWeights, out_dir: str, dtype=None) -> str:
    """Write `w` in z-lab's layout (`config.json` + `model.safetensors`)."""
    import jax.numpy as jnp
    from flax import nnx

    if w.d2t is not None:
        raise DrafterError(
            "a DFlash drafter with a reduced draft vocabulary has no z-lab layout (its head is the target's whole one)"
        )
    if not w.config.layers.qk_norm or w.config.layers.attention_bias:
        raise DrafterError("z-lab's DFlash layers are Qwen3 layers (q/k norms, no q/k/v biases)")
    pure = nnx.to_pure_dict(w.params)
    tensors = {
        k: np.asarray(jnp.asarray(v, dtype) if dtype is not None else v)
        for k, v in _zlab_tensors(w.config, pure).items()
    }
    return checkpoint.write(out_dir, zlab_config(w.config), tensors)
