"""Minimal safetensors reader/writer over numpy memmaps.

Written here rather than taken from the `safetensors` package so that bf16 works without torch
(via `ml_dtypes`) and so that a truncated or corrupt file is reported as one clear
:class:`ModelLoadError` naming the file, before any tensor is touched.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from specjax.errors import ModelLoadError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one `.safetensors` file: `names()`, `get(name) -> np.ndarray`."""

    def __init__(self, path: str):
        self.path = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    raise ValueError("header length exceeds file size")
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"{self.path}: not a valid safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self._start = 8 + n
        self._entries = header
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._start + end > size:
            raise ModelLoadError(
                f"{self.path}: truncated safetensors file ({size} bytes, header needs {self._start + end})"
            )
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else None

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        e = self._entries[name]  # KeyError when absent, as the mapping expects
        if e["dtype"] not in DTYPES:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']}")
        lo, hi = e["data_offsets"]
        raw = self._mm[self._start + lo : self._start + hi]
        return raw.view(DTYPES[e["dtype"]]).reshape(e["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` as a safetensors file, atomically (temp file + rename)."""
    header, offset, arrays = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a).reshape(np.shape(a))  # ascontiguousarray turns 0-d into 1-d
        nbytes = a.nbytes
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        arrays.append(a)
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for a in arrays:
            fh.write(a.tobytes())
    os.replace(tmp, path)
