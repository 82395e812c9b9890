"""Distilled draft model: training lowers the loss; the export holds only the draft's own layers
and loads through `--drafter draft:PATH` and the bare (shipped) `draft` with the target's
embedding and head; greedy output equals plain decoding; checkpoints for another target or with
a missing key fail in one line."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafters
from specjax.drafters import make_drafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.errors import DrafterError
from specjax.models.loading.safetensors_io import SafetensorsFile
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams
from train.draft_model import DraftDistillTask
from train.loop import OptimConfig, fit, read_log


@pytest.fixture(scope="module")
def trained(sharp_target, sharp_store, tmp_path_factory):
    task = DraftDistillTask(sharp_target, num_layers=2, eval_k=3, loss_chunk=16)
    o = OptimConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=3, checkpoint_every=30, eval_every=30)
    before = task.evaluate(task.init_params(o.seed), sharp_store)
    out = str(tmp_path_factory.mktemp("draft_run"))
    params = fit(task, sharp_store, o, out, eval_store=sharp_store)
    return task, params, before, read_log(out)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    task, params, _, _ = trained
    return task.export(params, str(tmp_path_factory.mktemp("draft") / "d"), jnp.bfloat16, {"note": "test"})


def test_distillation_lowers_the_loss_and_raises_acceptance(trained):
    _, _, before, log = trained
    assert len(log) == 30
    first, last = np.mean([r["loss"] for r in log[:3]]), np.mean([r["loss"] for r in log[-3:]])
    assert last < 0.8 * first, (first, last)
    after = log[-1]["eval"]
    assert after["sim_mal"] > before["sim_mal"] + 0.1, (before, after)
    assert (
        set(after) == {"sim_mal", "sim_per_position", "sim_starts", "path_mal", "path_per_position", "path_steps"}
        and len(after["sim_per_position"]) == 3
    )


def test_export_holds_only_the_drafts_own_tensors_and_loads(sharp_target, trained, exported):
    _, params, _, _ = trained
    names = SafetensorsFile(os.path.join(exported, "model.safetensors")).names()
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" not in names
    assert "model.layers.1.mlp.down_proj.weight" in names and "model.layers.2.mlp.down_proj.weight" not in names
    d = make_drafter(f"draft:{exported}", 3, sharp_target)
    assert isinstance(d, DraftModelDrafter) and d.model.config.num_layers == 2
    got = d.model.params
    np.testing.assert_array_equal(np.asarray(got["embed"][...]), np.asarray(sharp_target.params["embed"][...]))
    np.testing.assert_array_equal(np.asarray(got["lm_head"][...]), np.asarray(sharp_target.params["lm_head"][...]))
    want = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32), params)
    np.testing.assert_array_equal(
        np.asarray(got["layers"][1]["mlp"]["down"][...]), np.asarray(want["layers"][1]["mlp"]["down"][...])
    )
    np.testing.assert_array_equal(np.asarray(got["norm"]["scale"][...]), np.asarray(want["norm"]["scale"][...]))


def test_greedy_lossless_in_engine(sharp_target, exported):
    engine = Engine(sharp_target)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 11, 1)]
    sp = [SamplingParams(max_new_tokens=24)] * 3
    plain = [r.token_ids for r in engine.generate(prompts, sp)]
    rows = engine.generate(prompts, sp, drafter=make_drafter(f"draft:{exported}", 4, sharp_target))
    assert [r.token_ids for r in rows] == plain
    assert sum(sum(r.accepted) for r in rows) > 0  # both the accept and the reject paths ran


def test_bare_name_is_the_shipped_draft(sharp_target, exported, tmp_path, monkeypatch):
    monkeypatch.setattr(drafters, "SHIPPED_DIR", str(tmp_path))
    with pytest.raises(DrafterError, match="no draft drafter is shipped"):
        make_drafter("draft", 3, sharp_target)
    os.symlink(exported, drafters.shipped_path("draft"))
    d = make_drafter("draft", 0, sharp_target)
    assert isinstance(d, DraftModelDrafter) and d.num_draft == drafters.DEFAULT_NUM_DRAFT["draft"]


def test_draft_for_another_target_is_one_line(exported, other_target):
    other, message = other_target
    with pytest.raises(DrafterError, match=message) as e:
        make_drafter(f"draft:{exported}", 3, other)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("section, key", [("specjax_draft", "target_num_layers"), (None, "hidden_size")])
def test_missing_config_key_is_named(sharp_target, exported, tmp_path, section, key):
    import shutil

    path = shutil.copytree(exported, tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    del (raw[section] if section else raw)[key]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=f"missing the key '{key}'|missing key '{section}.{key}'") as e:
        make_drafter(f"draft:{path}", 3, sharp_target)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("positions", [None, 16])
def test_chunked_soft_ce_equals_the_plain_formula(positions):
    """Value and gradient of the chunked, compacted, custom-VJP soft CE == the one-array formula."""
    from train.common import chunked_soft_ce

    rng = np.random.RandomState(0)
    n, b, t, d, v = 2, 3, 21, 8, 50
    draft = jnp.asarray(rng.randn(n, b, t, d), jnp.float32)
    sharp_target, head = jnp.asarray(rng.randn(b, t, d), jnp.float32), jnp.asarray(rng.randn(v, d), jnp.float32)
    valid = jnp.asarray(rng.rand(n, b, t) < 0.4)  # at most 16 labelled positions per row here
    w = jnp.asarray([0.7, 1.3])

    def plain(dr):
        p = jax.nn.softmax(sharp_target @ head.T, -1)
        return jnp.sum(-jnp.sum(p * jax.nn.log_softmax(dr @ head.T, -1), -1) * valid, axis=(1, 2))

    chunked = lambda dr: chunked_soft_ce(dr, sharp_target, head, valid, 4, positions)[0]
    np.testing.assert_allclose(chunked(draft), plain(draft), rtol=1e-5)
    np.testing.assert_allclose(
        jax.grad(lambda dr: w @ chunked(dr))(draft), jax.grad(lambda dr: w @ plain(dr))(draft), atol=1e-5
    )


def test_recipes_build_their_tasks(sharp_target):
    from train.cli import feature_layers, make_task
    from train.config import RecipeError, load_recipe
    from train.mtp import MTPTask

    for kind, cls in (("mtp", MTPTask), ("draft", DraftDistillTask)):
        path = os.path.join(os.path.dirname(__file__), "..", "configs", f"{kind}-smollm2.yaml")
        assert load_recipe(path).model["draft_vocab_size"] == 8192
        r = load_recipe(path, ["model.draft_vocab_size=64"])  # this tiny target has 256 tokens
        assert r.drafter == kind and feature_layers(r, sharp_target) == ()
        task = make_task(r, sharp_target, np.arange(256))
        assert isinstance(task, cls) and task.d2t.shape == (64,)
        with pytest.raises(RecipeError, match="draft_vocab_size needs the training data's token counts"):
            make_task(r, sharp_target, None)
    r = load_recipe(None, ["drafter=mtp", "out_dir=x", "data={}", "optim={}", "model.num_modules=2", "model.eval_k=3"])
    with pytest.raises(RecipeError, match="model section: eval_k must be 1..num_modules"):
        make_task(r, sharp_target, None)
    r = load_recipe(None, ["drafter=draft", "out_dir=x", "data={}", "optim={}", "model.num_layer=2"])
    with pytest.raises(RecipeError, match="num_layer"):
        make_task(r, sharp_target, None)


def test_hf_assistant_export_matches_the_drafter(sharp_target, exported):
    """The bench's HF assisted-generation peer loads the distilled draft through a complete HF
    directory (the target's embedding and head merged in): transformers' logits equal ours."""
    import torch

    from specjax.bench.peers import load_assistant
    from specjax.drafters.draft_model import load_with_target_tables

    ours = load_with_target_tables(exported, sharp_target, "float32")
    hf = load_assistant(exported, sharp_target)
    ids = [[5, 17, 3, 99, 42, 7]]
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    m = ours.module()
    mine = np.asarray(m(jnp.asarray(ids), m.new_cache(1, len(ids[0])))[0])
    np.testing.assert_allclose(mine, theirs, atol=2e-4, rtol=1e-4)


def test_draft_vocabulary_is_exported_forecast_and_lossless(sharp_target, sharp_seqs, sharp_store, trained, tmp_path):
    """With `draft_vocab_size` the export carries `d2t` (the most frequent reply tokens), the drafter
    loads it and drafts from those head rows only; greedy output still equals plain decoding and
    the simulator's path MAL (restricted the same way) forecasts the engine's MAL on the target's
    own greedy replies as well as it does for the unrestricted drafter."""
    from specjax.drafters import checkpoint
    from specjax.drafters.base import vocab_maps

    _, params, _, _ = trained
    task = DraftDistillTask(
        sharp_target, sharp_store.counts, num_layers=2, eval_k=3, loss_chunk=16, draft_vocab_size=48
    )
    np.testing.assert_array_equal(np.asarray(task.d2t), vocab_maps(sharp_store.counts, 48)[0])
    path = task.export(params, str(tmp_path / "d"), None, {"note": "test"})  # f32: the engine runs these params
    assert os.path.isfile(os.path.join(path, checkpoint.VOCAB_FILE))
    d = make_drafter(f"draft:{path}", 3, sharp_target)
    np.testing.assert_array_equal(np.asarray(d.d2t), np.asarray(task.d2t))
    sim = task.evaluate(params, sharp_store)
    rows = Engine(sharp_target).generate(
        [ids[:p] for ids, p in sharp_seqs],
        [SamplingParams(max_new_tokens=len(ids) - p) for ids, p in sharp_seqs],
        drafter=d,
    )
    assert [r.token_ids for r in rows] == [ids[p:] for ids, p in sharp_seqs]  # = plain greedy
    engine_mal = sum(len(r.token_ids) - 1 for r in rows) / sum(r.steps for r in rows)
    full = DraftDistillTask(sharp_target, num_layers=2, eval_k=3, loss_chunk=16).evaluate(params, sharp_store)
    rows_full = Engine(sharp_target).generate(
        [ids[:p] for ids, p in sharp_seqs],
        [SamplingParams(max_new_tokens=len(ids) - p) for ids, p in sharp_seqs],
        drafter=DraftModelDrafter(3, d.model, sharp_target.config),
    )
    full_mal = sum(len(r.token_ids) - 1 for r in rows_full) / sum(r.steps for r in rows_full)
    # 26-token replies: the engine's last step of each reply is cut by max_new_tokens, which the
    # simulator does not model (~0.1 here, 0.01 on long replies); the same for both drafters
    assert engine_mal > 1.1 and abs((sim["path_mal"] - engine_mal) - (full["path_mal"] - full_mal)) < 0.03, (
        sim["path_mal"],
        engine_mal,
        full["path_mal"],
        full_mal,
    )
    assert abs(sim["path_mal"] - full["path_mal"]) > 0.05  # the restriction is what was simulated


@pytest.mark.parametrize(
    "d2t, message", [(np.array([5, 3, 9]), "ascending unique"), (np.array([1, 2, 256]), "below 256")]
)
def test_bad_draft_vocabulary_is_one_line(sharp_target, exported, tmp_path, d2t, message):
    import shutil

    from specjax.drafters.checkpoint import save_draft_vocab

    path = shutil.copytree(exported, tmp_path / "d")
    save_draft_vocab(str(path), d2t)
    with pytest.raises(DrafterError, match=message):
        make_drafter(f"draft:{path}", 3, sharp_target)
