"""`specjax bench`'s time shares: one draft, one verify forward and one accept step, each timed
as its own compiled function at the loop's shapes (inside the fused loop they cannot be
separated)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.bench.common import timed
from specjax.drafters.base import InitContext, StepContext
from specjax.runtime.engine import Engine, _prefill
from specjax.sampling import SamplingArrays, SamplingParams
from specjax.verify import accept_chain, accept_tree


# Component functions are jitted once per model / drafter and reused across configurations,
# batch sizes and suites: jax then compiles each shape once (a fresh closure per call would
# recompile every time, which dominated small bench runs).
@functools.cache
def _setup_fn(graphdef, drafter, cache_size: int, greedy: bool):
    """Target prefill, first token, history and drafter init as one compiled function (eager,
    a draft model's prefill would compile op by op: slower than compiling it whole)."""
    feature_layers, want_final = tuple(drafter.feature_layers), bool(drafter.needs_final_hidden)

    def setup(params, dparams, prompt, plen, samp):
        cache, logits, hid, fin = _prefill(
            graphdef, params, prompt, plen, cache_size=cache_size, feature_layers=feature_layers, want_final=want_final
        )
        b, t = prompt.shape
        first = jnp.argmax(logits, -1).astype(jnp.int32)  # [B]
        history = jnp.zeros((b, cache_size), jnp.int32).at[:, :t].set(prompt)  # [B, S]
        history = history.at[jnp.arange(b), plen].set(first)
        hlen = plen + 1
        dstate = drafter.init(dparams, InitContext(prompt, plen, history, hlen, samp, hid, fin, cache_size, greedy))
        return cache, first, history, hlen, dstate

    return jax.jit(setup)


@functools.cache
def _verify_fn(graphdef, feature_layers: tuple):
    def verify(params, tokens, cache):
        m = nnx.merge(graphdef, params)
        h, _, _ = m.hidden(tokens, cache, feature_layers=feature_layers)
        return m.logits(h)  # [B, K+1, V]

    return jax.jit(verify)


@functools.cache
def _propose_fn(drafter, greedy: bool):
    return jax.jit(lambda dp, st, h, n, samp, seeds: drafter.propose(dp, st, StepContext(h, n, samp, seeds, greedy)))


@functools.cache
def _accept_fn(greedy: bool, implementation: str, tree_depth: int):
    if tree_depth:
        return jax.jit(
            lambda lg, d, par, samp, seeds: accept_tree(lg, d, par, samp, seeds, greedy, tree_depth, implementation)
        )
    return jax.jit(lambda lg, d, q, samp, seeds: accept_chain(lg, d, q, samp, seeds, greedy, implementation))


def component_times(
    engine: Engine, drafter, prompt_ids: list[int], sampling: SamplingParams, batch: int = 1, repeats: int = 5
) -> dict[str, float]:
    """Median seconds of one draft, one verify forward (T = K + 1; a tree's pass is timed without
    its mask, the same work) and one accept step, for `batch` copies of one prompt."""
    model, k = engine.model, drafter.num_draft
    t, s = engine.shapes([len(prompt_ids)], 64, k)
    prompt = jnp.asarray([prompt_ids + [0] * (t - len(prompt_ids))] * batch, jnp.int32)  # [B, T]
    plen = jnp.full((batch,), len(prompt_ids), jnp.int32)  # [B]
    samp = SamplingArrays.from_params([sampling] * batch)
    greedy = sampling.greedy
    dparams = drafter.params()
    cache, first, history, hlen, dstate = _setup_fn(model.graphdef, drafter, s, greedy)(
        model.params, dparams, prompt, plen, samp
    )
    seeds = jnp.arange(batch, dtype=jnp.uint32)  # [B]
    out = {}
    if k > 0:
        propose = _propose_fn(drafter, greedy)
        proposal, _ = propose(dparams, dstate, history, hlen, samp, seeds)
        draft, q = proposal.draft, proposal.q  # [B, K], [B, K, V] | None
        out["draft"] = timed(
            lambda: jax.block_until_ready(propose(dparams, dstate, history, hlen, samp, seeds)), repeats
        )
    else:
        draft, q = jnp.zeros((batch, 0), jnp.int32), None
        out["draft"] = 0.0
    tokens_in = jnp.concatenate([first[:, None], draft], axis=1)  # [B, K+1]
    vf = _verify_fn(model.graphdef, tuple(drafter.feature_layers))
    vlogits = vf(model.params, tokens_in, cache)
    out["verify"] = timed(lambda: jax.block_until_ready(vf(model.params, tokens_in, cache)), repeats)
    tree = drafter.tree_topk > 1
    af = _accept_fn(greedy, engine.implementation, drafter.tree_depth if tree else 0)
    q_or_parents = proposal.parents if tree else q
    jax.block_until_ready(af(vlogits, draft, q_or_parents, samp, seeds))
    out["accept"] = timed(lambda: jax.block_until_ready(af(vlogits, draft, q_or_parents, samp, seeds)), repeats)
    return out
