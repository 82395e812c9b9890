"""One speculative decode step as named stages: plan -> draft -> verify (+ accept) -> truncate ->
commit -> stats.

`decode_step` is the one implementation of a step: `Engine.generate` loops it until every row is
done (specjax/runtime/engine.py), the slot engine (specjax/runtime/slots.py) loops it for a
bounded number of steps over persistent slots whose rows come and go between chunks. For that,
everything a row needs (its sampling settings, stop ids, limits) lives in `LoopState`, every
per-row leaf of the state has a leading batch-major dim (`B` or `B * r`), and the statistics
arrays may be wider than K.

The stages, each a pure function of pytrees:

* `plan`: which rows run and which the speculation policy lets verify (`StepPlan`);
* `draft`: the drafter's `Proposal` (skipped when no row may verify; deferred commits caught up);
* `schedule`: which pass the target runs and which drafts each row checks (`Verification`, the
  one struct that says where the drafts are: vLLM's `SpecDecodeMetadata`);
* `verify`: the target's pass over [last, drafts] (or a plain one-token pass, or a token tree
  under its ancestor mask), each followed by `specjax.verify.accept`, the one accept entry point
  (`PassOutput`: accepted count, emitted tokens, the pass's unwritten keys/values and features);
* `truncate`: emitted tokens cut at stop ids and `max_new`, written to the history;
* `commit`: the target cache written and advanced, the drafter's `commit` (or its deferral);
* `stats`: per-position checks and accepts, the policy's running estimates.

Invariant: `history[b, :hist_len[b]]` is prompt + emitted tokens, and the KV cache holds all of
them but the last. K = 0 is plain decoding.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specjax.drafters.base import CommitContext, Drafter, InitContext, Proposal, StepContext
from specjax.models.kv_cache import KVCache, KVUpdate, write_rows
from specjax.models.tree import ancestor_mask, first_children, mask_depths
from specjax.policy.rows import FORCE, IDLE, NEVER, RowPolicy
from specjax.policy.rows import plan as policy_plan
from specjax.policy.rows import update as policy_update
from specjax.sampling import FIRST_TOKEN, STREAM_DRAFT, STREAM_SAMPLE, STREAM_VERIFY, SamplingArrays, derive, sample
from specjax.verify import accept


@struct.dataclass
class Pending:
    """The emitted tokens the drafter has not committed yet, for drafters with `lazy_commit` under
    a speculation policy: each row's last `count` emitted tokens (count <= P, `pending_width`) and
    the target features the drafter's commit reads for them (slot i: the pass position that
    emitted token i)."""

    count: jax.Array  # [B] int32
    features: Any  # [n, B, P, D] target features (`feature_layers` outputs) at those positions, or None
    final_hidden: Any  # [B, P, D] final normed hidden state at those positions, or None


@struct.dataclass
class LoopState:
    cache: KVCache  # target cache: every emitted token but the last
    draft_state: object  # the drafter's pytree
    history: jax.Array  # [B, S] int32, prompt + emitted
    hist_len: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    stopped: jax.Array  # [B] bool, ended on EOS / a stop id (else on length)
    seed: jax.Array  # [B] uint32, each row's random seed (specjax/sampling.py)
    steps: jax.Array  # [B] int32, steps in which the row was running
    checked: jax.Array  # [B, W] int32, times draft position i was checked (W >= K)
    accepted: jax.Array  # [B, W] int32, times draft position i was accepted
    off_chain: jax.Array  # [B] int32, tree steps whose accepted path left the drafter's top-1 chain
    # The row's own settings, fixed for its life; in the state so a slot can change rows.
    prompt_len: jax.Array  # [B] int32
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, M] int32, -1 padded
    sampling: SamplingArrays  # [B] each
    policy: RowPolicy | None = None  # per-row speculation fallback (specjax/policy/rows.py), or None
    pending: Pending | None = None  # plain steps whose drafter commit is deferred, or None


@struct.dataclass
class StepPlan:
    """What the step may do, decided before drafting."""

    live: jax.Array  # [B] bool, rows still running
    on: jax.Array  # [B] bool, live rows the speculation policy lets verify (all live rows without one)
    force_verify: Any  # bool or [] bool: verify every live row's K drafts (the slot engine's timing)
    force_draft: Any  # bool or [] bool: propose though no row may verify (timing declined steps: IDLE)
    last: jax.Array  # [B, 1] int32, each row's last emitted token (not in the cache yet)
    draft_seeds: jax.Array  # [B] uint32, this step's draft randomness
    verify_seeds: jax.Array  # [B] uint32, this step's accept randomness


@struct.dataclass
class Verification:
    """Which rows verify which drafts: the target pass's input and the accept step's view of it."""

    tokens_in: jax.Array  # [B, K+1] int32, [last, drafts] as the pass reads them
    draft: jax.Array  # [B, K] int32, drafts as the accept step sees them (-1 past a row's `own`)
    q: Any  # [B, K, V] f32 draft probabilities (0 past a row's `own`), or None (one-hot)
    own: jax.Array  # [B] int32, drafts each row checks (0: none; a tree: the depth of its own nodes)
    branch: Any  # [] int32 index into the step's passes (0: the plain one-token pass), or None: one pass
    parents: Any = None  # [B, K] int32 the tree's parents as drafted, or None: a chain
    accept_parents: Any = None  # [B, K] int32 parents for the accept step (-2: the row accepts nothing)
    chain: Any = None  # [B, K] int32 the tree's top-1 chain (-1 past its end), or None
    mask: Any = None  # [B, N+1, N+1] bool the tree's ancestor mask over [last, nodes], or None


@struct.dataclass
class PassOutput:
    """The verify stage's result, K + 1 wide whatever pass ran."""

    n: jax.Array  # [B] int32, drafts accepted
    emitted: jax.Array  # [B, K+1] int32, accepted drafts then the recovered/bonus token, -1 after
    new_kv: KVUpdate  # the pass's keys and values, unwritten, K + 1 positions (a tree: its path)
    features: Any  # [n, B, K+1, D] target features at the emitting positions, or None
    final_hidden: Any  # [B, K+1, D] final normed hidden state there, or None


