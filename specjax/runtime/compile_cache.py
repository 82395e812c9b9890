"""Compiled executables, one per (function, static settings, argument shapes): `Engine` and
`SlotEngine` share this cache type, so compile time and post-warm-up compiles are counted once.
`persist` keeps XLA's executables on disk across processes (`serve`, `serve-bench`, `batch`)."""

from __future__ import annotations

import os
import time
from functools import partial

import jax

from specjax.drafters.base import Drafter


class CompileCache:
    """`get` lowers and compiles `fn` on first use for its key; later calls return the executable.

    The key is the function's name, its static keyword settings (a drafter by its `cache_key()`,
    since its settings are compile-time constants) and the shapes and dtypes of its arguments.
    `seconds` totals the time spent compiling; once `warm` is set, `after_warmup` counts the
    compiles that still happen (a server must see none on its hot path)."""

    def __init__(self):
        self.executables: dict = {}
        self.seconds = 0.0
        self.warm = False
        self.after_warmup = 0

    def get(self, name: str, fn, static: dict, donate: tuple, *args):
        """`fn(*args, **static)` compiled with `donate` (argument indices) donated."""
        key = (
            name,
            tuple(sorted((k, v.cache_key() if isinstance(v, Drafter) else v) for k, v in static.items())),
            tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)),
        )
        exe = self.executables.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = jax.jit(partial(fn, **static), donate_argnums=donate).lower(*args).compile()
            self.seconds += time.perf_counter() - t0
            self.after_warmup += self.warm
            self.executables[key] = exe
        return exe

    def __len__(self) -> int:
        return len(self.executables)


def persist(path: str | None) -> None:
    """Keep XLA executables in `path` across processes (`--compile-cache`: None or empty for
    `$SPECJAX_CACHE/xla`, "none" for no disk cache): a server's warm-up compiles a few dozen, and a
    batch job resumed after a kill, or run again, loads what its last run compiled."""
    if path == "none":
        return
    if not path:
        from specjax.models.loading import cache_root

        path = os.path.join(cache_root(), "xla")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
