"""The training loop every drafter shares: Optax, Orbax checkpoints with exact resume, a
data-parallel mesh, a progress bar, and periodic evaluation (the acceptance simulator).

A drafter plugs in as a *task* object with:

* `init_params(seed) -> params` (a pytree of arrays; only these are trained),
* `frozen() -> pytree` of arrays the loss reads but does not train (target embedding, LM head),
  passed to the compiled step as an argument (closing over them would bake 100+ MB constants in),
* `loss(params, frozen, batch) -> (loss, metrics)` (pure; batch from `FeatureStore.batch`),
* `evaluate(params, store) -> dict` (host-side; e.g. simulated MAL and per-position acceptance),
* `batch_axes`: for each batch array, the axis that is the batch (sharded over devices). A task
  that lists `row_id` gets `row_id [B]` uint32, distinct for every (step, row slot): the seed of
  random choices it makes per row (DFlash's block anchors), a pure function of the step, so that
  resume stays exact and the draws do not depend on how rows are sharded.

Exact resume: the batch of step s is a pure function of (seed, s) (an epoch-wise permutation), and
checkpoints hold params, optimizer state and step. A run killed after checkpoint c and resumed
recomputes steps c+1.. bit-for-bit the same as an uninterrupted run on the same devices.

Devices: a 1-D mesh `("data",)` over all local devices; batches are sharded along their batch
axis and params/optimizer state replicated, so XLA inserts the gradient all-reduce. On one device
this is plain single-device training; the loss agrees across device counts up to float
reduction order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass
class OptimConfig:
    steps: int = 1000
    batch_size: int = 8
    lr: float = 3e-4
    warmup_steps: int = 50
    end_lr_fraction: float = 0.1
    clip: float = 1.0
    weight_decay: float = 0.0
    checkpoint_every: int = 100
    eval_every: int = 200
    max_to_keep: int = 2
    seed: int = 0


def make_optimizer(o: OptimConfig) -> optax.GradientTransformation:
    """AdamW on a linear-warmup + cosine schedule, after global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, o.lr, max(o.warmup_steps, 1), max(o.steps, o.warmup_steps + 1), end_value=o.lr * o.end_lr_fraction
    )
    return optax.chain(optax.clip_by_global_norm(o.clip), optax.adamw(schedule, weight_decay=o.weight_decay))