@struct.dataclass
class RowInputs:
    """Each row's request as the loop takes it."""

    prompt: jax.Array  # [B, T] int32, right-padded
    prompt_len: jax.Array  # [B] int32
    sampling: SamplingArrays  # [B] settings
    max_new: jax.Array  # [B] int32
    stop_ids: jax.Array  # [B, M] int32 (-1 padded)
    seed: jax.Array  # [B] uint32, each row's random seed


def _is_stop(tokens, stop_ids):
    """tokens [B, T], stop_ids [B, M] (-1 padded) -> [B, T] bool."""
    return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)


def init_state(
    dparams,
    cache,
    last_logits,
    features,
    final_hidden,
    rows: RowInputs,
    *,
    drafter: Drafter,
    all_greedy: bool,
    stat_width: int,
    policy: RowPolicy | None = None,
) -> LoopState:
    """The loop state after the prefill.

    Args:
      dparams: the drafter's parameters; cache: the target cache after the prefill.
      last_logits: [B, V] logits after each prompt's last token (the first token is sampled here).
      features: [n, B, T, D] prompt features of the drafter's `feature_layers`, or None.
      final_hidden: [B, T, D] final normed hidden state over the prompt, or None.
      rows: the rows' prompts, sampling settings, token budgets, stop ids and seeds.
      stat_width: W of the statistics arrays (>= the drafter's accept width).
      policy: the rows' speculation fallback, or None (every step verifies what the drafter proposes).

    Returns:
      The `LoopState`: history [B, S] (S = the cache's size) holding prompt + first token.
    """
    prompt, prompt_len, samp, seed = rows.prompt, rows.prompt_len, rows.sampling, rows.seed
    b, s = prompt.shape[0], cache.size
    first = sample(derive(seed, FIRST_TOKEN, STREAM_SAMPLE), last_logits, samp)  # [B]
    history = jnp.zeros((b, s), jnp.int32).at[:, : prompt.shape[1]].set(prompt)  # [B, S]
    history = history.at[jnp.arange(b), prompt_len].set(first)
    hist_len = prompt_len + 1  # [B]
    stop = _is_stop(first[:, None], rows.stop_ids)[:, 0]  # [B]
    lazy = defers_commits(drafter, policy)
    # A deferred catch-up writes P drafter-cache positions from the first deferred one: room past S.
    room = s + (pending_width(drafter) if lazy else 0)
    dstate = drafter.init(
        dparams,
        InitContext(prompt, prompt_len, history, hist_len, samp, features, final_hidden, room, all_greedy),
    )
    return LoopState(
        cache=cache,
        draft_state=dstate,
        history=history,
        hist_len=hist_len,
        done=stop | (rows.max_new <= 1),
        stopped=stop,
        seed=seed,
        steps=jnp.zeros((b,), jnp.int32),
        checked=jnp.zeros((b, stat_width), jnp.int32),
        accepted=jnp.zeros((b, stat_width), jnp.int32),
        off_chain=jnp.zeros((b,), jnp.int32),
        prompt_len=prompt_len,
        max_new=rows.max_new,
        stop_ids=rows.stop_ids,
        sampling=samp,
        policy=policy,
        pending=new_pending(drafter, b, features, final_hidden) if lazy else None,
    )


