"""Drafter checkpoints: a directory with `config.json` and `model.safetensors`.

The config holds `"drafter": KIND` plus the drafter's own settings; the safetensors file holds
the drafter network's params under their NNX paths (`heads/0/proj`, ...) and any extra tensors
(e.g. a vocabulary map). Reading checks everything against the config before any array is
used, so a wrong, truncated or foreign checkpoint is one clear :class:`DrafterError` line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import DrafterError, ModelLoadError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Optional beside a draft model's or MTP's weights: `d2t [N]`, the target ids a drafter may
# propose (its head is restricted to those rows; see base.head_rows).
VOCAB_FILE = "draft_vocab.safetensors"


def save(
    out_dir: str, config: dict, params, extra: dict | None = None, dtype=None, metadata: dict | None = None
) -> str:
    """Write `config` (+ `metadata`) and the params state (cast to `dtype` if given) + `extra`."""
    from specjax.models.loading import _flatten

    tensors = {
        name: np.asarray(jnp.asarray(a, dtype) if dtype is not None else a)
        for name, a in _flatten(nnx.to_pure_dict(params))
    }
    tensors.update({k: np.asarray(v) for k, v in (extra or {}).items()})
    return write(out_dir, {**config, **(metadata or {})}, tensors)


def write(out_dir: str, config: dict, tensors: dict[str, np.ndarray]) -> str:
    """`config.json` + `model.safetensors` in `out_dir` (created): the layout of specjax's own
    drafters and of the published ones it exports."""
    from specjax.models.loading.safetensors_io import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as fh:
        json.dump(config, fh, indent=1)
    return out_dir


def read_config(path: str, kind: str | None, label: str) -> dict:
    """The raw config dict of a `kind` drafter directory (one-line errors otherwise); `kind=None`
    accepts any config object (a published drafter's)."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise DrafterError(f"{label} drafter not found: {path} (expected a directory with {CONFIG_FILE})")
    try:
        with open(cfg_path) as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as e:
        raise DrafterError(f"{cfg_path}: not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"{cfg_path}: a drafter config is a JSON object")
    if kind is not None and raw.get("drafter", kind) != kind:
        raise DrafterError(f"{path} holds a {raw.get('drafter')!r} drafter, not {kind!r}")
    return raw


def read_tensors(path: str, label: str) -> dict[str, np.ndarray]:
    """Every tensor of `path/model.safetensors` by name; one-line DrafterErrors (naming the
    `label` drafter) for a missing or unreadable file."""
    from specjax.models.loading.safetensors_io import SafetensorsFile

    w_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(w_path):
        raise DrafterError(f"{label} weights missing: {w_path}")
    try:
        f = SafetensorsFile(w_path)
        return {name: f.get(name) for name in f.names()}
    except (ModelLoadError, OSError, ValueError) as e:  # the reader's error carries the reason
        raise DrafterError(str(e).splitlines()[0]) from None


def fill(build: Callable[[], nnx.Module], arrays: dict[str, np.ndarray], source: str, dtype) -> tuple[Any, Any]:
    """(graphdef, params) of the module `build()` makes, holding `arrays` (names and shapes
    checked against the module first; the module itself is only traced, never allocated)."""
    from specjax.models.loading import _flatten, _unflatten

    graphdef, state = nnx.split(nnx.eval_shape(build))
    want = {k: tuple(v.shape) for k, v in _flatten(nnx.to_pure_dict(state))}
    if set(want) != set(arrays):
        missing, unexpected = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
        raise DrafterError(
            f"{source}: tensors do not match the config (missing: {missing[:3]}, unexpected: {unexpected[:3]})"
        )
    for name, a in arrays.items():
        if tuple(a.shape) != want[name]:
            raise DrafterError(f"{source}: tensor {name} has shape {tuple(a.shape)}, config expects {want[name]}")
    nnx.replace_by_pure_dict(state, _unflatten((k, jnp.asarray(v, dtype)) for k, v in arrays.items()))
    return graphdef, state


def config_fields(cls, raw: dict, source: str, what: str) -> dict:
    """The dataclass `cls`'s fields from `raw`; a missing required one is named in the error."""
    import dataclasses

    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING:
                raise DrafterError(f"{source}: missing key {f.name!r} in the {what} config")
            continue
        kw[f.name] = raw[f.name]
    return kw


def check_target(pairs, source: str) -> None:
    """`pairs` of (what, drafter's value, target's value): one line naming the first mismatch."""
    for what, mine, theirs in pairs:
        if mine != theirs:
            raise DrafterError(f"{source} was trained for a target with {what} {mine}, but this target has {theirs}")


def save_draft_vocab(out_dir: str, d2t) -> str:
    """Write the draft -> target map `d2t [N]` as `out_dir/draft_vocab.safetensors`; returns its path."""
    from specjax.models.loading.safetensors_io import save_file

    path = os.path.join(out_dir, VOCAB_FILE)
    save_file({"d2t": np.asarray(d2t, np.int32)}, path)
    return path


def load_draft_vocab(path: str, vocab_size: int) -> np.ndarray | None:
    """`d2t [N]` int32 from `path/draft_vocab.safetensors`, or None when the file is absent (the
    drafter then proposes over the whole vocabulary). One-line DrafterErrors for a bad file."""
    from specjax.models.loading.safetensors_io import SafetensorsFile

    v_path = os.path.join(path, VOCAB_FILE)
    if not os.path.isfile(v_path):
        return None
    try:
        d2t = np.asarray(SafetensorsFile(v_path).get("d2t"))
    except (ModelLoadError, OSError, ValueError, KeyError) as e:
        raise DrafterError(f"{v_path}: unreadable draft vocabulary ({str(e).splitlines()[0]})") from None
    ok = (
        d2t.ndim == 1
        and d2t.size > 0
        and np.issubdtype(d2t.dtype, np.integer)
        and d2t.min() >= 0
        and d2t.max() < vocab_size
        and np.all(np.diff(d2t) > 0)
    )
    if not ok:
        raise DrafterError(f"{v_path}: 'd2t' must be ascending unique target token ids below {vocab_size}")
    return d2t.astype(np.int32)
