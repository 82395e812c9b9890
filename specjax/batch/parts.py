"""A batch job over several hosts: one part file per process, then a merge.

`N` processes each take the input lines whose 0-based index i has `i % N == I` and append to
their own part file `<output>.part-I-of-N` (with `<part>.errors.jsonl`); a finished part gets a
`<part>.done` marker. Merging orders every part's rows by input line into `<output>` (and the
errors into `<output>.errors.jsonl`), written to a temporary file and renamed, so concurrent
merges of the same parts are harmless.

`jax.distributed.initialize` is the rendezvous: it assigns process ids (from `--coordinator`,
`--num-processes`, `--process-id`, or what JAX detects on TPU pods / SLURM / MPI) and checks
that all processes started. The processes then detach (`jax.distributed.shutdown`) and work
alone: a batch job needs no cross-host communication (each mesh holds local devices only,
specjax/models/sharding.py), and JAX's health check would otherwise abort every process when one
dies, and abort all of them again when the dead one reconnects. Detached, a killed process is
rerun by itself, without `--coordinator` (its share depends only on I and N), while the others
carry on. On CPU the client is made without cross-process collectives, so local multi-device
collectives do not depend on the (then closed) coordination service.
"""

from __future__ import annotations

import json
import os
import time

from specjax.batch.files import done_path, errors_path, job_path, part_path
from specjax.errors import SpecjaxError
from specjax.files import write_atomic


def init_distributed(
    coordinator: str | None, num_processes: int | None, process_id: int | None, stay_connected: bool = False
) -> tuple[int, int]:
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
        raise SpecjaxError(
            f"merge: part(s) {missing} of {num_processes} of {output} are not complete "
            f"(no .done marker): rerun those processes ({cmds} --num-processes {num_processes})"
        )
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
                raise SpecjaxError(
                    f"merge: the parts of {output} ran with different settings: {k}={settings[k][0]!r} "
                    f"in part {settings[k][1]}, {k}={v!r} in part {i}"
                )
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
        sizes = [
            os.path.getsize(p) if os.path.exists(p) else -1
            for p in (part_path(output, i, num_processes) for i in missing)
        ]
        if sizes != last_sizes:
            last_sizes, last_change = sizes, time.monotonic()
        if not told:
            log(
                f"waiting for part(s) {missing} of {num_processes} to merge them into {output} (a failed process "
                f"is rerun alone: the same command without --coordinator)"
            )
            told = True
        if time.monotonic() - last_change > stall_seconds:
            return False
        time.sleep(0.5)
