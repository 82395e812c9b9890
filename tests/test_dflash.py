"""DFlash block drafters against z-lab's reference (`dflash` 0.1.0, installed `--no-deps` by `make
test`): a checkpoint its `DFlashDraftModel` builds loads in specjax and gives its block logits from
the same target features; ours exported load back in it with the same logits; the context cache
after commits equals a fresh one over the accepted text; greedy decoding is token-identical to
plain decoding on a tiny Qwen3 target and on the real default model; bad checkpoints are one line."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel, extract_context_feature  # the reference
from transformers import Qwen3Config, Qwen3ForCausalLM

from helpers import rel_err
from specjax.drafters import dflash, dflash_formats, make_drafter
from specjax.drafters.base import CommitContext, InitContext
from specjax.errors import DrafterError
from specjax.models.config import LlamaConfig
from specjax.models.loading import load_model
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams

V, D, L = 96, 32, 6
LAYER_IDS = [1, 3]  # decoder-layer outputs (the reference reads hidden_states[id + 1])
BLOCK = 5
MASK = V - 1


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    out = str(tmp_path_factory.mktemp("qwen3_target"))
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, "float32", quiet=True)


def drafter_hf_config(layers: int = 2) -> Qwen3Config:
    """The HF (Qwen3) config of the tiny target's drafter layers, as the references build them."""
    return Qwen3Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
    )


def drafter_layers() -> LlamaConfig:
    """specjax's config of the tiny target's drafter layers (Qwen3: q/k norms)."""
    return LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=40,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        qk_norm=True,
    )


def reference_drafter(seed: int = 0, layers: int = 2, **extra) -> DFlashDraftModel:
    """A random z-lab DFlash drafter for the tiny target, with non-trivial norm scales."""
    torch.manual_seed(seed)
    cfg = drafter_hf_config(layers)
    cfg.block_size, cfg.num_target_layers = BLOCK, L
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS, **extra}
    cfg.architectures = ["DFlashDraftModel"]
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def reference_logits(model: DFlashDraftModel, target_dir: str, tokens: np.ndarray, last: int) -> np.ndarray:
    """The reference's block logits `[K, V]` after the prompt `tokens` with `last` as the anchor."""
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens)[None], output_hidden_states=True)
        feats = extract_context_feature(out.hidden_states, model.target_layer_ids)  # [1, T, nD]
        block = torch.as_tensor([[last] + [MASK] * (BLOCK - 1)])
        emb = hf.get_input_embeddings()(block)
        pos = torch.arange(len(tokens) + BLOCK)[None]
        h = model(target_hidden=feats, noise_embedding=emb, position_ids=pos)  # [1, B, D]
        return model.compute_logits(h[:, 1:], hf.lm_head)[0].numpy(), [x.numpy() for x in out.hidden_states]


def specjax_state(drafter, dparams, hidden_states: list[np.ndarray], tokens: np.ndarray, last: int):
    """Our drafter's state after a prefill of `tokens` whose features are the reference's."""
    feats = jnp.stack([jnp.asarray(hidden_states[i + 1]) for i in drafter.feature_layers])  # [n, 1, T, D]
    t = len(tokens)
    prompt = jnp.asarray(tokens, jnp.int32)[None]
    history = jnp.concatenate([prompt, jnp.asarray([[last]], jnp.int32)], axis=1)
    ctx = InitContext(
        prompt,
        jnp.asarray([t], jnp.int32),
        history,
        jnp.asarray([t + 1], jnp.int32),
        SamplingArrays.from_params([SamplingParams()]),
        feats,
        None,
        cache_size=32,
        all_greedy=True,
    )
    return drafter.init(dparams, ctx), history


def test_zlab_checkpoint_gives_the_references_block_logits(target_dir, target, tmp_path):
    ref = reference_drafter()
    ref.save_pretrained(str(tmp_path))
    tokens, last = np.array([3, 9, 27, 81, 50, 6, 18]), 54
    want, hidden_states = reference_logits(ref, target_dir, tokens, last)
    drafter = make_drafter(f"dflash:{tmp_path}", 0, target)
    assert drafter.num_draft == BLOCK - 1 and drafter.feature_layers == tuple(LAYER_IDS)
    dparams = drafter.params()
    st, history = specjax_state(drafter, dparams, hidden_states, tokens, last)
    got = np.asarray(drafter.block_logits(dparams, st, history, jnp.asarray([len(tokens) + 1])))[0]  # [K, V]
    assert rel_err(got, want) < 1e-5
    # a shorter block (K = 2): the reference's own behaviour near the end of a reply
    short = make_drafter(f"dflash:{tmp_path}", 2, target)
    assert short.num_draft == 2


def test_export_to_zlab_loads_back_in_the_reference(target_dir, target, tmp_path):
    cfg = dflash.DFlashConfig(drafter_layers(), tuple(LAYER_IDS), L, BLOCK, MASK)
    w = dflash.init_weights(cfg, seed=3)
    ours = str(tmp_path / "ours")
    dflash.save(w, ours)
    dflash_formats.export(dflash.load(ours), str(tmp_path / "zlab"))
    ref = DFlashDraftModel.from_pretrained(str(tmp_path / "zlab")).eval()
    tokens, last = np.array([5, 7, 11, 13, 17]), 19
    want, hidden_states = reference_logits(ref, target_dir, tokens, last)
    for path in (ours, str(tmp_path / "zlab")):
        drafter = make_drafter(f"dflash:{path}", 0, target)
        dparams = drafter.params()
        st, history = specjax_state(drafter, dparams, hidden_states, tokens, last)
        got = np.asarray(drafter.block_logits(dparams, st, history, jnp.asarray([len(tokens) + 1])))[0]
        assert rel_err(got, want) < 1e-5


