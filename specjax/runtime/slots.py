"""The slot engine: persistent per-slot decode state for continuous batching.

`Engine.generate` runs a whole batch to completion. A server cannot: requests arrive and finish
at any time. The slot engine keeps one `LoopState` (specjax/runtime/step.py) of B rows ("slots") alive
across calls and offers four compiled operations on it:

* `prefill(prompt_ids, ...)` runs one request's prompt through the target (batch 1, prompt
  bucket T), samples its first token and initialises the drafter: a one-row state;
* `insert(state, slot, row)` scatters a one-row state into a slot (admission, or resuming a
  preempted row); `extract(state, slot)` gathers it back out (preemption, bucket resize);
* `run_chunk(state, K, n)` runs up to n steps of `step.decode_step` with the drafter at K
  (a `lax.while_loop` bounded by the step count, all-done, and, on request, the first row to
  finish, so that a queued request can take its slot).

Every leaf of a state has a leading batch-major dim (`B`, or `B * r` for KV caches stored as
`[B*KV, ...]`), which is all insert/extract need to know: a one-row leaf is `[r, ...]`.

Shapes are static under XLA: B comes from a fixed set of batch buckets, the cache size S is fixed
(`max_seq_len + K_max + 2`, rounded up) and the prompt bucket T is a power of two. `warmup()`
compiles every (bucket, K) chunk, every insert/extract and every prompt bucket before serving,
and times one step per (bucket, K): the step costs the throttling policy reads. Nothing compiles
on the hot path afterwards (`compiles_after_warmup` counts, tests check it stays 0).

Drafter state across K switches: every K runs a copy of the same drafter with `num_draft = K`
over the same state pytree. The state of ngram (none), EAGLE-3 (its one-layer cache and last
feature) and the draft model (its cache; its `commit` feeds the token a plain step adds) does
not depend on K, and `decode_step` runs the drafter's `commit` at K = 0 too, so the state is
current when speculation resumes. The MTP drafter's state does depend on K (its window, and
module k's cache is only kept current by steps with K >= k); re-initialising it on a switch
would need a target pass over the whole history, so it is served at one K > 0 (`ks = [K]` or
`[0, K]`), and its K = 0 chunks run its K variant with no row verifying and its commits
deferred (`Pending`, specjax/runtime/step.py; the row policy's `OFF` mode): its state stays the
K variant's, and the tokens of the plain steps are committed in one pass, before the next
proposal or every `PENDING_STEPS` steps.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import Drafter, NoDrafter
from specjax.errors import DrafterError
from specjax.models.loading import Model
from specjax.policy.rows import ALWAYS, OFF, new_policy
from specjax.runtime.compile_cache import CompileCache
from specjax.runtime.engine import _prefill, bucket_multiple, bucket_pow2
from specjax.runtime.step import PENDING_STEPS, LoopState, RowInputs, decode_step, init_state
from specjax.sampling import SamplingArrays, SamplingParams

STOP_WIDTH = 8  # stop ids per row: EOS ids + the request's own stop_token_ids


def _put_row(big, small, slot):
    """big `[B*r, ...]`, small `[r, ...]` -> big with rows slot*r .. slot*r + r - 1 replaced."""
    r = small.shape[0]
    v = big.reshape((big.shape[0] // r, r) + big.shape[1:])  # [B, r, ...]
    v = jax.lax.dynamic_update_slice_in_dim(v, small[None].astype(big.dtype), slot, axis=0)
    return v.reshape(big.shape)


def _take_row(big, like, slot):
    r = like.shape[0]
    v = big.reshape((big.shape[0] // r, r) + big.shape[1:])  # [B, r, ...]
    return jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=0)[0]


def _row_policy(b: int, drafter: Drafter, mode: int):
    """The policy state a deferring engine's chunk runs under: every row in `mode` (ALWAYS or OFF)."""
    return new_policy(b, np.zeros(drafter.accept_width + 1, np.float32), mode)


def _prefill_row(params, dparams, rows: RowInputs, *, graphdef, cache_size, drafter, stat_width, defer):
    """One request's `RowInputs` (prompt `[1, T]`) -> a one-row LoopState (with an empty
    `Pending` when `defer`; the policy is attached per chunk, so every leaf stays batch-major)."""
    cache, logits, features, final_hidden = _prefill(
        graphdef,
        params,
        rows.prompt,
        rows.prompt_len,
        cache_size=cache_size,
        feature_layers=drafter.feature_layers,
        want_final=drafter.needs_final_hidden,
    )
    return init_state(
        dparams,
        cache,
        logits,
        features,
        final_hidden,
        rows,
        drafter=drafter,
        all_greedy=False,
        stat_width=stat_width,
        policy=_row_policy(1, drafter, ALWAYS) if defer else None,
    ).replace(policy=None)