def defers_commits(drafter: Drafter, policy) -> bool:
    """Whether the loop defers the drafter's commits (static): under a speculation policy, for
    drafters whose proposal is optional and whose commits may be deferred."""
    return policy is not None and drafter.num_draft > 0 and drafter.proposal_optional and drafter.lazy_commit


# Plain steps a row defers its drafter's commits over before catching up, in one pass over them
# all (or sooner, before its next proposal). A pass's cost grows far slower than its width at
# small batch: at batch 1 on the 2-core CPU the MTP modules take 3.0 ms over 4 positions, 5.7 ms
# over 16 and 8.2 ms over 32 (docs/spec-policy.md), so a row that does not verify pays its
# drafter's upkeep in a third of the time.
PENDING_STEPS = 32


def pending_width(drafter: Drafter) -> int:
    """P: the most tokens a row's `Pending` holds (static; at least a verify step's K + 1)."""
    return max(PENDING_STEPS, drafter.accept_width + 1)


def new_pending(drafter: Drafter, b: int, features, final_hidden) -> Pending:
    """No deferred steps; buffers shaped after the prefill's features `[n, B, T, D]` and final
    hidden state `[B, T, D]` (None when the drafter reads none)."""
    w = pending_width(drafter)
    feats = (
        None if features is None else jnp.zeros(features.shape[:2] + (w, features.shape[3]), features.dtype)
    )  # [n, B, P, D]
    final = None if final_hidden is None else jnp.zeros((b, w, final_hidden.shape[2]), final_hidden.dtype)  # [B, P, D]
    return Pending(jnp.zeros((b,), jnp.int32), feats, final)


def defer(pend: Pending, n_emit, features, final_hidden) -> Pending:
    """Add a step's emitted tokens to `pend`: n_emit [B] tokens each row added to the history (0
    when not running), features [n, B, K + 1, D] / final_hidden [B, K + 1, D] the step's target states
    (position j emitted token j). The caller keeps count + n_emit <= P."""

    def put(buf, new, axis):  # buf [..., B, P, D], new [..., B, K+1, D]: slot count + j of a row gets position j
        src = jnp.arange(buf.shape[axis])[None] - pend.count[:, None]  # [B, P]
        take = (src >= 0) & (src < n_emit[:, None])  # [B, P]
        shape = (1,) * (buf.ndim - 3) + src.shape + (1,)
        idx = jnp.clip(src, 0, new.shape[axis] - 1).reshape(shape)
        moved = jnp.take_along_axis(new, jnp.broadcast_to(idx, buf.shape[:-1] + new.shape[-1:]), axis=axis)  # like buf
        return jnp.where(take.reshape(shape), moved, buf)

    return pend.replace(
        count=pend.count + n_emit,
        features=None if pend.features is None else put(pend.features, features, 2),
        final_hidden=None if pend.final_hidden is None else put(pend.final_hidden, final_hidden, 1),
    )


