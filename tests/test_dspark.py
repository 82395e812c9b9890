"""DSpark drafters against the references: a checkpoint `speculators`' `DSparkDraftModel` saves
loads in specjax; its backbone's block hidden states equal z-lab's DFlash network on the same
weights (the layers are the same code), and the Markov-biased logits and confidences equal
speculators' own heads on them, slot by slot along the greedy chain; greedy decoding is
token-identical to plain decoding; bad checkpoints are one line."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel as ZlabDFlash  # the backbone's reference
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from test_dflash import (  # noqa: F401
    BLOCK,
    LAYER_IDS,
    MASK,
    D,
    L,
    V,
    drafter_hf_config,
    specjax_state,
    target,
    target_dir,
)
from transformers import Qwen3Config, Qwen3ForCausalLM

from helpers import rel_err
from specjax.drafters import make_drafter
from specjax.drafters.base import StepContext
from specjax.errors import DrafterError
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingArrays, SamplingParams

RANK = 12


def speculators_dspark(target_dir, draft_vocab: int = V, seed: int = 0, **flags) -> DSparkDraftModel:  # noqa: F811
    """A random speculators DSpark drafter for the tiny target (eager attention, CPU)."""
    torch.manual_seed(seed)
    layer = drafter_hf_config()
    layer._attn_implementation = "eager"
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab,
        block_size=BLOCK,
        mask_token_id=MASK,
        aux_hidden_state_layer_ids=[i + 1 for i in LAYER_IDS],
        markov_rank=RANK,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target_dir),
        ),
        **flags,
    )
    model = DSparkDraftModel(cfg)
    if draft_vocab < V:
        ids = torch.from_numpy(np.sort(np.random.RandomState(seed).choice(V, draft_vocab, replace=False)))
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif not name.startswith(("embed_tokens", "verifier_")):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def zlab_backbone(model: DSparkDraftModel) -> ZlabDFlash:
    """z-lab's DFlash network holding the DSpark backbone's weights."""
    tl = model.config.transformer_layer_config
    cfg = Qwen3Config(
        **{
            k: getattr(tl, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "rms_norm_eps",
            )
        }
    )
    cfg.block_size, cfg.num_target_layers = BLOCK, L
    cfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}
    ref = ZlabDFlash(cfg).eval()
    missing, _ = ref.load_state_dict(model.state_dict(), strict=False)
    assert not [m for m in missing if not m.startswith("rotary")], missing
    return ref


@pytest.mark.parametrize("draft_vocab", [V, 40])
def test_speculators_checkpoint_matches_the_references(target_dir, target, tmp_path, draft_vocab):  # noqa: F811
    model = speculators_dspark(target_dir, draft_vocab)
    model.save_pretrained(str(tmp_path))
    drafter = make_drafter(f"dspark:{tmp_path}", 0, target)
    assert drafter.num_draft == BLOCK and drafter.feature_layers == tuple(LAYER_IDS)
    tokens, last = np.array([3, 9, 27, 81, 50, 6, 18]), 54
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens)[None], output_hidden_states=True)
    hidden_states = [x.numpy() for x in out.hidden_states]
    dparams = drafter.params()
    st, history = specjax_state(drafter, dparams, hidden_states, tokens, last)
    hist_len = jnp.asarray([len(tokens) + 1])
    h = drafter.block_hidden(dparams, st, history, hist_len, drafter.num_draft)  # [1, K, D]
    # the backbone: z-lab's network over the same context and block [last, MASK x (K - 1)]
    feats = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
    block = torch.as_tensor([[last] + [MASK] * (BLOCK - 1)])
    with torch.no_grad():
        h_ref = zlab_backbone(model)(
            target_hidden=feats,
            noise_embedding=hf.get_input_embeddings()(block),
            position_ids=torch.arange(len(tokens) + BLOCK)[None],
        )  # [1, K, D]
    assert rel_err(np.asarray(h), h_ref.numpy()) < 1e-5
    head = model.lm_head if draft_vocab < V else hf.lm_head

    def ref_heads(prev, h_t):  # speculators' Markov-biased logits [1, K, N] and confidences [1, K]
        logits = head(h_t) + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=h_t)
        e = model.markov_head.prev_embeddings(prev)
        return logits, torch.sigmoid(model.confidence_head(torch.cat([h_t, e], dim=-1)))

    ids = np.arange(V) if draft_vocab == V else np.asarray(model.d2t) + np.arange(draft_vocab)
    assert_heads_match(drafter, dparams, h, history, last, ref_heads, ids)


def assert_heads_match(drafter, dparams, h, history, last: int, ref_heads, ids: np.ndarray) -> None:
    """Along the greedy chain (slot j's bias reads the token before it), our drafts, Markov-biased
    logits and confidences from block hidden `h [1, K, D]` equal `ref_heads(prev [1, K], h)`'s
    (logits over the head rows, target ids `ids [N]`; confidences)."""
    ctx = StepContext(
        history,
        jnp.asarray([history.shape[1]]),
        SamplingArrays.from_params([SamplingParams()]),
        jnp.zeros((1,), jnp.uint32),
        True,
        jnp.asarray([True]),
        False,
    )
    draft, q, conf = drafter.draft_chain(dparams, h, jnp.asarray([last]), ctx)
    assert q is None
    prev = torch.as_tensor(np.concatenate([[last], np.asarray(draft)[0, :-1]]))[None]  # [1, K]
    with torch.no_grad():
        logits, conf_ref = ref_heads(prev, torch.from_numpy(np.array(h)))
    assert np.asarray(draft)[0].tolist() == ids[logits[0].argmax(-1).numpy()].tolist()
    assert rel_err(np.asarray(conf), conf_ref.numpy()) < 1e-5
    net = drafter._net(dparams)
    rows = net.head[...] if drafter.weights.config.own_head else dparams["head"]
    ours = np.asarray(net.logits(rows, h) + net.markov_bias(net.prev_embed(jnp.asarray(prev.numpy()))))
    assert rel_err(ours, logits.numpy()) < 1e-5


def test_greedy_dspark_equals_plain_on_a_qwen3_target(target_dir, target, tmp_path):  # noqa: F811
    speculators_dspark(target_dir, 40, seed=2).save_pretrained(str(tmp_path))
    engine = Engine(target)
    prompts = [[3, 5, 7, 11, 2, 4], [13, 17], [1, 2, 3, 1, 2, 3, 1, 2]]
    params = [SamplingParams(max_new_tokens=24)] * len(prompts)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    for k in (1, BLOCK):
        drafter = make_drafter(f"dspark:{tmp_path}", k, target)
        assert [r.token_ids for r in engine.generate(prompts, params, drafter=drafter)] == plain


def test_bad_dspark_checkpoints_are_one_line(target_dir, target, tmp_path):  # noqa: F811
    src = tmp_path / "src"
    speculators_dspark(target_dir).save_pretrained(str(src))
    with pytest.raises(DrafterError, match=f"1..{BLOCK} tokens per step"):
        make_drafter(f"dspark:{src}", BLOCK + 1, target)
    with pytest.raises(DrafterError, match="drafts chains only"):
        make_drafter(f"dspark:{src}", 4, target, tree_topk=2, tree_depth=2)
    raw = json.loads((src / "config.json").read_text())
    for change, match in [
        ({"markov_head_type": "rnn"}, "vanilla only"),
        ({"sample_from_anchor": False}, "load it as dflash"),
        ({"aux_hidden_state_layer_ids": [0, 2]}, "embedding output"),
        ({"markov_rank": RANK + 1}, "markov_w1"),
    ]:
        (src / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(DrafterError, match=match):
            make_drafter(f"dspark:{src}", 0, target)


def test_schedule_stops_at_the_first_length_that_does_not_pay():
    from specjax.drafters.dspark import DSparkDrafter

    costs = jnp.asarray([1.0, 1.2, 1.5, 1.8])
    conf = jnp.asarray(
        [
            [0.9, 0.9, 0.9],  # E = 1, 1.9, 2.71, 3.44: rates 1, 1.58, 1.81, 1.91 -> 3
            [0.9, 0.2, 0.99],  # rates 1, 1.58, 1.24 -> stop at 1 (the 3rd would pay again)
            [0.1, 0.99, 0.99],  # 1.1 / 1.2 < 1 -> 0
            [1.0, 1.0, 0.0],
        ]
    )  # 1, 1.67, 2, 1.67 -> 2
    assert DSparkDrafter.schedule(conf, costs).tolist() == [3, 1, 0, 2]


def test_greedy_dspark_with_scheduled_lengths_equals_plain(target_dir, target, tmp_path):  # noqa: F811
    """Under a cost table each row verifies the length its confidences pick (several lengths occur)."""
    from specjax.policy.rows import ALWAYS

    speculators_dspark(target_dir, seed=4).save_pretrained(str(tmp_path))
    engine = Engine(target)
    prompts = [[3, 5, 7, 11, 2, 4], [13, 17], [1, 2, 3, 1, 2, 3, 1, 2], [9] * 5]
    params = [SamplingParams(max_new_tokens=32)] * len(prompts)
    plain = [r.token_ids for r in engine.generate(prompts, params)]
    drafter = make_drafter(f"dspark:{tmp_path}", 0, target)
    assert drafter.verify_lengths == (1, 2, 4, 5)
    costs = np.asarray([1.0, 1.05, 1.1, 1.2, 1.3, 1.4], np.float32)
    rows = engine.generate(prompts, params, drafter=drafter, spec_mode=ALWAYS, costs=costs)
    assert [r.token_ids for r in rows] == plain
    assert sum(r.checked[0] for r in rows) > 0
    # what the schedule handed the engine: lengths from the confidences, fewer under steeper costs
    tokens, last = np.array([3, 9, 27, 81, 50, 6, 18]), 54
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        hidden_states = [x.numpy() for x in hf(torch.as_tensor(tokens)[None], output_hidden_states=True).hidden_states]
    dparams = drafter.params()
    st, history = specjax_state(drafter, dparams, hidden_states, tokens, last)
    samp = SamplingArrays.from_params([SamplingParams()])
    lengths = []
    for step_cost in (0.0, 0.01, 0.3, 2.0):
        table = jnp.asarray(1.0 + step_cost * np.arange(BLOCK + 1), jnp.float32)
        ctx = StepContext(
            history,
            jnp.asarray([len(tokens) + 1]),
            samp,
            jnp.zeros((1,), jnp.uint32),
            True,
            jnp.asarray([True]),
            False,
            table,
        )
        proposal, _ = drafter.propose(dparams, st, ctx)
        assert bool(proposal.active[0]) == (int(proposal.length[0]) > 0)
        lengths.append(int(proposal.length[0]))
    assert lengths[0] == BLOCK and lengths[-1] == 0 and lengths == sorted(lengths, reverse=True), lengths


def test_calibrated_temperatures_scale_each_slots_confidence(target_dir, target, tmp_path):  # noqa: F811
    """`confidence_temperatures` (sequential temperature scaling) divide slot j's confidence logit
    by T_j, in specjax's own config (saved and loaded); bad ones are one line."""
    import dataclasses

    from specjax.drafters import dflash

    speculators_dspark(target_dir, seed=3).save_pretrained(str(tmp_path / "src"))
    base = make_drafter(f"dspark:{tmp_path / 'src'}", 0, target)
    temps = (2.0, 0.5, 1.0, 4.0, 0.25)
    cfg = dataclasses.replace(base.weights.config, confidence_temperatures=temps)
    dflash.save(dataclasses.replace(base.weights, config=cfg), str(tmp_path / "ours"))
    hot = make_drafter(f"dspark:{tmp_path / 'ours'}", 0, target)
    assert hot.weights.config.confidence_temperatures == temps
    tokens, last = np.array([3, 9, 27, 81, 50, 6, 18]), 54
    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():
        hidden_states = [x.numpy() for x in hf(torch.as_tensor(tokens)[None], output_hidden_states=True).hidden_states]
    ctx = StepContext(
        jnp.asarray([[*tokens, last]], jnp.int32),
        jnp.asarray([len(tokens) + 1]),
        SamplingArrays.from_params([SamplingParams()]),
        jnp.zeros((1,), jnp.uint32),
        True,
        jnp.asarray([True]),
        False,
    )
    confs = []
    for drafter in (base, hot):
        dparams = drafter.params()
        st, history = specjax_state(drafter, dparams, hidden_states, tokens, last)
        h = drafter.block_hidden(dparams, st, history, jnp.asarray([len(tokens) + 1]), BLOCK)
        draft, _, conf = drafter.draft_chain(dparams, h, jnp.asarray([last]), ctx)
        confs.append(np.asarray(conf, np.float64)[0])
    logit = np.log(confs[0]) - np.log1p(-confs[0])
    assert np.allclose(confs[1], 1 / (1 + np.exp(-logit / np.asarray(temps))), rtol=1e-4)
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    for bad, match in [([1.0, 2.0], "5 positive"), ([1, 1, 1, 1, -1], "5 positive"), ("hot", "list of numbers")]:
        (tmp_path / "ours" / "config.json").write_text(json.dumps({**raw, "confidence_temperatures": bad}))
        with pytest.raises(DrafterError, match=match):
            make_drafter(f"dspark:{tmp_path / 'ours'}", 0, target)
