"""The compiled runtime: the speculative decode loop and what runs it.

* `engine.py` — `Engine`: prefill, then the compiled `lax.while_loop` of `decode_step`, for
  whole batches (`specjax.generate`, batch jobs, bench);
* `slots.py` — `SlotEngine`: the same step over persistent per-slot state for continuous
  batching (the server);
* `cached.py` — `get_engine`: one `Engine` per model and device mesh in a process.
"""
