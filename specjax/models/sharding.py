"""Placing a model on a device mesh: `data` x `model` axes, tensor-parallel weight rules.

A `jax.sharding.Mesh` over this process's local devices with axes `data` x `model`: rows of a
batch are split over `data` (the engine places its per-row inputs with `PartitionSpec("data")`,
jit propagates that through prefill and the decode loop), the params are replicated over `data`
and, when `model` > 1, split over `model` tensor-parallel style: weights that produce heads / MLP
columns / vocabulary logits (`qkv`, `gate_up`, `embed`, `lm_head`, all `[out, in]`) by their
output rows, weights that consume them (`o`, `down`) by their input columns. GSPMD inserts the
collectives, so results are those of one device. The fused `qkv` (`[Q | K | V]`) and `gate_up`
(`[gate | up]`) rows are split in contiguous blocks, which does not align with heads or with the
gate/up halves; the compiler moves the activations that cross blocks. An interleaved per-shard
layout of the fused weights would avoid that traffic.

Batch jobs (`specjax batch --mesh`, specjax/batch/) are the user; `specjax.generate(mesh=...)`
takes a mesh made here.
"""

from __future__ import annotations

from specjax.errors import SpecjaxError

MESH_AXES = ("data", "model")
SPLIT_OUT_ROWS = ("qkv", "gate_up", "embed", "lm_head")  # [out, in]: split `out` over `model`
SPLIT_IN_COLS = ("o", "down")  # [out, in]: split `in` (heads / MLP columns) over `model`


def parse_mesh(spec: str | None, n_local: int) -> dict[str, int]:
    """`"data=2,model=2"` -> {"data": 2, "model": 2}. Missing `data` takes the local devices left
    over by `model`; the default (None) is all local devices on `data`."""
    sizes: dict[str, int] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, eq, val = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or name in sizes:
            raise SpecjaxError(
                f"--mesh takes axis=size pairs over {', '.join(MESH_AXES)} (e.g. data=2,model=2), got {spec!r}"
            )
        try:
            sizes[name] = int(val)
        except ValueError:
            raise SpecjaxError(f"--mesh: {name} needs an integer size, got {val!r}") from None
        if sizes[name] < 1:
            raise SpecjaxError(f"--mesh: {name} must be >= 1, got {sizes[name]}")
    model = sizes.get("model", 1)
    data = sizes.get("data", max(1, n_local // model))
    if data * model > n_local:
        raise SpecjaxError(f"--mesh {spec}: needs {data * model} devices, this process has {n_local}")
    return {"data": data, "model": model}


def make_mesh(sizes: dict[str, int]):
    """A `data` x `model` mesh over the first local devices, or None for a single device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    n = sizes["data"] * sizes["model"]
    if n == 1:
        return None
    devices = np.array(jax.local_devices()[:n]).reshape(sizes["data"], sizes["model"])
    return Mesh(devices, MESH_AXES)


def param_spec(path: tuple, shape: tuple[int, ...], model_size: int):
    """The PartitionSpec of one parameter (its nnx state path) on the mesh."""
    from jax.sharding import PartitionSpec as P

    names = [k for k in (getattr(p, "key", getattr(p, "name", None)) for p in path) if isinstance(k, str)]
    name = next((n for n in reversed(names) if n != "value"), "")
    if model_size > 1 and len(shape) == 2:
        if name in SPLIT_OUT_ROWS and shape[0] % model_size == 0:
            return P("model", None)
        if name in SPLIT_IN_COLS and shape[1] % model_size == 0:
            return P(None, "model")
    return P()  # replicated (norm scales, and weights the axis does not divide)


def place_model(model, mesh):
    """The model with its params on `mesh` (replicated over `data`, split over `model`)."""
    import dataclasses

    import jax
    from jax.sharding import NamedSharding

    if mesh is None:
        return model
    m = mesh.shape["model"]
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, param_spec(path, x.shape, m))), model.params
    )
    return dataclasses.replace(model, params=params)
