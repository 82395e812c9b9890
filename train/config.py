"""Training recipes: YAML files in `configs/` plus `key=value` overrides on the command line.

A recipe has four sections, each checked against a dataclass so that a typo or a missing key is
one clear line (exit code 2) instead of a traceback deep inside training:

    drafter: eagle3            # which task
    target: null               # model path; null = the embedded default model
    out_dir: runs/eagle3
    data:   {source, num_prompts, eval_prompts, max_prompt_tokens, max_new_tokens, seq_len, ...}
    model:  drafter-specific settings (e.g. draft_vocab_size, ttt_steps)
    optim:  train.loop.OptimConfig fields

Overrides use dotted keys and YAML values: `optim.steps=200 data.source=dataset`. Every value
is checked for its type and its range (`RANGES`) when the recipe loads, before the target does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from specjax.errors import SpecjaxError
from train.loop import OptimConfig


class RecipeError(SpecjaxError):
    """A training recipe that is missing keys, has unknown keys or wrong values."""


@dataclasses.dataclass
class DataConfig:
    source: str = "regen"  # regen | dataset
    num_prompts: int = 1000
    eval_prompts: int = 32
    max_prompt_tokens: int = 192
    max_new_tokens: int = 192
    seq_len: int = 384
    gen_batch_size: int = 32
    feature_batch_size: int = 8
    seed: int = 0
    # Where regenerated sequences (data/) and target feature stores (features/) live; "" means
    # out_dir. Recipes with the same data settings can point at one directory and share the
    # expensive regeneration and target prefill: a store keeping layers (2, 15, 27) also serves
    # MTP and the draft model, which read only the final hidden state.
    cache_dir: str = ""
    # The corpus of the target's regenerated replies (train/replies.py), keyed by prompt and only
    # added to; "" means cache_dir/replies. The shipped recipes keep theirs in the repository.
    replies_dir: str = ""


REQUIRED_TOP = ("drafter", "out_dir", "data", "model", "optim")
EXPORT_DTYPES = ("bfloat16", "float32")

# Allowed range of each numeric recipe value: (low, high, low excluded). A value outside it is
# one line (exit code 2) before the target loads, not a failure (or a silent no-op) later.
SEED_RANGE = (0, 2**32 - 1, False)
RANGES = {
    "data": {
        "num_prompts": (1, None, False),
        "eval_prompts": (1, None, False),
        "max_prompt_tokens": (1, None, False),
        "max_new_tokens": (1, None, False),
        "seq_len": (2, None, False),
        "gen_batch_size": (1, None, False),
        "feature_batch_size": (1, None, False),
        "seed": SEED_RANGE,
    },
    "optim": {
        "steps": (1, None, False),
        "batch_size": (1, None, False),
        "lr": (0, None, True),
        "warmup_steps": (0, None, False),
        "end_lr_fraction": (0, 1, False),
        "clip": (0, None, True),
        "weight_decay": (0, None, False),
        "checkpoint_every": (1, None, False),
        "eval_every": (0, None, False),
        "max_to_keep": (1, None, False),
        "seed": SEED_RANGE,
    },
}


def _check_range(name: str, value, rng) -> None:
    lo, hi, lo_open = rng
    if value != value or value in (float("inf"), float("-inf")):
        raise RecipeError(f"{name} must be a finite number, got {value!r}")
    if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
        want = f"> {lo}" if lo_open and hi is None else f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RecipeError(f"{name} must be {want}, got {value!r}")


@dataclasses.dataclass
class Recipe:
    drafter: str
    out_dir: str
    data: DataConfig
    model: dict[str, Any]
    optim: OptimConfig
    target: str | None = None
    export_dtype: str = "bfloat16"

    @property
    def cache_dir(self) -> str:
        return self.data.cache_dir or self.out_dir

    @property
    def replies_dir(self) -> str:
        return self.data.replies_dir or os.path.join(self.cache_dir, "replies")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _set_dotted(d: dict, key: str, value) -> None:
    node = d
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise RecipeError(f"override {key!r}: {p!r} is not a section")
    node[leaf] = value


def _section(cls, raw, name: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe section {name!r} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise RecipeError(f"unknown key {name}.{unknown[0]} in the recipe (known: {', '.join(fields)})")
    kw = {}
    for k, v in raw.items():
        want = type(fields[k].default) if fields[k].default is not dataclasses.MISSING else None
        if (
            want in (int, float)
            and (not isinstance(v, (int, float)) or isinstance(v, bool))
            or (want is int and isinstance(v, float))
        ):
            raise RecipeError(f"{name}.{k} must be {want.__name__}, got {v!r}")
        if want is str and not isinstance(v, str):
            raise RecipeError(f"{name}.{k} must be a string, got {v!r}")
        if k in RANGES.get(name, {}):
            _check_range(f"{name}.{k}", v, RANGES[name][k])
        kw[k] = float(v) if want is float else v
    return cls(**kw)


def load_recipe(path: str | None, overrides: list[str] = ()) -> Recipe:
    raw: dict = {}
    if path:
        try:
            with open(path) as fh:
                raw = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise RecipeError(f"recipe not found: {path}") from None
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: a recipe is a YAML mapping")
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise RecipeError(f"override {item!r} is not key=value")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise RecipeError(f"override {item!r}: not a YAML value ({str(e).splitlines()[0]})") from None
        _set_dotted(raw, key.strip(), parsed)
    for key in REQUIRED_TOP:
        if key not in raw:
            raise RecipeError(f"the recipe is missing the key {key!r}")
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(Recipe)})
    if unknown:
        raise RecipeError(f"unknown key {unknown[0]!r} in the recipe")
    data = _section(DataConfig, raw["data"], "data")
    if data.source not in ("regen", "dataset"):
        raise RecipeError(f"data.source must be 'regen' or 'dataset', got {data.source!r}")
    if not isinstance(raw["model"], dict):
        raise RecipeError("recipe section 'model' must be a mapping")
    optim = _section(OptimConfig, raw["optim"], "optim")
    if data.seq_len <= data.max_prompt_tokens:
        raise RecipeError(
            f"data.seq_len ({data.seq_len}) must exceed data.max_prompt_tokens "
            f"({data.max_prompt_tokens}): a sequence needs room for its reply"
        )
    export_dtype = raw.get("export_dtype", "bfloat16")
    if export_dtype not in EXPORT_DTYPES:
        raise RecipeError(f"export_dtype must be one of {', '.join(EXPORT_DTYPES)}, got {export_dtype!r}")
    for key in ("drafter", "out_dir"):
        if not isinstance(raw[key], str) or not raw[key]:
            raise RecipeError(f"{key} must be a non-empty string, got {raw[key]!r}")
    if raw.get("target") is not None and not isinstance(raw["target"], str):
        raise RecipeError(f"target must be a model path or null, got {raw['target']!r}")
    return Recipe(
        drafter=raw["drafter"],
        out_dir=raw["out_dir"],
        data=data,
        model=dict(raw["model"]),
        optim=optim,
        target=raw.get("target"),
        export_dtype=export_dtype,
    )
