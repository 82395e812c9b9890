"""EAGLE-3 drafters in the published layouts (EAGLE/SpecForge, vLLM `speculators`), checked against
the `speculators` library itself: checkpoints it builds load in specjax and give its draft logits
and tokens on the same target (whose hidden states come from HF transformers, so the layer-id
conventions are tested too); ours exported load back in it with the same logits."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig  # the reference (`make test` installs it)
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from specjax.drafters import eagle3_formats, make_drafter, shipped_path
from specjax.drafters.eagle3 import load as load_specjax
from specjax.errors import DrafterError
from specjax.models.loading import load_model
from specjax.models.loading.safetensors_io import SafetensorsFile, save_file
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams

V, D, L, N = 96, 32, 6, 40
AUX_IDS = [1, 3, 5]  # speculators ids: HF hidden_states indices = outputs of layers 0, 2, 4


@pytest.fixture(scope="module")
def hf_target_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = HFLlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
    )
    out = str(tmp_path_factory.mktemp("hf_target"))
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target(hf_target_dir):
    return load_model(hf_target_dir, "float32", quiet=True)


def reference_drafter(target_dir: str, qwen3: bool = False, seed: int = 0, **flags) -> Eagle3DraftModel:
    """A random `speculators` EAGLE-3 drafter (eager attention so it runs on CPU), N < V with a map."""
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
    )
    layer = Qwen3Config(**kw) if qwen3 else HFLlamaConfig(**kw)
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=N,
        eagle_aux_hidden_state_layer_ids=AUX_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target_dir),
        ),
        **flags,
    )
    model = Eagle3DraftModel(cfg)
    ids = torch.from_numpy(np.sort(np.random.RandomState(seed).choice(V, N, replace=False)))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(N))
    embed = LlamaForCausalLM.from_pretrained(target_dir).model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight":
                p.copy_(embed)  # a copy of the target's table, as published drafters carry it
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def ref_layer_logits(model: Eagle3DraftModel, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Draft logits `[T, N]` at every position, run with the reference's own modules."""
    model.layers[0].self_attn.config._attn_implementation = "eager"  # a loaded one defaults to flex
    x = feats
    if model.input_norm is not None:
        x = model.input_norm(x)
    x = model.fc(x)
    h = torch.cat([model.embed_tokens(next_ids), x], dim=-1)
    t = h.shape[1]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = model.layers[0](h, attention_mask=mask, position_ids=pos, position_embeddings=model.rotary_emb(h, pos))
    return model.lm_head(model.norm(out))[0]  # norm_output changes what is fed back, not these


def hf_features(target_dir: str, tokens: np.ndarray) -> torch.Tensor:
    """`[1, T, 3D]`: HF transformers' hidden_states at the speculators ids, concatenated."""
    hf = LlamaForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        hs = hf(torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in AUX_IDS], dim=-1)


def specjax_logits(weights, target, tokens: np.ndarray) -> np.ndarray:
    """Our draft logits `[T, N]` for positions 0..T-2 (feature at t, token t + 1) plus the last."""
    net = weights.module()
    x = jnp.asarray(tokens[None], jnp.int32)
    m = target.module()
    _, _, feats = m.hidden(x, m.new_cache(1, 64), feature_layers=weights.config.target_layers)
    embed = target.params["embed"][...] if weights.embed is None else weights.embed
    nxt = jnp.concatenate([x[:, 1:], x[:, -1:]], axis=1)
    g, _ = net.step(jnp.take(embed, nxt, axis=0), net.fuse(feats), net.new_cache(1, 64))
    return np.asarray(net.logits(g)[0])