def batch_indices(num_rows: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Rows of step `step`: consecutive slices of a per-epoch permutation (pure in seed, step)."""
    out = []
    pos = step * batch_size
    while len(out) < batch_size:
        epoch, off = divmod(pos, num_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
        take = perm[off : off + batch_size - len(out)]
        out.extend(take.tolist())
        pos += len(take)
    return np.asarray(out)


def trim_padding(batch: dict, batch_axes: dict, multiple: int = 64) -> dict:
    """Cut the sequence axis (the one after each array's batch axis) to the batch's longest
    response, rounded up to `multiple` so that only a few shapes compile. Sequences are stored
    right-padded to a fixed length; most batches need far less, and the loss never reads past
    the last response token."""
    mask = batch["mask"]  # [B, T]
    last = int(np.max(np.nonzero(mask.any(axis=0))[0], initial=0)) + 2  # + the label position
    t = min(mask.shape[1], -(-last // multiple) * multiple)
    out = {}
    for k, v in batch.items():
        ax = batch_axes.get(k, 0) + 1
        out[k] = v[(slice(None),) * ax + (slice(0, t),)] if v.ndim > ax else v
    return out


def data_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()), ("data",))


def _checkpoint_manager(path: str, o: OptimConfig):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=o.max_to_keep, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(path), options=options)


def fit(task, store, o: OptimConfig, out_dir: str, eval_store=None, console=None, stop_after: int | None = None):
    """Train `task` on `store` for `o.steps` steps (resuming from `out_dir/checkpoints`).

    Appends one JSON line per step to `out_dir/log.jsonl` and returns the final params.
    `stop_after` ends the run early after that many steps of this invocation (tests).
    """
    import orbax.checkpoint as ocp

    os.makedirs(out_dir, exist_ok=True)
    mesh = data_mesh()
    n_dev = mesh.devices.size
    if o.batch_size % n_dev:
        raise ValueError(f"batch_size {o.batch_size} must be a multiple of the {n_dev} devices")
    replicated = NamedSharding(mesh, P())
    tx = make_optimizer(o)
    params = task.init_params(o.seed)
    state = {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state = jax.device_put(state, replicated)

    mngr = _checkpoint_manager(os.path.join(out_dir, "checkpoints"), o)
    start = mngr.latest_step() or 0
    if start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        state = jax.device_put(state, replicated)
    log_path = os.path.join(out_dir, "log.jsonl")
    _truncate_log(log_path, start)

    frozen = jax.device_put(task.frozen(), replicated)

    def step_fn(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(state["params"], frozen, batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    train_step = jax.jit(step_fn, donate_argnums=(0,))
    shardings = {name: NamedSharding(mesh, P(*([None] * axis + ["data"]))) for name, axis in task.batch_axes.items()}

    def device_batch(step):
        b = trim_padding(store.batch(batch_indices(len(store), o.batch_size, o.seed, step)), task.batch_axes)
        if "row_id" in task.batch_axes:
            b["row_id"] = (step * o.batch_size + np.arange(o.batch_size)).astype(np.uint32)
        return {k: jax.device_put(v, shardings[k]) for k, v in b.items() if k in shardings}

    end = o.steps if stop_after is None else min(o.steps, start + stop_after)
    progress = _Progress(console, start, o.steps)
    t0, tokens = time.perf_counter(), 0
    with progress:
        for step in range(start, end):
            batch = device_batch(step)
            state, metrics = train_step(state, frozen, batch)
            metrics = {k: float(v) for k, v in metrics.items()}
            tokens += int(np.asarray(batch["mask"]).sum())
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            record = {"step": step + 1, **metrics, "tokens_per_second": rate}
            if eval_store is not None and o.eval_every and (step + 1) % o.eval_every == 0:
                record["eval"] = task.evaluate(state["params"], eval_store)
                progress.note(record["eval"])
            with open(log_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if (step + 1) % o.checkpoint_every == 0 or step + 1 == o.steps:
                mngr.save(step + 1, args=ocp.args.StandardSave(state))
            progress.update(step + 1, metrics["loss"], rate)
    mngr.wait_until_finished()
    mngr.close()
    return state["params"]


def _truncate_log(path: str, step: int) -> None:
    """Drop log lines past the checkpoint we resume from (they will be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as fh:
        keep = [line for line in fh if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as fh:
        fh.writelines(keep)


def read_log(out_dir: str) -> list[dict]:
    """The per-step records so far ([] before the first step)."""
    if not os.path.exists(os.path.join(out_dir, "log.jsonl")):
        return []
    with open(os.path.join(out_dir, "log.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


class _Progress:
    """A rich progress bar with loss, tokens/s and ETA (quiet when console is None)."""

    def __init__(self, console, start: int, total: int):
        self.console, self.start, self.total = console, start, total
        self.prog = None

    def __enter__(self):
        if self.console is not None:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.prog = Progress(
                TextColumn("train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.prog.__enter__()
            self.task = self.prog.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def update(self, step: int, loss: float, rate: float):
        if self.prog is not None:
            info = f"loss {loss:.4f}  {rate:,.0f} tok/s" if math.isfinite(loss) else "loss nan"
            self.prog.update(self.task, completed=step, info=info)

    def note(self, ev: dict):
        if self.prog is not None:
            self.prog.console.print(
                "eval: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.items())
            )

    def __exit__(self, *exc):
        if self.prog is not None:
            self.prog.__exit__(*exc)
