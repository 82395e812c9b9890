"""The files a batch job writes, and the rule they follow: validate everything, then write.

A job (`specjax batch --output OUT`, one process) writes

* `OUT`: the results, appended line by line (`ResultsFile`);
* `OUT.errors.jsonl`: its bad rows, rewritten on each run;
* `OUT.job.json`: the settings that give the results their meaning (job.py: `job_settings`);
* `OUT.policy.json`: the `--spec-policy auto` cost tables (specjax/policy/batch.py);
* `P.tmp-PID` beside each file P written atomically (written, then renamed over P).

Process I of N writes the same files for its part `OUT.part-I-of-N` plus the marker
`OUT.part-I-of-N.done`; process 0 then merges into `OUT`, `OUT.errors.jsonl` and `OUT.job.json`.

`check_paths` runs before the model loads and writes nothing. It refuses (one line, exit code
2) a job that would write to its own input (any of these paths being the input file, through a
symlink or a hard link too), to a directory, to a file that exists but is not the job's kind of
file (a results file, an errors file, a JSON object), to a read-only file, or into a directory
it cannot create files in (checked by creating and removing a probe file). A refused job leaves
every file as it was. docs/files.md lists what each command writes.
"""

from __future__ import annotations

import json
import os

from specjax.batch.config import LATENCY_BATCH_SIZE
from specjax.errors import SpecjaxError
from specjax.files import check_dir_writable

RESULT_FIELDS = {"id", "line", "token_ids", "finish_reason"}  # what every result line carries


def part_path(output: str, process_id: int, num_processes: int) -> str:
    return f"{output}.part-{process_id}-of-{num_processes}"


def errors_path(results_path: str) -> str:
    return f"{results_path}.errors.jsonl"


def done_path(part: str) -> str:
    return f"{part}.done"


def job_path(results_path: str) -> str:
    """The settings the results were made with (`check_job_settings`)."""
    return f"{results_path}.job.json"


def policy_path(out_path: str) -> str:
    return f"{out_path}.policy.json"


def results_path(cfg) -> str:
    """This process's results file: OUT, or its part file of a multi-process job."""
    n = cfg.num_processes
    return cfg.output if n == 1 else part_path(cfg.output, cfg.process_id, n)


def written_files(cfg) -> dict[str, str]:
    """path -> kind ("results", "errors", "json", "marker") of every file this process's job
    may write, temporary files aside (`temp_files`)."""
    out = results_path(cfg)
    files = {out: "results", errors_path(out): "errors", job_path(out): "json", policy_path(out): "json"}
    if cfg.num_processes > 1:
        files[done_path(out)] = "json"
        if cfg.process_id == 0:  # the merge
            files.update({cfg.output: "results", errors_path(cfg.output): "errors", job_path(cfg.output): "json"})
    return files


def temp_files(paths) -> list[str]:
    """The temporary files `specjax.files.write_atomic` writes beside `paths` (from this process)."""
    return [f"{p}.tmp-{os.getpid()}" for p in paths]


def check_paths(cfg) -> None:
    """Refuse, before anything loads and without writing a byte, a job whose input cannot be read
    or whose files cannot or must not be written (see the module docstring)."""
    from specjax.policy.batch import parse_policy

    if bool(cfg.input) == bool(cfg.suite):
        raise SpecjaxError("batch: give exactly one of --input FILE and --suite NAME")
    if cfg.input:
        try:
            with open(cfg.input, "rb"):
                pass
        except OSError as e:
            raise SpecjaxError(f"{cfg.input}: {e.strerror or e}") from None
    if not 0 <= cfg.process_id < cfg.num_processes:
        raise SpecjaxError(f"--process-id must be in [0, {cfg.num_processes}), got {cfg.process_id}")
    if cfg.latency_class not in LATENCY_BATCH_SIZE:
        raise SpecjaxError(f"--latency-class must be one of {', '.join(LATENCY_BATCH_SIZE)}")
    parse_policy(cfg.spec_policy)
    if cfg.batch_size is not None and cfg.batch_size < 1:
        raise SpecjaxError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    out_dir = os.path.dirname(os.path.abspath(cfg.output))
    if not os.path.isdir(out_dir):
        raise SpecjaxError(f"{cfg.output}: directory {out_dir} does not exist")
    files = written_files(cfg)
    for path in [*files, *temp_files(files)]:
        if cfg.input and os.path.exists(path) and os.path.samefile(cfg.input, path):
            what = "is the input file" if path == cfg.output else f"would write {path}, which is the input file"
            raise SpecjaxError(f"--output {cfg.output}: {what}; choose another --output")
    for path, kind in files.items():
        check_own_file(path, kind, cfg.output)
    check_dir_writable(out_dir, f"--output {cfg.output}")


