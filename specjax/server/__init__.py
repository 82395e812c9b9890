"""`specjax serve`: the OpenAI-compatible HTTP server and what runs its requests.

* `app.py` — the HTTP API (Starlette + uvicorn): routes, request parsing, streaming, 400s;
* `scheduler.py` — continuous batching with latency classes (interactive first, batch rows
  preempted and parked for them), one thread owning the device;
* `config.py` — the serving config (`configs/serving-policy.yaml`);
* `metrics.py` — Prometheus text exposition (`/metrics`).

Elsewhere: the slot engine the scheduler drives (persistent per-slot decode state, compiled
prefill / insert / extract / chunk per (batch bucket, K), warm-up and step-cost timing) is
`specjax/runtime/slots.py`; when to speculate (K per chunk, the acceptance monitor) is
`specjax/policy/`, shared with `generate` and batch jobs; the offered-load sweep
(`specjax serve-bench`) is `specjax/bench/loadbench.py`.
"""
