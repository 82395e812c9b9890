"""Scaling a batch job out: over the devices of a host (a mesh) and over hosts (part files).

Devices. A `jax.sharding.Mesh` over this process's local devices with axes `data` x `model`:
rows of a batch are split over `data` (the engine places its per-row inputs with
`PartitionSpec("data")`, jit propagates that through prefill and the decode loop), the params
are replicated over `data` and, when `model` > 1, split over `model` tensor-parallel style:
weights that produce heads / MLP columns / vocabulary logits (`qkv`, `gate_up`, `embed`,
`lm_head`, all `[out, in]`) by their output rows, weights that consume them (`o`, `down`) by
their input columns. GSPMD inserts the collectives, so results are those of one device. The
fused `qkv` (`[Q | K | V]`) and `gate_up` (`[gate | up]`) rows are split in contiguous blocks,
which does not align with heads or with the gate/up halves; the compiler moves the activations
that cross blocks. An interleaved per-shard layout of the fused weights would avoid that traffic.

Hosts. `N` processes each take the input lines whose 0-based index i has `i % N == I` and
append to their own part file `<output>.part-I-of-N` (with `<part>.errors.jsonl`); a finished
part gets a `<part>.done` marker. Merging orders every part's rows by input line into
`<output>` (and the errors into `<output>.errors.jsonl`), written to a temporary file and
renamed, so concurrent merges of the same parts are harmless.

`jax.distributed.initialize` is the rendezvous: it assigns process ids (from `--coordinator`,
`--num-processes`, `--process-id`, or what JAX detects on TPU pods / SLURM / MPI) and checks
that all processes started. The processes then detach (`jax.distributed.shutdown`) and work
alone: a batch job needs no cross-host communication (each mesh holds local devices only), and
JAX's health check would otherwise abort every process when one dies, and abort all of them
again when the dead one reconnects. Detached, a killed process is rerun by itself, without
`--coordinator` (its share depends only on I and N), while the others carry on. On CPU the
client is made without cross-process collectives, so local multi-device collectives do not
depend on the (then closed) coordination service.
"""

from __future__ import annotations

import json
import os
import time

from specjax.errors import SpecjaxError

MESH_AXES = ("data", "model")
SPLIT_OUT_ROWS = ("qkv", "gate_up", "embed", "lm_head")  # [out, in]: split `out` over `model`
SPLIT_IN_COLS = ("o", "down")  # [out, in]: split `in` (heads / MLP columns) over `model`


# ---- devices ----------------------------------------------------------------------------------


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
            raise SpecjaxError(f"--mesh takes axis=size pairs over {', '.join(MESH_AXES)} "
                               f"(e.g. data=2,model=2), got {spec!r}")
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


# ---- hosts ------------------------------------------------------------------------------------


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None,
                     stay_connected: bool = False) -> tuple[int, int]:
    """Rendezvous through `jax.distributed.initialize`; returns (process id, process count).

    `coordinator` "auto" lets JAX detect everything (TPU pods, SLURM, Open MPI); otherwise it is
    HOST:PORT of process 0 (or None to read JAX_COORDINATOR_ADDRESS). Must run before any JAX
    computation. Detaches afterwards unless `stay_connected` (see the module docstring).
    """
    import jax

    # Batch jobs never run collectives across processes; without this, CPU collectives between
    # local devices would go through gloo and the coordination service.
    jax.config.update("jax_cpu_collectives_implementation", None)
    kw = {}
    if coordinator and coordinator != "auto":
        kw["coordinator_address"] = coordinator
    if num_processes is not None:
        kw["num_processes"] = num_processes
    if process_id is not None:
        kw["process_id"] = process_id
    try:
        jax.distributed.initialize(**kw)
    except (ValueError, TypeError, RuntimeError) as e:
        raise SpecjaxError(f"jax.distributed.initialize failed: {str(e).splitlines()[0]}") from None
    pid, count = jax.process_index(), jax.process_count()
    if not stay_connected:
        jax.distributed.shutdown()
    return pid, count


