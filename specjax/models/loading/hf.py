"""Load HF checkpoints: a directory with `config.json` and (sharded) safetensors, or a hub id
that resolves through the local HF cache (no network is used)."""

from __future__ import annotations

import json
import os

import numpy as np

from specjax.errors import ModelLoadError
from specjax.models.config import LlamaConfig
from specjax.models.loading.mapping import params_from_hf
from specjax.models.loading.safetensors_io import SafetensorsFile


def resolve_hf_dir(path: str) -> str:
    """A local directory as is; otherwise a hub id looked up in the local HF cache only."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ModelLoadError(f"{path}: not a model (expected a .gguf file or an HF checkpoint directory)")
    if path.count("/") != 1 or path.startswith((".", "/")):
        raise ModelLoadError(f"model not found: {path}")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:
        raise ModelLoadError(
            f"model not found: {path} is neither a local path nor in the local HF cache "
            "(specjax never downloads; put the checkpoint on disk and pass its path)"
        ) from None


def read_config(model_dir: str) -> LlamaConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{model_dir}: no config.json (not an HF checkpoint directory)")
    try:
        with open(path) as fh:
            hf = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable config ({e})") from None
    return LlamaConfig.from_hf(hf)


def open_tensors(model_dir: str):
    """`get(name) -> np.ndarray` over a single or sharded safetensors checkpoint."""
    return open_checkpoint(model_dir)[0]


def open_checkpoint(model_dir: str):
    """(`get(name) -> np.ndarray`, the set of tensor names) of a single or sharded checkpoint."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid index ({e})") from None
        files = {f: SafetensorsFile(os.path.join(model_dir, f)) for f in sorted(set(weight_map.values()))}
        return (lambda name: files[weight_map[name]].get(name)), set(weight_map)
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return f.get, set(f.names())
    bins = _torch_bin_files(model_dir)
    if bins:  # torch's pickle format, read without torch (torch_bin.py)
        from specjax.models.loading.torch_bin import load

        tensors = {}
        for b in bins:
            tensors.update(load(b))
        return tensors.__getitem__, set(tensors)
    raise ModelLoadError(f"{model_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _torch_bin_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: invalid index ({e})") from None
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, "pytorch_model.bin")
    return [single] if os.path.isfile(single) else []


def load_hf(model_dir: str, on_tensor=None) -> tuple[LlamaConfig, dict]:
    cfg = read_config(model_dir)
    get = open_tensors(model_dir)
    return cfg, params_from_hf(cfg, get, np.float32, on_tensor)
