"""Drafters: one proposer per method behind the protocol in `base.py`.

`make_drafter(spec, num_draft, target)` turns a CLI/API drafter spec into a drafter:
`none` | `ngram` | `draft:PATH`.
"""

from __future__ import annotations

from specjax.drafters.base import Drafter, NoDrafter
from specjax.errors import DrafterError

DEFAULT_NUM_DRAFT = {"ngram": 5, "draft": 5}
KNOWN = ("none", "ngram", "draft:PATH")


def make_drafter(spec: str | None, num_draft: int, target, dtype: str | None = None, load=None) -> Drafter:
    """`load(path, dtype)` loads a draft model (defaults to `specjax.load_model`)."""
    spec = (spec or "none").strip()
    kind, _, arg = spec.partition(":")
    if num_draft < 0:
        raise DrafterError(f"num_draft must be >= 0, got {num_draft}")
    if kind == "none":
        if num_draft:
            raise DrafterError("num_draft > 0 needs a drafter (--drafter ngram | draft:PATH)")
        return NoDrafter()
    k = num_draft or DEFAULT_NUM_DRAFT.get(kind, 5)
    if kind == "ngram":
        from specjax.drafters.ngram import NgramDrafter

        return NgramDrafter(k)
    if kind == "draft":
        if not arg:
            raise DrafterError("the draft drafter needs a model path: --drafter draft:PATH")
        from specjax.drafters.draft_model import DraftModelDrafter
        from specjax.models.loading import load_model

        draft = (load or load_model)(arg, dtype or str(target.dtype))
        return DraftModelDrafter(k, draft, target.config)
    raise DrafterError(f"unknown drafter {spec!r} (known: {', '.join(KNOWN)})")