def catch_up(drafter: Drafter, dparams, dstate, pend: Pending, history, hist_len, width: int):
    """Commit the deferred tokens in one context `width` wide (count <= width <= P), as if one
    verify step had emitted each row's last `count` tokens (n_accepted = count - 1; -1: none).
    Returns (drafter state, empty Pending)."""
    idx = hist_len[:, None] - pend.count[:, None] + jnp.arange(width)[None]  # [B, width]
    tokens = jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)  # [B, width]
    feats = None if pend.features is None else pend.features[:, :, :width]  # [n, B, width, D]
    final = None if pend.final_hidden is None else pend.final_hidden[:, :width]  # [B, width, D]
    ctx = CommitContext(pend.count - 1, tokens, history, hist_len, pend.count > 0, feats, final)
    return drafter.catch_up(dparams, dstate, ctx), pend.replace(count=jnp.zeros_like(pend.count))


def plan(st: LoopState, k: int, force_verify) -> StepPlan:
    """Stage 1: the step's randomness (keyed by each row's seed and its own step count), the live
    rows, and which of them the policy lets verify (`st.policy` None or K = 0: every live row)."""
    step_seed = derive(st.seed, st.steps)  # [B]; derive(s, a, b) == derive(derive(s, a), b)
    live = ~st.done  # [B]
    last = jnp.take_along_axis(st.history, (st.hist_len - 1)[:, None], axis=1)  # [B, 1]
    pol = st.policy if k > 0 else None
    on = live if pol is None else policy_plan(pol, live, st.steps)  # [B]
    force_draft = False
    if pol is not None:
        force_verify = force_verify | (pol.mode == FORCE)
        force_draft = pol.mode == IDLE
    seeds = derive(step_seed, STREAM_DRAFT), derive(step_seed, STREAM_VERIFY)
    return StepPlan(live, on, force_verify, force_draft, last, *seeds)


def draft(drafter: Drafter, dparams, st: LoopState, pl: StepPlan, all_greedy: bool):
    """Stage 2: the drafter's proposal. Under a speculation policy a `proposal_optional` drafter
    proposes only when some row may verify (else an idle proposal of zeros, inactive), and a
    `lazy_commit` drafter first catches up its deferred commits: in a pass P wide when some row
    holds more than a verify step's K + 1 tokens (or P, so that this step's would not fit), else
    K + 1 wide in the conditional that also proposes; when every live row is retired (`NEVER`),
    its deferred commits are dropped instead. Each conditional writes the drafter's state in one
    branch only and passes it through in the other (XLA copies a buffer into a conditional whose
    two branches both write it). Returns (Proposal, drafter state, Pending or None)."""
    policed = st.policy is not None
    costs = st.policy.costs if policed else None  # [K + 1] or None
    ctx = StepContext(st.history, st.hist_len, st.sampling, pl.draft_seeds, all_greedy, pl.on, pl.force_verify, costs)
    if not (policed and drafter.proposal_optional):
        return (*drafter.propose(dparams, st.draft_state, ctx), st.pending)
    drafting = jnp.any(pl.on) | pl.force_verify | pl.force_draft  # []
    shapes = jax.eval_shape(drafter.propose, dparams, st.draft_state, ctx)
    idle = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])  # draft [B, K] 0, inactive
    if not defers_commits(drafter, st.policy):
        proposal, dstate = jax.lax.cond(
            drafting, lambda: drafter.propose(dparams, st.draft_state, ctx), lambda: (idle, st.draft_state)
        )
        return proposal, dstate, st.pending
    kp1, p = drafter.accept_width + 1, pending_width(drafter)
    count = st.pending.count  # [B]
    wide = jnp.any(count >= p) | (drafting & jnp.any(count > kp1))  # []
    # Rows whose table says no verify can pay never propose again: their upkeep is dropped.
    retired = jnp.all((st.policy.resume == NEVER) | ~pl.live)  # []
    dstate, pending = jax.lax.cond(
        wide & ~retired,
        lambda: catch_up(drafter, dparams, st.draft_state, st.pending, st.history, st.hist_len, p),
        lambda: (st.draft_state, st.pending.replace(count=jnp.where(retired, 0, count))),
    )

    def start():
        dst, pend = jax.lax.cond(
            jnp.any(pending.count > 0),
            lambda: catch_up(drafter, dparams, dstate, pending, st.history, st.hist_len, kp1),
            lambda: (dstate, pending),
        )
        return (*drafter.propose(dparams, dst, ctx), pend)

    return jax.lax.cond(drafting, start, lambda: (idle, dstate, pending))


