"""DSpark drafters in their published layouts, against the references (`speculators` 0.9.0 and
`specforge` 0.2.0, installed `--no-deps` by `make test`):

* `specjax export --format speculators` of a speculators checkpoint gives back every tensor
  speculators' `DSparkDraftModel` saved; a drafter that scores its drafts with the target's head
  rows (as the shipped one does) exports them as `lm_head` and drafts the same from the export;
* a checkpoint SpecForge's `DSparkDraftModel` saves loads in specjax with SpecForge's block hidden
  states (its own forward), Markov-biased logits and confidences; `--format specforge` gives its
  tensors back;
* bad SpecForge configs and impossible exports are one line.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from specforge.modeling.draft.dspark import DSparkDraftModel as SpecForgeDSpark
from speculators.models.dspark import DSparkDraftModel
from test_dflash import (  # noqa: F401
    BLOCK,
    LAYER_IDS,
    MASK,
    L,
    V,
    drafter_hf_config,
    drafter_layers,
    specjax_state,
    target,
    target_dir,
)
from test_dspark import RANK, assert_heads_match, speculators_dspark
from transformers import Qwen3ForCausalLM

from helpers import rel_err
from specjax.cli import main
from specjax.drafters import dflash, dspark, make_drafter
from specjax.drafters.dspark import DSparkConfig
from specjax.errors import DrafterError


def specforge_dspark(seed: int = 0, **flags) -> SpecForgeDSpark:
    """A random SpecForge DSpark drafter for the tiny target, with non-trivial norm scales."""
    torch.manual_seed(seed)
    cfg = drafter_hf_config()
    cfg.block_size, cfg.num_target_layers = BLOCK, L
    cfg.dflash_config = {
        "mask_token_id": MASK,
        "target_layer_ids": LAYER_IDS,
        "projector_type": "dspark",
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        **flags,
    }
    cfg.architectures = ["DSparkDraftModel"]
    model = SpecForgeDSpark(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model


def save_draft_vocab_dspark(path: str, d2t: np.ndarray) -> None:
    """A random specjax DSpark drafter over the draft vocabulary `d2t [40]`, scored by the target's
    own head rows (own_head false, as the shipped one), saved at `path`."""
    cfg = DSparkConfig(drafter_layers(), tuple(LAYER_IDS), L, BLOCK, MASK, draft_vocab_size=40, markov_rank=RANK)
    dflash.save(dspark.init_weights(cfg, d2t, seed=3), path)


def export(src: str, fmt: str, out: str, target_dir: str) -> None:  # noqa: F811
    argv = ["export", f"dspark:{src}", "--format", fmt, "--out", out, "--model", target_dir, "--dtype", "float32"]
    assert main(argv) == 0


def features(target_dir: str, tokens: np.ndarray):  # noqa: F811
    """The tiny target's HF hidden states over `tokens` (a list of `[1, T, D]`) and its model."""
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens)[None], output_hidden_states=True)
    return out.hidden_states, hf


def assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """The drafter's own tensors are equal (the verifier's embedding, which speculators reads from
    the target at load time, is not the drafter's)."""
    mine = lambda m: {k: t for k, t in m.state_dict().items() if not k.startswith(("embed_tokens", "verifier_"))}  # noqa: E731
    g, w = mine(got), mine(want)
    assert sorted(g) == sorted(w)
    for name, t in w.items():
        assert torch.equal(g[name], t), name


@pytest.mark.parametrize("draft_vocab", [V, 40])
def test_export_to_speculators_gives_back_its_tensors(target_dir, target, tmp_path, draft_vocab):  # noqa: F811
    model = speculators_dspark(target_dir, draft_vocab, seed=5)
    model.save_pretrained(str(tmp_path / "src"))
    export(str(tmp_path / "src"), "speculators", str(tmp_path / "out"), target_dir)
    back = DSparkDraftModel.from_pretrained(str(tmp_path / "out"))
    assert_same_tensors(back, DSparkDraftModel.from_pretrained(str(tmp_path / "src")))
    assert back.config.to_dict()["block_size"] == BLOCK and back.config.markov_rank == RANK


