"""MTP layers that ship inside target checkpoints, read into `mtp.MTPWeights` (`load_from_checkpoint`).

Three layouts, each an `MTPModule` per layer (norms of the token embedding and of the previous
hidden, a [2D] -> [D] projection, one decoder layer, an output norm; the target's embedding and
LM head):

* `deepseek` (DeepSeek-V3, GLM-4.5): `model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm}`
  plus the decoder layer under the same prefix; `eh_proj` reads [embed ; hidden]; the next depth
  reads the layer's output before `shared_head.norm`. Config: `num_nextn_predict_layers`.
* `qwen3_next` (Qwen3-Next, Qwen3.5): `mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}`
  shared by `mtp.layers.{i}`; `fc` reads [embed ; hidden]; the next depth reads the normed output.
  Config: `mtp_num_hidden_layers`.
* `mimo` (Xiaomi MiMo): `model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm}` + the layer; `input_proj` reads [hidden ; embed]; normed output fed on.

As vLLM does, draft k runs layer (k - 1) mod n, so a checkpoint with one MTP layer drafts any
number of tokens (`MAX_DRAFTS`). The decoder layers must be of a kind specjax has (dense
attention + SwiGLU, the target's own kind); MoE or MLA layers and an LM head or embedding that
is not the target's are one-line errors.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from specjax.drafters import checkpoint
from specjax.drafters.mtp import MTP, MTPConfig, MTPWeights
from specjax.errors import DrafterError, ModelLoadError
from specjax.models.config import LlamaConfig
from specjax.models.loading import _flatten
from specjax.models.loading.mapping import checked_getter, layer_from_hf

MAX_DRAFTS = 8
# Tensor-name fragments of layer kinds specjax does not have, with what to call them.
FOREIGN = {
    ".experts.": "mixture-of-experts",
    ".mlp.gate.weight": "mixture-of-experts",
    "kv_a_proj_with_mqa": "multi-head latent attention (MLA)",
    "linear_attn": "linear attention",
}


def _layout(names: set[str], cfg_raw: dict, num_layers: int) -> tuple[str, int] | None:
    """(layout, number of MTP layers) of a target checkpoint's tensors, or None."""
    if any(n.startswith("mtp.") for n in names):
        idx = {int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")}
        return "qwen3_next", len(idx)
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo", len({int(n.split(".")[2]) for n in names if n.startswith("model.mtp_layers.")})
    n = int(cfg_raw.get("num_nextn_predict_layers") or 0)
    if n and any(x.startswith(f"model.layers.{num_layers}.") for x in names):
        return "deepseek", n
    return None


def checkpoint_dir(target) -> str | None:
    """The HF directory a loaded target came from (None for GGUF files)."""
    from specjax.models.loading.hf import resolve_hf_dir

    src = target.source
    if src.endswith(".gguf") or os.path.isfile(src):
        return None
    try:
        return resolve_hf_dir(src)
    except ModelLoadError:
        return None


# Per layout: the tensor names of a module's norms and projection, one shared set (Qwen3-Next)
# or relative to each module's prefix (DeepSeek-V3, MiMo).
_SHARED_NAMES = {
    "qwen3_next": {
        "enorm": "mtp.pre_fc_norm_embedding.weight",
        "hnorm": "mtp.pre_fc_norm_hidden.weight",
        "proj": "mtp.fc.weight",
        "norm": "mtp.norm.weight",
    }
}
_OWN_NAMES = {
    "deepseek": {
        "enorm": "enorm.weight",
        "hnorm": "hnorm.weight",
        "proj": "eh_proj.weight",
        "norm": "shared_head.norm.weight",
    },
    "mimo": {
        "enorm": "token_layernorm.weight",
        "hnorm": "hidden_layernorm.weight",
        "proj": "input_proj.weight",
        "norm": "final_layernorm.weight",
    },
}


def _open_index(path: str | None):
    """(tensor getter, tensor names, config dict) of the HF checkpoint at `path`, or None when it
    is not a readable HF checkpoint (e.g. a specjax drafter directory)."""
    from specjax.models.loading.hf import open_checkpoint

    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        get, names = open_checkpoint(path)
        with open(os.path.join(path, "config.json")) as fh:
            raw = json.load(fh)
    except (ModelLoadError, OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "drafter" in raw:
        return None
    return get, names, raw.get("text_config", raw)


def _mtp_config(tc: LlamaConfig, layout: str, n: int) -> MTPConfig:
    """`n` MTP modules shaped like the target's layers, wired as `layout` wires them."""
    return MTPConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        target_vocab_size=tc.vocab_size,
        target_num_layers=0,
        num_modules=n,
        rope_theta=tc.rope_theta,
        rope_scaling=tc.rope_scaling,
        rms_norm_eps=tc.rms_norm_eps,
        attention_bias=tc.attention_bias,
        qk_norm=tc.qk_norm,
        hidden_first=layout == "mimo",
        norm_feedback=layout != "deepseek",
        max_drafts=MAX_DRAFTS,
    )


def _read_modules(cfg: MTPConfig, fetch, names, prefixes: list[str], layout: str, target, source: str) -> dict:
    """Module i's arrays read under `prefixes[i]`. DeepSeek checkpoints may store copies of the
    target's embedding and head in every module: they must equal the target's."""
    d, v = cfg.hidden_size, cfg.target_vocab_size
    tables = {}
    if layout == "deepseek":
        full = {
            "shared_head.head.weight": target.module().head_weight(),
            "embed_tokens.weight": target.params["embed"][...],
        }
        tables = {k: np.asarray(t, np.float32) for k, t in full.items() if any(p + k in names for p in prefixes)}
    shared, own = _SHARED_NAMES.get(layout), _OWN_NAMES.get(layout)
    modules = {}
    for i, p in enumerate(prefixes):
        names_i = {k: (shared[k] if shared else p + own[k]) for k in ("enorm", "hnorm", "proj", "norm")}
        modules[i] = {
            "enorm": {"scale": fetch(names_i["enorm"], (d,))},
            "hnorm": {"scale": fetch(names_i["hnorm"], (d,))},
            "proj": fetch(names_i["proj"], (d, 2 * d)),
            "norm": {"scale": fetch(names_i["norm"], (d,))},
            "block": layer_from_hf(cfg.layer_config(), fetch, p),
        }
        for name, table in tables.items():  # copies of the target's tables, if stored: must be them
            if p + name in names and not np.allclose(fetch(p + name, (v, d)), table, atol=1e-6):
                raise DrafterError(
                    f"{source}: {p}{name} is not the target's; specjax's MTP reads the target's embedding and LM head"
                )
    return modules


def load_from_checkpoint(path: str | None, target, dtype=jnp.float32) -> MTPWeights | None:
    """The MTP layers of the target checkpoint at `path` (whose trunk `target` is), or None when
    `path` is not a readable HF checkpoint carrying some (e.g. a specjax MTP drafter directory).
    The checkpoint's tensor index is opened once, for both questions."""
    opened = _open_index(path)
    if opened is None:
        return None
    get, names, raw = opened
    tc: LlamaConfig = target.config
    found = _layout(names, raw, tc.num_layers)
    if found is None:
        return None
    source = f"MTP layers of {path}"
    layout, n = found
    prefixes = {
        "deepseek": [f"model.layers.{tc.num_layers + i}." for i in range(n)],
        "qwen3_next": [f"mtp.layers.{i}." for i in range(n)],
        "mimo": [f"model.mtp_layers.{i}." for i in range(n)],
    }[layout]
    mtp_names = [
        x for x in names if x.startswith(("mtp.", "model.mtp_layers.")) or any(x.startswith(p) for p in prefixes)
    ]
    for frag, what in FOREIGN.items():
        if any(frag in x for x in mtp_names):
            raise DrafterError(
                f"{source}: {what} MTP layers are not supported (specjax runs dense attention + SwiGLU layers)"
            )
    cfg = _mtp_config(tc, layout, n)
    try:
        modules = _read_modules(cfg, checked_getter(get), names, prefixes, layout, target, source)
    except ModelLoadError as e:
        raise DrafterError(f"{source}: {e}") from None
    arrays = {f"heads/{k}": a for k, a in _flatten(modules)}
    graphdef, params = checkpoint.fill(lambda: _build(cfg, dtype), arrays, source, dtype)
    return MTPWeights(cfg, graphdef, params, path)


def _build(cfg: MTPConfig, dtype):
    from flax import nnx

    return MTP(cfg, rngs=nnx.Rngs(0), dtype=dtype)
