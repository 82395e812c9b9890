"""Training recipes: YAML files in `configs/` plus `key=value` overrides on the command line.

A recipe has four sections, each checked against a dataclass so that a typo or a missing key is
one clear line (exit code 2) instead of a traceback deep inside training:

    drafter: eagle3            # which task
    target: null               # model path; null = the embedded default model
    out_dir: runs/eagle3
    data:   {source, num_prompts, eval_prompts, max_prompt_tokens, max_new_tokens, seq_len, ...}
    model:  drafter-specific settings (e.g. draft_vocab_size, ttt_steps)
    optim:  train.loop.OptimConfig fields

Overrides use dotted keys and YAML values: `optim.steps=200 data.source=dataset`.
"""

from __future__ import annotations

import dataclasses
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


REQUIRED_TOP = ("drafter", "out_dir", "data", "model", "optim")


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
        if want in (int, float) and not isinstance(v, (int, float)) or want is int and isinstance(v, float):
            raise RecipeError(f"{name}.{k} must be {want.__name__}, got {v!r}")
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
        _set_dotted(raw, key.strip(), yaml.safe_load(value))
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
    return Recipe(
        drafter=str(raw["drafter"]), out_dir=str(raw["out_dir"]), data=data, model=dict(raw["model"]),
        optim=_section(OptimConfig, raw["optim"], "optim"), target=raw.get("target"),
        export_dtype=str(raw.get("export_dtype", "bfloat16")),
    )
