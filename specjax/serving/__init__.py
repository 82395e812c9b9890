"""Serving: how requests reach the engine.

* `batch.py` — `specjax batch`: resumable offline jobs over a JSONL file of prompts;
* `scaleout.py` — devices (a `data` x `model` mesh) and hosts (one part file per process, merge);
* `slots.py` — the slot engine: persistent per-slot decode state, compiled prefill / insert /
  extract / chunk per (batch bucket, K), warm-up and step-cost timing;
* `scheduler.py` — continuous batching with latency classes (interactive first, batch rows
  preempted and parked for them), one thread owning the device;
* `policy.py` — load-aware throttling: K per chunk from step costs, batch, queue and acceptance;
* `monitor.py` — rolling acceptance / MAL per class, fallback with hysteresis and probes,
  the decision log;
* `metrics.py` — Prometheus text exposition;
* `server.py` — `specjax serve`, the OpenAI-compatible HTTP API (Starlette + uvicorn);
* `config.py` — the serving config (`configs/serving-policy.yaml`);
* `loadbench.py` — `specjax serve-bench`, the offered-load sweep.
"""