TOKENS = np.random.RandomState(5).randint(0, V, 14).astype(np.int32)
VARIANTS = {
    "llama": ({}, False),
    "qwen3-layer": ({}, True),
    "norms": ({"norm_before_residual": True, "norm_output": True, "norm_before_fc": True}, False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_checkpoint_gives_reference_logits(variant, hf_target_dir, target, tmp_path):
    flags, qwen3 = VARIANTS[variant]
    ref = reference_drafter(hf_target_dir, qwen3=qwen3, **flags)
    ref.save_pretrained(str(tmp_path))
    assert eagle3_formats.detect(str(tmp_path)) == "speculators"
    w = eagle3_formats.load(str(tmp_path), jnp.float32)
    assert w.config.target_layers == (0, 2, 4)  # ids index hidden_states: outputs of layer id - 1
    with torch.no_grad():
        nxt = torch.from_numpy(np.concatenate([TOKENS[1:], TOKENS[-1:]])).long()[None]
        want = ref_layer_logits(ref, hf_features(hf_target_dir, TOKENS), nxt).numpy()
    np.testing.assert_allclose(specjax_logits(w, target, TOKENS), want, atol=1e-5)


def test_chain_drafts_match_reference_ttt(hf_target_dir, target, tmp_path):
    """The reference's training-time-test steps (teacher-forced tokens, fed-back features) at a
    position t are our chain drafting from the prefix ending at t with those tokens as drafts."""
    ref = reference_drafter(hf_target_dir, seed=2)
    ref.save_pretrained(str(tmp_path))
    w = eagle3_formats.load(str(tmp_path), jnp.float32)
    feats = hf_features(hf_target_dir, TOKENS)
    steps, t = 3, len(TOKENS)
    with torch.no_grad():
        ids = torch.from_numpy(np.concatenate([TOKENS[1:], [0]])).long()[None]
        drafts = ref(feats, ids, torch.zeros_like(ids), ttt_steps=steps)  # [steps] x [1, T] draft ids
    net = w.module()
    x = jnp.asarray(TOKENS[None], jnp.int32)
    m = target.module()
    _, _, ours = m.hidden(x, m.new_cache(1, 64), feature_layers=w.config.target_layers)
    emb = jnp.take(target.params["embed"][...], x, axis=0)
    for p in (4, 8):  # accepted prefix x_0..x_p: features for positions < p
        cache = net.new_cache(1, 64)
        g, cache = net.step(emb[:, 1 : p + 1], net.fuse(ours[:, :, :p]), cache)
        cache, g_last = cache.with_lengths(jnp.full((1,), p)), g[:, p - 1]
        for j in range(steps):
            assert int(jnp.argmax(net.logits(g_last))) == int(drafts[j][0, p - 1])
            if p + j + 1 < t:
                g1, cache = net.step(emb[:, p + j + 1 : p + j + 2], g_last[:, None], cache)
                cache, g_last = cache.advance(1), g1[:, 0]


def eagle_layout_from(spec_dir: str, out: str) -> str:
    """The same drafter written in the EAGLE/SpecForge layout (midlayer.*, a Llama config with
    draft_vocab_size and eagle_config ids naming layer outputs, as SpecForge and SGLang do)."""
    raw = json.load(open(os.path.join(spec_dir, "config.json")))
    f = SafetensorsFile(os.path.join(spec_dir, "model.safetensors"))
    os.makedirs(out, exist_ok=True)
    save_file(
        {n.replace("layers.0.", "midlayer."): np.array(f.get(n)) for n in f.names()},
        os.path.join(out, "model.safetensors"),
    )
    cfg = {
        **raw["transformer_layer_config"],
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": raw["draft_vocab_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in raw["eagle_aux_hidden_state_layer_ids"]]},
    }
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return out


def test_eagle_layout_gives_the_same_drafter(hf_target_dir, target, tmp_path):
    ref = reference_drafter(hf_target_dir, seed=4)
    ref.save_pretrained(str(tmp_path / "spec"))
    eagle_dir = eagle_layout_from(str(tmp_path / "spec"), str(tmp_path / "eagle"))
    assert eagle3_formats.detect(eagle_dir) == "eagle"
    a = eagle3_formats.load(str(tmp_path / "spec"), jnp.float32)
    b = eagle3_formats.load(eagle_dir, jnp.float32)
    assert a.config == b.config and np.array_equal(a.d2t, b.d2t)
    np.testing.assert_array_equal(specjax_logits(a, target, TOKENS), specjax_logits(b, target, TOKENS))
    # SafeAILab's own EAGLE-3 heads ship as pytorch_model.bin: read without torch, the same drafter
    f = SafetensorsFile(os.path.join(eagle_dir, "model.safetensors"))
    os.makedirs(tmp_path / "bin")
    torch.save({n: torch.from_numpy(np.array(f.get(n))) for n in f.names()}, tmp_path / "bin" / "pytorch_model.bin")
    json.dump(json.load(open(os.path.join(eagle_dir, "config.json"))), open(tmp_path / "bin" / "config.json", "w"))
    c = eagle3_formats.load(str(tmp_path / "bin"), jnp.float32)
    np.testing.assert_array_equal(specjax_logits(c, target, TOKENS), specjax_logits(b, target, TOKENS))


