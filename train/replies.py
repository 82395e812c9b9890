"""The target's own greedy replies, kept as a corpus that only grows.

Regenerating training text is the costliest stage of every recipe (~124 reply tokens/s at batch
64 on the 2-core CPU: 1.2M tokens is hours), so replies are kept by prompt in one directory that
any number of runs, recipes and sessions add to and read from: a run asks for the replies of its
prompts, finds the ones already there and generates only the rest. The shipped recipes keep it in
the repository (`train/replies/<target>/`), so the data accumulates across machines.

Layout: `meta.json` (what a reply depends on: the target, the reply cap, the parameter dtype,
greedy decoding) and `part-NNNN.jsonl.gz` files, each written by one run, one gzip member per
generated batch, one line per sequence: `{"ids": prompt + reply token ids, "prompt_len": n}`. A
kill mid-batch leaves a cut last member: readers skip it (its replies are regenerated into the
next run's part). Each run appends only to the part it created, and no reader rewrites a part, so
runs and readers may share a corpus at the same time; adding data is adding files. A prompt's key
is its token ids, so a changed chat template or tokenizer misses rather than mixes.

Cost: ~1 MB per million stored tokens (prompt + reply, gzip of JSON; 342k tokens in 0.32 MB).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib

META = "meta.json"
FORMAT = 1


class RepliesError(ValueError):
    """The corpus at a path was made under other settings (another target, cap or dtype)."""


def _key(prompt: list[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in prompt)


def _read_part(path: str) -> list[tuple[list[int], int]]:
    """The part's rows up to its first cut or corrupt gzip member (a killed run's last batch, or
    one a running job is still writing)."""
    rows = []
    try:
        with gzip.open(path, "rt") as fh:
            for line in fh:
                rec = json.loads(line)
                rows.append((list(rec["ids"]), int(rec["prompt_len"])))
    except (EOFError, OSError, zlib.error, ValueError, KeyError):
        pass
    return rows


def _write_rows(fh, rows) -> None:
    fh.writelines(json.dumps({"ids": ids, "prompt_len": p}, separators=(",", ":")) + "\n" for ids, p in rows)


class Replies:
    """The corpus at `path` for replies of `target` (its name) capped at `max_new_tokens` new
    tokens, greedy, with parameters in `dtype`; created if absent, a RepliesError if it was made
    under other settings."""

    def __init__(self, path: str, target: str, max_new_tokens: int, dtype: str):
        self.path = path
        self.meta = {
            "format": FORMAT,
            "target": target,
            "max_new_tokens": int(max_new_tokens),
            "dtype": dtype,
            "decoding": "greedy",
        }
        os.makedirs(path, exist_ok=True)
        meta_path = os.path.join(path, META)
        if os.path.exists(meta_path):
            with open(meta_path) as fh:
                old = json.load(fh)
            if old != self.meta:
                diff = next(k for k in self.meta if old.get(k) != self.meta[k])
                raise RepliesError(
                    f"replies in {path} were generated with {diff}={old.get(diff)!r}, "
                    f"this recipe has {self.meta[diff]!r} (use another data.replies_dir)"
                )
        else:
            with open(meta_path, "w") as fh:
                json.dump(self.meta, fh, indent=1)
        self.rows: dict[tuple[int, ...], tuple[list[int], int]] = {}
        for name in sorted(os.listdir(path)):
            if not (name.startswith("part-") and name.endswith(".jsonl.gz")):
                continue
            for ids, p in _read_part(os.path.join(path, name)):
                self.rows.setdefault(_key(ids[:p]), (ids, p))
        self._part: str | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, prompt: list[int]) -> tuple[list[int], int] | None:
        """(prompt + reply ids, prompt length) of `prompt`, or None when it was never answered."""
        return self.rows.get(_key(prompt))

    def reply_tokens(self) -> int:
        return sum(len(ids) - p for ids, p in self.rows.values())

    def add(self, rows: list[tuple[list[int], int]]) -> None:
        """Append `rows` (one generated batch) as one gzip member of this run's part file."""
        if self._part is None:  # this run's own part, created on its first batch
            i = 0
            while True:
                name = os.path.join(self.path, f"part-{i:04d}.jsonl.gz")
                try:
                    os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                    break
                except FileExistsError:
                    i += 1
            self._part = name
        with gzip.open(self._part, "at", compresslevel=9) as fh:
            _write_rows(fh, rows)
        for ids, p in rows:
            self.rows.setdefault(_key(ids[:p]), (ids, p))