def test_commit_keeps_the_context_of_the_accepted_text(target_dir, target, tmp_path):
    """After a verify step that accepts j drafts, the drafter's cache and its next block equal a
    fresh prefill of the longer prompt (the rollback is exact)."""
    reference_drafter(seed=1).save_pretrained(str(tmp_path))
    drafter = make_drafter(f"dflash:{tmp_path}", 3, target)
    dparams = drafter.params()
    net = target.module()
    seq = jnp.asarray([[4, 8, 15, 16, 23, 42, 7, 9, 30, 31, 2]], jnp.int32)
    p, kp1 = 5, drafter.num_draft + 1

    def feats(upto):
        cache = net.new_cache(1, 32)
        _, _, col = net.hidden(seq[:, :upto], cache, drafter.feature_layers)
        return col  # [n, 1, T, D]

    def init(t):
        hist = seq[:, : t + 1]
        ctx = InitContext(
            seq[:, :t],
            jnp.asarray([t]),
            hist,
            jnp.asarray([t + 1]),
            SamplingArrays.from_params([SamplingParams()]),
            feats(t),
            None,
            cache_size=32,
            all_greedy=True,
        )
        return drafter.init(dparams, ctx)

    full = feats(p + kp1)
    for j in range(kp1):  # j drafts accepted: positions p .. p + j committed
        st = init(p)
        ctx = CommitContext(
            jnp.asarray([j]),
            seq[:, p + 1 : p + 1 + kp1],
            seq[:, : p + j + 2],
            jnp.asarray([p + j + 2]),
            jnp.asarray([True]),
            full[:, :, p : p + kp1],
            None,
        )
        st = drafter.commit(dparams, st, ctx)
        fresh = init(p + j + 1)
        n = p + j + 1
        assert int(st.cache.lengths[0]) == n == int(fresh.cache.lengths[0])
        for a, b in zip(st.cache.k + st.cache.v, fresh.cache.k + fresh.cache.v, strict=True):
            assert rel_err(np.asarray(a)[:, :n], np.asarray(b)[:, :n]) < 1e-5
        hist, hl = seq[:, : n + 1], jnp.asarray([n + 1])
        assert (
            rel_err(
                np.asarray(drafter.block_logits(dparams, st, hist, hl)),
                np.asarray(drafter.block_logits(dparams, fresh, hist, hl)),
            )
            < 1e-5
        )


def test_greedy_dflash_equals_plain_on_a_qwen3_target(target, tmp_path):
    reference_drafter(seed=2).save_pretrained(str(tmp_path))
    engine = Engine(target)
    prompts = [[3, 5, 7, 11, 2, 4], [13, 17], [1, 2, 3, 1, 2, 3, 1, 2]]
    params = [SamplingParams(max_new_tokens=24)] * len(prompts)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    for k in (1, 4):
        drafter = make_drafter(f"dflash:{tmp_path}", k, target)
        assert [r.token_ids for r in engine.generate(prompts, params, drafter=drafter)] == plain


def test_greedy_dflash_equals_plain_on_the_default_model(default_model, tmp_path):
    """A random DFlash drafter for SmolLM2-135M (the shipped one's shape, untrained)."""
    lc = LlamaConfig(
        vocab_size=default_model.config.vocab_size,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        qk_norm=True,
    )
    cfg = dflash.DFlashConfig(lc, dflash.default_target_layers(30, 1), 30, 8, 0)
    dflash.save(dflash.init_weights(cfg, seed=0), str(tmp_path))
    engine = Engine(default_model)
    prompts = [default_model.tokenizer.encode(s) for s in ("def fibonacci(n):", "The capital of France is")]
    params = [SamplingParams(max_new_tokens=24)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    drafter = make_drafter(f"dflash:{tmp_path}", 0, default_model)
    assert drafter.num_draft == 7
    assert [r.token_ids for r in engine.generate(prompts, params, drafter=drafter)] == plain


def _corrupt(src: str, out: str, config=None) -> str:
    os.makedirs(out)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as fi, open(os.path.join(out, name), "wb") as fo:
            fo.write(fi.read())
    if config:
        path = os.path.join(out, "config.json")
        with open(path) as fh:
            raw = json.load(fh)
        config(raw)
        with open(path, "w") as fh:
            json.dump(raw, fh)
    return out


@pytest.mark.parametrize(
    "case, message",
    [
        (lambda r: r.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
        (lambda r: r["dflash_config"].pop("mask_token_id"), "no mask_token_id"),
        (lambda r: r["dflash_config"].update(mask_token_id=V + 3), "outside the vocabulary"),
        (lambda r: r.update(hidden_size=48), "shape"),
        (lambda r: r.update(num_target_layers=L + 2), "layer count"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[1, L]), "reads target layer"),
        (lambda r: r.update(block_size=1), "block_size"),
        (lambda r: r.update(is_causal=True), "causal"),
    ],
)
def test_bad_zlab_checkpoints_are_one_line_errors(case, message, target, tmp_path):
    reference_drafter(seed=4).save_pretrained(str(tmp_path / "src"))
    bad = _corrupt(str(tmp_path / "src"), str(tmp_path / "bad"), case)
    with pytest.raises(DrafterError, match=message) as e:
        make_drafter(f"dflash:{bad}", 0, target)
    assert "\n" not in str(e.value)


def test_too_many_drafts_for_the_block_is_one_line(target, tmp_path):
    reference_drafter(seed=5).save_pretrained(str(tmp_path))
    with pytest.raises(DrafterError, match="1..4 tokens per step"):
        make_drafter(f"dflash:{tmp_path}", BLOCK, target)
