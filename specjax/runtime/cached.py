"""`get_engine`: one `Engine` (and its compiled code) per model and device mesh in this process,
shared by `specjax.generate`, batch jobs and their cost measurements."""

from __future__ import annotations

from specjax.models.loading import Model
from specjax.runtime.engine import Engine

_ENGINES: dict[tuple, tuple[Model, Engine]] = {}


def get_engine(model: Model, mesh=None) -> Engine:
    """One engine (and its compiled code) per model and device mesh."""
    key = (id(model), mesh)
    hit = _ENGINES.get(key)
    if hit is None or hit[0] is not model:
        hit = (model, Engine(model, mesh=mesh))
        _ENGINES[key] = hit
    return hit[1]
