"""`get_drafter`: `make_drafter`'s drafters, built once per target, spec, K and tree shape in this
process, so repeated calls (generate, batch jobs, bench) reuse their loaded draft models and
compiled code."""

from __future__ import annotations

from specjax.drafters import make_drafter
from specjax.drafters.base import Drafter
from specjax.models.loading import Model, get_model

_DRAFTERS: dict[tuple, tuple[Model, Drafter]] = {}


def get_drafter(spec: str | None, num_draft: int, target: Model, tree_topk: int = 1, tree_depth: int = 0) -> Drafter:
    """`make_drafter`'s drafters, cached with their loaded draft models, so repeated calls reuse
    compiled code."""
    key = (id(target), spec, num_draft, tree_topk, tree_depth)
    hit = _DRAFTERS.get(key)
    if hit is None or hit[0] is not target:
        hit = (
            target,
            make_drafter(
                spec, num_draft, target, load=lambda p, dt: get_model(p, dt), tree_topk=tree_topk, tree_depth=tree_depth
            ),
        )
        _DRAFTERS[key] = hit
    return hit[1]
