"""The compiled speculative loop: draft -> verify -> accept -> commit in one `lax.while_loop`.

Two compiled functions per shape bucket (batch, prompt bucket T, cache size S, drafter, K):

* `prefill(params, prompt [B, T], prompt_len [B])` runs right-padded prompts of different
  lengths in one pass (row b's prompt at positions 0..prompt_len[b]-1) and returns the cache, the
  last-position logits and, for drafters that read them, the target's hidden states;
* `decode(...)` samples the first token, initialises the drafter (`init_state`) and runs the
  loop. Each step (`decode_step`): the drafter proposes K tokens; the target verifies
  [last, d_1..d_K] in one forward (T = K + 1), or, when the drafter marks no live row's drafts as
  worth it, runs a plain one-token step; the accept step keeps n drafts and adds one token; each
  row commits its own n + 1 tokens (KV cache lengths advance by n + 1; rejected positions are
  rolled back by not advancing); rows stop on EOS / stop ids / their own max_new_tokens.
  Per-row statistics (steps, per-position checks and accepts) ride in the loop state. K = 0 is
  plain decoding.

`decode_step` is the one implementation of a step: `Engine.generate` loops it until every row is
done, the serving slot engine (specjax/runtime/slots.py) loops it for a bounded number of steps
over persistent slots whose rows come and go between chunks. For that, everything a row needs
(its sampling settings, stop ids, limits) lives in the state, every per-row leaf of the state
has a leading batch-major dim (`B` or `B * r`), and the statistics arrays may be wider than K.

Invariant: `history[b, :hist_len[b]]` is prompt + emitted tokens, and the KV cache holds all of
them but the last. The caches are donated, so XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.drafters.base import CommitContext, Drafter, InitContext, NoDrafter, StepContext
from specjax.models.kv_cache import KVCache, write_rows
from specjax.models.loading import Model
from specjax.models.tree import ancestor_mask, first_children
from specjax.policy.rows import FORCE, RowPolicy, new_policy
from specjax.policy.rows import plan as policy_plan
from specjax.policy.rows import update as policy_update
from specjax.sampling import (
    FIRST_TOKEN,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    STREAM_VERIFY,
    SamplingArrays,
    SamplingParams,
    derive,
    sample,
)
from specjax.verify import accept, accept_tree


def bucket_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def bucket_multiple(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def bucket_prompt(n: int) -> int:
    """Prompt bucket T of `Engine.generate`: a power of two up to 1024, then a multiple of 1024
    (a 5k-token prompt pads to 5120, not 8192)."""
    return bucket_pow2(n) if n <= 1024 else bucket_multiple(n, 1024)


@struct.dataclass
class Pending:
    """The emitted tokens the drafter has not committed yet, for drafters with `lazy_commit` under
    a speculation policy: each row's last `count` emitted tokens (count <= K + 1) and the target
    states the drafter's commit reads for them (slot i: the pass position that emitted token i)."""

    count: jax.Array  # [B] int32
    hidden: Any  # [n, B, K + 1, D] hidden states of `hidden_layers` at those positions, or None
    final: Any  # [B, K + 1, D] final normed hidden at those positions, or None


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


@dataclasses.dataclass
class RowOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    steps: int
    checked: list[int]  # per draft position (a tree: per depth)
    accepted: list[int]
    off_chain: int  # tree steps that accepted more than the top-1 chain would have
    prefill_seconds: float
    decode_seconds: float


# Attention scores of one prefill pass are `[B*KV, S, T*G]` f32: a batch of long prompts in one
# pass would need tens of GB (32 rows of a 5k-token prompt: ~50 GB). Longer prompts are run in
# chunks of C positions (T halved until the scores fit), each attending to the
# cache the previous chunks wrote, so the scores stay under this many bytes.
PREFILL_SCORE_BYTES = 256 << 20


def prefill_chunk(b: int, t: int, s: int, num_heads: int) -> int:
    """Positions per prefill pass for `b` rows, prompt bucket `t`, cache size `s` (divides t)."""
    c = t
    while c > 16 and c % 2 == 0 and b * num_heads * s * c * 4 > PREFILL_SCORE_BYTES:
        c //= 2
    return c


