"""Serving: how requests reach the engine.

* `batch.py` — `specjax batch`: resumable offline jobs over a JSONL file of prompts;
* `scaleout.py` — devices (a `data` x `model` mesh) and hosts (one part file per process, merge).

The serving scheduler (latency classes, K per batch, throttling) will live here too.
"""
