"""Write a specjax model as an HF checkpoint directory (config.json, model.safetensors,
tokenizer), e.g. a draft model for HF's assisted generation or a truncated test model."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from specjax.models.loading import Model, build_model
from specjax.models.loading.mapping import params_to_hf
from specjax.models.loading.safetensors_io import save_file


def save_hf(model: Model, out_dir: str, dtype: str | None = None) -> str:
    """Write `model` (its tensors as `dtype`, default float32) with its tokenizer, if any."""
    os.makedirs(out_dir, exist_ok=True)
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(model.params))
    dt = np.dtype(jax.numpy.dtype(dtype or "float32"))
    config = {**model.config.to_hf(), "torch_dtype": str(dt)}
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    tensors = {k: v.astype(dt) for k, v in params_to_hf(model.config, pure).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(out_dir)
    return out_dir


def truncate_layers(model: Model, num_layers: int) -> Model:
    """The first `num_layers` decoder layers of `model`, with its embedding, final norm and head:
    a crude but real draft model (the training issue distils a better one)."""
    cfg = dataclasses.replace(model.config, num_layers=num_layers)
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(model.params))
    pure["layers"] = {i: pure["layers"][i] for i in range(num_layers)}
    graphdef, state = build_model(cfg, pure, model.dtype)
    return Model(cfg, graphdef, state, model.tokenizer, f"{model.name}-first{num_layers}", model.source)
