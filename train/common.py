"""Helpers the drafter training tasks share: sequence shifts, a full-vocabulary soft
cross-entropy that never holds `[B, T, V]` logits, greedy chain-acceptance counting, and the
simulator's summary (simulated MAL and per-position acceptance).

Full-vocabulary distillation is what the MTP heads and the draft model need (they draft from the
target's own LM head over all V tokens), and its LM-head products dominate a training step (at
V = 49152 and D = 576, one product over 8 x 320 positions is 145 GFLOP). `chunked_soft_ce` keeps
them few and small:

* only positions that carry a label are computed: `positions` compacts each row's labelled
  positions to the front and drops the rest (prompt and padding, about half of a regen row);
* the sequence runs in chunks, so only one chunk's `[.., C, V]` logits exist at a time (one
  `[8, 320, V]` f32 array is 500 MB);
* the gradient with respect to the draft hidden state, `(softmax(draft) - p) @ head`, is formed
  in the forward pass of each chunk (a custom VJP), so the backward pass needs no logits at all:
  one head product for the target and two per draft (instead of three with rematerialisation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.llama import linear


def shift_left(x: jax.Array, by: int = 1) -> jax.Array:
    """x `[B, T, ...]` -> y with y[:, t] = x[:, t + by] (the last entry repeats past the end;
    callers mask those positions)."""
    if by == 0:
        return x
    pad = [(0, 0), (0, by)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad, mode="edge")[:, by:]


def shift_right(x: jax.Array, by: int = 1) -> jax.Array:
    """x `[B, T, ...]` -> y with y[:, t] = x[:, t - by] (zeros for t < by)."""
    if by == 0:
        return x
    pad = [(0, 0), (by, 0)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad)[:, : x.shape[1]]


def _chunks(x: jax.Array, axis: int, chunk: int) -> jax.Array:
    """Pad `axis` (length T) to a multiple of `chunk` and move the chunk index to the front:
    `[..., T, ...]` -> `[T/C, ..., C, ...]`."""
    pad = (-x.shape[axis]) % chunk
    x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // chunk, chunk) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


@jax.custom_vjp
def _soft_ce_chunk(dr, tg, head, w):
    """dr `[n, B, C, D]` normed draft states, tg `[B, C, D]` target states, head `[V, D]`,
    w `[n, B, C]` f32 weights -> (weighted CE sums `[n]`, weighted argmax agreements `[n]`)."""
    return _soft_ce_chunk_fwd(dr, tg, head, w)[0]


def _soft_ce_chunk_fwd(dr, tg, head, w):
    p = jax.nn.softmax(linear(head, tg, jnp.float32), axis=-1)  # [B, C, V] target law
    dl = linear(head, dr, jnp.float32)  # [n, B, C, V]
    logq = jax.nn.log_softmax(dl, axis=-1)
    ce = -jnp.sum(p * logq, axis=-1)  # [n, B, C]
    hit = jnp.argmax(dl, axis=-1) == jnp.argmax(p, axis=-1)  # [n, B, C]
    d_logits = (jnp.exp(logq) - p) * w[..., None]  # [n, B, C, V]: d(sum w * ce) / d logits
    d_dr = jnp.einsum("NBCV,VD->NBCD", d_logits, head.astype(jnp.float32)).astype(dr.dtype)  # [n, B, C, D]
    return (jnp.sum(ce * w, axis=(1, 2)), jnp.sum(hit * w, axis=(1, 2))), d_dr


def _soft_ce_chunk_bwd(d_dr, g):
    g_ce, _ = g  # [n]: the agreement count has no gradient
    return g_ce[:, None, None, None].astype(d_dr.dtype) * d_dr, None, None, None


_soft_ce_chunk.defvjp(_soft_ce_chunk_fwd, _soft_ce_chunk_bwd)


def label_positions(valid: jax.Array, r: int) -> jax.Array:
    """valid `[B, T]` -> `[B, R]` indices of each row's first R valid positions (in order), padded
    with invalid ones when a row has fewer."""
    return jnp.argsort(~valid, axis=1, stable=True)[:, :r]


def chunked_soft_ce(
    draft: jax.Array,
    target: jax.Array,
    head: jax.Array,
    valid: jax.Array,
    chunk: int = 32,
    positions: int | None = None,
):
    """Soft cross-entropy of draft distributions against the target's, over the full vocabulary.

    draft `[n, B, T, D]`: n normed draft hidden states per label position; target `[B, T, D]`:
    the target's final normed hidden at the same positions; head `[V, D]`: the shared LM head;
    valid `[n, B, T]`. `positions` (R): compute only each row's first R positions valid at any
    depth (exact when no row has more). Returns (sum of CE `[n]`, count of argmax agreements
    `[n]`), both over valid positions. Gradients flow into `draft` only.
    """
    n = draft.shape[0]
    if positions is not None and positions < draft.shape[2]:
        idx = label_positions(jnp.any(valid, axis=0), positions)  # [B, R]
        draft = jnp.take_along_axis(draft, idx[None, :, :, None], axis=2)  # [n, B, R, D]
        target = jnp.take_along_axis(target, idx[:, :, None], axis=1)  # [B, R, D]
        valid = jnp.take_along_axis(valid, idx[None], axis=2)  # [n, B, R]
    w = valid.astype(jnp.float32)
    xs = (_chunks(draft, 2, chunk), _chunks(target, 1, chunk), _chunks(w, 2, chunk))

    def body(carry, x):
        ce, hit = _soft_ce_chunk(x[0], x[1], head, x[2])  # [n] each
        return (carry[0] + ce, carry[1] + hit), None

    zero = jnp.zeros((n,), jnp.float32)
    (ce, hits), _ = jax.lax.scan(body, (zero, zero), xs)
    return ce, hits


def chunked_argmax(h: jax.Array, head: jax.Array, chunk: int = 32, d2t=None) -> jax.Array:
    """Greedy tokens of normed hidden states `[n, B, T, D]` under head `[V, D]` -> `[n, B, T]`
    int32, a chunk of positions at a time (no `[n, B, T, V]` array). With a draft vocabulary
    `d2t [N]`, `head` holds its rows `[N, D]` (`head_rows`) and the tokens are mapped back to
    target ids: what such a drafter proposes."""
    t = h.shape[2]
    out = jax.lax.map(
        lambda x: jnp.argmax(linear(head, x, jnp.float32), axis=-1).astype(jnp.int32), _chunks(h, 2, chunk)
    )
    out = jnp.moveaxis(out, 0, 2).reshape(h.shape[:2] + (-1,))[:, :, :t]  # [n, B, T]
    return out if d2t is None else jnp.take(d2t, out)


def chain_counts(hits: list[jax.Array]) -> jax.Array:
    """Greedy chain acceptance: `hits[i] [B, T]` says draft i + 1 from start t is right.
    Returns the accepted count per start `[B, T]` (drafts are accepted up to the first miss)."""
    ok = jnp.ones(hits[0].shape, bool)
    count = jnp.zeros(hits[0].shape, jnp.int32)
    for hit in hits:
        ok = ok & hit
        count = count + ok
    return count


def simulate_store(
    sim, params, frozen, store, names: tuple[str, ...], k: int, max_rows: int = 64, batch_size: int = 8
) -> dict:
    """Run `sim(params, frozen, batch) -> (count [B, T], starts [B, T])` over the first
    `max_rows` rows of a FeatureStore and summarise (see `acceptance_summary`).

    Two views of the same counts. `sim_*`: every reply position as a chain start, the drafter's
    average quality. `path_*`: only the starts greedy decoding visits (the first reply token,
    then start + accepted + 1, the position after the target's bonus token), so `path_mal` is the
    MAL that `specjax generate` reaches on these prompts (the stored replies are the target's own
    greedy text). Starts after a rejection are harder than the average position, so path_mal is
    the lower and the honest forecast."""
    hist = np.zeros(k + 1, np.int64)  # starts with exactly a accepted drafts
    path = np.zeros(k + 1, np.int64)  # the same, over the starts greedy decoding visits
    for s in range(0, min(len(store), max_rows), batch_size):
        b = store.batch(np.arange(s, min(s + batch_size, len(store), max_rows)))
        count, starts = sim(params, frozen, {n: jnp.asarray(b[n]) for n in names})
        count, starts = np.asarray(count), np.asarray(starts)
        hist += np.bincount(count[starts], minlength=k + 1)
        for c, ok in zip(count, starts):  # one row: walk the decoder's chain starts
            t = int(np.argmax(ok)) if ok.any() else len(ok)
            while t < len(ok) and ok[t]:
                path[c[t]] += 1
                t += int(c[t]) + 1
    out = acceptance_summary(hist)
    p = acceptance_summary(path)
    out.update(path_mal=p["sim_mal"], path_per_position=p["sim_per_position"], path_steps=p["sim_starts"])
    return out


def acceptance_summary(hist) -> dict:
    """From counts of starts with exactly a = 0..K accepted drafts: simulated MAL (accepted + 1)
    and per-position acceptance P(draft i accepted | drafts < i accepted)."""
    hist = np.asarray(hist, np.float64)
    total = max(hist.sum(), 1.0)
    k = len(hist) - 1
    reach = [hist[i:].sum() for i in range(k + 1)]  # starts with >= i accepted
    per_pos = [float(reach[i + 1] / reach[i]) if reach[i] else 0.0 for i in range(k)]
    return {
        "sim_mal": float((hist * np.arange(k + 1)).sum() / total + 1.0),
        "sim_per_position": [round(p, 4) for p in per_pos],
        "sim_starts": int(total),
    }


def draft_vocab(counts, size: int, vocab_size: int):
    """`d2t [N]` int32 (jnp) of the `size` most frequent reply tokens, or None for size 0 (the
    drafter proposes over the whole vocabulary). MTP and the draft model use it to restrict the
    head they draft with; they still train against the target's full distribution."""
    if not size:
        return None
    if counts is None:
        raise ValueError("draft_vocab_size needs the training data's token counts")
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be 0 (whole vocabulary) or 1..{vocab_size}, got {size}")
    from specjax.drafters.base import vocab_maps

    return jnp.asarray(vocab_maps(counts, size)[0])


def save_draft_vocab_if_any(out_dir: str, d2t) -> str:
    """Write `out_dir/draft_vocab.safetensors` when the task has a draft vocabulary."""
    if d2t is not None:
        from specjax.drafters.checkpoint import save_draft_vocab

        save_draft_vocab(out_dir, np.asarray(d2t))
    return out_dir
