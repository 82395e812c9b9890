"""Serving: how requests reach the engine.

* `batch.py` — `specjax batch`: resumable offline jobs over a JSONL file of prompts;
* `scaleout.py` — devices (a `data` x `model` mesh) and hosts (one part file per process, merge);
* `specjax/runtime/slots.py` — the slot engine: persistent per-slot decode state, compiled prefill / insert /
  extract / chunk per (batch bucket, K), warm-up and step-cost timing;
* `scheduler.py` — continuous batching with latency classes (interactive first, batch rows
  preempted and parked for them), one thread owning the device;
* when to speculate (K per chunk, the acceptance monitor): `specjax/policy/`, shared with
  `generate` and batch jobs;
* `metrics.py` — Prometheus text exposition;
* `server.py` — `specjax serve`, the OpenAI-compatible HTTP API (Starlette + uvicorn);
* `config.py` — the serving config (`configs/serving-policy.yaml`);
* `loadbench.py` — `specjax serve-bench`, the offered-load sweep.
"""