def schedule(drafter: Drafter, proposal: Proposal, pl: StepPlan, policed: bool) -> Verification:
    """Stage 3: which pass runs and which drafts each row checks.

    Each row checks what it would check alone: the shortest of `drafter.verify_lengths` that holds
    its wanted count (`Proposal.length`: leading drafts of a chain, leading nodes of a tree, whose
    nodes come parents first, so any prefix is a tree), none when it is not active; the pass
    verifies the shortest listed prefix that holds every live row's (the plain one-token pass when
    none is active: far cheaper than K + 1 positions). What lies past a row's own prefix is masked
    (a chain's drafts -1 with q = 0: its token there is drawn from the target, as at the end of its
    chain; a tree's nodes parent -2: never accepted), so what a row emits does not depend on its
    batch-mates. A chain with a single listed length, no gate and no policy: one pass, no branch."""
    draft, q, k = proposal.draft, proposal.q, drafter.accept_width  # [B, N], [B, N, V] | None
    b, nodes = draft.shape  # N: K drafts of a chain, or a tree's nodes
    tokens_in = jnp.concatenate([pl.last, draft], axis=1)  # [B, N+1]
    lengths = drafter.verify_lengths  # static, ascending, last = N
    active = pl.on if proposal.active is None else proposal.active & pl.on  # [B]
    tree = proposal.parents is not None
    if not tree and len(lengths) == 1 and proposal.active is None and not policed:
        return Verification(tokens_in, draft, q, jnp.full((b,), k, jnp.int32), None)
    want = jnp.full((b,), nodes, jnp.int32) if proposal.length is None else proposal.length  # [B]
    table = jnp.asarray((0, *lengths), jnp.int32)
    own = jnp.where(active & (want > 0), table[1 + jnp.searchsorted(jnp.asarray(lengths), want)], 0)  # [B]
    own = jnp.where(pl.force_verify & pl.live, nodes, own)  # timing: every live row checks all N
    branch = jnp.searchsorted(table, jnp.max(own))  # [] own values are table entries
    keep = jnp.arange(nodes)[None] < own[:, None]  # [B, N]
    if tree:
        accept_parents = jnp.where(keep, proposal.parents, -2)  # [B, N]
        first = first_children(proposal.parents, k)  # [B, K]
        chain = jnp.where(first >= 0, jnp.take_along_axis(draft, jnp.maximum(first, 0), axis=1), -1)  # [B, K]
        par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), proposal.parents + 1], axis=1)  # [B, N+1]: last is root
        mask = ancestor_mask(par)  # [B, N+1, N+1]; a prefix's ancestors lie in the prefix
        reach = mask_depths(mask)[:, 1:]  # [B, N] node i's depth + 1 (last is depth 0)
        depth = jnp.max(jnp.where(keep & (proposal.parents > -2), reach, 0), axis=1)  # [B] as deep as its own nodes go
        return Verification(tokens_in, draft, q, depth, branch, proposal.parents, accept_parents, chain, mask)
    masked = jnp.where(keep, draft, -1)  # [B, K]
    q = None if q is None else jnp.where(keep[:, :, None], q, 0.0)  # [B, K, V]
    return Verification(tokens_in, masked, q, own, branch)