def _prefill(graphdef, params, prompt, prompt_len, *, cache_size, collect, want_final):
    """prompt `[B, T]` (right-padded), prompt_len `[B]` -> (cache with lengths = prompt_len,
    last-position logits `[B, V]`, collected hidden `[n, B, T, D]` or None, final hidden
    `[B, T, D]` or None)."""
    model = nnx.merge(graphdef, params)
    b, t = prompt.shape
    cache = model.new_cache(b, cache_size)
    c = prefill_chunk(b, t, cache_size, model.cfg.num_heads)
    last = (prompt_len - 1)[:, None, None]  # [B, 1, 1]
    if c == t:
        h, cache, hidden = model.hidden(prompt, cache, collect=collect, fresh=True)  # h [B, T, D]
        last_h = jnp.take_along_axis(h, last, axis=1)[:, 0]  # [B, D]
    else:
        d = model.cfg.hidden_size
        dtype = model.embed[...].dtype
        h = jnp.zeros((b, t, d), dtype) if want_final else None
        hidden = jnp.zeros((len(collect), b, t, d), dtype) if collect else None

        def chunk(i, carry):
            cache, last_h, h, hidden = carry
            lo = i * c
            toks = jax.lax.dynamic_slice_in_dim(prompt, lo, c, axis=1)  # [B, C]
            h_c, cache, hid_c = model.hidden(toks, cache.with_lengths(jnp.full((b,), lo, jnp.int32)), collect)
            j = jnp.clip(last - lo, 0, c - 1)  # [B, 1, 1]
            here = (last[:, 0] >= lo) & (last[:, 0] < lo + c)  # [B, 1]
            last_h = jnp.where(here, jnp.take_along_axis(h_c, j, axis=1)[:, 0], last_h)
            if h is not None:
                h = jax.lax.dynamic_update_slice_in_dim(h, h_c.astype(dtype), lo, axis=1)
            if hidden is not None:
                hidden = jax.lax.dynamic_update_slice_in_dim(hidden, hid_c.astype(dtype), lo, axis=2)
            return cache, last_h, h, hidden

        cache, last_h, h, hidden = jax.lax.fori_loop(0, t // c, chunk,
                                                     (cache, jnp.zeros((b, d), dtype), h, hidden))
    return cache.with_lengths(prompt_len), model.logits(last_h), hidden, (h if want_final else None)


def _is_stop(tokens, stop_ids):
    """tokens [B, T], stop_ids [B, M] (-1 padded) -> [B, T] bool."""
    return jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)


def init_state(dparams, cache, last_logits, prompt, prompt_len, pre_hidden, pre_final, samp: SamplingArrays,
               max_new, stop_ids, seed, *, drafter: Drafter, all_greedy: bool, stat_width: int,
               policy: RowPolicy | None = None) -> LoopState:
    """The loop state after the prefill: the first token sampled from `last_logits [B, V]`, the
    history `[B, S]` (S = the cache's size), the drafter initialised. `seed [B]` uint32: each
    row's random seed, kept in the state. `policy`: the rows' speculation fallback, or None
    (every step verifies what the drafter proposes)."""
    b, s = prompt.shape[0], cache.size
    first = sample(derive(seed, FIRST_TOKEN, STREAM_SAMPLE), last_logits, samp)  # [B]
    history = jnp.zeros((b, s), jnp.int32).at[:, : prompt.shape[1]].set(prompt)
    history = history.at[jnp.arange(b), prompt_len].set(first)
    hist_len = prompt_len + 1
    stop = _is_stop(first[:, None], stop_ids)[:, 0]
    dstate = drafter.init(
        dparams,
        InitContext(prompt, prompt_len, history, hist_len, samp, pre_hidden, pre_final, s, all_greedy),
    )
    return LoopState(
        cache=cache,
        draft_state=dstate,
        history=history,
        hist_len=hist_len,
        done=stop | (max_new <= 1),
        stopped=stop,
        seed=seed,
        steps=jnp.zeros((b,), jnp.int32),
        checked=jnp.zeros((b, stat_width), jnp.int32),
        accepted=jnp.zeros((b, stat_width), jnp.int32),
        off_chain=jnp.zeros((b,), jnp.int32),
        prompt_len=prompt_len,
        max_new=max_new,
        stop_ids=stop_ids,
        sampling=samp,
        policy=policy,
        pending=new_pending(drafter, b, pre_hidden, pre_final) if defers_commits(drafter, policy) else None,
    )