def test_published_drafter_is_lossless_in_the_engine(hf_target_dir, target, tmp_path):
    """`--drafter eagle3:DIR` on a speculators directory: greedy output equals plain decoding."""
    reference_drafter(hf_target_dir, seed=6).save_pretrained(str(tmp_path))
    drafter = make_drafter(f"eagle3:{tmp_path}@0", 3, target)
    assert drafter.embed is None  # the checkpoint's embed_tokens is the target's: shared, not copied
    engine = Engine(target)
    prompts = [[3, 5, 7, 11], [13, 17]]
    params = [SamplingParams(max_new_tokens=20)] * len(prompts)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    assert [r.token_ids for r in engine.generate(prompts, params, drafter=drafter)] == plain


@pytest.fixture(scope="module")
def shipped(default_model):
    return load_specjax(shipped_path("eagle3"), jnp.float32)


def ours_vs_reference(w, model: Eagle3DraftModel, target, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Our logits and the reference's on the same (our target's) features."""
    x = jnp.asarray(tokens[None], jnp.int32)
    m = target.module()
    _, _, feats = m.hidden(x, m.new_cache(1, 64), feature_layers=w.config.target_layers)
    f = torch.from_numpy(np.asarray(jnp.concatenate(list(feats), axis=-1)))
    nxt = torch.from_numpy(np.concatenate([tokens[1:], tokens[-1:]])).long()[None]
    with torch.no_grad():
        want = ref_layer_logits(model, f, nxt).numpy()
    return specjax_logits(w, target, tokens), want


@pytest.fixture(scope="module")
def default_hf_dir(default_model, tmp_path_factory):
    """The default model as an HF checkpoint: the verifier a `speculators` checkpoint names (the
    reference loads its config and tables from there)."""
    from specjax.models.loading.export import save_hf

    return save_hf(default_model, str(tmp_path_factory.mktemp("default_hf")))


def test_shipped_drafter_exports_to_speculators(shipped, default_model, default_hf_dir, tmp_path):
    embed = np.asarray(default_model.params["embed"][...])
    verifier = {"name_or_path": default_hf_dir, "architectures": ["LlamaForCausalLM"]}
    eagle3_formats.export(shipped, str(tmp_path), "speculators", embed=embed, verifier=verifier)
    model = Eagle3DraftModel.from_pretrained(str(tmp_path)).eval()  # the reference reads our export
    assert model.config.eagle_aux_hidden_state_layer_ids == [3, 16, 28]  # outputs of 2, 15, 27
    tokens = np.random.RandomState(1).randint(0, default_model.config.vocab_size, 24).astype(np.int32)
    ours, want = ours_vs_reference(shipped, model, default_model, tokens)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=1e-4)
    back = eagle3_formats.load(str(tmp_path), jnp.float32)
    assert np.array_equal(back.d2t, shipped.d2t) and back.config.target_layers == shipped.config.target_layers


def test_shipped_drafter_exports_to_eagle_layout(shipped, default_model, default_hf_dir, tmp_path):
    """Our EAGLE-layout export read by `speculators`' own converter for that layout."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    eagle3_formats.export(shipped, str(tmp_path / "eagle"), "eagle")
    raw = json.load(open(tmp_path / "eagle" / "config.json"))
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 15, 27]
    f = SafetensorsFile(str(tmp_path / "eagle" / "model.safetensors"))
    off = np.asarray(f.get("d2t"))
    assert off.dtype == np.int64 and np.array_equal(np.arange(len(off)) + off, np.asarray(shipped.d2t))
    assert np.asarray(f.get("t2d")).sum() == len(off)
    # The converter takes the ids in its own (hidden_states) convention; the embedding comes from
    # the base model, as our export leaves it out (SGLang and vLLM share the target's).
    Eagle3Converter().convert(
        str(tmp_path / "eagle"),
        str(tmp_path / "conv"),
        base_model=default_hf_dir,
        validate=False,
        eagle_aux_hidden_state_layer_ids=[3, 16, 28],
    )
    conv = Eagle3DraftModel.from_pretrained(str(tmp_path / "conv")).eval()
    # speculators fills a missing table from the verifier only while it is NaN; transformers 5.24
    # (newer than speculators 0.9 pins) initialises missing weights first, so set it as it means to.
    with torch.no_grad():
        conv.embed_tokens.weight.copy_(torch.from_numpy(np.asarray(default_model.params["embed"][...])))
    tokens = np.random.RandomState(2).randint(0, default_model.config.vocab_size, 24).astype(np.int32)
    ours, want = ours_vs_reference(shipped, conv, default_model, tokens)
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=1e-4)
    back = eagle3_formats.load(str(tmp_path / "eagle"), jnp.float32)
    assert np.array_equal(back.d2t, shipped.d2t) and back.config.target_layers == shipped.config.target_layers


