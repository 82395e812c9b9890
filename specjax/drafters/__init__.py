"""Drafters: one proposer per method behind the protocol in `base.py`.

`make_drafter(spec, num_draft, target)` turns a CLI/API drafter spec into a drafter:
`none` | `ngram` | `draft[:PATH]` | `mtp[:PATH]` | `eagle3[:PATH][@GATE]` (PATH: a specjax, an
EAGLE/SpecForge or a `speculators` directory, see eagle3_formats.py) | `dflash[:PATH]` (a specjax
or a z-lab directory, dflash_formats.py; K defaults to its block size - 1) | `dspark[:PATH]` (a
specjax or a `speculators` directory, dspark.py; K defaults to its block size). A bare learned-drafter
name means the one shipped for the default model (`shipped/<name>-smollm2-135m/`, see
`shipped_path`); a bare `mtp` on a target whose checkpoint carries MTP layers (DeepSeek-V3,
Qwen3-Next, MiMo layouts: mtp_formats.py) means those. specjax's own MTP drafts at most one token
per trained module; its K defaults to the module count.
EAGLE-3's GATE is its confidence gate (`Eagle3Drafter`): `eagle3@0` verifies every step; the
default is `eagle3.default_min_confidence()` (on CPU only).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from specjax.drafters.base import Drafter, NoDrafter
from specjax.errors import DrafterError, ModelLoadError

MAX_NUM_DRAFT = 64  # a verify pass of K + 1 positions; past this the pass costs more than it saves
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "shipped")
SHIPPED_FOR = "smollm2-135m"


def shipped_path(kind: str) -> str:
    """Directory of the drafter of this kind trained for the default model (may not exist)."""
    return os.path.join(SHIPPED_DIR, f"{kind}-{SHIPPED_FOR}")


def _shipped_or_error(kind: str) -> str:
    path = shipped_path(kind)
    if not os.path.isdir(path):
        raise DrafterError(
            f"no {kind} drafter is shipped in this installation ({path}); "
            f"train one with `specjax train {kind}` and pass --drafter {kind}:PATH"
        )
    return path


def split_spec(spec: str) -> tuple[str, str]:
    """`kind[:ARG]` -> (kind, ARG); `eagle3@0.5` is read as `eagle3:@0.5` (a gated EAGLE-3)."""
    kind, _, arg = spec.strip().partition(":")
    if "@" in kind:
        kind, _, gate = kind.partition("@")
        arg = f"{arg}@{gate}"
    return kind, arg


def _gate_suffix(arg: str, spec: str) -> tuple[str, float | None]:
    """`PATH@G` / `@G`: the confidence gate G in [0, 1] (0 = verify every step), else None."""
    path, at, gate = arg.rpartition("@")
    if not at:
        return arg, None
    try:
        g = float(gate)
    except ValueError:
        raise DrafterError(f"{spec!r}: the gate after '@' must be a number in [0, 1], got {gate!r}") from None
    if not 0.0 <= g <= 1.0:
        raise DrafterError(f"{spec!r}: the gate after '@' must be in [0, 1], got {g}")
    return path, g


def make_drafter(
    spec: str | None,
    num_draft: int,
    target,
    dtype: str | None = None,
    load=None,
    tree_topk: int = 1,
    tree_depth: int = 0,
) -> Drafter:
    """`load(path, dtype)` loads a draft model (defaults to `specjax.load_model`). A draft model
    that cannot be loaded raises DrafterError naming the drafter (not ModelLoadError, which would
    read as the target's). `tree_topk` > 1: token trees of `num_draft` nodes over `tree_depth`
    levels (0: the drafter's `default_tree_depth`); shapes it cannot draft are one-line errors."""
    try:
        d = _make_drafter(spec, num_draft, target, dtype, load)
    except ModelLoadError as e:
        msg = str(e)
        if msg.startswith("model not found"):
            msg = "drafter not found" + msg[len("model not found") :]
        raise DrafterError(f"--drafter {(spec or '').strip()}: {msg}") from None
    d = d.with_tree(tree_topk, tree_depth or d.default_tree_depth())
    d.check_shape()
    return d


def _make_drafter(spec: str | None, num_draft: int, target, dtype: str | None, load) -> Drafter:
    spec = (spec or "none").strip()
    name, arg = split_spec(spec)
    if not 0 <= num_draft <= MAX_NUM_DRAFT:
        raise DrafterError(f"num_draft (--num-draft) must be in [0, {MAX_NUM_DRAFT}], got {num_draft}")
    kind = KINDS.get(name)
    if kind is None:
        raise DrafterError(f"unknown drafter {spec!r} (known: {', '.join(KNOWN)})")
    if not kind.takes_arg and arg:
        raise DrafterError(f"the {name} drafter takes no argument, got {spec!r}")
    return kind.build(spec, arg, num_draft or kind.default_num_draft, target, dtype, load)


def _none(spec, arg, num_draft, target, dtype, load) -> Drafter:
    if num_draft:
        raise DrafterError("num_draft > 0 needs a drafter (--drafter ngram | draft:PATH)")
    return NoDrafter()


def _ngram(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters.ngram import NgramDrafter

    return NgramDrafter(num_draft)


def _draft(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters import checkpoint, draft_model
    from specjax.models.loading import load_model

    path = arg or _shipped_or_error("draft")
    if draft_model.borrows_target_tables(path):  # distilled: the target's embedding and head
        draft = draft_model.load_with_target_tables(path, target, dtype or str(target.dtype))
    else:
        draft = (load or load_model)(path, dtype or str(target.dtype))
    vocab = checkpoint.load_draft_vocab(path, target.config.vocab_size)  # None for a GGUF file
    return draft_model.DraftModelDrafter(num_draft, draft, target.config, draft_vocab=vocab)


def _mtp(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters import checkpoint, mtp, mtp_formats

    # MTP layers in a target checkpoint, as vLLM reads them
    weights = mtp_formats.load_from_checkpoint(arg or mtp_formats.checkpoint_dir(target), target, target.dtype)
    vocab = None
    if weights is None:
        path = arg or _shipped_or_error("mtp")
        weights = mtp.load(path, dtype=target.dtype)
        vocab = checkpoint.load_draft_vocab(path, target.config.vocab_size)
    return mtp.MTPDrafter(num_draft or weights.config.num_modules, weights, target, draft_vocab=vocab)


def _eagle3(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters import eagle3, eagle3_formats

    arg, gate = _gate_suffix(arg, spec)
    path = arg or _shipped_or_error("eagle3")
    weights = eagle3_formats.load(path, target.dtype, target.config.num_layers)
    gate = eagle3.default_min_confidence() if gate is None else gate
    return eagle3.Eagle3Drafter(num_draft, weights, target, min_confidence=gate)


def _dflash(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters import dflash, dflash_formats

    weights = dflash_formats.load(arg or _shipped_or_error("dflash"), target.dtype)
    return dflash.DFlashDrafter(num_draft or weights.config.max_num_draft, weights, target)


def _dspark(spec, arg, num_draft, target, dtype, load) -> Drafter:
    from specjax.drafters import dspark, dspark_formats

    weights = dspark_formats.load(arg or _shipped_or_error("dspark"), target.dtype)
    return dspark.DSparkDrafter(num_draft or weights.config.max_num_draft, weights, target)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What specjax knows of one drafter kind before importing it: every name-keyed site (the
    factory, CLI help, bench name checks, training, export) reads this table. Adding a drafter =
    its module, a builder here and one `Kind` row (+ a training task)."""

    name: str  # as a spec names it
    usage: str  # "eagle3[:PATH][@GATE]"
    build: Callable  # (spec, arg, K, target, dtype, load) -> Drafter
    default_num_draft: int = 0  # K when --num-draft is 0 (0: the drafter decides, e.g. MTP's module count)
    takes_arg: bool = True
    train_task: str | None = None  # "module:Class" of its `specjax train` task
    export_formats: tuple[str, ...] = ()  # `specjax export --format` values

    def task_class(self):
        """The training task class (imported on use)."""
        import importlib

        module, _, cls = self.train_task.partition(":")
        return getattr(importlib.import_module(module), cls)


# n-gram: up to 15 drafts, of which it asks to verify all only behind a match of 5+ tokens, else 3
# (NgramDrafter.verify_lengths; docs/performance.md, "Verify as many drafts as the match supports").
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("none", "none", _none, takes_arg=False),
        Kind("ngram", "ngram", _ngram, 15, takes_arg=False),
        Kind(
            "draft", "draft[:PATH]", _draft, 5, train_task="train.draft_model:DraftDistillTask", export_formats=("hf",)
        ),
        Kind("mtp", "mtp[:PATH]", _mtp, 0, train_task="train.mtp:MTPTask"),
        Kind(
            "eagle3",
            "eagle3[:PATH][@GATE]",
            _eagle3,
            5,
            train_task="train.eagle3:Eagle3Task",
            export_formats=("eagle", "speculators"),
        ),
        Kind("dflash", "dflash[:PATH]", _dflash, 0, train_task="train.dflash:DFlashTask", export_formats=("zlab",)),
        Kind(
            "dspark",
            "dspark[:PATH]",
            _dspark,
            0,
            train_task="train.dspark:DSparkTask",
            export_formats=("speculators", "specforge"),
        ),
    )
}
KNOWN = tuple(k.usage for k in KINDS.values())
DEFAULT_NUM_DRAFT = {k.name: k.default_num_draft for k in KINDS.values() if k.default_num_draft}
TRAINABLE = tuple(k.name for k in KINDS.values() if k.train_task)