def defers_commits(drafter: Drafter, policy) -> bool:
    """Whether the loop defers the drafter's commits (static): under a speculation policy, for
    drafters whose proposal is optional and whose commits may be deferred."""
    return policy is not None and drafter.num_draft > 0 and drafter.proposal_optional and drafter.lazy_commit


def new_pending(drafter: Drafter, b: int, pre_hidden, pre_final) -> Pending:
    """No deferred steps; buffers shaped after the prefill's hidden `[n, B, T, D]` and final
    `[B, T, D]` states (None when the drafter reads none)."""
    w = drafter.accept_width + 1
    hidden = None if pre_hidden is None else jnp.zeros(pre_hidden.shape[:2] + (w, pre_hidden.shape[3]),
                                                       pre_hidden.dtype)  # [n, B, K+1, D]
    final = None if pre_final is None else jnp.zeros((b, w, pre_final.shape[2]), pre_final.dtype)  # [B, K+1, D]
    return Pending(jnp.zeros((b,), jnp.int32), hidden, final)


def defer(pend: Pending, n_emit, hidden, final) -> Pending:
    """Add a step's emitted tokens to `pend`: n_emit [B] tokens each row added to the history (0
    when not running), hidden [n, B, K + 1, D] / final [B, K + 1, D] the step's target states
    (position j emitted token j). The caller keeps count + n_emit <= K + 1."""
    def put(buf, new, axis):  # buf, new [..., B, K+1, D]: slot count + j of a row gets new position j
        src = jnp.arange(buf.shape[axis])[None] - pend.count[:, None]  # [B, K+1]
        take = (src >= 0) & (src < n_emit[:, None])
        shape = (1,) * (buf.ndim - 3) + src.shape + (1,)
        moved = jnp.take_along_axis(new, jnp.broadcast_to(jnp.clip(src, 0, buf.shape[axis] - 1).reshape(shape),
                                                          new.shape), axis=axis)
        return jnp.where(take.reshape(shape), moved, buf)

    return pend.replace(count=pend.count + n_emit,
                        hidden=None if pend.hidden is None else put(pend.hidden, hidden, 2),
                        final=None if pend.final is None else put(pend.final, final, 1))


def catch_up(drafter: Drafter, dparams, dstate, pend: Pending, history, hist_len):
    """Commit the deferred tokens in one context, as if one verify step had emitted each row's last
    `count` tokens (n_accepted = count - 1; -1: none). Returns (drafter state, empty Pending)."""
    w = drafter.accept_width + 1
    idx = hist_len[:, None] - pend.count[:, None] + jnp.arange(w)[None]  # [B, K+1]
    tokens = jnp.take_along_axis(history, jnp.clip(idx, 0, history.shape[1] - 1), axis=1)  # [B, K+1]
    ctx = CommitContext(pend.count - 1, tokens, history, hist_len, pend.count > 0, pend.hidden, pend.final)
    return drafter.catch_up(dparams, dstate, ctx), pend.replace(count=jnp.zeros_like(pend.count))