def verify(
    model,
    drafter: Drafter,
    ver: Verification,
    cache: KVCache,
    samp: SamplingArrays,
    seeds,
    all_greedy: bool,
    implementation: str,
) -> PassOutput:
    """Stage 4: the target's pass over `ver.tokens_in` and the accept step, K + 1 wide.

    The pass reads the cache and returns its new keys and values unwritten (`commit` writes them
    after whichever branch ran: inside a `lax.switch` branch XLA copied the cache). The passes:
    the plain one-token step (branch 0), then a verify of each listed prefix length: a chain's
    first L drafts, or a tree's first L nodes under their ancestor mask, node i at position
    lengths + 1 + depth(i)."""
    b, k = ver.tokens_in.shape[0], drafter.accept_width
    layers = drafter.feature_layers

    def final_of(h):
        return h if drafter.needs_final_hidden else None

    def full_width(out: PassOutput) -> PassOutput:
        """A pass over T < K + 1 positions padded to K + 1 (emitted with -1, the rest with zeros)."""
        extra = k + 1 - out.emitted.shape[1]
        if extra == 0:
            return out
        return PassOutput(
            out.n,
            jnp.pad(out.emitted, ((0, 0), (0, extra)), constant_values=-1),  # [B, K+1]
            out.new_kv.pad_to(k + 1),
            None if out.features is None else jnp.pad(out.features, ((0, 0), (0, 0), (0, extra), (0, 0))),
            None if out.final_hidden is None else jnp.pad(out.final_hidden, ((0, 0), (0, extra), (0, 0))),
        )

    def chain_pass(length, tokens_in, draft, q, cache, seeds):
        """The first `length` drafts: a pass over [last, d_1..d_length] [B, length+1]."""
        h, new_kv, features = model.hidden_kv(tokens_in[:, : length + 1], cache, layers)  # [B, L+1, D]
        qp = None if q is None else q[:, :length]
        n, emitted, _ = accept(model.logits(h), draft[:, :length], qp, samp, seeds, all_greedy, implementation)
        return full_width(PassOutput(n, emitted, new_kv, features, final_of(h)))

    def plain_pass(tokens_in, draft, q, cache, seeds):
        """One token without verification (drafts all rejected)."""
        h, new_kv, features = model.hidden_kv(tokens_in[:, :1], cache, layers)  # [B, 1, D]
        tok = sample(seeds, model.logits(h[:, 0]), samp)  # [B]
        return full_width(PassOutput(jnp.zeros((b,), jnp.int32), tok[:, None], new_kv, features, final_of(h)))

    def tree_pass(length, tokens_in, draft, q, cache, seeds):
        """The first `length` nodes, [last, nodes] [B, length+1], under the ancestor mask; the
        accepted path's outputs, root first."""
        mask = ver.mask[:, : length + 1, : length + 1]  # [B, L+1, L+1]
        positions = cache.lengths[:, None] + mask_depths(mask)  # [B, L+1]
        h, new_kv, features = model.hidden_kv(tokens_in[:, : length + 1], cache, layers, positions=positions, mask=mask)
        n, emitted, path = accept(
            model.logits(h),
            draft[:, :length],
            None,
            samp,
            seeds,
            all_greedy,
            implementation,
            parents=ver.accept_parents[:, :length],
            width=k,
        )  # [B], [B, K+1], [B, K]
        rows = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(path, -1) + 1], axis=1)  # [B, K+1]
        features = None if features is None else jnp.take_along_axis(features, rows[None, :, :, None], axis=2)
        final = jnp.take_along_axis(h, rows[:, :, None], axis=1) if drafter.needs_final_hidden else None
        return PassOutput(n, emitted, new_kv.take(rows), features, final)

    args = (ver.tokens_in, ver.draft, ver.q, cache, seeds)
    if ver.branch is None:  # K = 0 (plain decoding), or one listed length and nothing to gate
        return chain_pass(k, *args)
    verify_pass = chain_pass if ver.parents is None else tree_pass
    passes = [plain_pass] + [partial(verify_pass, x) for x in drafter.verify_lengths]
    return jax.lax.switch(ver.branch, passes, *args)