def corrupt(src: str, out: str, config=None, tensors=None) -> str:
    """A copy of the drafter directory `src` with its config and tensors edited."""
    raw = json.load(open(os.path.join(src, "config.json")))
    f = SafetensorsFile(os.path.join(src, "model.safetensors"))
    arrays = {n: np.array(f.get(n)) for n in f.names()}
    if config:
        config(raw)
    if tensors:
        tensors(arrays)
    os.makedirs(out, exist_ok=True)
    json.dump(raw, open(os.path.join(out, "config.json"), "w"))
    save_file(arrays, os.path.join(out, "model.safetensors"))
    return out


def _set(d, key, value):
    d[key] = value


BAD = {
    "d2t wrong length": (None, lambda a: _set(a, "d2t", a["d2t"][:-1]), "'d2t' must be 40 integer offsets"),
    "d2t out of range": (None, lambda a: _set(a, "d2t", a["d2t"] + 90), "outside the target vocabulary"),
    "t2d disagrees": (None, lambda a: _set(a, "t2d", np.ones(V, bool)), "'t2d' does not mark"),
    "missing tensor": (None, lambda a: a.pop("layers.0.hidden_norm.weight"), "no tensor 'layers.0.hidden_norm"),
    "extra tensor": (None, lambda a: _set(a, "fc.bias", np.zeros(D, np.float32)), "no place for: ['fc.bias']"),
    "two layers": (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None, "2 decoder layers"),
    "fc_norm": (lambda c: _set(c, "fc_norm", True), None, "fc_norm) is not supported"),
    "moe layer": (lambda c: c["transformer_layer_config"].update(model_type="qwen3_moe"), None, "mixture-of-experts"),
    "other speculator": (lambda c: _set(c, "speculators_model_type", "dflash"), None, "'dflash' drafter, not"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_published_drafters_are_one_line_errors(case, hf_target_dir, target, tmp_path):
    reference_drafter(hf_target_dir).save_pretrained(str(tmp_path / "ok"))
    config, tensors, msg = BAD[case]
    bad = corrupt(str(tmp_path / "ok"), str(tmp_path / "bad"), config, tensors)
    with pytest.raises(DrafterError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as e:
        make_drafter(f"eagle3:{bad}", 3, target)
    assert "\n" not in str(e.value)


def test_drafter_for_another_target_is_exit_2(hf_target_dir, tmp_path, cli_env):
    """The CLI on the default model with a drafter published for the tiny target: one line, exit 2."""
    reference_drafter(hf_target_dir).save_pretrained(str(tmp_path))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specjax.cli",
            "generate",
            "--drafter",
            f"eagle3:{tmp_path}",
            "--max-new-tokens",
            "4",
            "hi",
        ],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden size 32, but this target has 576" in lines[0], r.stderr


def test_export_cli(shipped, default_model, tmp_path, capsys):
    """`specjax export`: the shipped EAGLE-3 in both layouts (bf16, loadable back), the shipped
    draft model as an HF checkpoint; MTP, a wrong format and a used --out are one-line exit 2."""
    from specjax.cli import main

    for fmt in ("eagle", "speculators"):
        assert main(["export", "eagle3", "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        raw = json.load(open(tmp_path / fmt / "config.json"))
        layer = raw if fmt == "eagle" else raw["transformer_layer_config"]
        assert layer["max_position_embeddings"] == default_model.config.max_position_embeddings
        back = eagle3_formats.load(str(tmp_path / fmt), jnp.float32)
        assert back.config.target_layers == shipped.config.target_layers and np.array_equal(back.d2t, shipped.d2t)
        np.testing.assert_allclose(back.params["fc"][...], shipped.params["fc"][...], rtol=1e-2, atol=1e-3)
    assert (
        json.load(open(tmp_path / "speculators" / "config.json"))["speculators_config"]["verifier"]["name_or_path"]
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert main(["export", "draft", "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    draft = load_model(str(tmp_path / "hf"), "float32", quiet=True)  # a plain HF checkpoint now
    assert draft.tokenizer is not None and draft.config.vocab_size == default_model.config.vocab_size
    capsys.readouterr()
    for argv, msg in [
        (["mtp", "--format", "hf", "--out", str(tmp_path / "m")], "no published format"),
        (["eagle3", "--format", "hf", "--out", str(tmp_path / "x")], "exports as eagle | speculators"),
        (["eagle3", "--format", "eagle", "--out", str(tmp_path / "eagle")], "not an empty directory"),
    ]:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_default_layers_are_the_references(hf_target_dir, tmp_path):
    """A published config naming no layers: specjax takes the hidden states speculators (and
    vLLM, SGLang, EAGLE) default to, the inputs of layers 2, L/2, L - 3."""
    from speculators.models.utils import resolve_target_layer_ids

    reference_drafter(hf_target_dir).save_pretrained(str(tmp_path / "ok"))
    bad = corrupt(str(tmp_path / "ok"), str(tmp_path / "noids"), lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    deep = tmp_path / "deep"  # a 14-layer target's config (speculators refuses repeated ids, as 6 layers give)
    deep.mkdir()
    json.dump(
        {**json.load(open(os.path.join(hf_target_dir, "config.json"))), "num_hidden_layers": 14},
        open(deep / "config.json", "w"),
    )
    w = eagle3_formats.load(bad, jnp.float32, target_num_layers=14)
    with pytest.warns(UserWarning):
        ids = resolve_target_layer_ids(None, str(deep))
    assert w.config.target_layers == tuple(i - 1 for i in ids)
    with pytest.raises(DrafterError, match="names no target layers"):
        eagle3_formats.load(bad, jnp.float32)


def test_drafter_for_another_vocab_or_depth(hf_target_dir, tmp_path):
    from helpers import tiny
    from specjax.models.loading import random_model

    reference_drafter(hf_target_dir).save_pretrained(str(tmp_path))
    shallow = random_model(tiny(vocab_size=V, hidden_size=D, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8))
    with pytest.raises(DrafterError, match="reads target layer 4, but the target has 2 layers"):
        make_drafter(f"eagle3:{tmp_path}", 3, shallow)
    wide = random_model(tiny(vocab_size=128, hidden_size=D, num_layers=L, num_heads=4, num_kv_heads=2, head_dim=8))
    with pytest.raises(DrafterError, match="vocab size 96, but this target has 128"):
        make_drafter(f"eagle3:{tmp_path}", 3, wide)


def test_qwen3_target_with_a_published_drafter(tmp_path):
    """The newcomer's case: --model a Qwen3 directory, --drafter eagle3: a published drafter for
    it with a Qwen3-type layer, in either layout: lossless greedy decoding."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1)
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
    Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path / "qwen3"))
    target = load_model(str(tmp_path / "qwen3"), "float32", quiet=True)
    assert target.config.qk_norm
    reference_drafter(str(tmp_path / "qwen3"), qwen3=True, seed=8).save_pretrained(str(tmp_path / "spec"))
    engine = Engine(target)
    prompts = [[3, 5, 7, 11], [13, 17, 19]]
    params = [SamplingParams(max_new_tokens=20)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    drafter = make_drafter(f"eagle3:{tmp_path / 'spec'}@0", 4, target)
    assert drafter.weights.config.qk_norm
    assert [r.token_ids for r in engine.generate(prompts, params, drafter=drafter)] == plain