def decode_step(model, dparams, st: LoopState, *, drafter: Drafter, all_greedy: bool,
                implementation: str, force_verify=False) -> LoopState:
    """One draft -> verify -> accept -> commit step over every row (done rows write nothing).

    `all_greedy` is static: True compiles only the greedy accept; False decides at run time
    (greedy fast path when no row samples), so one compiled step serves any mix of rows. The
    drafter's `commit` runs at K = 0 too, so drafter state stays current across plain steps
    (the serving scheduler switches K between chunks; NoDrafter's commit does nothing). Under a
    speculation policy, a `lazy_commit` drafter's commits are deferred: every step's emitted
    tokens join `st.pending`, caught up in one K + 1 wide pass (`catch_up`) before the drafter's
    next proposal or once K + 1 tokens have gathered. The drafter's state is then written in one
    conditional a step whose other branch passes it through (XLA updates its buffers in place; a
    conditional whose two branches both wrote them copied every buffer each step).
    `force_verify` (a bool, or a traced scalar) verifies even when the drafter marks no row
    active: the slot engine times verify steps with the compiled code it serves with.
    """
    b, s = st.history.shape
    k = drafter.accept_width  # the most drafts a step accepts (a tree's depth)
    w = st.checked.shape[1]
    samp, prompt_len, max_new, stop_ids = st.sampling, st.prompt_len, st.max_new, st.stop_ids
    collect = drafter.hidden_layers

    def accept_step(logits, draft, q, seeds):
        if all_greedy or k == 0:
            return accept(logits, draft, q, samp, seeds, all_greedy, implementation)
        return jax.lax.cond(
            jnp.any(samp.temperature > 0),
            lambda: accept(logits, draft, q, samp, seeds, False, implementation),
            lambda: accept(logits, draft, q, samp, seeds, True, implementation),
        )

    def verify(tokens_in, draft, q, cache, seeds):
        """Target pass over [last, d_1..d_K] [B, K+1] and the accept step. The pass reads the
        cache and returns its new keys and values (`KVUpdate`) unwritten: the caller writes
        them after the branch that ran (inside a `lax.switch` branch XLA copied the cache)."""
        h, new_kv, hidden = model.hidden_kv(tokens_in, cache, collect=collect)  # [B, K+1, D]
        n, emitted = accept_step(model.logits(h), draft, q, seeds)
        return n, emitted, new_kv, hidden, (h if drafter.needs_final_hidden else None)

    def to_full_width(emitted, new_kv, hidden, final):
        """Outputs of a pass over T < K+1 positions padded to K+1 (emitted [B, T] with -1, the
        new keys and values, hidden [n, B, T, D] and final [B, T, D] with zeros): every branch
        returns one shape."""
        extra = k + 1 - emitted.shape[1]
        emitted = jnp.pad(emitted, ((0, 0), (0, extra)), constant_values=-1)  # [B, K+1]
        hidden = None if hidden is None else jnp.pad(hidden, ((0, 0), (0, 0), (0, extra), (0, 0)))
        final = None if final is None else jnp.pad(final, ((0, 0), (0, extra), (0, 0)))
        return emitted, new_kv.pad_to(k + 1), hidden, final

    def verify_prefix(length, tokens_in, draft, q, cache, seeds):
        """verify() of the first `length` drafts only (a shorter, cheaper pass)."""
        qp = None if q is None else q[:, :length]
        n, emitted, new_kv, hidden, final = verify(tokens_in[:, : length + 1], draft[:, :length], qp, cache, seeds)
        return (n, *to_full_width(emitted, new_kv, hidden, final))

    def plain_step(tokens_in, draft, q, cache, seeds):
        """One token without verification, padded to verify()'s shapes (drafts all rejected)."""
        h, new_kv, hidden = model.hidden_kv(tokens_in[:, :1], cache, collect=collect)  # [B, 1, D]
        tok = sample(seeds, model.logits(h[:, 0]), samp)  # [B]
        final = h if drafter.needs_final_hidden else None
        return (jnp.zeros((b,), jnp.int32), *to_full_width(tok[:, None], new_kv, hidden, final))

    def verify_tree(parents, accept_parents, tokens_in, draft, q, cache, seeds):
        """Target pass over [last, nodes] [B, N+1], node i at position lengths + 1 + depth(i)
        attending to its ancestors, then `accept_tree` (a row with `accept_parents` -2 accepts
        nothing). Returns verify()'s outputs for the accepted path, root first, K + 1 wide."""
        par = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents + 1], axis=1)  # [B, N+1]: last is the root
        mask = ancestor_mask(par)  # [B, N+1, N+1]
        positions = cache.lengths[:, None] + jnp.sum(mask, axis=-1) - 1  # [B, N+1]
        h, new_kv, hidden = model.hidden_kv(tokens_in, cache, collect=collect, positions=positions, mask=mask)
        logits = model.logits(h)  # [B, N+1, V]

        def accept_with(greedy):
            return accept_tree(logits, draft, accept_parents, samp, seeds, greedy, k, implementation)

        n, path, emitted = (accept_with(all_greedy) if all_greedy else jax.lax.cond(
            jnp.any(samp.temperature > 0), lambda: accept_with(False), lambda: accept_with(True)))
        rows = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(path, -1) + 1], axis=1)  # [B, K+1]
        hidden = None if hidden is None else jnp.take_along_axis(hidden, rows[None, :, :, None], axis=2)
        final = jnp.take_along_axis(h, rows[:, :, None], axis=1) if drafter.needs_final_hidden else None
        return n, emitted, new_kv.take(rows), hidden, final

    # Each row's randomness for this step, keyed by its seed and its own step count.
    step_seed = derive(st.seed, st.steps)  # [B]; derive(s, a, b) == derive(derive(s, a), b)
    draft_seeds, verify_seeds = derive(step_seed, STREAM_DRAFT), derive(step_seed, STREAM_VERIFY)
    live = ~st.done
    last = jnp.take_along_axis(st.history, (st.hist_len - 1)[:, None], axis=1)  # [B, 1]
    pol = st.policy if k > 0 else None
    pending, lazy = st.pending, defers_commits(drafter, pol)
    plain_pass = None  # [] bool when this step may have run the plain one-token pass
    chain = None  # [B, K] the top-1 chain's tokens of a tree proposal (-1 past its end)
    on = live if pol is None else policy_plan(pol, live, st.steps)  # [B] rows the policy lets verify
    if pol is not None:
        force_verify = force_verify | (pol.mode == FORCE)
    if k > 0:
        ctx = StepContext(st.history, st.hist_len, samp, draft_seeds, all_greedy, on, force_verify,
                          None if pol is None else pol.costs)
        if pol is not None and drafter.proposal_optional:
            # No row may verify this step: skip the drafter's work (a plain step follows, and its
            # commit keeps the drafter's state current, or is deferred until the drafter is needed).
            drafting = jnp.any(on) | force_verify  # []
            shapes = jax.eval_shape(drafter.propose, dparams, st.draft_state, ctx)
            idle = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0])  # draft [B, K] 0, inactive
            if lazy:
                def start():
                    dst, pend = catch_up(drafter, dparams, st.draft_state, pending, st.history, st.hist_len)
                    return jax.lax.cond(drafting, lambda: (*drafter.propose(dparams, dst, ctx), pend),
                                        lambda: (idle, dst, pend))

                # Catch up before proposing, or when a plain step would overfill `pending`.
                proposal, dstate, pending = jax.lax.cond(drafting | jnp.any(pending.count > k), start,
                                                         lambda: (idle, st.draft_state, pending))
            else:
                proposal, dstate = jax.lax.cond(drafting, lambda: drafter.propose(dparams, st.draft_state, ctx),
                                                lambda: (idle, st.draft_state))
        else:
            proposal, dstate = drafter.propose(dparams, st.draft_state, ctx)
        draft, q = proposal.draft, proposal.q  # [B, K], [B, K, V] | None (a tree: K nodes)
        tokens_in = jnp.concatenate([last, draft], axis=1)  # [B, K+1]
        lengths = drafter.verify_lengths  # static, ascending, last = K
        if proposal.parents is not None:
            # A token tree: rows the policy or the drafter's gate leave out accept nothing (no
            # node is a child of their prefix); a plain step when no live row is in.
            active = on if proposal.active is None else proposal.active & on
            own = jnp.where((active | force_verify) & live, k, 0)  # [B]
            plain_pass = jnp.max(own) == 0
            accept_parents = jnp.where(own[:, None] > 0, proposal.parents, -2)  # [B, N]
            tree = partial(verify_tree, proposal.parents, accept_parents)
            first = first_children(proposal.parents, k)  # [B, K]
            chain = jnp.where(first >= 0, jnp.take_along_axis(draft, jnp.maximum(first, 0), axis=1), -1)
            n, emitted, new_kv, hidden, final = jax.lax.switch(
                (~plain_pass).astype(jnp.int32), [plain_step, tree], tokens_in, draft, q, st.cache, verify_seeds)
        elif len(lengths) == 1 and proposal.active is None and pol is None:
            own = jnp.full((b,), k, jnp.int32)  # drafts each row checks this step
            n, emitted, new_kv, hidden, final = verify(tokens_in, draft, q, st.cache, verify_seeds)
        else:
            # Each row checks the drafts it would check alone: the shortest listed length that
            # holds its wanted count, none when it is not active. The pass verifies the shortest
            # listed prefix that holds every live row's (a plain one-token step when no live row
            # is active, branch 0: far cheaper than the (K+1)-token pass, e.g. the n-gram drafter
            # without a real match); a row's drafts past its own length are masked (-1, q = 0:
            # its token there is drawn from the target, as at the end of its chain), so what a
            # row emits does not depend on its batch-mates.
            want = jnp.full((b,), k, jnp.int32) if proposal.length is None else proposal.length
            active = on if proposal.active is None else proposal.active & on
            table = jnp.asarray((0, *lengths), jnp.int32)
            own = jnp.where(active & (want > 0), table[1 + jnp.searchsorted(jnp.asarray(lengths), want)], 0)  # [B]
            own = jnp.where(force_verify & live, k, own)  # timing: every live row checks all K
            branch = jnp.searchsorted(table, jnp.max(own))  # own values are table entries
            plain_pass = branch == 0
            keep = jnp.arange(k)[None] < own[:, None]  # [B, K]
            masked = jnp.where(keep, draft, -1)
            q = None if q is None else jnp.where(keep[:, :, None], q, 0.0)
            branches = [plain_step] + [partial(verify_prefix, x) for x in lengths[:-1]] + [verify]
            n, emitted, new_kv, hidden, final = jax.lax.switch(branch, branches, tokens_in, masked, q, st.cache,
                                                               verify_seeds)
    else:
        draft, q, dstate = jnp.zeros((b, 0), jnp.int32), None, st.draft_state
        own = jnp.zeros((b,), jnp.int32)
        n, emitted, new_kv, hidden, final = verify(last, draft, q, st.cache, verify_seeds)
    # Write the pass's K + 1 positions at the lengths (rows keep n + 1 of them) after every read
    # of the cache: the write offsets depend on the emitted tokens (>= 0, so they equal the
    # lengths), which depend on all the reads; XLA then updates the cache in place (unordered,
    # it copied every buffer; an optimization barrier did not order them).
    starts = jnp.where(emitted[:, 0] < 0, 0, st.cache.lengths)  # [B] == lengths
    cache = st.cache.with_lengths(starts).write(new_kv)

    # Truncate at the first stop token and at max_new; only live rows write.
    num_out = st.hist_len - prompt_len
    idx = jnp.arange(k + 1)[None]
    valid = idx <= n[:, None]
    is_stop = _is_stop(emitted, stop_ids) & valid
    first_stop = jnp.min(jnp.where(is_stop, idx, k + 1), axis=1)  # [B]
    n_emit = jnp.minimum(jnp.minimum(n + 1, first_stop + 1), max_new - num_out)
    n_emit = jnp.where(live, n_emit, 0)
    window = jnp.take_along_axis(st.history, jnp.minimum(st.hist_len[:, None] + idx, s - 1), axis=1)
    new_vals = jnp.where(idx < n_emit[:, None], emitted, window)
    history = write_rows(st.history, new_vals, st.hist_len)  # S leaves room: see shapes()
    hist_len = st.hist_len + n_emit
    stopped = st.stopped | (live & (first_stop < n_emit))
    done = st.done | stopped | (hist_len - prompt_len >= max_new)
    cache = cache.advance(jnp.where(live, n + 1, 0))

    commit_ctx = CommitContext(n, emitted, history, hist_len, live, hidden, final)
    if lazy:
        pending = defer(pending, n_emit, hidden, final)  # committed by the next step's catch-up
    elif drafter.narrow_commit and plain_pass is not None:
        # A plain step emits one token a row: commit over that position alone, not K + 1.
        narrow = CommitContext(n, emitted[:, :1], history, hist_len, live,
                               None if hidden is None else hidden[:, :, :1], None if final is None else final[:, :1])
        dstate = jax.lax.cond(plain_pass, lambda: drafter.commit(dparams, dstate, narrow),
                              lambda: drafter.commit(dparams, dstate, commit_ctx))
    else:
        dstate = drafter.commit(dparams, dstate, commit_ctx)
    pos = jnp.arange(w)[None]
    # Drafts cut off by a stop token or max_new were never used: they count as neither.
    checked = (pos <= n[:, None]) & (pos < own[:, None]) & (pos < n_emit[:, None])  # [B, W]; n_emit = 0 if not live
    if pol is not None:
        n_checked = jnp.sum(checked, axis=1)  # [B]
        pol = policy_update(pol, on, st.steps, own, n_checked, jnp.sum(checked & (pos < n[:, None]), axis=1))
    return st.replace(
        policy=st.policy if pol is None else pol,
        pending=pending,
        cache=cache,
        draft_state=dstate,
        history=history,
        hist_len=hist_len,
        done=done,
        stopped=stopped,
        steps=st.steps + live,
        checked=st.checked + checked,
        accepted=st.accepted + (checked & (pos < n[:, None])),
        off_chain=st.off_chain if chain is None else st.off_chain + jnp.any(
            (checked & (pos < n[:, None]))[:, :k] & (emitted[:, :k] != chain), axis=1),
    )


