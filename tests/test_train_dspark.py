"""DSpark training (train/dspark.py): the loss drops, simulated acceptance rises and the confidence
head learns the drafts' acceptance rate; resume is exact; 4 host devices equal one; the exported
drafter's greedy output is the target's and the simulator's forecast is the engine's MAL."""

import numpy as np
import pytest

from helpers import SHARP_LAYERS, four_device_losses
from specjax.drafters import make_drafter
from specjax.runtime.engine import Engine
from specjax.sampling import SamplingParams
from train.dspark import DSparkTask
from train.loop import OptimConfig, fit, read_log


def make_task(target, store):
    return DSparkTask(target, store.counts, num_layers=1, block_size=3, mask_token_id=255, draft_vocab_size=0,
                      target_layers=SHARP_LAYERS, intermediate_size=64, anchors=12, markov_rank=8)


@pytest.fixture(scope="module")
def trained(sharp_target, sharp_store, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dspark_run"))
    task = make_task(sharp_target, sharp_store)
    o = OptimConfig(steps=60, batch_size=8, lr=3e-3, warmup_steps=4, checkpoint_every=60, eval_every=60)
    before = task.evaluate(task.init_params(o.seed), sharp_store)
    params = fit(task, sharp_store, o, out, eval_store=sharp_store)
    return task, params, before, read_log(out)


def test_loss_drops_acceptance_improves_and_confidence_learns(trained):
    _, _, before, log = trained
    first, last = np.mean([r["loss"] for r in log[:4]]), np.mean([r["loss"] for r in log[-4:]])
    assert last < 0.7 * first, (first, last)
    after = log[-1]["eval"]
    assert after["sim_mal"] > before["sim_mal"] + 0.2, (before, after)
    assert len(after["sim_per_position"]) == 3
    err = [np.mean([r["conf_abs_err"] for r in part]) for part in (log[:4], log[-4:])]
    assert err[1] < 0.5 * err[0], err


def test_exported_drafter_is_lossless_and_the_forecast_holds(sharp_target, sharp_seqs, sharp_store, trained,
                                                              tmp_path):
    task, params, _, log = trained
    task.export(params, str(tmp_path), metadata={"final_eval": log[-1]["eval"]})
    drafter = make_drafter(f"dspark:{tmp_path}", 0, sharp_target)
    assert drafter.num_draft == 3
    seqs = sharp_seqs[:16]
    rows = Engine(sharp_target).generate([ids[:p] for ids, p in seqs],
                                         [SamplingParams(max_new_tokens=len(ids) - p) for ids, p in seqs],
                                         drafter=drafter)
    assert [r.token_ids for r in rows] == [ids[p:] for ids, p in seqs]
    engine_mal = sum(len(r.token_ids) - 1 for r in rows) / sum(r.steps for r in rows)
    sim = task.evaluate(params, sharp_store, max_rows=16)
    assert engine_mal > 1.3 and abs(sim["path_mal"] - engine_mal) < 0.12, (sim, engine_mal)


def test_resume_reproduces_the_next_steps_exactly(sharp_target, sharp_store, tmp_path):
    o = OptimConfig(steps=8, batch_size=8, lr=1e-3, warmup_steps=2, checkpoint_every=4, eval_every=0)
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "full"))
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "cut"), stop_after=6)
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "cut"))  # resumes from step 4
    full, cut = read_log(str(tmp_path / "full")), read_log(str(tmp_path / "cut"))
    assert [r["step"] for r in cut] == list(range(1, 9))
    assert [r["loss"] for r in cut] == [r["loss"] for r in full]


def test_four_devices_match_one(sharp_target, sharp_store, tmp_path):
    o = OptimConfig(steps=3, batch_size=8, lr=1e-3, warmup_steps=1, checkpoint_every=3, eval_every=0)
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "one"))
    one = [r["loss"] for r in read_log(str(tmp_path / "one"))]
    four = four_device_losses("test_train_dspark", sharp_store.path, str(tmp_path / "four"), 3)
    np.testing.assert_allclose(four, one, rtol=2e-5)
