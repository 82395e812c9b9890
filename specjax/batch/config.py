"""A batch job's settings (`specjax batch` flags; the job itself: job.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

LATENCY_BATCH_SIZE = {"batch": 16, "interactive": 1}  # default --batch-size per latency class


@dataclasses.dataclass
class BatchConfig:
    output: str
    input: str | None = None  # a JSONL file, or
    suite: str | None = None  # a packaged prompt suite (specjax.datasets): humaneval, mtbench, sharegpt
    limit: int | None = None  # only the first N rows (of the file or the suite)
    model: Any = None  # a Model, a path, or None (the default model)
    dtype: str | None = None
    drafter: str | None = "none"
    num_draft: int | str = 0  # K, or `auto` / `auto:N1,N2`: per batch class, the fastest measured (policy/batch.py)
    tree_topk: int = 1  # > 1: token trees of num_draft nodes (specjax.generate's tree_topk / tree_depth)
    tree_depth: int = 0
    spec_policy: str | int = "auto"  # specjax/policy/batch.py: auto | always | N (speculate up to N rows)
    sampling: Any = None  # default SamplingParams of rows
    batch_size: int | None = None  # None: from the latency class
    latency_class: str = "batch"
    raw: bool = False  # no chat template for "prompt" strings
    mesh: str | None = None  # "data=2,model=2"; None: every local device on `data`
    process_id: int = 0
    num_processes: int = 1
    merge_wait: float = 600.0  # process 0 gives up merging when no part grew for this long
    progress: bool = True
