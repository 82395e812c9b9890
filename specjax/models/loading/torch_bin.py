"""Read `pytorch_model.bin` checkpoints (torch's zip + pickle format) without torch.

Many published checkpoints (SafeAILab's EAGLE-3 heads among them) ship only this format. The
pickle is read with an allow-list of globals (tensor rebuilds, storage types, OrderedDict), so a
file cannot run code; anything else is a one-line ModelLoadError. Tensors come back as numpy
arrays with their torch dtype (bf16 via ml_dtypes).
"""

from __future__ import annotations

import collections
import pickle
import zipfile

import ml_dtypes
import numpy as np

from specjax.errors import ModelLoadError

STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name: str):
        self.dtype = np.dtype(STORAGE_DTYPES[name])


def _rebuild_tensor(storage, offset, size, stride, *_):
    """A tensor view of `storage` (a flat array) -> an owned numpy array of shape `size`."""
    if not size:
        return storage[offset : offset + 1].reshape(()).copy()
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size), strides=[s * item for s in stride])
    return np.ascontiguousarray(view)


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(fh)
        self.archive, self.prefix, self.path = archive, prefix, path

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *_: data
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise ModelLoadError(
            f"{self.path}: holds {module}.{name}, which a weights file has no need of "
            "(refused: unpickling it could run code)"
        )

    def persistent_load(self, pid):
        kind, stype, key, _location, numel = pid
        if kind != "storage" or not isinstance(stype, _StorageType):
            raise ModelLoadError(f"{self.path}: unexpected storage record {kind!r}")
        raw = self.archive.read(f"{self.prefix}/data/{key}")
        return np.frombuffer(raw, dtype=stype.dtype, count=numel)


def load(path: str) -> dict[str, np.ndarray]:
    """`{name: array}` of a torch-saved state dict."""
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
            if pkl is None:
                raise ModelLoadError(f"{path}: not a torch zip checkpoint (no data.pkl)")
            with archive.open(pkl) as fh:
                state = _Unpickler(fh, archive, pkl[: -len("/data.pkl")], path).load()
    except (zipfile.BadZipFile, OSError, pickle.UnpicklingError, EOFError, KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable torch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise ModelLoadError(f"{path}: not a state dict of tensors")
    return dict(state)
