"""The per-row rule inside the compiled loop (`--spec-policy auto`: `generate` and batch jobs).

Each row keeps a running estimate of its drafts' acceptance and verifies only while the tokens a
verify step is expected to emit, per unit of its measured cost, beat a plain step; otherwise it
takes plain steps and probes again later, after a wait that doubles with every failed probe (up
to a longest wait) and is at least long enough that failed probes lose at most a set share (the
probe loss) of the row's steps at its current estimate. The longest wait and the probe loss come
from the drafter (`Drafter.probe_wait`; by default `MAX_WAIT` and `PROBE_LOSS`): a drafter whose
acceptance switches with the text, like the n-gram drafter's on a repeated span, wants short
waits. The decision for a step depends only on tokens already emitted and on the cost table, so
the output law is untouched: every step, verifying or not, emits tokens with the target's law.

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
1 + alpha + ... + alpha^L tokens (positions accepted independently at rate alpha). A step on
which the row may verify costs `costs[L]` plain steps when it verifies L drafts, and `costs[0]`
when its drafter declines (a gated drafter, e.g. EAGLE-3's confidence gate, proposed and found
nothing worth a verify: the drafter ran, the target took a plain step). With `s` the row's
decayed share of such steps that verified (prior: they all do, with a small weight), a step with
the row on is worth s * E[tokens] + (1 - s) tokens for s * costs[L] + (1 - s) * costs[0] plain
steps; the row stays on while that is at least 1 token per plain step. Declined steps count because they are not free:
a row whose gate declines on most steps pays its drafter on each of them for nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# `mode`: decide per row | verify whenever the drafter wants | time verify | time declined steps |
# no row verifies and the drafter does not propose (the slot engine's plain chunks of a drafter
# whose commits it defers: specjax/runtime/slots.py)
AUTO, ALWAYS, FORCE, IDLE, OFF = 0, 1, 2, 3, 4
MAX_WAIT = 128  # the default longest wait (in the row's steps) between probes
# The default share of a row's steps that its failed probes may lose: a row that turns off waits
# at least (expected loss of a step with it on) / PROBE_LOSS steps. A drafter far from paying (loss
# 0.5 plain steps) then waits 32-63 steps after its first probe instead of 2, 4, 8, ...
PROBE_LOSS = 0.01
DECAY = 0.9  # weight of the previous observations at each new one (acceptance: verify steps; share: on-steps)
PRIOR_ACCEPTED, PRIOR_CHECKED = 1.0, 2.0
# Prior of the share of on-steps that verify: all of them, worth a quarter of a step, so that a
# row whose drafter keeps declining sees its share fall to ~2% (the decayed counts hold ~10 steps).
PRIOR_VERIFIED = 0.25
NEVER = np.iinfo(np.int32).max  # `resume` of rows whose table says no verify can pay


@struct.dataclass
class RowPolicy:
    costs: jax.Array  # [K + 1] f32, cost of verifying L drafts in plain steps (costs[0]: a declined step)
    mode: jax.Array  # [] int32: AUTO | ALWAYS | FORCE | IDLE | OFF
    max_wait: jax.Array  # [] int32, the longest wait between probes
    probe_loss: jax.Array  # [] f32, the share of the row's steps its failed probes may lose
    accepted: jax.Array  # [B] f32, decayed accepted drafts
    checked: jax.Array  # [B] f32, decayed checked draft positions
    tried: jax.Array  # [B] f32, decayed steps on which the row could verify
    verified: jax.Array  # [B] f32, decayed steps on which it did
    resume: jax.Array  # [B] int32, the row's step count from which it may verify again
    backoff: jax.Array  # [B] int32, the wait after the next failed probe


def can_pay(costs: np.ndarray) -> bool:
    """Whether some width L >= 1 pays when every draft is accepted: L + 1 >= costs[L]."""
    widths = np.arange(len(costs))
    return bool(np.any(widths[1:] + 1 >= np.asarray(costs)[1:]))


def new_policy(b: int, costs: np.ndarray, mode: int, probe_wait: tuple[int, float] | None = None) -> RowPolicy:
    """The state of `b` fresh rows: each verifies its first step (a probe), unless no width can
    pay under `costs` and `mode` is AUTO. `probe_wait`: (longest wait, probe loss), None for
    (MAX_WAIT, PROBE_LOSS)."""
    start = 0 if mode != AUTO or can_pay(costs) else NEVER
    max_wait, probe_loss = probe_wait or (MAX_WAIT, PROBE_LOSS)
    return RowPolicy(
        costs=jnp.asarray(costs, jnp.float32),
        mode=jnp.asarray(mode, jnp.int32),
        max_wait=jnp.asarray(max_wait, jnp.int32),
        probe_loss=jnp.asarray(probe_loss, jnp.float32),
        accepted=jnp.zeros((b,), jnp.float32),
        checked=jnp.zeros((b,), jnp.float32),
        tried=jnp.zeros((b,), jnp.float32),
        verified=jnp.zeros((b,), jnp.float32),
        resume=jnp.full((b,), start, jnp.int32),
        backoff=jnp.ones((b,), jnp.int32),
    )


def plan(pol: RowPolicy, live: jax.Array, steps: jax.Array) -> jax.Array:
    """live [B] bool, steps [B] int32 (the rows' step counts) -> [B] bool: rows that may verify
    this step (the drafter still decides whether its drafts are worth it, e.g. the n-gram match or
    EAGLE-3's gate). IDLE and OFF: none (under IDLE the drafter still proposes: `draft` in
    runtime/step.py)."""
    return live & (pol.mode != IDLE) & (pol.mode != OFF) & ((pol.mode != AUTO) | (steps >= pol.resume))


def expected_tokens(alpha: jax.Array, width: jax.Array) -> jax.Array:
    """alpha [B] in [0, 1), width [B] int32 -> [B] f32: 1 + alpha + ... + alpha^width."""
    alpha = jnp.clip(alpha, 0.0, 0.999)
    return (1.0 - alpha ** (width + 1).astype(jnp.float32)) / (1.0 - alpha)


def update(
    pol: RowPolicy, on: jax.Array, steps: jax.Array, width: jax.Array, checked: jax.Array, accepted: jax.Array
) -> RowPolicy:
    """After a step. on [B] bool: `plan`'s rows; steps [B] int32: the rows' step counts at this
    step; width [B] int32: drafts the row verified (0: a plain step); checked/accepted [B] int32:
    draft positions it checked (up to the first rejection) and accepted. A row that was on updates
    its estimates (acceptance only when it verified) and stays on while a step with it on is
    expected to emit at least one token per plain step of cost (module doc; the width of a
    declined step is taken as K); else it waits: with `wait` the larger of `backoff` and the
    loss-scaled wait (`probe_loss`), it may verify again from the first multiple of `wait` at least
    `wait` steps on, and `backoff` becomes 2 * wait."""
    looked = on & (width > 0)  # [B]
    acc = jnp.where(looked, DECAY * pol.accepted + accepted, pol.accepted)  # [B]
    chk = jnp.where(looked, DECAY * pol.checked + checked, pol.checked)  # [B]
    tried = jnp.where(on, DECAY * pol.tried + 1.0, pol.tried)  # [B]
    verified = jnp.where(on, DECAY * pol.verified + looked, pol.verified)  # [B]
    alpha = (acc + PRIOR_ACCEPTED) / (chk + PRIOR_CHECKED)  # [B]
    share = (verified + PRIOR_VERIFIED) / (tried + PRIOR_VERIFIED)  # [B]
    k = pol.costs.shape[0] - 1
    w = jnp.where(looked, jnp.clip(width, 1, k), k)  # [B]
    tokens = share * expected_tokens(alpha, w) + (1.0 - share)  # [B]
    cost = share * pol.costs[w] + (1.0 - share) * pol.costs[0]  # [B]
    pays = tokens >= cost  # [B]
    # A step with the row on loses `cost - tokens` plain steps: wait long enough that probing
    # loses at most `probe_loss` of the row's steps (a power of two, so that rows still align).
    scaled = jnp.exp2(jnp.floor(jnp.log2(jnp.maximum((cost - tokens) / pol.probe_loss, 1.0)))).astype(jnp.int32)
    wait = jnp.clip(scaled, pol.backoff, pol.max_wait)  # [B]
    later = (steps + 2 * wait) // wait * wait  # [B], in steps + wait .. + 2 wait - 1
    resume = jnp.where(on, jnp.where(pays, 0, later), pol.resume)  # [B]
    backoff = jnp.where(on, jnp.where(pays, 1, jnp.minimum(2 * wait, pol.max_wait)), pol.backoff)
    return pol.replace(
        accepted=acc,
        checked=chk,
        tried=tried,
        verified=verified,
        resume=resume.astype(jnp.int32),
        backoff=backoff.astype(jnp.int32),
    )
