"""Measurement helpers shared by the benchmarks."""

from __future__ import annotations

import re
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def copy_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memory copy bandwidth, counting bytes read + written (GB/s), median of repeats."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def device_copy_bandwidth_gbs(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Memory bandwidth of the default JAX device (HBM on an accelerator), bytes read + written.

    `x + 1` over a u8 buffer is the simplest kernel XLA cannot elide and that streams every byte
    once in and once out; several passes per timed call (a compiled loop) hide launch overhead.
    """
    passes = 4
    x = jnp.zeros((max(1, nbytes >> 12), 4096), jnp.uint8)  # [N / 4096, 4096]: no 2^31-element axis
    nbytes = x.size

    @jax.jit
    def run(x):
        return jax.lax.fori_loop(0, passes, lambda i, y: y + jnp.uint8(1), x)

    jax.block_until_ready(run(x))  # compile
    secs = timed(lambda: jax.block_until_ready(run(x)), repeats)
    return 2 * nbytes * passes / secs / 1e9


def _rss_hwm_kb() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", fh.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None


class PeakMemory:
    """Peak memory of one configuration, from the best source the platform offers.

    * a device that reports `peak_bytes_in_use` (GPU, TPU): that figure. XLA cannot reset it, so
      it is the high-water mark of the process so far (source `device_peak_lifetime`);
    * Linux CPU: the kernel's resident-set high-water mark, reset before each configuration by
      writing 5 to /proc/self/clear_refs, so the reading is that configuration's own peak
      (weights and everything else resident included; source `rss_peak`);
    * elsewhere: the process's lifetime peak RSS (source `rss_peak_lifetime`).
    """

    def __init__(self):
        stats = jax.devices()[0].memory_stats() or {}
        self.device = "peak_bytes_in_use" in stats

    def reset(self) -> None:
        if self.device:
            return
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def read(self) -> tuple[float, str]:
        """(MiB, source)."""
        if self.device:
            return jax.devices()[0].memory_stats()["peak_bytes_in_use"] / 2**20, "device_peak_lifetime"
        kb = _rss_hwm_kb()
        if kb is not None:
            return kb / 1024, "rss_peak"
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (kb / 1024 if sys.platform != "darwin" else kb / 2**20), "rss_peak_lifetime"


def peak_memory_mb() -> float:
    """Peak device memory where the backend reports it, else the process's peak RSS."""
    return PeakMemory().read()[0]


def compiled_memory_mb(executables) -> float | None:
    """Largest XLA-planned footprint (arguments + outputs + temporaries, minus donated aliases)
    among compiled executables: a per-configuration figure that a lifetime device peak is not."""
    best = None
    for exe in executables:
        try:
            m = exe.memory_analysis()
        except Exception:  # backends without memory analysis
            continue
        if m is None:
            continue
        peak = getattr(m, "peak_memory_in_bytes", 0) or (
            m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        )
        best = max(best or 0.0, peak / 2**20)
    return best


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
