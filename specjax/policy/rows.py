"""The per-row rule inside the compiled loop (`--spec-policy auto`: `generate` and batch jobs).

Each row keeps a running estimate of its drafts' acceptance and verifies only while the tokens a
verify step is expected to emit, per unit of its measured cost, beat a plain step; otherwise it
takes plain steps and probes again later, after a wait that doubles with every failed probe (up
to `MAX_WAIT` steps). The decision for a step depends only on tokens already emitted and on the
cost table, so the output law is untouched: every step, verifying or not, emits tokens with the
target's law.

Probes fall on multiples of the row's wait counted in its own steps, so rows of one batch that
wait as long probe on the same step: a verify pass is paid by the whole batch, and one row
probing alone on each step would make most steps wide. A table under which no width can pay even
when every draft is accepted (costs[L] > L + 1 for every L, e.g. a large batch on a CPU) never
verifies at all. On a step where no row may verify, the engine (`decode_step`) skips the
drafter's proposal too.

The state rides in `LoopState.policy` (specjax/runtime/engine.py); the engine calls `plan` before drafting
(which rows may verify) and `update` after acceptance. Costs come from costs.py.

Estimate: with `a` the row's decayed accepted drafts and `c` its decayed checked draft positions
(prior: one accept in two checks), alpha = a / c, and a verify of L drafts emits in expectation
1 + alpha + ... + alpha^L tokens (positions accepted independently at rate alpha). Cost of a
verify of L drafts, in plain steps: `costs[L]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

AUTO, ALWAYS, FORCE = 0, 1, 2  # `mode`: decide per row | verify whenever the drafter wants | time verify
MAX_WAIT = 128  # the longest wait (in the row's steps) between probes
DECAY = 0.9  # weight of the previous observations at each verify step
PRIOR_ACCEPTED, PRIOR_CHECKED = 1.0, 2.0
NEVER = np.iinfo(np.int32).max  # `resume` of rows whose table says no verify can pay


@struct.dataclass
class RowPolicy:
    costs: jax.Array  # [K + 1] f32, cost of verifying L drafts in plain steps (costs[0] = 1)
    mode: jax.Array  # [] int32: AUTO | ALWAYS | FORCE
    accepted: jax.Array  # [B] f32, decayed accepted drafts
    checked: jax.Array  # [B] f32, decayed checked draft positions
    resume: jax.Array  # [B] int32, the row's step count from which it may verify again
    backoff: jax.Array  # [B] int32, the wait after the next failed probe


def can_pay(costs: np.ndarray) -> bool:
    """Whether some width L >= 1 pays when every draft is accepted: L + 1 >= costs[L]."""
    widths = np.arange(len(costs))
    return bool(np.any(widths[1:] + 1 >= np.asarray(costs)[1:]))


def new_policy(b: int, costs: np.ndarray, mode: int) -> RowPolicy:
    """The state of `b` fresh rows: each verifies its first step (a probe), unless no width can
    pay under `costs` and `mode` is AUTO."""
    start = 0 if mode != AUTO or can_pay(costs) else NEVER
    return RowPolicy(
        costs=jnp.asarray(costs, jnp.float32),
        mode=jnp.asarray(mode, jnp.int32),
        accepted=jnp.zeros((b,), jnp.float32),
        checked=jnp.zeros((b,), jnp.float32),
        resume=jnp.full((b,), start, jnp.int32),
        backoff=jnp.ones((b,), jnp.int32),
    )


def plan(pol: RowPolicy, live: jax.Array, steps: jax.Array) -> jax.Array:
    """live [B] bool, steps [B] int32 (the rows' step counts) -> [B] bool: rows that may verify
    this step (the drafter still decides whether its drafts are worth it, e.g. the n-gram match or
    EAGLE-3's gate)."""
    return live & ((pol.mode != AUTO) | (steps >= pol.resume))


def expected_tokens(alpha: jax.Array, width: jax.Array) -> jax.Array:
    """alpha [B] in [0, 1), width [B] int32 -> [B] f32: 1 + alpha + ... + alpha^width."""
    alpha = jnp.clip(alpha, 0.0, 0.999)
    return (1.0 - alpha ** (width + 1).astype(jnp.float32)) / (1.0 - alpha)


def update(
    pol: RowPolicy, on: jax.Array, steps: jax.Array, width: jax.Array, checked: jax.Array, accepted: jax.Array
) -> RowPolicy:
    """After a step. on [B] bool: `plan`'s rows; steps [B] int32: the rows' step counts at this
    step; width [B] int32: drafts the row verified (0: a plain step); checked/accepted [B] int32:
    draft positions it checked (up to the first rejection) and accepted. A row that verified
    updates its estimate and stays on while the expected tokens per unit cost of that width beat a
    plain step (>= 1); else it waits: it may verify again from the first multiple of `backoff`
    at least `backoff` steps on, and `backoff` doubles. A row whose drafter proposed nothing
    learns nothing."""
    looked = on & (width > 0)  # [B]
    acc = jnp.where(looked, DECAY * pol.accepted + accepted, pol.accepted)  # [B]
    chk = jnp.where(looked, DECAY * pol.checked + checked, pol.checked)  # [B]
    alpha = (acc + PRIOR_ACCEPTED) / (chk + PRIOR_CHECKED)  # [B]
    w = jnp.clip(width, 1, pol.costs.shape[0] - 1)  # [B]
    pays = expected_tokens(alpha, w) >= pol.costs[w]  # [B]
    later = (steps + 2 * pol.backoff) // pol.backoff * pol.backoff  # [B], in steps + backoff .. + 2 backoff - 1
    resume = jnp.where(looked, jnp.where(pays, 0, later), pol.resume)  # [B]
    backoff = jnp.where(looked, jnp.where(pays, 1, jnp.minimum(2 * pol.backoff, MAX_WAIT)), pol.backoff)
    return pol.replace(accepted=acc, checked=chk, resume=resume.astype(jnp.int32), backoff=backoff.astype(jnp.int32))
