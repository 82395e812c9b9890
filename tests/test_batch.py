"""Batch jobs (`specjax batch`, specjax/batch/): resume after a real SIGKILL, the errors file,
a sharded run on 4 host devices and a two-process run over loopback equal to one process (the
speculation policy: test_batch_policy.py; input files and bad input: test_batch_input.py).

Everything runs a tiny random checkpoint (`batch_model_dir`, conftest.py: 1 layer, weights with std
0.3 so greedy texts differ from row to row) with the default model's real tokenizer and chat
template. The reference (`reference`, conftest.py) is an uninterrupted single-device run in this
process; runs that need their own JAX (XLA_FLAGS, jax.distributed) or a kill are real
`specjax batch` subprocesses. Prompts all
fall in one prompt bucket and groups in one batch shape, so each process compiles once per group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import BATCH_MAX_NEW as MAX_NEW
from helpers import BATCH_ROWS as BATCH
from helpers import assert_same_rows as assert_same
from helpers import batch_config as config
from helpers import batch_job_rows, read_rows, specjax_cli_cmd, write_jsonl


def cli_args(batch_model_dir, inp, out, *more) -> list[str]:
    return [
        *specjax_cli_cmd(),
        "batch",
        "--input",
        inp,
        "--output",
        str(out),
        "--model",
        batch_model_dir,
        "--max-new-tokens",
        str(MAX_NEW),
        "--batch-size",
        str(BATCH),
        "--no-progress",
        *more,
    ]


def wait_for_lines(path, proc, n=1, timeout=180.0) -> None:
    """Until `path` holds n complete lines (or `proc` ends)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if os.path.exists(path):
            with open(path, "rb") as fh:
                if fh.read().count(b"\n") >= n:
                    return
        time.sleep(0.01)


# ---- resume --------------------------------------------------------------------------------------