def part_path(output: str, process_id: int, num_processes: int) -> str:
    return f"{output}.part-{process_id}-of-{num_processes}"


def errors_path(results_path: str) -> str:
    return f"{results_path}.errors.jsonl"


def done_path(part: str) -> str:
    return f"{part}.done"


def job_path(results_path: str) -> str:
    """The settings the results were made with (batch.py: `check_job_settings`)."""
    return f"{results_path}.job.json"


def write_atomic(path: str, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename: readers see all or nothing."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    """Complete lines of a JSONL file (a trailing partial line is ignored); [] if it is missing."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(data[: data.rfind(b"\n") + 1].split(b"\n")[:-1], 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise SpecjaxError(f"{path}:{i}: not a JSON line; fix or remove the file") from None
    return out


def missing_parts(output: str, num_processes: int) -> list[int]:
    return [i for i in range(num_processes) if not os.path.exists(done_path(part_path(output, i, num_processes)))]


def merge_parts(output: str, num_processes: int) -> int:
    """Merge complete parts into `output` ordered by input line; returns the number of rows."""
    if num_processes < 2:
        raise SpecjaxError("--merge needs --num-processes N with N >= 2")
    missing = missing_parts(output, num_processes)
    if missing:
        cmds = ", ".join(f"--process-id {i}" for i in missing)
        raise SpecjaxError(f"merge: part(s) {missing} of {num_processes} of {output} are not complete "
                           f"(no .done marker): rerun those processes ({cmds} --num-processes {num_processes})")
    markers = []
    for i in range(num_processes):
        with open(done_path(part_path(output, i, num_processes))) as fh:
            markers.append(json.load(fh))
    if len({m["input"] for m in markers}) != 1:
        raise SpecjaxError(f"merge: the parts of {output} were made from different inputs")
    settings: dict = {}  # setting -> value, over the parts that recorded one (None: not read)
    for i, m in enumerate(markers):
        for k, v in (m.get("settings") or {}).items():
            if v is not None and settings.setdefault(k, (v, i))[0] != v:
                raise SpecjaxError(f"merge: the parts of {output} ran with different settings: {k}={settings[k][0]!r} "
                                   f"in part {settings[k][1]}, {k}={v!r} in part {i}")
    rows, errors, seen = [], [], set()
    for i in range(num_processes):
        part = part_path(output, i, num_processes)
        for r in read_jsonl(part):
            key = json.dumps(r.get("id"))
            if key not in seen:  # a part never repeats an id; guard anyway
                seen.add(key)
                rows.append(r)
        errors += read_jsonl(errors_path(part))
    rows.sort(key=lambda r: r.get("line", 0))
    errors.sort(key=lambda r: r.get("line", 0))
    dump = lambda xs: "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in xs).encode()  # noqa: E731
    write_atomic(errors_path(output), dump(errors))
    write_atomic(job_path(output), json.dumps({k: v for k, (v, _) in settings.items()}, indent=1).encode())
    write_atomic(output, dump(rows))
    return len(rows)


def wait_for_parts(output: str, num_processes: int, stall_seconds: float, log) -> bool:
    """Process 0 waits for the other parts; gives up when none has grown for `stall_seconds`."""
    last_change, last_sizes, told = time.monotonic(), None, False
    while True:
        missing = missing_parts(output, num_processes)
        if not missing:
            return True
        sizes = [os.path.getsize(p) if os.path.exists(p) else -1
                 for p in (part_path(output, i, num_processes) for i in missing)]
        if sizes != last_sizes:
            last_sizes, last_change = sizes, time.monotonic()
        if not told:
            log(f"waiting for part(s) {missing} of {num_processes} to merge them into {output} (a failed process "
                f"is rerun alone: the same command without --coordinator)")
            told = True
        if time.monotonic() - last_change > stall_seconds:
            return False
        time.sleep(0.5)
