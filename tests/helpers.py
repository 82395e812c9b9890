"""Helpers shared by the tests (imported as `helpers`; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import collections
import json
import os
import sys

import numpy as np


def tiny(**overrides):
    """The tests' tiny specjax `LlamaConfig`: the `cpu_smoke` preset's shape (vocab 256, 2 layers,
    hidden 64, 4 heads / 2 KV heads of 16, FFN 128, context 512, untied head: a few-hundred-kilobyte
    random model); `overrides` replace fields."""
    from specjax.models.config import cpu_smoke

    return cpu_smoke(**overrides)


def hf_llama_config(**kw):
    """A transformers LlamaConfig for tiny random models (eager attention, f32)."""
    from transformers import LlamaConfig as HFLlamaConfig

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    cfg = HFLlamaConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def random_hf_model(seed: int = 0, **kw):
    """A random HF LlamaForCausalLM in eval mode, with non-trivial RMSNorm scales (HF inits
    them to ones, which would hide a dropped or misplaced norm weight)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_llama_config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def specjax_from_hf(hf_model):
    """The specjax Model holding exactly `hf_model`'s weights (config read from its HF dict)."""
    import jax.numpy as jnp

    from specjax.models.config import LlamaConfig
    from specjax.models.loading import Model, build_model
    from specjax.models.loading.mapping import params_from_hf

    cfg = LlamaConfig.from_hf(hf_model.config.to_dict())
    sd = {k: v.detach().cpu().numpy() for k, v in hf_model.state_dict().items()}
    pure = params_from_hf(cfg, lambda n: sd[n], np.float32)
    graphdef, state = build_model(cfg, pure, jnp.float32)
    return Model(cfg, graphdef, state, None, "from-hf", "memory")


def rel_err(a, b) -> float:
    """max|a - b| / max|b|, in f32 (no float64 anywhere)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def specjax_cli_cmd() -> list[str]:
    """The installed `specjax` console script of this interpreter's environment."""
    script = os.path.join(os.path.dirname(sys.executable), "specjax")
    return [script] if os.path.isfile(script) else [sys.executable, "-m", "specjax.cli"]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SHARP_LAYERS = (0, 1, 3)  # target layers the shared tiny feature store keeps (EAGLE-3 tests)


def sharpen(model, scale=4.0):
    """`model` with its LM head scaled by `scale`, in place, so the law has a few likely paths
    (random tiny models are near uniform); returns the model."""
    from flax import nnx

    pure = nnx.to_pure_dict(model.params)
    pure["lm_head"] = pure["lm_head"] * scale
    nnx.replace_by_pure_dict(model.params, pure)
    return model


def sharp_target():
    """A tiny random target (`tiny(num_layers=4)`) with a peaked next-token distribution (its LM
    head scaled by 25), so that a drafter trained on it has something to learn."""
    from specjax.models.loading import random_model

    return sharpen(random_model(tiny(num_layers=4), seed=1), 25.0)


# Targets unlike the sharp target's shape (`tiny(num_layers=4)` with the change) and the one-line
# error a drafter trained for it must give there (`conftest.other_target`).
OTHER_TARGETS = {
    "hidden": (dict(hidden_size=32, num_heads=2, num_kv_heads=1), "hidden size 64, but this target has 32"),
    "vocab": (dict(vocab_size=512), "vocab size 256, but this target has 512"),
    "layers": (dict(num_layers=6), "layer count 4, but this target has 6"),
}


def tiny_checkpoint_with_tokenizer(out_dir: str, tokenizer, seed: int = 0, **config) -> str:
    """Write a tiny random HF Llama checkpoint (`hf_llama_config(**config)`) plus `tokenizer`:
    string prompts and the chat template work on it in a second instead of the real model."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(hf_llama_config(**config)).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def batch_job_rows() -> list[dict]:
    """12 greedy rows (prompts and chat messages, one with its own max_new_tokens) and 4 rows
    sampled at temperature 0.9 with seed 5."""
    rows = []
    for i in range(16):
        if i % 3 == 0:
            row = {"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}: why is the sky blue?"}]}
        else:
            row = {"id": f"q{i}", "prompt": f"Tell me about topic number {i}" + " please" * (i % 4)}
        if i >= 12:
            row.update(temperature=0.9, seed=5)
        rows.append(row)
    rows[4]["max_new_tokens"] = 3
    rows[5]["id"] = 5  # integer ids are fine too
    return rows


def write_jsonl(path, rows) -> str:
    """Rows (dicts, or str lines as they are) as a JSONL file at `path`; returns the path."""
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def read_rows(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


# The batch-job tests (test_batch.py, test_batch_policy.py): their runs' max_new_tokens and batch
# size, their BatchConfig, and their comparison of result rows with the reference run's.
BATCH_MAX_NEW = 8
BATCH_ROWS = 4


def batch_config(model, inp, out, **kw):
    from specjax.batch.config import BatchConfig
    from specjax.sampling import SamplingParams

    kw = dict(batch_size=BATCH_ROWS, progress=False) | kw
    return BatchConfig(
        output=str(out), input=inp, model=model, sampling=SamplingParams(max_new_tokens=BATCH_MAX_NEW), **kw
    )


def assert_same_rows(rows: list[dict], reference: dict, ids: list, greedy_only: bool = False) -> None:
    """Each id exactly once and, row by row, the reference's tokens and text."""
    counts = collections.Counter(json.dumps(r["id"]) for r in rows)
    assert all(c == 1 for c in counts.values()), [k for k, c in counts.items() if c > 1]
    assert set(counts) == {json.dumps(i) for i in ids}
    for r in rows:
        ref = reference[r["id"]]
        if greedy_only and ref["id"] in {x["id"] for x in batch_job_rows() if "temperature" in x}:
            continue
        fields = ("token_ids", "text", "finish_reason")
        assert [r[f] for f in fields] == [ref[f] for f in fields], r["id"]


FOUR_DEVICE_SCRIPT = """
import json, sys
import jax
sys.path.insert(0, {tests!r})
from helpers import sharp_target
from {module} import make_task
from train.data import FeatureStore
from train.loop import OptimConfig, fit, read_log
assert len(jax.devices()) == 4
target = sharp_target()
store = FeatureStore({store!r})
o = OptimConfig(steps={steps}, batch_size=8, lr=1e-3, warmup_steps=1, checkpoint_every={steps}, eval_every=0)
fit(make_task(target, store, *{task_args!r}), store, o, {out!r})
print(json.dumps([r["loss"] for r in read_log({out!r})]))
"""


def four_device_losses(module: str, store_path: str, out: str, steps: int, *task_args) -> list[float]:
    """The per-step losses of `module.make_task(sharp_target(), store, *task_args)` trained for
    `steps` steps (batch 8, lr 1e-3) in a fresh process on 4 host devices: the data-parallel run
    the tests compare with one device."""
    import subprocess

    script = FOUR_DEVICE_SCRIPT.format(
        tests=os.path.dirname(os.path.abspath(__file__)),
        module=module,
        store=store_path,
        out=out,
        steps=steps,
        task_args=task_args,
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