def truncate(st: LoopState, out: PassOutput, live):
    """Stage 5: cut each row's emitted tokens at its first stop id and at `max_new`, append them to
    the history. Returns (n_emit [B], history [B, S], hist_len [B], stopped [B], done [B])."""
    s, kp1 = st.history.shape[1], out.emitted.shape[1]
    num_out = st.hist_len - st.prompt_len  # [B]
    idx = jnp.arange(kp1)[None]  # [1, K+1]
    valid = idx <= out.n[:, None]  # [B, K+1]
    is_stop = _is_stop(out.emitted, st.stop_ids) & valid  # [B, K+1]
    first_stop = jnp.min(jnp.where(is_stop, idx, kp1), axis=1)  # [B]
    n_emit = jnp.minimum(jnp.minimum(out.n + 1, first_stop + 1), st.max_new - num_out)  # [B]
    n_emit = jnp.where(live, n_emit, 0)
    window = jnp.take_along_axis(st.history, jnp.minimum(st.hist_len[:, None] + idx, s - 1), axis=1)  # [B, K+1]
    new_vals = jnp.where(idx < n_emit[:, None], out.emitted, window)  # [B, K+1]
    history = write_rows(st.history, new_vals, st.hist_len)  # S leaves room: see Engine.shapes()
    hist_len = st.hist_len + n_emit
    stopped = st.stopped | (live & (first_stop < n_emit))
    done = st.done | stopped | (hist_len - st.prompt_len >= st.max_new)
    return n_emit, history, hist_len, stopped, done


def commit(
    drafter: Drafter,
    dparams,
    dstate,
    pending,
    lazy: bool,
    cache: KVCache,
    out: PassOutput,
    ver: Verification,
    live,
    n_emit,
    history,
    hist_len,
):
    """Stage 6: write the pass's K + 1 positions into the target cache at its lengths and advance
    each live row by n + 1 (rejected positions roll back by not advancing); then the drafter's
    commit, deferred into `pending` when `lazy` (static, `defers_commits`), over the emitted width
    only after a plain pass for narrow ones. Returns (cache, drafter state, pending).

    The write comes after every read of the cache: its offsets depend on the emitted tokens
    (>= 0, so they equal the lengths), which depend on all the reads; XLA then updates the cache
    in place (unordered, it copied every buffer; an optimization barrier did not order them)."""
    starts = jnp.where(out.emitted[:, 0] < 0, 0, cache.lengths)  # [B] == lengths
    cache = cache.with_lengths(starts).write(out.new_kv)
    cache = cache.advance(jnp.where(live, out.n + 1, 0))
    ctx = CommitContext(out.n, out.emitted, history, hist_len, live, out.features, out.final_hidden)
    if lazy:
        return cache, dstate, defer(pending, n_emit, out.features, out.final_hidden)  # caught up later
    if drafter.narrow_commit and ver.branch is not None:
        # A plain step emits one token a row: commit over that position alone, not K + 1.
        narrow = CommitContext(
            out.n,
            out.emitted[:, :1],
            history,
            hist_len,
            live,
            None if out.features is None else out.features[:, :, :1],
            None if out.final_hidden is None else out.final_hidden[:, :1],
        )
        dstate = jax.lax.cond(
            ver.branch == 0,
            lambda: drafter.commit(dparams, dstate, narrow),
            lambda: drafter.commit(dparams, dstate, ctx),
        )
        return cache, dstate, pending
    return cache, drafter.commit(dparams, dstate, ctx), pending