def _decode(graphdef, params, dparams, cache, last_logits, prompt, prompt_len, pre_hidden, pre_final,
            samp: SamplingArrays, max_new, stop_ids, seed, policy, *, drafter: Drafter, all_greedy: bool,
            implementation: str):
    """max_new [B] int32; stop_ids [B, M] int32 (-1 padded); policy: RowPolicy or None. Returns
    the final LoopState."""
    model = nnx.merge(graphdef, params)
    state = init_state(dparams, cache, last_logits, prompt, prompt_len, pre_hidden, pre_final, samp, max_new,
                       stop_ids, seed, drafter=drafter, all_greedy=all_greedy, stat_width=drafter.accept_width,
                       policy=policy)
    step = partial(decode_step, model, dparams, drafter=drafter, all_greedy=all_greedy,
                   implementation=implementation)
    return jax.lax.while_loop(lambda st: ~jnp.all(st.done), step, state)


class Engine:
    """Runs batches of tokenized prompts through the compiled loop; caches compiled code."""

    def __init__(self, model: Model, implementation: str = "auto", mesh: jax.sharding.Mesh | None = None):
        """`mesh`: a device mesh with a `data` axis; rows are then sharded over `data` (batch sizes
        must be multiples of its size) and jit propagates that through the loop. The model's params
        are used as placed (replicated, or split over a `model` axis: specjax/serving/batch.py)."""
        self.model = model
        self.implementation = implementation
        self.mesh = mesh
        self._compiled: dict = {}
        self.compile_seconds = 0.0  # total spent compiling, reported apart from run time

    def _get(self, name, fn, static: dict, donate: tuple, *args):
        key = (name, tuple(sorted((k, v.cache_key() if isinstance(v, Drafter) else v) for k, v in static.items())),
               tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            jitted = jax.jit(partial(fn, self.model.graphdef, **static), donate_argnums=donate)
            exe = jitted.lower(*args).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe

    def shapes(self, prompt_lens: list[int], max_new: int, k: int) -> tuple[int, int]:
        """(prompt bucket T, cache size S) for a batch."""
        t = bucket_prompt(max(prompt_lens))
        s = bucket_multiple(max(max(prompt_lens) + max_new + k + 2, t), 128)
        return t, s

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams], eos_ids=(),
                 drafter: Drafter | None = None, max_new_cap: int | None = None, spec_mode: int | None = None,
                 costs: np.ndarray | None = None) -> list[RowOutput]:
        """`max_new_cap`: stop every row after this many tokens while compiling for the params'
        `max_new_tokens` (a short probe that runs the code the full batch runs). `spec_mode`: None
        (verify whatever the drafter proposes, no policy state) or a `policy.rows` mode (AUTO,
        ALWAYS, FORCE: one compiled loop serves all three) with `costs [K + 1]` for AUTO."""
        drafter = drafter or NoDrafter()
        b = len(prompt_ids)
        lens = [len(p) for p in prompt_ids]
        max_new = max(p.max_new_tokens for p in params)
        t, s = self.shapes(lens, max_new, drafter.num_draft)
        prompt = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompt_ids):
            prompt[i, : len(p)] = p
        stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_ids)) for p in params]
        stop_arr = np.full((b, max(1, max(len(x) for x in stops))), -1, np.int32)
        for i, x in enumerate(stops):
            stop_arr[i, : len(x)] = x
        samp = SamplingArrays.from_params(params)
        all_greedy = all(p.greedy for p in params)
        seed = jnp.asarray([p.row_seed() for p in params], jnp.uint32)
        prompt, prompt_len = jnp.asarray(prompt), jnp.asarray(lens, jnp.int32)
        cap = max_new if max_new_cap is None else max_new_cap
        max_new_arr = jnp.asarray([min(p.max_new_tokens, cap) for p in params], jnp.int32)
        stop_arr = jnp.asarray(stop_arr)
        mp, dparams = self.model.params, drafter.params()
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            rows, repl = NamedSharding(self.mesh, PartitionSpec("data")), NamedSharding(self.mesh, PartitionSpec())
            prompt, prompt_len, samp, max_new_arr, stop_arr, seed = jax.device_put(
                (prompt, prompt_len, samp, max_new_arr, stop_arr, seed), rows)
            dparams = jax.device_put(dparams, repl)

        policy = None
        if spec_mode is not None and drafter.num_draft > 0:
            table = np.ones(drafter.accept_width + 1, np.float32) if costs is None else costs
            policy = new_policy(b, table, spec_mode)
            if self.mesh is not None:
                policy = jax.device_put(policy, RowPolicy(repl, repl, rows, rows, rows, rows))
        pre_static = dict(cache_size=s, collect=drafter.hidden_layers, want_final=drafter.needs_final_hidden)
        pre = self._get("prefill", _prefill, pre_static, (), mp, prompt, prompt_len)
        # Compile decode before timing anything: its arguments' shapes are known without running.
        c_shape, l_shape, h_shape, f_shape = pre.out_info
        dec_static = dict(drafter=drafter, all_greedy=all_greedy, implementation=self.implementation)
        dec = self._get("decode", _decode, dec_static, (2,), mp, dparams, c_shape, l_shape, prompt, prompt_len,
                        h_shape, f_shape, samp, max_new_arr, stop_arr, seed, policy)
        t0 = time.perf_counter()
        cache, last_logits, pre_hidden, pre_final = pre(mp, prompt, prompt_len)
        jax.block_until_ready(last_logits)
        t1 = time.perf_counter()
        st = dec(mp, dparams, cache, last_logits, prompt, prompt_len, pre_hidden, pre_final,
                 samp, max_new_arr, stop_arr, seed, policy)
        history = np.asarray(st.history)
        t2 = time.perf_counter()
        hist_len, stopped = np.asarray(st.hist_len), np.asarray(st.stopped)
        steps, checked, accepted = np.asarray(st.steps), np.asarray(st.checked), np.asarray(st.accepted)
        off_chain = np.asarray(st.off_chain)
        return [
            RowOutput(
                token_ids=history[i, lens[i] : hist_len[i]].tolist(),
                finish_reason="stop" if stopped[i] else "length",
                steps=int(steps[i]),  # loop steps; the prefill's first token is not one
                checked=checked[i].tolist(),
                accepted=accepted[i].tolist(),
                off_chain=int(off_chain[i]),
                prefill_seconds=t1 - t0,
                decode_seconds=t2 - t1,
            )
            for i in range(b)
        ]