def _insert(state, slot, row):
    return jax.tree.map(lambda b, s: _put_row(b, s, slot), state, row)


def _extract(state, slot, like):
    return jax.tree.map(lambda b, s: _take_row(b, s, slot), state, like)


def _run_chunk(
    params, dparams, state, n_steps, exit_on_finish, force_verify, *, graphdef, drafter, implementation, mode
):
    """Up to `n_steps` steps; stops early when every row is done or, with `exit_on_finish`, as
    soon as a row finishes. `force_verify` (warm-up timing only) verifies every step. `mode`
    (static): None, or the row policy's mode every row runs in (ALWAYS: speculate; OFF: plain
    steps, commits deferred). Returns the state and the number of steps run."""
    model = nnx.merge(graphdef, params)
    done0 = state.done  # [B]
    if mode is not None:
        state = state.replace(policy=_row_policy(done0.shape[0], drafter, mode))

    def cond(c):
        i, st = c
        finished = jnp.any(st.done & ~done0)
        return (i < n_steps) & ~jnp.all(st.done) & ~(exit_on_finish & finished)

    def body(c):
        i, st = c
        return i + 1, decode_step(
            model,
            dparams,
            st,
            drafter=drafter,
            all_greedy=False,
            implementation=implementation,
            force_verify=force_verify,
        )

    steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state.replace(policy=None), steps