def test_head_rows_of_the_target_export_as_lm_head(target_dir, target, tmp_path):  # noqa: F811
    """A drafter over a draft vocabulary scored by the target's own head rows (own_head false)."""
    d2t = np.sort(np.random.RandomState(1).choice(V, 40, replace=False))
    save_draft_vocab_dspark(str(tmp_path / "ours"), d2t)
    export(str(tmp_path / "ours"), "speculators", str(tmp_path / "out"), target_dir)
    back = DSparkDraftModel.from_pretrained(str(tmp_path / "out")).eval()
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    assert torch.equal(back.lm_head.weight, hf.lm_head.weight[torch.from_numpy(d2t)])
    assert (np.asarray(back.d2t) + np.arange(40)).tolist() == d2t.tolist()
    tokens, last = np.array([5, 7, 11, 13, 17]), 19
    hidden_states, _ = features(target_dir, tokens)
    drafts = []
    for path in (tmp_path / "ours", tmp_path / "out"):
        drafter = make_drafter(f"dspark:{path}", 0, target)
        dparams = drafter.params()
        st, history = specjax_state(drafter, dparams, [x.numpy() for x in hidden_states], tokens, last)
        h = drafter.block_hidden(dparams, st, history, jnp.asarray([history.shape[1]]), BLOCK)  # [1, K, D]
        drafts.append(np.asarray(h))
    assert rel_err(drafts[1], drafts[0]) < 1e-6


def test_specforge_checkpoint_matches_specforge(target_dir, target, tmp_path):  # noqa: F811
    model = specforge_dspark()
    model.save_pretrained(str(tmp_path / "src"))
    drafter = make_drafter(f"dspark:{tmp_path / 'src'}", 0, target)
    assert drafter.num_draft == BLOCK and drafter.feature_layers == tuple(LAYER_IDS)
    tokens, last = np.array([3, 9, 27, 81, 50, 6, 18]), 54
    hidden_states, hf = features(target_dir, tokens)
    dparams = drafter.params()
    st, history = specjax_state(drafter, dparams, [x.numpy() for x in hidden_states], tokens, last)
    h = drafter.block_hidden(dparams, st, history, jnp.asarray([history.shape[1]]), BLOCK)  # [1, K, D]
    feats = torch.cat([hidden_states[i + 1] for i in LAYER_IDS], dim=-1)  # [1, T, nD]
    block = torch.as_tensor([[last] + [MASK] * (BLOCK - 1)])
    with torch.no_grad():
        h_ref = model(
            position_ids=torch.arange(len(tokens) + BLOCK)[None],
            noise_embedding=hf.get_input_embeddings()(block),
            target_hidden=feats,
        )  # [1, K, D]
    assert rel_err(np.asarray(h), h_ref.numpy()) < 1e-5

    def ref_heads(prev, h_t):  # SpecForge's Markov-biased logits [1, K, V] and confidences [1, K]
        logits = model.apply_logits_head(hf.lm_head(h_t), prev_token_ids=prev, hidden_states=h_t)
        return logits, torch.sigmoid(model.predict_confidence(h_t, prev_token_ids=prev))

    assert_heads_match(drafter, dparams, h, history, last, ref_heads, np.arange(V))
    export(str(tmp_path / "src"), "specforge", str(tmp_path / "out"), target_dir)
    assert_same_tensors(SpecForgeDSpark.from_pretrained(str(tmp_path / "out")), model)


def test_bad_specforge_checkpoints_and_exports_are_one_line(target_dir, target, tmp_path, capsys):  # noqa: F811
    src = tmp_path / "src"
    specforge_dspark(seed=1).save_pretrained(str(src))
    raw = json.loads((src / "config.json").read_text())
    sub = raw["dflash_config"]
    for change, match in [
        ({"dflash_config": {**sub, "markov_head_type": "gated"}}, "vanilla only"),
        ({"dflash_config": {**sub, "markov_rank": RANK + 1}}, "markov_w1"),
        ({"dflash_config": {**sub, "enable_confidence_head": False}}, "no place for"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window"),
    ]:
        (src / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(DrafterError, match=match) as e:
            make_drafter(f"dspark:{src}", 0, target)
        assert "\n" not in str(e.value)
    save_draft_vocab_dspark(str(tmp_path / "ours"), np.arange(40))
    argv = ["export", f"dspark:{tmp_path / 'ours'}", "--format", "specforge", "--out", str(tmp_path / "x")]
    capsys.readouterr()
    assert main([*argv, "--model", target_dir]) == 2
    err = capsys.readouterr().err.strip()
    assert "use --format speculators" in err and len(err.splitlines()) == 1, err
