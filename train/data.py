"""Training data for drafters: conversations -> token sequences -> target features on disk.

Two sources of responses, both on ShareGPT prompts (HumanEval and MT-bench are benchmarks and
never enter training):

* `regen`: the target's own greedy replies, generated in batches by the specjax engine and kept
  in a growing corpus (train/replies.py). This is the text a drafter sees at inference, and for
  greedy data the simulator's teacher-forced acceptance is exact.
* `dataset`: the conversation's own first reply, labelled by the target's soft distribution.
  Free to build (no generation), but off the target's distribution.

Features are computed once by a target prefill over each padded sequence and stored as
memory-mapped `.npy` files (bf16 stored as uint16), so training streams batches from disk instead
of holding gigabytes in RAM or re-running the 30-layer target every epoch:

    tokens [N, T] int32, mask [N, T] bool (response tokens), argmax [N, T] int32 (target's greedy
    next token at each position), final [N, T, D] (final normed hidden), hidden [N, n, T, D]
    (outputs of `layers`), counts [V] int64 (response-token frequencies, for the draft vocab).

Cost: (n + 1) * D * 2 bytes per stored position (prompt, reply and padding to `seq_len`), e.g.
4.6 KB for EAGLE-3 on SmolLM2-135M (n = 3, D = 576): 4.6 GB per million positions, ~9 GB per
million reply tokens at the recipes' padding (seq_len 288, ~140-token replies). An extraction is
resumable (`extract_features`).
"""

from __future__ import annotations

import json
import os
import random
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from specjax.datasets import sharegpt_split
from specjax.files import write_atomic
from specjax.models.loading import Model
from specjax.prompts import encode_prompt
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams

META = "meta.json"


def conversations(num: int, seed: int = 0, offset: int = 0) -> list[list[dict]]:
    """`num` ShareGPT training conversations (the bench sample excluded), shuffled by `seed`."""
    return _shuffled_pool(seed)[offset : offset + num]


def held_out_conversations(num: int, seed: int = 0) -> list[list[dict]]:
    """The last `num` conversations of the shuffled pool: the held-out split of every recipe, the
    same whatever `num_prompts` a recipe trains on (so held-out MAL compares across data sizes)."""
    return _shuffled_pool(seed)[-num:]


def pool_size() -> int:
    return len(sharegpt_split()[1])


def _shuffled_pool(seed: int) -> list[list[dict]]:
    _, train = sharegpt_split()
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    return [train[i] for i in order]


def dataset_sequences(model: Model, convs, max_prompt: int, seq_len: int) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) from each conversation's first user turn + its own reply."""
    tok = model.tokenizer
    out = []
    for conv in convs:
        if len(conv) < 2 or conv[1]["role"] != "assistant":
            continue
        prompt = encode_prompt(model, conv[:1])
        if len(prompt) > max_prompt:
            continue
        text = tok.apply_chat_template(conv[:2], tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids[:seq_len]
        if ids[: len(prompt)] == prompt and len(ids) > len(prompt) + 1:
            out.append((ids, len(prompt)))
    return out


def regen_replies(
    model: Model, prompts: list[list[int]], max_new: int, batch_size: int, on_batch=None
) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy reply, prompt length) for each prompt's token ids, generated
    `batch_size` at a time in order of length (similar lengths share a batch: less padding, fewer
    shape buckets); returned in that order."""
    prompts = sorted(prompts, key=len)
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=max_new)
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        rows = engine.generate(chunk, [params] * len(chunk), eos_ids=model.config.eos_token_ids)
        new = [(p + r.token_ids, len(p)) for p, r in zip(chunk, rows)]
        out.extend(new)
        if on_batch:
            on_batch(new)
    return out


def encode_prompts(model: Model, convs, max_prompt: int) -> list[list[int]]:
    """Each conversation's first user turn as chat-template token ids, those of at most
    `max_prompt` tokens, in order."""
    ids = (encode_prompt(model, conv[:1]) for conv in convs)
    return [p for p in ids if len(p) <= max_prompt]


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)


class FeatureStore:
    """Memory-mapped features of one split (see the module docstring for the arrays)."""

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, META)) as fh:
            self.meta = json.load(fh)
        if not self.meta.get("complete"):
            raise RuntimeError(f"feature store {path} is incomplete; rerun the extraction")
        self.arrays = {
            name: np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")
            for name in ("tokens", "mask", "argmax", "final", "hidden")
        }
        self.counts = np.load(os.path.join(path, "counts.npy"))

    def __len__(self) -> int:
        return self.arrays["tokens"].shape[0]

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.meta["layers"])

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `idx` as numpy arrays; bf16 features come back as float32."""
        idx = np.sort(np.asarray(idx))  # sequential reads from the memmap
        out = {name: np.asarray(a[idx]) for name, a in self.arrays.items()}
        for name in ("final", "hidden"):
            out[name] = out[name].view(ml_dtypes.bfloat16).astype(np.float32)
        out["hidden"] = out["hidden"].transpose(1, 0, 2, 3)  # [n, B, T, D]
        return out

    def num_tokens(self) -> int:
        return int(np.asarray(self.arrays["mask"]).sum())