class SlotEngine:
    """Compiled slot operations for one target, one drafter family, a set of K and batch buckets."""

    def __init__(
        self,
        model: Model,
        drafter: Drafter | None,
        ks=(0,),
        buckets=(1, 2, 4, 8),
        max_seq_len: int | None = None,
        implementation: str = "auto",
    ):
        drafter = drafter or NoDrafter()
        self.ks = tuple(sorted({int(k) for k in ks}))
        if not self.ks or self.ks[0] < 0:
            raise ValueError(f"K values must be >= 0, got {ks}")
        if self.ks[-1] > 0 and isinstance(drafter, NoDrafter):
            raise ValueError("K > 0 needs a drafter")
        spec_ks = [k for k in self.ks if k > 0]
        if drafter.k_dependent_state and len(spec_ks) != 1:
            raise DrafterError(
                f"the {drafter.name} drafter's state depends on K, so it cannot switch between "
                f"draft sizes: serve it with one K > 0 and 0 for plain steps (e.g. ks: [0, {drafter.num_draft}])"
            )
        # K = 0 chunks of such a drafter run its K variant with commits deferred (module doc)
        self.defer = drafter.k_dependent_state
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {buckets}")
        self.model = model
        self.drafter = drafter
        self.drafter_name = drafter.name
        self.variants = {k: drafter.with_num_draft(k) for k in self.ks}
        self.kmax = self.ks[-1]
        ctx = model.config.max_position_embeddings
        self.max_seq_len = min(int(max_seq_len or ctx), ctx)
        # history writes reach hist_len + K; positions past max_seq_len hold only scratch drafts
        self.cache_size = bucket_multiple(self.max_seq_len + self.kmax + 2, 128)
        # K -> the most drafts a step accepts (K for chains; a tree of K nodes: its depth)
        self.accept_widths = {k: v.accept_width for k, v in self.variants.items()}
        self.stat_width = max(max(self.accept_widths.values()), 1)
        self.implementation = implementation
        self.dparams = drafter.params()
        self.params = model.params
        self.compiled = CompileCache()
        self.step_costs: dict[int, dict[int, float]] = {}  # bucket -> K -> seconds per step
        self.timing_verified: dict[int, dict[int, float]] = {}  # fraction of timed steps that verified
        self._row_like = None

    # ---- compiled functions --------------------------------------------------------------------

    def _get(self, name, fn, static: dict, donate: tuple, *args):
        """The compiled `fn`; a `graphdef` in `static` is bound but kept out of the cache key."""
        static = dict(static)
        if "graphdef" in static:
            fn = partial(fn, graphdef=static.pop("graphdef"))
        return self.compiled.get(name, fn, static, donate, *args)

    @property
    def compile_seconds(self) -> float:
        return self.compiled.seconds

    @property
    def compiles_after_warmup(self) -> int:
        return self.compiled.after_warmup

    def prompt_bucket(self, n: int) -> int:
        return min(bucket_pow2(n), self.cache_size)

    def prompt_buckets(self) -> list[int]:
        out, t = [], bucket_pow2(1)
        while True:
            out.append(min(t, self.cache_size))
            if t >= self.max_seq_len or t >= self.cache_size:
                return out
            t *= 2

    def row_inputs(self, prompt_ids: list[int], sampling: SamplingParams, stop_ids) -> RowInputs:
        """One request as the loop takes it: its prompt right-padded to its bucket, `[1, ...]`."""
        t = self.prompt_bucket(len(prompt_ids))
        prompt = np.zeros((1, t), np.int32)
        prompt[0, : len(prompt_ids)] = prompt_ids
        stops = np.full((1, STOP_WIDTH), -1, np.int32)
        stops[0, : len(stop_ids)] = list(stop_ids)[:STOP_WIDTH]
        return RowInputs(
            prompt=jnp.asarray(prompt),
            prompt_len=jnp.asarray([len(prompt_ids)], jnp.int32),
            sampling=SamplingArrays.from_params([sampling]),
            max_new=jnp.asarray([sampling.max_new_tokens], jnp.int32),
            stop_ids=jnp.asarray(stops),
            seed=jnp.asarray([sampling.row_seed()], jnp.uint32),
        )

    def prefill(self, prompt_ids: list[int], sampling: SamplingParams, stop_ids=()) -> LoopState:
        """One request -> a one-row state (first token sampled, drafter initialised); the row
        draws from its own stream (`sampling.seed`, or a fresh one when None)."""
        if len(prompt_ids) + sampling.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt {len(prompt_ids)} + max_new_tokens {sampling.max_new_tokens} > max_seq_len {self.max_seq_len}"
            )
        if len(stop_ids) > STOP_WIDTH:
            raise ValueError(f"at most {STOP_WIDTH} stop ids per row")
        args = (self.params, self.dparams, self.row_inputs(prompt_ids, sampling, stop_ids))
        static = dict(
            graphdef=self.model.graphdef,
            cache_size=self.cache_size,
            drafter=self.variants[self.kmax],
            stat_width=self.stat_width,
            defer=self.defer,
        )
        return self._get("prefill", _prefill_row, static, (), *args)(*args)

    def row_like(self):
        """Abstract shapes of a one-row state (for extract and empty states)."""
        if self._row_like is None:
            args = (self.params, self.dparams, self.row_inputs([0], SamplingParams(max_new_tokens=1, seed=0), ()))
            fn = partial(
                _prefill_row,
                graphdef=self.model.graphdef,
                cache_size=self.cache_size,
                drafter=self.variants[self.kmax],
                stat_width=self.stat_width,
                defer=self.defer,
            )
            self._row_like = jax.eval_shape(fn, *args)
        return self._row_like

    def empty(self, b: int) -> LoopState:
        """B free slots: done rows (they write nothing) with harmless contents."""
        like = self.row_like()
        st = jax.tree.map(lambda x: jnp.zeros((b * x.shape[0],) + x.shape[1:], x.dtype), like)
        return st.replace(
            done=jnp.ones((b,), bool),
            hist_len=jnp.ones((b,), jnp.int32),
            max_new=jnp.ones((b,), jnp.int32),
            stop_ids=jnp.full((b, STOP_WIDTH), -1, jnp.int32),
        )

    def free_row(self) -> LoopState:
        """A one-row free slot, inserted to evict a row (cancelled requests)."""
        return self.empty(1)  # one row of B = 1 is a one-row state

    def insert(self, state: LoopState, slot: int, row: LoopState) -> LoopState:
        return self._get("insert", _insert, {}, (0,), state, jnp.int32(slot), row)(state, jnp.int32(slot), row)

    def extract(self, state: LoopState, slot: int) -> LoopState:
        like = self.row_like()
        fn = self._get("extract", partial(_extract, like=like), {}, (), state, jnp.int32(slot))
        return fn(state, jnp.int32(slot))

    def _chunk_static(self, k: int) -> dict:
        """The static arguments of a K chunk: the K variant, or for a deferring engine the one
        K > 0 variant, speculating (ALWAYS) or, at K = 0, plain with commits deferred (OFF)."""
        if self.defer:
            drafter, mode = self.variants[self.kmax], (ALWAYS if k else OFF)
        else:
            drafter, mode = self.variants[k], None
        return dict(graphdef=self.model.graphdef, drafter=drafter, implementation=self.implementation, mode=mode)

    def run_chunk(self, state: LoopState, k: int, n_steps: int, exit_on_finish: bool = False):
        """-> (state, steps run). The state is donated: use only the returned one."""
        args = (self.params, self.dparams, state, jnp.int32(n_steps), jnp.asarray(exit_on_finish), jnp.asarray(False))
        state, steps = self._get("chunk", _run_chunk, self._chunk_static(k), (2,), *args)(*args)
        return state, int(steps)

    def resize(self, state: LoopState, slots: list[int], b: int) -> LoopState:
        """A state of b slots holding the rows of `slots` (in that order) at slots 0.."""
        assert len(slots) <= b
        new = self.empty(b)
        for j, s in enumerate(slots):
            new = self.insert(new, j, self.extract(state, s))
        return new

    # ---- warm-up -------------------------------------------------------------------------------

    def _timing_state(self, b: int, k: int):
        """B live rows of a repetitive prompt, room for the timed steps, no stop ids."""
        pattern = ([101, 102, 103, 104, 105, 106, 107] * 3)[: max(self.max_seq_len // 2, 1)]
        room = self.max_seq_len - len(pattern)
        row = self.prefill(pattern, SamplingParams(max_new_tokens=max(room, 1), ignore_eos=True))
        state = self.empty(b)
        for s in range(b):
            state = self.insert(state, s, row)
        return state

    def _time_chunk(self, b: int, k: int, steps: int) -> tuple[float, float]:
        """(seconds per step, fraction of row-steps that verified) of one chunk of B live rows,
        every step verifying K + 1 tokens (`force_verify`: the n-gram drafter would skip
        verification without a match and time plain steps instead)."""
        state = self._timing_state(b, k)
        args = (self.params, self.dparams, state, jnp.int32(steps), jnp.asarray(False), jnp.asarray(k > 0))
        exe = self._get("chunk", _run_chunk, self._chunk_static(k), (2,), *args)
        # The prefill and B inserts that built `state` were dispatched asynchronously: wait for
        # them, so that their tail is not timed as part of the chunk.
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        state, n = exe(*args)
        n = int(n)
        dt = time.perf_counter() - t0
        row_steps = max(int(np.asarray(state.steps).sum()), 1)
        verified = float(np.asarray(state.checked)[:, 0].sum()) / row_steps if k else 0.0
        return dt / max(n, 1), verified

    def warmup(self, time_steps: int = 4, reps: int = 3, measure: bool = True, log=None) -> dict:
        """Compile everything the scheduler can call; time the steps of each (bucket, K). Returns
        the step-cost table {bucket: {K: seconds}} (also kept as `step_costs`).

        Within a bucket the K values are timed in turns, `reps` rounds after a warming one, and
        each keeps its fastest round: a burst of load on a shared machine then slows one round
        of every K rather than all rounds of one K, and the ratios the policy reads survive."""
        log = log or (lambda msg: None)
        t0 = time.perf_counter()
        for t in self.prompt_buckets():
            self.prefill([101] * min(t, self.max_seq_len - 1), SamplingParams(max_new_tokens=1))
        row = self.free_row()
        for b in self.buckets:
            state = self.empty(b)
            state = self.insert(state, 0, row)
            self.extract(state, 0)
            if not measure:
                for k in self.ks:
                    self.run_chunk(self.empty(b), k, 1)
                continue
            for rnd in range(reps + 1):  # round 0 compiles and warms
                for k in self.ks:
                    # a deferring engine's plain steps pay their catch-up pass once per PENDING_STEPS
                    n = PENDING_STEPS + 1 if self.defer and not k else time_steps
                    cost, verified = self._time_chunk(b, k, n)
                    if rnd and cost < self.step_costs.setdefault(b, {}).get(k, float("inf")):
                        self.step_costs[b][k] = cost
                        self.timing_verified.setdefault(b, {})[k] = verified
            log(f"bucket {b}: " + ", ".join(f"K={k} {c * 1e3:.2f} ms" for k, c in self.step_costs.get(b, {}).items()))
        self.compiled.warm = True
        log(
            f"warm-up: {len(self.compiled)} compiled functions in {time.perf_counter() - t0:.1f} s "
            f"({self.compile_seconds:.1f} s compiling)"
        )
        return self.step_costs
