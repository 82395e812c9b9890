"""MTP layers inside target checkpoints (Qwen3-Next, DeepSeek-V3 and MiMo layouts) as
`--drafter mtp`, checked against `speculators`' MTP converter and model (the Qwen3-Next layout
over dense Qwen3 layers) on a tiny random Qwen3 target built with HF transformers."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speculators.convert.mtp.converter import MTPConverter  # the reference (`make test` installs it)
from speculators.models.mtp import MTPDraftModel
from transformers import Qwen3Config, Qwen3ForCausalLM

from specjax.drafters import make_drafter
from specjax.drafters.mtp import MTPDrafter
from specjax.errors import DrafterError
from specjax.models.loading import load_model
from specjax.models.loading.safetensors_io import SafetensorsFile, save_file
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams

V, D, L, STEPS = 96, 32, 3, 3
LAYER_KEYS = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def write_target(out: str, layout: str, seed: int = 0, edit=None) -> str:
    """A tiny Qwen3 target whose checkpoint carries one MTP layer in `layout`: the trunk and
    the MTP layer's decoder block from HF transformers (the block is a copy of a random extra
    layer), the MTP norms and projection random."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=L + 1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    full = Qwen3ForCausalLM(cfg)
    sd = {k: v.detach().numpy() for k, v in full.state_dict().items()}
    block = {k: sd.pop(f"model.layers.{L}.{k}") for k in LAYER_KEYS}  # the extra layer: the MTP block
    rng = np.random.RandomState(seed)
    norm = lambda: (1 + 0.1 * rng.randn(D)).astype(np.float32)
    proj = (0.15 * rng.randn(D, 2 * D)).astype(np.float32)  # [embed ; hidden] columns
    e_norm, h_norm, out_norm = norm(), norm(), norm()
    if layout == "qwen3_next":
        sd.update(
            {
                "mtp.fc.weight": proj,
                "mtp.pre_fc_norm_embedding.weight": e_norm,
                "mtp.pre_fc_norm_hidden.weight": h_norm,
                "mtp.norm.weight": out_norm,
            }
        )
        sd.update({f"mtp.layers.0.{k}": a for k, a in block.items()})
        extra = {"mtp_num_hidden_layers": 1}
    elif layout == "deepseek":
        p = f"model.layers.{L}."
        sd.update(
            {
                p + "eh_proj.weight": proj,
                p + "enorm.weight": e_norm,
                p + "hnorm.weight": h_norm,
                p + "shared_head.norm.weight": out_norm,
                p + "shared_head.head.weight": sd["lm_head.weight"],
            }
        )
        sd.update({p + k: a for k, a in block.items()})
        extra = {"num_nextn_predict_layers": 1}
    else:  # mimo: input_proj reads [hidden ; embed]
        p = "model.mtp_layers.0."
        sd.update(
            {
                p + "input_proj.weight": np.concatenate([proj[:, D:], proj[:, :D]], axis=1),
                p + "token_layernorm.weight": e_norm,
                p + "hidden_layernorm.weight": h_norm,
                p + "final_layernorm.weight": out_norm,
            }
        )
        sd.update({p + k: a for k, a in block.items()})
        extra = {"num_nextn_predict_layers": 1}
    if edit:
        edit(sd)
    os.makedirs(out, exist_ok=True)
    save_file(sd, os.path.join(out, "model.safetensors"))
    hf = {**cfg.to_dict(), "num_hidden_layers": L, "architectures": ["Qwen3ForCausalLM"], **extra}
    if hf.get("layer_types"):
        hf["layer_types"] = hf["layer_types"][:L]
    json.dump(hf, open(os.path.join(out, "config.json"), "w"))
    return out


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    return write_target(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next")


@pytest.fixture(scope="module")
def reference_logits(qwen3_next_dir, tmp_path_factory):
    """`speculators`: convert the checkpoint's MTP layer, run its teacher-forced MTP forward on the
    HF target's final hidden states. -> (tokens [T], logits per step [STEPS] x [T', V])."""
    out = str(tmp_path_factory.mktemp("converted"))
    MTPConverter().convert(qwen3_next_dir, out, base_model=qwen3_next_dir, num_speculative_steps=STEPS, validate=False)
    model = MTPDraftModel.from_pretrained(out).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    hf = Qwen3ForCausalLM.from_pretrained(qwen3_next_dir).eval()
    tokens = np.random.RandomState(3).randint(0, V, 16)
    ids = torch.from_numpy(tokens)[None]
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state  # the target's final normed hidden, as vLLM feeds MTP
        logits, _, _ = model(ids, hidden)
    return tokens, [lg[0].numpy() for lg in logits]


def specjax_logits(target, weights, tokens, steps):
    """Teacher-forced logits of depths 1..steps at every position (as the reference computes)."""
    net = weights.module()
    x = jnp.asarray(tokens[None], jnp.int32)
    m = target.module()
    h, _, _ = m.hidden(x, m.new_cache(1, 64))  # [1, T, D] final normed hidden
    t = x.shape[1]
    pos = jnp.arange(t)[None]
    cos, sin = net.rope(pos)
    cache = net.new_cache(steps, 1, 64)
    out = []
    for k in range(1, steps + 1):
        emb = jnp.take(target.params["embed"][...], x[:, jnp.minimum(jnp.arange(t) + k, t - 1)], axis=0)
        h, cache = net.run(k, emb, h, cache, cos, sin)
        out.append(np.asarray(net.logits(k, h, m.head_weight())[0]))
    return out


def test_qwen3_next_layout_matches_speculators(qwen3_next_dir, reference_logits):
    """`--drafter mtp` (no path) on a target whose checkpoint has MTP layers reads them; its
    teacher-forced logits at depths 1..3 (one layer reused, normed output fed on) are the
    reference's."""
    target = load_model(qwen3_next_dir, "float32", quiet=True)
    drafter = make_drafter("mtp", STEPS, target)
    assert isinstance(drafter, MTPDrafter) and drafter.weights.config.num_modules == 1
    tokens, want = reference_logits
    ours = specjax_logits(target, drafter.weights, tokens, STEPS)
    for k in range(STEPS):
        n = want[k].shape[0]
        np.testing.assert_allclose(ours[k][:n], want[k], atol=1e-5)


@pytest.mark.parametrize("layout", ["deepseek", "mimo"])
def test_other_layouts_give_the_same_first_draft(layout, reference_logits, tmp_path):
    """The same weights in the DeepSeek-V3 and MiMo layouts: the same depth-1 logits (their
    depth-2 input differs by design: DeepSeek feeds the output on before its norm)."""
    path = write_target(str(tmp_path), layout)
    target = load_model(path, "float32", quiet=True)
    weights = make_drafter("mtp", 2, target).weights
    tokens, want = reference_logits
    ours = specjax_logits(target, weights, tokens, 1)
    np.testing.assert_allclose(ours[0][: want[0].shape[0]], want[0], atol=1e-5)


@pytest.mark.parametrize("layout", ["qwen3_next", "deepseek"])
def test_checkpoint_mtp_is_lossless(layout, tmp_path):
    path = write_target(str(tmp_path), layout, seed=1)
    target = load_model(path, "float32", quiet=True)
    engine = Engine(target)
    prompts = [[3, 5, 7, 11, 2], [13, 17]]
    params = [SamplingParams(max_new_tokens=24)] * 2
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    for k in (1, 3):
        rows = engine.generate(prompts, params, drafter=make_drafter(f"mtp:{path}", k, target))
        assert [r.token_ids for r in rows] == plain


def _moe(sd):
    sd["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.zeros((8, D), np.float32)


def _own_head(sd):
    sd[f"model.layers.{L}.shared_head.head.weight"] = sd[f"model.layers.{L}.shared_head.head.weight"] + 1


def _drop(sd):
    sd.pop("mtp.layers.0.self_attn.o_proj.weight")


@pytest.mark.parametrize(
    "layout,edit,msg",
    [
        ("qwen3_next", _moe, "mixture-of-experts MTP layers are not supported"),
        ("deepseek", _own_head, "shared_head.head.weight is not the target's"),
        ("qwen3_next", _drop, "no tensor 'mtp.layers.0.self_attn.o_proj.weight'"),
    ],
)
def test_bad_mtp_layers_are_one_line_errors(layout, edit, msg, tmp_path):
    path = write_target(str(tmp_path), layout, edit=edit)
    target = load_model(path, "float32", quiet=True)
    with pytest.raises(DrafterError, match=msg) as e:
        make_drafter("mtp", 1, target)
    assert "\n" not in str(e.value)


def test_mimo_config_loads_as_a_qwen2_trunk(tmp_path):
    path = write_target(str(tmp_path), "mimo")
    raw = json.load(open(os.path.join(path, "config.json")))
    raw.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    json.dump(raw, open(os.path.join(path, "config.json"), "w"))
    f = SafetensorsFile(os.path.join(path, "model.safetensors"))
    assert "model.mtp_layers.0.input_proj.weight" in f.names()
    with pytest.raises(Exception, match="q_proj.bias"):  # a MiMo trunk is Qwen2's: biased q/k/v
        load_model(path, "float32", quiet=True)