def test_resume_after_sigkill(batch_model_dir, job_input, reference, cli_env, tmp_path):
    """SIGKILL a real `specjax batch` once results appear, tear its last line, rerun: every id
    once, every row (sampled ones too) equal to the uninterrupted run. The rerun reads the
    executables the killed run left in the XLA disk cache (`--compile-cache`)."""
    out = tmp_path / "res.jsonl"
    args = cli_args(batch_model_dir, job_input, out, "--compile-cache", str(tmp_path / "xla"))
    proc = subprocess.Popen(args, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_lines(out, proc)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the job ended before it could be killed: {err[-2000:]}"
    killed_at = len(read_rows(out))
    assert 0 < killed_at < 16
    assert os.listdir(tmp_path / "xla"), "the killed run cached no executable"
    with open(out, "ab") as fh:  # what a crash in the middle of a write would leave
        fh.write(b'{"id": "q0", "line": 1, "text": "tor')

    done = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{16 - killed_at} rows written" in done.stderr and f"{killed_at} were already there" in done.stderr
    rows = read_rows(out)
    assert len(rows) == 16
    assert_same(rows, reference, [r["id"] for r in batch_job_rows()])


def test_resume_reruns_partly_done_batches(batch_model, job_input, reference, tmp_path):
    """Rows missing from the middle of batches (a kill between two rows' writes) are redone in
    their original batch: results identical, nothing written twice, the errors file not doubled."""
    from specjax.batch.job import run_batch

    out = tmp_path / "res.jsonl"
    kept = [r for i, r in enumerate(reference.values()) if i % 3 != 1]  # a row from most batches
    with open(out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in kept)
        fh.write('{"id": "q1", "text": "partial li')
    summary = run_batch(config(batch_model, job_input, out))
    assert summary["written"] == 16 - len(kept) and summary["already"] == len(kept)
    assert_same(read_rows(out), reference, [r["id"] for r in batch_job_rows()])
    assert read_rows(str(out) + ".errors.jsonl") == []


# ---- errors ----------------------------------------------------------------------------------------


def test_sampled_rows_do_not_depend_on_the_batch_size(batch_model, job_input, reference, tmp_path):
    """Every row draws from its own seed's stream: one row per batch gives the reference's
    sampled rows (batches of 4) token for token."""
    from specjax.batch.job import run_batch

    run_batch(config(batch_model, job_input, tmp_path / "b1.jsonl", batch_size=1))
    rows = read_rows(tmp_path / "b1.jsonl")
    sampled = [r for r in rows if r["id"] in ("q12", "q13", "q14", "q15")]
    assert len(sampled) == 4
    assert_same(rows, reference, list(reference))


def test_rerun_with_other_settings_is_refused(batch_model, job_input, reference, tmp_path):
    """A rerun that changes what the results mean (here the temperature, max_new_tokens) is
    refused and leaves the output alone; one that changes only the drafter and batch size (the
    target's law either way), or settings no row reads, resumes; an emptied output starts anew."""
    import dataclasses

    from specjax.batch.job import run_batch
    from specjax.errors import SpecjaxError

    out = tmp_path / "res.jsonl"
    rows = [r for r in batch_job_rows() if "temperature" not in r]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    first = config(batch_model, inp, out)
    run_batch(dataclasses.replace(first, limit=6))
    before = out.read_bytes()
    other = dataclasses.replace(first.sampling, temperature=0.5, max_new_tokens=MAX_NEW + 1)
    with pytest.raises(
        SpecjaxError,
        match=r"temperature=0.0, max_new_tokens=8 \(kept in .*res.jsonl.job.json\); "
        r"this run has temperature=0.5, max_new_tokens=9",
    ):
        run_batch(dataclasses.replace(first, sampling=other))
    assert out.read_bytes() == before
    reseeded = dataclasses.replace(first.sampling, seed=123, top_p=0.5)  # read by sampled rows only: none here
    summary = run_batch(dataclasses.replace(first, sampling=reseeded, drafter="ngram", num_draft=3, batch_size=2))
    assert summary["already"] == 6 and summary["written"] == len(rows) - 6
    assert_same(read_rows(out), reference, [r["id"] for r in rows])
    out.unlink()  # no results left: any settings start a new job
    run_batch(dataclasses.replace(first, sampling=other, limit=1))
    assert len(read_rows(out)) == 1


def test_errors_file_names_each_bad_row(batch_model, reference, tmp_path):
    from specjax.batch.job import run_batch

    good = batch_job_rows()[:4]
    lines = [json.dumps(r) for r in good] + [
        "{not json",  # 5
        "[1, 2, 3]",  # 6
        json.dumps({"id": "np"}),  # 7
        json.dumps({"prompt": "no id here"}),  # 8
        json.dumps({"id": "q1", "prompt": "the same id again"}),  # 9
        json.dumps({"id": "long", "prompt": "word " * 300}),  # 10
        json.dumps({"id": "fill", "prompt": "Hello there", "max_new_tokens": 250}),  # 11
        json.dumps({"id": "t", "prompt": "x", "temperature": -1}),  # 12
        json.dumps({"id": "p", "prompt": "x", "top_p": 1.5}),  # 13
        json.dumps({"id": "k", "prompt": "x", "top_k": "3"}),  # 14
        json.dumps({"id": "n", "prompt": "x", "max_new_tokens": 0}),  # 15
        json.dumps({"id": "s", "prompt": "x", "seed": -1}),  # 16
        json.dumps({"id": "m", "messages": []}),  # 17
        json.dumps({"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}),  # 18
        "",  # 19: blank, skipped
        json.dumps({"id": "", "prompt": "empty id"}),  # 20
        json.dumps({"id": "e", "prompt": "   "}),  # 21
    ]
    inp = tmp_path / "in.jsonl"
    with open(inp, "wb") as fh:
        fh.write(("\n".join(lines) + "\n").encode())
        fh.write(b'{"id": "bytes", "prompt": "\xff\xfe"}\n')  # 22
    out = tmp_path / "out.jsonl"
    summary = run_batch(config(batch_model, str(inp), out))
    assert summary["written"] == 4 and summary["errors"] == 17
    assert sorted(r["id"] for r in read_rows(out)) == sorted(r["id"] for r in good if isinstance(r["id"], str))
    errors = read_rows(str(out) + ".errors.jsonl")
    expected = [
        (5, None, "invalid JSON"),
        (6, None, "must be a JSON object"),
        (7, "np", "missing prompt"),
        (8, None, "missing id"),
        (9, "q1", "duplicate id (first on line 2)"),
        (10, "long", "does not fit the model's context of 256 tokens"),
        (11, "fill", "max_new_tokens 250 exceeds the model's context"),
        (12, "t", "temperature"),
        (13, "p", "top_p"),
        (14, "k", "top_k must be a number"),
        (15, "n", "max_new_tokens"),
        (16, "s", "seed"),
        (17, "m", "'messages' must be a non-empty list"),
        (18, "both", "not both"),
        (20, None, "invalid id ''"),
        (21, "e", "'prompt' must be a non-empty string"),
        (22, None, "not UTF-8"),
    ]
    assert [(e["line"], e["id"]) for e in errors] == [(line, i) for line, i, _ in expected]
    for e, (_, _, reason) in zip(errors, expected):
        assert reason in e["reason"], (e, reason)


def test_openai_max_tokens_and_ignored_fields():
    from specjax.batch.inputs import BadRow, parse_input, parse_row
    from specjax.sampling import SamplingParams

    defaults = SamplingParams(max_new_tokens=16)
    row = parse_row(1, json.dumps({"id": 1, "prompt": "x", "max_tokens": 4}).encode(), defaults)
    assert row.sampling.max_new_tokens == 4
    same = parse_row(2, json.dumps({"id": 2, "prompt": "x", "max_tokens": 4, "max_new_tokens": 4}).encode(), defaults)
    assert same.sampling.max_new_tokens == 4
    bad = parse_row(3, json.dumps({"id": 3, "prompt": "x", "max_tokens": 4, "max_new_tokens": 5}).encode(), defaults)
    assert isinstance(bad, BadRow) and "disagree" in bad.reason
    lines = [
        (1, b'{"id": 1, "prompt": "x", "category": "a", "temprature": 0.5}'),
        (2, b'{"id": 2, "prompt": "y", "category": "b", "max_tokens": 3}'),
        (3, b"{not json"),
    ]
    ignored: dict[str, int] = {}
    parse_input(lines, defaults, ignored)
    assert ignored == {"category": 2, "temprature": 1}


# ---- devices -------------------------------------------------------------------------------------

SHARDED_SCRIPT = r"""
import json, sys
import jax
from specjax.sampling import SamplingParams
from specjax.batch.config import BatchConfig
from specjax.batch.job import run_batch
model_dir, inp, out = sys.argv[1:4]
info = {"devices": jax.local_device_count()}
for mesh in ("data=4", "data=2,model=2"):
    run_batch(BatchConfig(output=f"{out}.{mesh}", input=inp, model=model_dir, mesh=mesh, batch_size=4,
                          sampling=SamplingParams(max_new_tokens=int(sys.argv[4])), progress=False))
from specjax.runtime.cached import _ENGINES
for model, engine in _ENGINES.values():
    qkv = model.params["layers"][0]["attn"]["qkv"][...]
    info[",".join(f"{k}={v}" for k, v in engine.mesh.shape.items())] = list(qkv.sharding.spec)
print(json.dumps(info))
"""


def test_out_of_memory_batch_runs_as_halves(batch_model, greedy_input, reference, tmp_path, monkeypatch):
    """A batch that runs out of device memory is retried as two halves (recursively); a row that
    does not fit even alone goes to the errors file; the job goes on and the greedy rows equal
    the uninterrupted run. Memory "runs out" (XLA's own error text) for batches of more than 2
    rows and for the longest prompt in any batch."""
    import specjax
    from specjax.batch.job import run_batch
    from specjax.prompts import encode_prompt

    with open(greedy_input) as fh:
        job = [json.loads(line) for line in fh]
    longest = max(len(encode_prompt(batch_model, r.get("messages") or r["prompt"])) for r in job)
    real, calls = specjax.generate, []

    def tight_memory(prompts, **kw):
        calls.append(len(prompts))
        if len(prompts) > 2 or max(len(p) for p in prompts) >= longest:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 157514989568 bytes.")
        return real(prompts, **kw)

    monkeypatch.setattr(specjax, "generate", tight_memory)
    out = tmp_path / "res.jsonl"
    summary = run_batch(config(batch_model, greedy_input, out))
    assert {4, 2, 1} <= set(calls)  # 4 rows -> 2 + 2 -> the longest prompt alone
    errors = read_rows(str(out) + ".errors.jsonl")
    assert errors and all("out of device memory even alone" in e["reason"] for e in errors)
    done = read_rows(out)
    assert summary["written"] == len(done) == len(job) - len(errors) and summary["errors"] == len(errors)
    assert {json.dumps(r["id"]) for r in done + errors} == {json.dumps(r["id"]) for r in job}
    assert_same(done, reference, [r["id"] for r in done])


def test_sharded_over_four_host_devices_matches_one_device(batch_model_dir, greedy_input, reference, cli_env, tmp_path):
    """`--mesh data=4` (rows split over devices) and `data=2,model=2` (plus weights split
    tensor-parallel) give the single-device run's greedy outputs."""
    out = str(tmp_path / "out.jsonl")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, batch_model_dir, greedy_input, out, str(MAX_NEW)],
        env=dict(cli_env, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["devices"] == 4
    assert info["data=4,model=1"] == []  # replicated
    assert info["data=2,model=2"] == ["model", None]  # split tensor-parallel
    ids = [r["id"] for r in batch_job_rows() if "temperature" not in r]
    for mesh in ("data=4", "data=2,model=2"):
        assert_same(read_rows(f"{out}.{mesh}"), reference, ids)


# ---- hosts ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_over_loopback_with_a_restart(batch_model_dir, job_input, reference, cli_env, tmp_path):
    """Two processes meet through jax.distributed on 127.0.0.1; process 1 is SIGKILLed once it
    has written results and rerun alone; process 0 waits and merges. The merged output holds
    every id once, in input order, with the one-process run's outputs (sampled rows too)."""
    from specjax.cli import main

    out = tmp_path / "out.jsonl"
    coord = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    args = [
        cli_args(batch_model_dir, job_input, out, *coord, "--process-id", str(i), "--merge-wait", "200")
        for i in range(2)
    ]
    procs = [subprocess.Popen(a, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in args]
    part1 = f"{out}.part-1-of-2"
    wait_for_lines(part1, procs[1])
    procs[1].send_signal(signal.SIGKILL)
    _, err1 = procs[1].communicate()
    assert procs[1].returncode == -signal.SIGKILL, f"process 1 ended before it could be killed: {err1[-2000:]}"
    assert 0 < len(read_rows(part1)) < 8

    rerun = subprocess.run(
        cli_args(batch_model_dir, job_input, out, "--num-processes", "2", "--process-id", "1"),
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr
    _, err0 = procs[0].communicate(timeout=300)
    assert procs[0].returncode == 0, err0
    assert "merged 2 parts: 16 rows" in err0 + rerun.stderr

    rows = read_rows(out)
    ids = [r["id"] for r in batch_job_rows()]
    assert [r["id"] for r in rows] == ids  # input order
    assert_same(rows, reference, ids)  # sampled rows too: each row draws from its own seed
    for i in range(2):  # each part: its own share (line index % 2), each id once
        part = read_rows(f"{out}.part-{i}-of-2")
        assert sorted(r["line"] for r in part) == list(range(i + 1, 17, 2))

    os.remove(out)  # an explicit merge rebuilds the same file
    assert main(["batch", "--merge", "--output", str(out), "--num-processes", "2"]) == 0
    assert read_rows(out) == rows
    with open(f"{out}.job.json") as fh:  # the parts' common settings, for a later resume of the merged file
        assert json.load(fh)["max_new_tokens"] == MAX_NEW

    done = f"{out}.part-1-of-2.done"  # parts that ran with other settings are not merged
    with open(done) as fh:
        marker = json.load(fh)
    marker["settings"]["temperature"] = 0.5
    with open(done, "w") as fh:
        json.dump(marker, fh)
    from specjax.batch.parts import merge_parts
    from specjax.errors import SpecjaxError

    with pytest.raises(SpecjaxError, match="different settings: temperature=0.0 in part 0, temperature=0.5 in part 1"):
        merge_parts(str(out), 2)
