"""A batch job's input: lines read from a JSONL file or a packaged suite, parsed into rows
(`JobRow`) or the reason they are bad (`BadRow`), then tokenized against the model's context.
Validation is a pure function of the input and the settings (see the package docstring)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from specjax.batch.config import BatchConfig
from specjax.errors import SpecjaxError, short_repr
from specjax.files import write_atomic

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "max_new_tokens", "seed")
ROW_FIELDS = {"id", "prompt", "messages", "raw", "max_tokens", *SAMPLING_FIELDS}  # what a row may carry


@dataclasses.dataclass
class JobRow:
    line: int  # 1-based line of the input
    id: str | int
    prompt: str | list  # text (chat template applied unless raw) or chat messages
    sampling: Any  # SamplingParams
    token_ids: list[int] | None = None  # set by validation (own share only)


@dataclasses.dataclass
class BadRow:
    line: int
    id: Any  # None when the row has no usable id
    reason: str

    def to_dict(self) -> dict:
        return {"line": self.line, "id": self.id, "reason": self.reason}


def read_input(cfg: BatchConfig) -> list[tuple[int, bytes]]:
    """(line number, raw bytes) of every non-blank input line."""
    if cfg.suite:
        from specjax import datasets

        rows = datasets.load_suite(cfg.suite, cfg.limit)
        return [(i + 1, json.dumps({"id": f"{cfg.suite}-{i}", **suite_row(m)}).encode()) for i, m in enumerate(rows)]
    try:
        with open(cfg.input, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise SpecjaxError(f"{cfg.input}: {e.strerror or e}") from None
    lines = [(i, line) for i, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    return lines[: cfg.limit] if cfg.limit else lines


def suite_row(prompt) -> dict:
    """The batch-input fields of one suite prompt: chat messages, or completion text
    (`datasets.RawText`, e.g. humaneval-raw) as a raw prompt."""
    from specjax.datasets import RawText

    return {"prompt": str(prompt), "raw": True} if isinstance(prompt, RawText) else {"messages": prompt}


def write_suite_jsonl(suite: str, path: str, limit: int | None = None) -> int:
    """Write a packaged suite as batch input (`{"id", "messages"}` or `{"id", "prompt", "raw"}`
    rows, `suite_row`); returns the row count."""
    lines = read_input(BatchConfig(output="", suite=suite, limit=limit))
    write_atomic(path, b"".join(raw + b"\n" for _, raw in lines))
    return len(lines)


def _valid_id(x) -> bool:
    return (isinstance(x, str) and x != "") or (isinstance(x, int) and not isinstance(x, bool))


def parse_row(line: int, raw: bytes, defaults, ignored: dict[str, int] | None = None) -> JobRow | BadRow:
    """One input line -> a row (not yet tokenized) or the reason it is bad. `ignored` counts the
    fields of JSON-object rows that specjax does not read (metadata, or a misspelt setting), so the
    job can name them once instead of silently dropping a setting."""
    from specjax.sampling import SamplingParams

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return BadRow(line, None, "not UTF-8 text")
    except json.JSONDecodeError as e:
        return BadRow(line, None, f"invalid JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return BadRow(line, None, "invalid JSON (nested too deeply)")
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        return BadRow(line, None, f"invalid JSON ({e})")
    if not isinstance(obj, dict):
        return BadRow(line, None, "a row must be a JSON object")
    if ignored is not None:
        for f in obj.keys() - ROW_FIELDS:
            ignored[f] = ignored.get(f, 0) + 1
    rid = obj.get("id")
    if not _valid_id(rid):
        what = f"invalid id {short_repr(rid)}" if "id" in obj else "missing id"
        return BadRow(line, None, f"{what}: a row needs an 'id' (a non-empty string or an integer)")
    if "max_tokens" in obj:  # OpenAI's name for it
        if "max_new_tokens" in obj and obj["max_new_tokens"] != obj["max_tokens"]:
            return BadRow(line, rid, "'max_tokens' and 'max_new_tokens' disagree; give one")
        obj["max_new_tokens"] = obj["max_tokens"]
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p and has_m:
        return BadRow(line, rid, "give either 'prompt' or 'messages', not both")
    if "raw" in obj and (not isinstance(obj["raw"], bool) or (obj["raw"] and not has_p)):
        return BadRow(line, rid, "'raw' must be true or false, and only with a 'prompt' string")
    if has_p:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            return BadRow(line, rid, "'prompt' must be a non-empty string")
        if obj.get("raw"):
            from specjax.datasets import RawText

            prompt = RawText(prompt)  # encode_prompt: no chat template
    elif has_m:
        prompt = obj["messages"]
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            return BadRow(line, rid, "'messages' must be a non-empty list of {'role': str, 'content': str}")
    else:
        return BadRow(line, rid, "missing prompt: a row needs a 'prompt' string or a 'messages' list")
    kw = {}
    for f in SAMPLING_FIELDS:
        if f in obj:
            v = obj[f]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return BadRow(line, rid, f"{f} must be a number, got {short_repr(v)}")
            kw[f] = v
    if "seed" not in kw:  # the job's seed (0 when unset) and the line: a rerun draws the same
        kw["seed"] = line_seed(defaults.seed or 0, line)
    try:
        sampling = dataclasses.replace(defaults, **kw)
    except SpecjaxError as e:  # SamplingParams validates on construction
        return BadRow(line, rid, str(e))
    assert isinstance(sampling, SamplingParams)
    return JobRow(line, rid, prompt, sampling)


def line_seed(job_seed: int, line: int) -> int:
    """The seed of a row without its own: a hash of the job's seed and the row's input line."""
    return int.from_bytes(hashlib.blake2b(f"{job_seed}:{line}".encode(), digest_size=4).digest(), "little")


def parse_input(
    lines: list[tuple[int, bytes]], defaults, ignored: dict[str, int] | None = None
) -> list[JobRow | BadRow]:
    """Parse every line; a repeated id is bad on every line after the first that has it."""
    first: dict[str, int] = {}
    out = []
    for line, raw in lines:
        r = parse_row(line, raw, defaults, ignored)
        if r.id is not None:
            key = json.dumps(r.id)
            if key in first:
                r = BadRow(line, r.id, f"duplicate id (first on line {first[key]})")
            else:
                first[key] = line
        out.append(r)
    return out


def tokenize(model, row: JobRow, raw: bool) -> JobRow | BadRow:
    """Token ids of a row's prompt, checked against the context (prompt + its max_new_tokens)."""
    from specjax.prompts import check_fits, encode_prompt

    try:
        ids = encode_prompt(model, row.prompt, raw)
        check_fits(model, len(ids), row.sampling.max_new_tokens)
    except SpecjaxError as e:
        return BadRow(row.line, row.id, str(e))
    except Exception as e:  # e.g. a chat template that rejects these messages
        return BadRow(row.line, row.id, f"cannot tokenize the prompt: {type(e).__name__}: {e}")
    return dataclasses.replace(row, token_ids=ids)


def input_fingerprint(lines: list[tuple[int, bytes]]) -> str:
    h = hashlib.sha256()
    for line, raw in lines:
        h.update(b"%d:" % line + raw + b"\n")
    return h.hexdigest()[:16]