def stats(st: LoopState, pl: StepPlan, ver: Verification, out: PassOutput, n_emit, k: int):
    """Stage 7: per-position checks and accepts (drafts cut off by a stop token or max_new were
    never used: they count as neither), tree steps off the top-1 chain, the policy's estimates.
    Returns (checked [B, W], accepted [B, W], off_chain [B], policy)."""
    pos = jnp.arange(st.checked.shape[1])[None]  # [1, W]
    checked = (pos <= out.n[:, None]) & (pos < ver.own[:, None]) & (pos < n_emit[:, None])  # [B, W]
    hit = checked & (pos < out.n[:, None])  # [B, W]
    pol = st.policy
    if pol is not None and k > 0:
        pol = policy_update(pol, pl.on, st.steps, ver.own, jnp.sum(checked, axis=1), jnp.sum(hit, axis=1))
    off_chain = (
        st.off_chain
        if ver.chain is None
        else st.off_chain + jnp.any(hit[:, :k] & (out.emitted[:, :k] != ver.chain), axis=1)
    )  # [B]
    return st.checked + checked, st.accepted + hit, off_chain, pol


def decode_step(
    model, dparams, st: LoopState, *, drafter: Drafter, all_greedy: bool, implementation: str, force_verify=False
) -> LoopState:
    """One plan -> draft -> verify -> truncate -> commit -> stats step over every row (done rows
    write nothing).

    Args:
      model: the target (merged NNX module); dparams: the drafter's parameters.
      st: the loop state.
      drafter: static; its `accept_width` K sets the step's width (0: plain decoding).
      all_greedy: static. True compiles only the greedy accept; False decides at run time (the
        greedy fast path when no row samples), so one compiled step serves any mix of rows.
      implementation: the rejection sampler ("auto" | "pallas" | "reference").
      force_verify: a bool or traced [] bool: verify even when the drafter marks no row active
        (the slot engine times verify steps with the compiled code it serves with).

    Returns:
      The next `LoopState`. The drafter's `commit` runs on plain steps too, so its state stays
      current (the serving scheduler switches K between chunks; NoDrafter's commit does nothing).
    """
    k = drafter.accept_width  # the most drafts a step accepts (a tree's depth)
    pl = plan(st, k, force_verify)
    if k > 0:
        proposal, dstate, pending = draft(drafter, dparams, st, pl, all_greedy)
        ver = schedule(drafter, proposal, pl, st.policy is not None)
    else:
        dstate, pending = st.draft_state, st.pending
        ver = Verification(
            pl.last, jnp.zeros((pl.last.shape[0], 0), jnp.int32), None, jnp.zeros_like(st.hist_len), None
        )
    out = verify(model, drafter, ver, st.cache, st.sampling, pl.verify_seeds, all_greedy, implementation)
    n_emit, history, hist_len, stopped, done = truncate(st, out, pl.live)
    lazy = defers_commits(drafter, st.policy if k > 0 else None)
    cache, dstate, pending = commit(
        drafter, dparams, dstate, pending, lazy, st.cache, out, ver, pl.live, n_emit, history, hist_len
    )
    checked, accepted, off_chain, policy = stats(st, pl, ver, out, n_emit, k)
    return st.replace(
        policy=policy,
        pending=pending,
        cache=cache,
        draft_state=dstate,
        history=history,
        hist_len=hist_len,
        done=done,
        stopped=stopped,
        steps=st.steps + pl.live,
        checked=checked,
        accepted=accepted,
        off_chain=off_chain,
    )
