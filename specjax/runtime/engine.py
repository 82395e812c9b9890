"""The compiled speculative loop for whole batches: prefill, then one `lax.while_loop` of
`decode_step` (specjax/runtime/step.py: plan -> draft -> verify -> truncate -> commit -> stats).

Two compiled functions per shape bucket (batch, prompt bucket T, cache size S, drafter, K):

* `_prefill(params, prompt [B, T], prompt_len [B])` runs right-padded prompts of different
  lengths in one pass (row b's prompt at positions 0..prompt_len[b]-1) and returns the cache, the
  last-position logits and, for drafters that read them, the target's features;
* `_decode(...)` samples the first token, initialises the drafter (`init_state`) and loops
  `decode_step` until every row stopped (EOS / stop ids / its own max_new_tokens). Per-row
  statistics (steps, per-position checks and accepts) ride in the loop state. K = 0 is plain
  decoding.

The caches are donated, so XLA updates them in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import Drafter, NoDrafter
from specjax.models.loading import Model
from specjax.policy.rows import RowPolicy, new_policy
from specjax.runtime.compile_cache import CompileCache
from specjax.runtime.step import RowInputs, decode_step, init_state
from specjax.sampling import SamplingArrays, SamplingParams


def bucket_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def bucket_multiple(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


def bucket_prompt(n: int) -> int:
    """Prompt bucket T of `Engine.generate`: a power of two up to 1024, then a multiple of 1024
    (a 5k-token prompt pads to 5120, not 8192)."""
    return bucket_pow2(n) if n <= 1024 else bucket_multiple(n, 1024)


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
HOLD_BYTES = 2 << 30  # the largest cache `Engine.holding_prefills` keeps a copy of


def prefill_chunk(b: int, t: int, s: int, num_heads: int) -> int:
    """Positions per prefill pass for `b` rows, prompt bucket `t`, cache size `s` (divides t)."""
    c = t
    while c > 16 and c % 2 == 0 and b * num_heads * s * c * 4 > PREFILL_SCORE_BYTES:
        c //= 2
    return c


def _prefill(graphdef, params, prompt, prompt_len, *, cache_size, feature_layers, want_final):
    """prompt `[B, T]` (right-padded), prompt_len `[B]` -> (cache with lengths = prompt_len,
    last-position logits `[B, V]`, target features `[n, B, T, D]` or None, final hidden
    `[B, T, D]` or None)."""
    model = nnx.merge(graphdef, params)
    b, t = prompt.shape
    cache = model.new_cache(b, cache_size)
    c = prefill_chunk(b, t, cache_size, model.cfg.num_heads)
    last = (prompt_len - 1)[:, None, None]  # [B, 1, 1]
    if c == t:
        h, cache, features = model.hidden(prompt, cache, feature_layers=feature_layers, fresh=True)  # h [B, T, D]
        last_h = jnp.take_along_axis(h, last, axis=1)[:, 0]  # [B, D]
    else:
        d = model.cfg.hidden_size
        dtype = model.embed[...].dtype
        h = jnp.zeros((b, t, d), dtype) if want_final else None
        features = jnp.zeros((len(feature_layers), b, t, d), dtype) if feature_layers else None  # [n, B, T, D]

        def chunk(i, carry):
            cache, last_h, h, features = carry
            lo = i * c
            toks = jax.lax.dynamic_slice_in_dim(prompt, lo, c, axis=1)  # [B, C]
            h_c, cache, feat_c = model.hidden(toks, cache.with_lengths(jnp.full((b,), lo, jnp.int32)), feature_layers)
            j = jnp.clip(last - lo, 0, c - 1)  # [B, 1, 1]
            here = (last[:, 0] >= lo) & (last[:, 0] < lo + c)  # [B, 1]
            last_h = jnp.where(here, jnp.take_along_axis(h_c, j, axis=1)[:, 0], last_h)
            if h is not None:
                h = jax.lax.dynamic_update_slice_in_dim(h, h_c.astype(dtype), lo, axis=1)
            if features is not None:
                features = jax.lax.dynamic_update_slice_in_dim(features, feat_c.astype(dtype), lo, axis=2)
            return cache, last_h, h, features

        cache, last_h, h, features = jax.lax.fori_loop(0, t // c, chunk, (cache, jnp.zeros((b, d), dtype), h, features))
    return cache.with_lengths(prompt_len), model.logits(last_h), features, (h if want_final else None)


def _decode(
    graphdef,
    params,
    dparams,
    cache,
    last_logits,
    features,
    final_hidden,
    rows: RowInputs,
    policy,
    *,
    drafter: Drafter,
    all_greedy: bool,
    implementation: str,
):
    """The decode loop after the prefill (`init_state`'s arguments); policy: RowPolicy or None.
    Returns the final LoopState."""
    model = nnx.merge(graphdef, params)
    state = init_state(
        dparams,
        cache,
        last_logits,
        features,
        final_hidden,
        rows,
        drafter=drafter,
        all_greedy=all_greedy,
        stat_width=drafter.accept_width,
        policy=policy,
    )
    step = partial(decode_step, model, dparams, drafter=drafter, all_greedy=all_greedy, implementation=implementation)
    return jax.lax.while_loop(lambda st: ~jnp.all(st.done), step, state)


class Engine:
    """Runs batches of tokenized prompts through the compiled loop; caches compiled code."""

    def __init__(self, model: Model, implementation: str = "auto", mesh: jax.sharding.Mesh | None = None):
        """`mesh`: a device mesh with a `data` axis; rows are then sharded over `data` (batch sizes
        must be multiples of its size) and jit propagates that through the loop. The model's params
        are used as placed (replicated, or split over a `model` axis: specjax/models/sharding.py)."""
        self.model = model
        self.implementation = implementation
        self.mesh = mesh
        self.compiled = CompileCache()
        self._held: dict | None = None  # prefill outputs kept by `holding_prefills`

    @contextlib.contextmanager
    def holding_prefills(self):
        """Within it, `generate` keeps each batch's prefill outputs and reuses them when the same
        prompts are prefilled again at the same cache size, instead of running the prefill again (the
        speculation policy's measuring runs decode one batch several times: at 32 rows a prefill
        costs as much as a dozen decode steps). Each decode gets its own copy of the cache, which it
        donates, so a held cache takes its memory twice: caches over `HOLD_BYTES` are not held.
        Re-entrant: an inner use shares the outer one's outputs."""
        if self._held is not None:
            yield
            return
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    def _prefilled(self, pre, weights, rows: RowInputs, prompt_ids, static: dict) -> tuple:
        """The prefill's outputs for `rows`: held ones when `holding_prefills` kept a prefill of the
        same prompts at the same cache size (one that also returned a drafter's features serves a
        plain decode, which reads only the cache and the last logits)."""
        if self._held is None or sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pre.out_info[0])) > HOLD_BYTES:
            return pre(weights, rows.prompt, rows.prompt_len)
        held = self._held.setdefault((tuple(map(tuple, prompt_ids)), static["cache_size"]), {})
        want = (static["feature_layers"], static["want_final"])
        if want not in held:
            donor = next(iter(held.values()), None) if want == ((), False) else None
            held[want] = (*donor[:2], None, None) if donor else pre(weights, rows.prompt, rows.prompt_len)
        cache, *rest = held[want]
        return (jax.tree.map(jnp.copy, cache), *rest)

    def _get(self, name, fn, static: dict, donate: tuple, *args):
        return self.compiled.get(name, partial(fn, self.model.graphdef), static, donate, *args)

    @property
    def compile_seconds(self) -> float:
        """Total seconds spent compiling, reported apart from run time."""
        return self.compiled.seconds

    def shapes(self, prompt_lens: list[int], max_new: int, k: int) -> tuple[int, int]:
        """(prompt bucket T, cache size S) for a batch."""
        t = bucket_prompt(max(prompt_lens))
        s = bucket_multiple(max(max(prompt_lens) + max_new + k + 2, t), 128)
        return t, s

    def _rows(self, prompt_ids, t: int, sampling, eos_ids, drafter: Drafter, max_new_cap, spec_mode, costs):
        """The batch's `RowInputs` (prompts right-padded to `t`) and its `RowPolicy` or None, placed
        on the mesh's `data` axis when there is one."""
        b = len(prompt_ids)
        lens = [len(p) for p in prompt_ids]
        max_new = max(p.max_new_tokens for p in sampling)
        prompt = np.zeros((b, t), np.int32)  # [B, T]
        for i, p in enumerate(prompt_ids):
            prompt[i, : len(p)] = p
        stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_ids)) for p in sampling]
        stop_arr = np.full((b, max(1, max(len(x) for x in stops))), -1, np.int32)  # [B, M]
        for i, x in enumerate(stops):
            stop_arr[i, : len(x)] = x
        cap = max_new if max_new_cap is None else max_new_cap
        rows = RowInputs(
            prompt=jnp.asarray(prompt),
            prompt_len=jnp.asarray(lens, jnp.int32),
            sampling=SamplingArrays.from_params(sampling),
            max_new=jnp.asarray([min(p.max_new_tokens, cap) for p in sampling], jnp.int32),
            stop_ids=jnp.asarray(stop_arr),
            seed=jnp.asarray([p.row_seed() for p in sampling], jnp.uint32),
        )
        policy = None
        if spec_mode is not None and drafter.num_draft > 0:
            table = np.ones(drafter.accept_width + 1, np.float32) if costs is None else costs
            policy = new_policy(b, table, spec_mode, drafter.probe_wait)
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            by_row, repl = NamedSharding(self.mesh, PartitionSpec("data")), NamedSharding(self.mesh, PartitionSpec())
            rows = jax.device_put(rows, by_row)
            if policy is not None:
                policy = jax.device_put(policy, RowPolicy(*[repl] * 4, *[by_row] * 6))
        return rows, policy

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: list[SamplingParams],
        eos_ids=(),
        drafter: Drafter | None = None,
        max_new_cap: int | None = None,
        spec_mode: int | None = None,
        costs: np.ndarray | None = None,
    ) -> list[RowOutput]:
        """Generate for a batch of tokenized prompts, one `SamplingParams` per row.

        `eos_ids`: stop ids of every row not ignoring EOS. `max_new_cap`: stop every row after
        this many tokens while compiling for the rows' `max_new_tokens` (a short probe that runs
        the code the full batch runs). `spec_mode`: None (verify whatever the drafter proposes,
        no policy state) or a `policy.rows` mode (AUTO, ALWAYS, FORCE: one compiled loop serves
        all three) with `costs [K + 1]` for AUTO. Returns one `RowOutput` per row."""
        drafter = drafter or NoDrafter()
        lens = [len(p) for p in prompt_ids]
        t, s = self.shapes(lens, max(p.max_new_tokens for p in sampling), drafter.num_draft)
        rows, policy = self._rows(prompt_ids, t, sampling, eos_ids, drafter, max_new_cap, spec_mode, costs)
        weights, dparams = self.model.params, drafter.params()
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            dparams = jax.device_put(dparams, NamedSharding(self.mesh, PartitionSpec()))
        pre_static = dict(cache_size=s, feature_layers=drafter.feature_layers, want_final=drafter.needs_final_hidden)
        pre = self._get("prefill", _prefill, pre_static, (), weights, rows.prompt, rows.prompt_len)
        # Compile decode before timing anything: its arguments' shapes are known without running.
        c_shape, l_shape, h_shape, f_shape = pre.out_info
        dec_static = dict(
            drafter=drafter, all_greedy=all(p.greedy for p in sampling), implementation=self.implementation
        )
        abstract = (c_shape, l_shape, h_shape, f_shape)  # decode's inputs 3-6: the prefill's outputs
        dec = self._get("decode", _decode, dec_static, (2,), weights, dparams, *abstract, rows, policy)
        t0 = time.perf_counter()
        cache, last_logits, features, final_hidden = self._prefilled(pre, weights, rows, prompt_ids, pre_static)
        jax.block_until_ready(last_logits)
        t1 = time.perf_counter()
        st = dec(weights, dparams, cache, last_logits, features, final_hidden, rows, policy)
        history = np.asarray(st.history)  # [B, S]
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
            for i in range(len(prompt_ids))
        ]