def extract_features(
    model: Model,
    seqs: list[tuple[list[int], int]],
    layers: tuple[int, ...],
    out_dir: str,
    seq_len: int,
    batch_size: int = 8,
    on_batch=None,
) -> FeatureStore:
    """Run the target over every sequence (right-padded to `seq_len`) and write the store.

    Reuses a complete store of the same sequences instead of recomputing it when it keeps the
    same layers, or any layers when `layers` is empty (readers of the final hidden state only).
    Resumes a store of the same extraction that a killed run left incomplete: `meta.json` records
    how many sequences are written (after their arrays are flushed), and the next run goes on
    from there, so a kill costs at most one batch.
    """
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, META)
    digest = _digest(seqs, seq_len, model.name)
    old = {}
    if os.path.exists(meta_path):
        with open(meta_path) as fh:
            old = json.load(fh)
        if (
            old.get("complete")
            and old.get("digest") == digest
            and (not layers or tuple(old["layers"]) == tuple(layers))
        ):
            return FeatureStore(out_dir)
    n, d, v = len(seqs), model.config.hidden_size, model.config.vocab_size
    meta = {"digest": digest, "layers": list(layers), "seq_len": seq_len, "num_sequences": n, "target": model.name}
    resume = not old.get("complete") and all(old.get(k) == meta[k] for k in meta)
    done = int(old.get("done", 0)) if resume else 0
    mm = lambda name, shape, dtype: np.lib.format.open_memmap(  # noqa: E731
        os.path.join(out_dir, f"{name}.npy"), mode="r+" if resume else "w+", dtype=dtype, shape=shape
    )
    tokens, mask = mm("tokens", (n, seq_len), np.int32), mm("mask", (n, seq_len), np.bool_)
    argmax = mm("argmax", (n, seq_len), np.int32)
    final = mm("final", (n, seq_len, d), np.uint16)
    hidden = mm("hidden", (n, len(layers), seq_len, d), np.uint16)
    arrays = (tokens, mask, argmax, final, hidden)
    counts = np.zeros(v, np.int64)
    for i, (ids, plen) in enumerate(seqs):
        ids = ids[:seq_len]
        tokens[i, : len(ids)] = ids
        mask[i, plen : len(ids)] = True
        np.add.at(counts, np.asarray(ids[plen:], np.int64), 1)

    record = lambda **extra: write_atomic(meta_path, json.dumps({**meta, **extra}).encode())  # noqa: E731
    run = _feature_pass(model, layers, seq_len)
    t0 = time.perf_counter() - float(old.get("seconds", 0.0) if resume else 0.0)
    if not resume:
        record(complete=False, done=0, seconds=0.0)  # the arrays no longer hold an older store
    for s in range(done, n, batch_size):
        e = min(s + batch_size, n)
        toks = np.zeros((batch_size, seq_len), np.int32)
        toks[: e - s] = tokens[s:e]
        h, coll, am = run(model.params, jnp.asarray(toks))
        final[s:e] = _bf16_bits(h[: e - s])
        if layers:  # drafters that read only the final hidden (MTP, draft model) store none
            hidden[s:e] = _bf16_bits(jnp.transpose(coll, (1, 0, 2, 3))[: e - s])
        argmax[s:e] = np.asarray(am[: e - s])
        for a in arrays:
            a.flush()
        record(complete=False, done=e, seconds=time.perf_counter() - t0)
        if on_batch:
            on_batch(e - s, int(mask[s:e].sum()))
    for a in arrays:
        a.flush()
    np.save(os.path.join(out_dir, "counts.npy"), counts)
    record(complete=True, response_tokens=int(np.asarray(mask).sum()), seconds=time.perf_counter() - t0)
    return FeatureStore(out_dir)


def _feature_pass(model: Model, layers: tuple[int, ...], seq_len: int):
    """jit(params, tokens `[B, T]`) -> (final hidden `[B, T, D]`, features `[n, B, T, D]`,
    the target's greedy next token `[B, T]`) of one fresh prefill."""

    @jax.jit
    def run(params, toks):
        m = nnx.merge(model.graphdef, params)
        h, _, coll = m.hidden(toks, m.new_cache(toks.shape[0], seq_len), feature_layers=layers, fresh=True)
        return h, coll, jnp.argmax(m.logits(h), axis=-1).astype(jnp.int32)

    return run


def _digest(seqs, seq_len, name) -> str:
    import hashlib

    h = hashlib.sha256(json.dumps([seq_len, name]).encode())
    for ids, plen in seqs:
        h.update(np.asarray(ids + [-1, plen], np.int64).tobytes())
    return h.hexdigest()[:24]
