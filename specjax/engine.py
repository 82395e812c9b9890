"""The compiled generation loop.

Two compiled functions per shape bucket:

* `prefill(params, tokens [B, T], lengths [B]) -> cache, last_logits [B, V]`: runs right-padded
  prompts of different lengths in one pass; row b's prompt sits at positions `0..lengths[b]-1`;
* `decode(params, cache, last_logits, ...) -> outputs`: one `lax.while_loop` that samples a token
  per row, feeds it back, and stops each row on EOS / a stop id / its own `max_new_tokens`.

Invariant of the loop state: every emitted token but the last is in the cache; the last one is fed
at the next step. Shapes are bucketed (prompt length to a power of two, cache size and output
buffer to multiples of 128/64) so repeated calls reuse compiled code; compile time is measured
apart from run time.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from specjax.models.kv_cache import KVCache
from specjax.models.loading import Model
from specjax.sampling import SamplingArrays, SamplingParams, sample


def bucket_pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def bucket_multiple(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


@struct.dataclass
class DecodeState:
    cache: KVCache
    last: jax.Array  # [B] int32, last emitted token (not yet in the cache)
    out: jax.Array  # [B, N] int32, emitted tokens
    num_out: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    stopped: jax.Array  # [B] bool, finished on a stop/EOS token (vs. length)
    key: jax.Array
    step: jax.Array  # [] int32, loop iterations
    row_steps: jax.Array  # [B] int32, iterations in which the row was still running


@dataclasses.dataclass
class RowOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    steps: int
    prefill_seconds: float
    decode_seconds: float


def _prefill(graphdef, params, tokens, lengths, cache_size):
    model = nnx.merge(graphdef, params)
    b = tokens.shape[0]
    cache = model.new_cache(b, cache_size)
    h, cache, _ = model.hidden(tokens, cache)  # [B, T, D]
    last_h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    return cache.with_lengths(lengths), model.logits(last_h)  # [B, V]


def _is_stop(tok, stop_ids):
    return jnp.any(tok[:, None] == stop_ids, axis=-1)  # [B]


def _decode(graphdef, params, cache, last_logits, samp: SamplingArrays, max_new, stop_ids, key, out_size):
    """Plain autoregressive decoding; max_new [B] int32, stop_ids [B, M] int32 (-1 padded)."""
    model = nnx.merge(graphdef, params)
    b = last_logits.shape[0]
    key, sub = jax.random.split(key)
    first = sample(sub, last_logits, samp)  # [B]
    stop = _is_stop(first, stop_ids)
    state = DecodeState(
        cache=cache,
        last=first,
        out=jnp.zeros((b, out_size), jnp.int32).at[:, 0].set(first),
        num_out=jnp.ones((b,), jnp.int32),
        done=stop | (max_new <= 1),
        stopped=stop,
        key=key,
        step=jnp.zeros((), jnp.int32),
        row_steps=jnp.ones((b,), jnp.int32),
    )

    def cond(s: DecodeState):
        return ~jnp.all(s.done)

    def body(s: DecodeState):
        logits, cache, _ = model(s.last[:, None], s.cache)  # [B, 1, V]
        live = ~s.done
        cache = cache.advance(live.astype(jnp.int32))
        key, sub = jax.random.split(s.key)
        tok = sample(sub, logits[:, 0], samp)  # [B]
        pos = jnp.minimum(s.num_out, out_size - 1)
        out = s.out.at[jnp.arange(b), pos].set(jnp.where(live, tok, s.out[jnp.arange(b), pos]))
        num_out = s.num_out + live
        stop = live & _is_stop(tok, stop_ids)
        return DecodeState(
            cache=cache,
            last=jnp.where(live, tok, s.last),
            out=out,
            num_out=num_out,
            done=s.done | stop | (num_out >= max_new),
            stopped=s.stopped | stop,
            key=key,
            step=s.step + 1,
            row_steps=s.row_steps + live,
        )

    s = jax.lax.while_loop(cond, body, state)
    return s.out, s.num_out, s.stopped, s.row_steps, s.cache


class Engine:
    """Runs batches of tokenized prompts through the compiled loop; caches compiled code."""

    def __init__(self, model: Model):
        self.model = model
        self._compiled: dict = {}
        self.compile_seconds = 0.0  # total spent compiling, reported apart from run time

    def _get(self, name, fn, static, *args):
        key = (name, static, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)))
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = jax.jit(partial(fn, self.model.graphdef, **dict(static))).lower(*args).compile()
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe

    def shapes(self, prompt_lens: list[int], max_new: int) -> tuple[int, int, int]:
        """(prompt bucket T, cache size S, output buffer N) for a batch."""
        t = bucket_pow2(max(prompt_lens))
        s = bucket_multiple(max(max(prompt_lens) + max_new + 1, t), 128)
        n = bucket_multiple(max_new, 64)
        return t, s, n

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams], eos_ids=()) -> list[RowOutput]:
        b = len(prompt_ids)
        lens = [len(p) for p in prompt_ids]
        max_new = max(p.max_new_tokens for p in params)
        t, s, n = self.shapes(lens, max_new)
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompt_ids):
            tokens[i, : len(p)] = p
        stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_ids)) for p in params]
        m = max(1, max(len(x) for x in stops))
        stop_arr = np.full((b, m), -1, np.int32)
        for i, x in enumerate(stops):
            stop_arr[i, : len(x)] = x
        samp = SamplingArrays.from_params(params)
        key = jax.random.key(params[0].seed)
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lens, jnp.int32)
        max_new_arr = jnp.asarray([p.max_new_tokens for p in params], jnp.int32)
        stop_arr = jnp.asarray(stop_arr)

        pre = self._get("prefill", _prefill, (("cache_size", s),), self.model.params, tokens, lengths)
        t0 = time.perf_counter()
        cache, last_logits = pre(self.model.params, tokens, lengths)
        jax.block_until_ready(last_logits)
        t1 = time.perf_counter()
        dec = self._get(
            "decode", _decode, (("out_size", n),),
            self.model.params, cache, last_logits, samp, max_new_arr, stop_arr, key,
        )
        out, num_out, stopped, row_steps, _ = dec(
            self.model.params, cache, last_logits, samp, max_new_arr, stop_arr, key
        )
        out = np.asarray(out)
        t2 = time.perf_counter()
        num_out, stopped, row_steps = np.asarray(num_out), np.asarray(stopped), np.asarray(row_steps)
        return [
            RowOutput(
                token_ids=out[i, : num_out[i]].tolist(),
                finish_reason="stop" if stopped[i] else "length",
                steps=int(row_steps[i]),
                prefill_seconds=t1 - t0,
                decode_seconds=t2 - t1,
            )
            for i in range(b)
        ]
