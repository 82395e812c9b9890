"""The compiled runtime: the speculative decode loop and what runs it.

* `step.py` — `decode_step`, one step as named stages (plan -> draft -> schedule -> verify +
  accept -> truncate -> commit -> stats) over the `LoopState`;
* `engine.py` — `Engine`: prefill, then the compiled `lax.while_loop` of `decode_step`, for
  whole batches (`specjax.generate`, batch jobs, bench);
* `slots.py` — `SlotEngine`: the same step over persistent per-slot state for continuous
  batching (the server);
* `compile_cache.py` — `CompileCache`: the executables both engines compile, one per function,
  static settings and argument shapes;
* `cached.py` — `get_engine`: one `Engine` per model and device mesh in a process.
"""
