"""Each `--peers` implementation runs in a subprocess of its own, so that a crash costs only its rows.

A peer is foreign code (torch, llama.cpp's C++): an assertion there aborts the whole process,
and in the bench's own process it would lose every figure measured so far. So the bench writes a
job file per peer and runs `python -m specjax.bench.peer_process JOB EVENTS_FD`; the subprocess
loads the peer (through `job["factory"]`, "module:function", default `peers.load_peer`), runs
`peers.run_peer` and reports on the pipe EVENTS_FD, one JSON object per line:

* `{"ev": "begin", "name", "total"}`, `{"ev": "stage", "desc", "n", "group"}`,
  `{"ev": "advance", "k"}`: progress (replayed into the bench's `BenchProgress`);
* `{"ev": "log", "text"}`: a line for the bench's stderr log;
* `{"ev": "rows", "rows": [...]}`: one (suite, temperature) group's rows, sent as soon as they
  are measured, so a later crash keeps them;
* `{"ev": "error", "message"}`: a Python exception (the subprocess then exits 1);
* `{"ev": "done"}`: the peer finished.

The subprocess's stdout and stderr are captured (not shown: they would break the live display);
their last lines explain a crash. The outcome of each peer, `peer_status(...)`:
`status` "ok" | "failed" (a Python exception: `reason` is its one line) | "crashed" (killed by a
signal, `reason` e.g. "SIGABRT", or exited without reporting: "exit code N"); `returncode`;
`stderr_tail` (its last output lines, at most 10); `rows` (rows kept); `seconds` (wall time).
Only one subprocess runs at a time, and the bench's own measurements are finished before the
first starts, so the implementations never share the cores.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_FACTORY = "specjax.bench.peers:load_peer"
TAIL_LINES = 10


def peer_status(
    status: str,
    reason: str | None = None,
    returncode: int | None = None,
    stderr_tail: list[str] | None = None,
    rows: int = 0,
    seconds: float = 0.0,
) -> dict:
    """One entry of the report's `peers_status` (see the module docstring)."""
    return {
        "status": status,
        "reason": reason,
        "returncode": returncode,
        "stderr_tail": list(stderr_tail or []),
        "rows": rows,
        "seconds": seconds,
    }


def one_line(st: dict) -> str:
    """`crashed: SIGABRT; last output line: ...` for the tables and `peers_skipped`."""
    text = st["status"] + (f": {st['reason']}" if st.get("reason") else "")
    tail = [ln for ln in st.get("stderr_tail") or [] if ln.strip()]
    if st["status"] == "crashed" and tail:
        text += f"; last output line: {tail[-1].strip()}"
    return text


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def run_peer_subprocess(name: str, job: dict, console, progress=None) -> tuple[list[dict], dict]:
    """Run one peer in its own process (see the module docstring). Returns (its rows, its
    `peer_status`); never raises for what happens inside the peer."""
    job = dict(job, peer=name)
    job.setdefault("factory", DEFAULT_FACTORY)
    rows: list[dict] = []
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    error, done = None, False
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"specjax-peer-{name}-") as d:
        path = os.path.join(d, "job.json")
        with open(path, "w") as fh:
            json.dump(job, fh)
        r, w = os.pipe()
        # ggml answers a failed assertion by attaching gdb for a backtrace: slow, and its output
        # would push the assertion's own line out of the tail that the report keeps
        env = dict(os.environ)
        env.setdefault("GGML_NO_BACKTRACE", "1")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "specjax.bench.peer_process", path, str(w)],
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
            )
        finally:
            os.close(w)

        def drain():
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        with os.fdopen(r, "r", errors="replace") as events:
            for line in events:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                kind = ev.get("ev")
                if kind == "rows":
                    rows += ev["rows"]
                elif kind == "log":
                    console.log(ev["text"])
                elif kind == "error":
                    error = ev["message"]
                elif kind == "done":
                    done = True
                elif progress is not None and kind == "begin":
                    progress.begin(ev["name"], ev["total"])
                elif progress is not None and kind == "stage":
                    group = ev.get("group")
                    progress.stage(ev["desc"], ev["n"], tuple(group) if group is not None else None)
                elif progress is not None and kind == "advance":
                    progress.advance(ev.get("k", 1))
        rc = proc.wait()
        reader.join(timeout=10)
    secs = time.perf_counter() - t0
    if done and rc == 0:
        st = peer_status("ok", None, rc, list(tail), len(rows), secs)
    elif error is not None and rc >= 0:
        st = peer_status("failed", error, rc, list(tail), len(rows), secs)
    else:
        st = peer_status("crashed", _describe_exit(rc), rc, list(tail), len(rows), secs)
    return rows, st


def run_peers(names: list[str], job: dict, console, progress=None) -> tuple[list[dict], dict[str, dict]]:
    """Every peer in turn, each in its own process. `job` holds what they share: `model_source`,
    `eos_ids`, `threads`, `drafters`, `num_drafts`, `suite_ids`, `temperatures`,
    `max_new_tokens`, `repeats`, optionally `factory`. Returns (all rows, speedups included;
    {name: peer_status}). A peer that fails or crashes is logged with one line."""
    from specjax.bench.report import add_speedups

    rows, status = [], {}
    for name in names:
        if progress is not None:
            progress.begin(name, 0, "starting its own process, loading")
        got, st = run_peer_subprocess(name, job, console, progress)
        rows += got
        status[name] = st
        if st["status"] != "ok":
            kept = f" ({st['rows']} rows measured before it are kept)" if st["rows"] else ""
            console.log(f"peer {name}: {one_line(st)}{kept}")
    return add_speedups(rows), status


# -- the subprocess side -------------------------------------------------------------------------
class _Events:
    """What `peers.run_peer` talks to in the subprocess: a console (`log`) and a progress
    (`begin`, `stage`, `advance`) that write events to the pipe."""

    def __init__(self, fh):
        self.fh = fh

    def send(self, **ev) -> None:
        self.fh.write(json.dumps(ev) + "\n")
        self.fh.flush()

    def log(self, text) -> None:
        self.send(ev="log", text=str(text))

    def begin(self, name, total) -> None:
        self.send(ev="begin", name=name, total=total)

    def stage(self, desc, n, group=None) -> None:
        self.send(ev="stage", desc=desc, n=n, group=list(group) if group is not None else None)

    def advance(self, k=1) -> None:
        self.send(ev="advance", k=k)


def _main(job_path: str, fd: int) -> int:
    from specjax.bench.peers import run_peer

    with open(job_path) as fh:
        job = json.load(fh)
    events = _Events(os.fdopen(fd, "w", buffering=1))
    name = job["peer"]
    try:
        module, _, fn = job.get("factory", DEFAULT_FACTORY).partition(":")
        peer, configs = getattr(importlib.import_module(module), fn)(name, job)
        run_peer(
            peer,
            configs,
            job["suite_ids"],
            job["temperatures"],
            job["max_new_tokens"],
            job["repeats"],
            events,
            events,
            on_rows=lambda group: events.send(ev="rows", rows=group),
        )
    except Exception as e:  # a Python-level failure: report it; a crash below Python cannot be
        import traceback

        traceback.print_exc()  # into the captured output, whose tail the report keeps
        events.send(ev="error", message=f"{type(e).__name__}: {e}".splitlines()[0])
        return 1
    events.send(ev="done")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], int(sys.argv[2])))
