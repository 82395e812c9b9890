"""The platform code is traced for: the default backend, or the one an export lowers for.

Code that picks a layout or a kernel by platform (`linear`'s few-row path on CPU, the rejection
kernel's backend, EAGLE-3's CPU gate, the default dtype) asks `target_platform()`, never
`jax.default_backend()` directly, so that lowering for TPU or GPU on a CPU host
(`specjax lower`, specjax/bench/lower.py) traces what that device would run.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_LOWERING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("lowering_for", default=None)


def target_platform() -> str:
    """ "cpu" | "gpu" | "tpu": the platform set by `lowering_for`, else `jax.default_backend()`."""
    return _LOWERING_FOR.get() or jax.default_backend()


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace for `platform` ("tpu", "cuda"/"gpu", "rocm", "cpu") inside the block. Functions must be
    jitted afresh inside it: a trace made before is cached under the host's platform."""
    token = _LOWERING_FOR.set({"cuda": "gpu", "rocm": "gpu"}.get(platform, platform))
    try:
        yield
    finally:
        _LOWERING_FOR.reset(token)
