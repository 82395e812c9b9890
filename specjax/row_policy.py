"""Per-row speculation fallback inside the compiled loop (`--spec-policy auto`).

Each row keeps a running estimate of its drafts' acceptance and verifies only while the tokens a
verify step is expected to emit, per unit of its measured cost, beat a plain step; otherwise it
takes plain steps and probes again after a wait that doubles with every failed probe (1, 2, 4,
... `MAX_WAIT` steps). The decision for a step depends only on tokens already emitted, so the
output law is untouched: every step, verifying or not, emits tokens with the target's law.

The state rides in `LoopState.policy` (specjax/engine.py); the engine calls `plan` before drafting
(which rows may verify) and `update` after acceptance. Costs come from `measure_costs`: the
decode loop timed on the batch's own prompts and shapes, once with every row verifying all K
drafts and once plain, cached on disk per model, drafter and batch bucket.

Estimate: with `a` the row's decayed accepted drafts and `c` its decayed checked draft positions
(prior: one accept in two checks), alpha = a / c, and a verify of L drafts emits in expectation
1 + alpha + ... + alpha^L tokens (positions accepted independently at rate alpha). Cost of a
verify of L drafts, in plain steps: `costs[L]` (measured at L = K; shorter widths interpolated
linearly in L from a plain step's 1.0).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

AUTO, ALWAYS, FORCE = 0, 1, 2  # `mode`: decide per row | verify whenever the drafter wants | time verify
MAX_WAIT = 64  # the longest run of plain steps between probes
DECAY = 0.9  # weight of the previous observations at each verify step
PRIOR_ACCEPTED, PRIOR_CHECKED = 1.0, 2.0


@struct.dataclass
class RowPolicy:
    costs: jax.Array  # [K + 1] f32, cost of verifying L drafts in plain steps (costs[0] = 1)
    mode: jax.Array  # [] int32: AUTO | ALWAYS | FORCE
    accepted: jax.Array  # [B] f32, decayed accepted drafts
    checked: jax.Array  # [B] f32, decayed checked draft positions
    wait: jax.Array  # [B] int32, plain steps left before the row may verify again
    backoff: jax.Array  # [B] int32, the wait after the next failed probe


def cost_table(k: int, verify_cost: float) -> np.ndarray:
    """[K + 1] costs in plain steps: 1 at L = 0, `verify_cost` at L = K, linear between."""
    return (1.0 + (max(verify_cost, 1.0) - 1.0) * np.arange(k + 1) / max(k, 1)).astype(np.float32)


def new_policy(b: int, costs: np.ndarray, mode: int) -> RowPolicy:
    """The state of `b` fresh rows: every row verifies its first step (a probe)."""
    return RowPolicy(
        costs=jnp.asarray(costs, jnp.float32),
        mode=jnp.asarray(mode, jnp.int32),
        accepted=jnp.zeros((b,), jnp.float32),
        checked=jnp.zeros((b,), jnp.float32),
        wait=jnp.zeros((b,), jnp.int32),
        backoff=jnp.ones((b,), jnp.int32),
    )


def plan(pol: RowPolicy, live: jax.Array) -> jax.Array:
    """live [B] bool -> [B] bool: rows that may verify this step (the drafter still decides
    whether its drafts are worth it, e.g. the n-gram match or EAGLE-3's gate)."""
    return live & ((pol.mode != AUTO) | (pol.wait == 0))


def expected_tokens(alpha: jax.Array, width: jax.Array) -> jax.Array:
    """alpha [B] in [0, 1), width [B] int32 -> [B] f32: 1 + alpha + ... + alpha^width."""
    alpha = jnp.clip(alpha, 0.0, 0.999)
    return (1.0 - alpha ** (width + 1).astype(jnp.float32)) / (1.0 - alpha)


def update(pol: RowPolicy, on: jax.Array, live: jax.Array, width: jax.Array, checked: jax.Array,
           accepted: jax.Array) -> RowPolicy:
    """After a step. on/live [B] bool; width [B] int32: drafts the row verified this step (0: a
    plain step); checked/accepted [B] int32: draft positions it checked (up to the first
    rejection) and accepted. A row that verified updates its estimate and stays on while the
    expected tokens per unit cost of that width beat a plain step (>= 1); else it waits `backoff`
    steps and doubles it. A row that may verify but whose drafter proposed nothing learns
    nothing. Waiting rows count down."""
    looked = on & live & (width > 0)  # [B]
    acc = jnp.where(looked, DECAY * pol.accepted + accepted, pol.accepted)  # [B]
    chk = jnp.where(looked, DECAY * pol.checked + checked, pol.checked)  # [B]
    alpha = (acc + PRIOR_ACCEPTED) / (chk + PRIOR_CHECKED)  # [B]
    w = jnp.clip(width, 1, pol.costs.shape[0] - 1)  # [B]
    pays = expected_tokens(alpha, w) >= pol.costs[w]  # [B]
    counted = jnp.where(live, jnp.maximum(pol.wait - 1, 0), pol.wait)  # [B]
    wait = jnp.where(looked, jnp.where(pays, 0, pol.backoff), counted)
    backoff = jnp.where(looked, jnp.where(pays, 1, jnp.minimum(2 * pol.backoff, MAX_WAIT)), pol.backoff)
    return pol.replace(accepted=acc, checked=chk, wait=wait.astype(jnp.int32), backoff=backoff.astype(jnp.int32))


# ---- step costs, measured on this machine -------------------------------------------------------

_COSTS: dict[str, float] = {}
PROBE_TOKENS = 24


def _costs_file() -> str:
    from specjax.models.loading import cache_root

    return os.path.join(cache_root(), "step-costs.json")


def cost_key(model, drafter, label: str, batch: int) -> str:
    """What a verify step's relative cost depends on: model, dtype, drafter (its label, K and
    verify widths), batch bucket (a power of two), device."""
    bucket = 1 << max(batch - 1, 0).bit_length()
    return "|".join([model.name, str(model.dtype), label, f"K{drafter.num_draft}", repr(drafter.verify_lengths),
                     f"B{bucket}", jax.devices()[0].device_kind])


def measure_costs(engine, prompt_ids, params, eos_ids, drafter, label: str) -> np.ndarray:
    """[K + 1] cost table for this batch: the decode loop over the batch's own prompts and shapes
    (`PROBE_TOKENS` tokens a row) timed with every live row verifying all K drafts (`FORCE`) and
    plain, after one untimed run of each (the first loop runs after compiling are slow). The
    verify-to-plain ratio is cached in memory and in `$SPECJAX_CACHE/step-costs.json`."""
    k = drafter.num_draft
    key = cost_key(engine.model, drafter, label, len(prompt_ids))
    if key not in _COSTS:
        try:
            with open(_costs_file()) as fh:
                _COSTS.update({k_: float(v) for k_, v in json.load(fh).items()})
        except (OSError, ValueError, AttributeError):
            pass
    if key not in _COSTS:
        def per_step(mode, d):
            rows = engine.generate(prompt_ids, params, eos_ids=(), drafter=d, max_new_cap=PROBE_TOKENS,
                                   spec_mode=mode)
            return rows[0].decode_seconds / max(max(r.steps for r in rows), 1)

        for _ in range(2):  # the first of each is a warm-up
            verify_s, plain_s = per_step(FORCE, drafter), per_step(ALWAYS, None)
        _COSTS[key] = verify_s / plain_s
        try:
            os.makedirs(os.path.dirname(_costs_file()), exist_ok=True)
            tmp = f"{_costs_file()}.tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                json.dump(_COSTS, fh, indent=1)
            os.replace(tmp, _costs_file())
        except OSError:
            pass  # an unwritable cache: measured again next run
    return cost_table(k, _COSTS[key])