def check_merge_paths(output: str, num_processes: int) -> None:
    """`batch --merge`: the merged files must be the job's own kind and their directory writable."""
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise SpecjaxError(f"{output}: directory {out_dir} does not exist")
    for path, kind in {output: "results", errors_path(output): "errors", job_path(output): "json"}.items():
        check_own_file(path, kind, output)
    check_dir_writable(out_dir, f"--output {output}")


def check_own_file(path: str, kind: str, output: str) -> None:
    """Refuse to overwrite `path` unless it is missing or a file of `kind` that a job wrote."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        raise SpecjaxError(f"{path}: is a directory; choose another --output")
    if not os.access(path, os.W_OK):
        raise SpecjaxError(f"{path}: not writable; choose another --output")
    if kind == "results":
        read_results(path)
        return
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise SpecjaxError(f"{path}: {e.strerror or e}") from None
    if kind == "errors":
        for i, line in enumerate(data[: data.rfind(b"\n") + 1].split(b"\n")[:-1], 1):
            if line.strip() and not _is_object_with(line, ("line", "reason")):
                raise SpecjaxError(
                    f"{path}:{i}: not a batch errors line; this run would overwrite it: move the "
                    f"file or choose another --output than {output}"
                )
    elif data.strip() and not _is_object_with(data, ()):
        raise SpecjaxError(
            f"{path}: not a file of a batch job (a JSON object); this run would overwrite it: move "
            f"the file or choose another --output than {output}"
        )


def _is_object_with(data: bytes, keys) -> bool:
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and all(k in obj for k in keys)


def read_results(path: str) -> tuple[set[str], int, int]:
    """(json.dumps(id) of each result, end of the last complete line, file size) of a results
    file (all empty if it is missing). Raises SpecjaxError, changing nothing, unless every
    complete line is a result line and a partial last line starts like one."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return set(), 0, 0
    except OSError as e:
        raise SpecjaxError(f"{path}: {e.strerror or e}") from None
    done: set[str] = set()
    end = data.rfind(b"\n") + 1
    for i, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ok = isinstance(obj, dict) and RESULT_FIELDS <= obj.keys()
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise SpecjaxError(f"{path}:{i}: not a result line; fix the file or choose another --output")
        done.add(json.dumps(obj["id"]))
    if end < len(data) and not data[end:].startswith(b'{"id": '):
        raise SpecjaxError(f"{path}: last line is not a result line; fix the file or choose another --output")
    return done, end, len(data)


class ResultsFile:
    """An append-only JSONL file of results; each line is written whole or not at all. Opening
    it checks it (`read_results`) and drops a partial last line (a crash mid-write)."""

    def __init__(self, path: str):
        self.path = path
        self.done, end, size = read_results(path)
        try:
            if end < size:
                with open(path, "rb+") as fh:
                    fh.truncate(end)
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise SpecjaxError(f"{path}: {e.strerror or e}") from None

    def append(self, obj: dict) -> None:
        data = json_line(obj)
        n = os.write(self.fd, data)  # one write of the whole line; O_APPEND puts it at the end
        while n < len(data):  # only on exotic filesystems; a crash here leaves a partial line
            n += os.write(self.fd, data[n:])
        os.fsync(self.fd)
        self.done.add(json.dumps(obj["id"]))

    def close(self) -> None:
        os.close(self.fd)


def json_line(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def check_job_settings(path: str, settings: dict, out_path: str) -> None:
    """Refuse a rerun whose settings differ from those of the run that wrote the results in
    `out_path` (kept in `path`). Reads only; the caller records the settings once every check
    has passed."""
    if os.path.exists(path) and os.path.exists(out_path) and os.path.getsize(out_path) > 0:
        try:
            with open(path) as fh:
                old = json.load(fh)
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            raise SpecjaxError(f"{path}: unreadable job settings ({e}); remove it to accept the current ones") from None
        diff = [k for k, v in settings.items() if old.get(k) is not None and v is not None and old[k] != v]
        if diff:
            was = ", ".join(f"{k}={old[k]!r}" for k in diff)
            now = ", ".join(f"{k}={settings[k]!r}" for k in diff)
            raise SpecjaxError(
                f"{out_path} holds results of a job run with {was} (kept in {path}); this run has "
                f"{now}: rerun with the same settings, or choose another --output"
            )
