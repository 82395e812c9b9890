"""Drafter training: recipes, loss goes down, exact resume (in process and after SIGKILL of a real
`specjax train` process), and data-parallel training on 4 host devices equal to one device."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import REPO, SHARP_LAYERS, four_device_losses, specjax_cli_cmd
from train.config import RecipeError, load_recipe
from train.data import FeatureStore, extract_features
from train.eagle3 import Eagle3Task
from train.loop import OptimConfig, batch_indices, fit, read_log

LAYERS = SHARP_LAYERS


def make_task(target, store):
    return Eagle3Task(target, store.counts, draft_vocab_size=128, target_layers=LAYERS, ttt_steps=2, eval_k=3)


def test_loss_drops_and_acceptance_improves(sharp_target, sharp_store, tmp_path):
    task = make_task(sharp_target, sharp_store)
    o = OptimConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=4, checkpoint_every=40, eval_every=40)
    before = task.evaluate(task.init_params(o.seed), sharp_store)
    fit(task, sharp_store, o, str(tmp_path), eval_store=sharp_store)
    log = read_log(str(tmp_path))
    assert len(log) == 40
    first = np.mean([r["loss"] for r in log[:4]])
    last = np.mean([r["loss"] for r in log[-4:]])
    assert last < 0.7 * first, (first, last)
    after = log[-1]["eval"]
    assert after["sim_mal"] > before["sim_mal"] + 0.1, (before, after)
    assert len(after["sim_per_position"]) == 3


def test_resume_reproduces_the_next_steps_exactly(sharp_target, sharp_store, tmp_path):
    o = OptimConfig(steps=10, batch_size=8, lr=1e-3, warmup_steps=2, checkpoint_every=4, eval_every=0)
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "full"))
    # checkpoint at 4, steps 5-6 lost
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "cut"), stop_after=6)
    assert [r["step"] for r in read_log(str(tmp_path / "cut"))] == list(range(1, 7))
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "cut"))  # resumes from step 4
    full, cut = read_log(str(tmp_path / "full")), read_log(str(tmp_path / "cut"))
    assert [r["step"] for r in cut] == list(range(1, 11))
    assert [r["loss"] for r in cut] == [r["loss"] for r in full]


def test_batch_order_is_a_pure_function_of_the_step():
    a = [batch_indices(10, 4, 7, s).tolist() for s in range(5)]
    assert a == [batch_indices(10, 4, 7, s).tolist() for s in range(5)]
    seen = sorted(sum(a[:5], [])[:20])
    assert seen == sorted(list(range(10)) * 2)  # two epochs cover every row twice


def test_four_devices_match_one(sharp_target, sharp_store, tmp_path):
    o = OptimConfig(steps=4, batch_size=8, lr=1e-3, warmup_steps=1, checkpoint_every=4, eval_every=0)
    fit(make_task(sharp_target, sharp_store), sharp_store, o, str(tmp_path / "one"))
    one = [r["loss"] for r in read_log(str(tmp_path / "one"))]
    four = four_device_losses("test_train", sharp_store.path, str(tmp_path / "four"), 4)
    np.testing.assert_allclose(four, one, rtol=2e-5)


def test_recipe_errors_name_the_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("drafter: eagle3\nout_dir: x\ndata: {}\nmodel: {}\n")
    with pytest.raises(RecipeError, match="missing the key 'optim'"):
        load_recipe(str(p))
    p.write_text("drafter: eagle3\nout_dir: x\ndata: {sourc: regen}\nmodel: {}\noptim: {}\n")
    with pytest.raises(RecipeError, match="unknown key data.sourc"):
        load_recipe(str(p))
    with pytest.raises(RecipeError, match="optim.steps must be int"):
        load_recipe(str(p), ["data={}", "optim.steps=abc"])
    r = load_recipe(str(p), ["data={}", "optim.steps=7", "model.ttt_steps=2"])
    assert r.optim.steps == 7 and r.model == {"ttt_steps": 2}
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(str(tmp_path / "missing.yaml"))


def test_cli_bad_recipe_is_one_line_exit_2(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("drafter: eagle3\nout_dir: x\ndata: {}\noptim: {}\n")
    out = subprocess.run(
        specjax_cli_cmd() + ["train", "--config", str(p)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["specjax: error: the recipe is missing the key 'model'"]
    from specjax.cli import main

    assert main(["train"]) == 2  # no recipe at all: says how to give one
    assert main(["train", "--config", str(p), "--stop-after", "0"]) == 2


@pytest.fixture(scope="module")
def tiny_target_dir(real_tokenizer_checkpoint):
    """A tiny random HF checkpoint with the real tokenizer and room for ShareGPT prompts."""
    return real_tokenizer_checkpoint("tiny_target", num_hidden_layers=4, max_position_embeddings=512)


def test_killed_training_resumes_on_the_same_curve(tiny_target_dir, tmp_path):
    """SIGKILL a real `specjax train` mid-run, rerun the same command: the loss curve continues
    exactly as in an uninterrupted run, and the drafter is exported."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        textwrap.dedent(f"""
        drafter: eagle3
        target: {tiny_target_dir}
        out_dir: OUT
        data: {{source: regen, num_prompts: 12, eval_prompts: 4, max_prompt_tokens: 64, max_new_tokens: 12,
               seq_len: 80, gen_batch_size: 12, feature_batch_size: 4}}
        model: {{draft_vocab_size: 256, target_layers: [0, 1, 3], ttt_steps: 2, eval_k: 2}}
        optim: {{steps: 14, batch_size: 4, lr: 0.001, warmup_steps: 2, checkpoint_every: 3, eval_every: 7}}
    """)
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def cmd(out):
        return specjax_cli_cmd() + ["train", "--config", str(recipe), f"out_dir={out}"]

    ref = subprocess.run(cmd(tmp_path / "ref"), env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-2000:]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cmd(run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    log = run_dir / "log.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_text().splitlines()) >= 8:  # past the checkpoint at step 6
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(log.read_text().splitlines())
    assert 8 <= killed_at < 14
    again = subprocess.run(cmd(run_dir), env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert again.returncode == 0, again.stderr[-2000:]
    a, b = read_log(str(tmp_path / "ref")), read_log(str(run_dir))
    assert [r["step"] for r in b] == list(range(1, 15))
    assert [r["loss"] for r in b] == [r["loss"] for r in a]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert os.path.isfile(os.path.join(summary["exported"], "model.safetensors"))
    assert summary["final_eval"]["sim_mal"] >= 1.0


def test_final_hidden_readers_reuse_a_richer_store(sharp_target, sharp_seqs, sharp_store):
    """MTP and the draft model (no layers) reuse an EAGLE-3 store of the same sequences (one
    shared `data.cache_dir`); a store of other sequences is not reused."""
    stamp = os.path.getmtime(os.path.join(sharp_store.path, "final.npy"))
    again = extract_features(sharp_target, sharp_seqs, (), sharp_store.path, 32)
    assert again.layers == LAYERS and os.path.getmtime(os.path.join(sharp_store.path, "final.npy")) == stamp
    other = extract_features(sharp_target, sharp_seqs[:4], (), sharp_store.path + "-other", 32)
    assert other.layers == () and len(other) == 4


EXTRACT_SCRIPT = """
import json, sys, time
from specjax.models.loading import load_model
from train.data import FeatureStore, extract_features
target_dir, seqs_path, out, pause = sys.argv[1:]
seqs = [tuple(s) for s in json.load(open(seqs_path))]
model = load_model(target_dir, "float32", quiet=True)
ran = []  # sequences this run extracted
extract_features(model, seqs, (0, 2), out, 48, 2, on_batch=lambda n, t: ran.append(n) or time.sleep(float(pause)))
print(sum(ran))
"""


def test_killed_feature_extraction_resumes_to_the_same_store(tiny_target_dir, tmp_path):
    """SIGKILL a real extraction mid-run, rerun it: it goes on from the sequences it had written
    (not from the start) and the store equals an uninterrupted extraction's, array for array."""
    rng = np.random.RandomState(1)
    seqs = [(rng.randint(5, 250, 30).tolist(), 10) for _ in range(24)]
    (tmp_path / "seqs.json").write_text(json.dumps(seqs))
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def cmd(out, pause):
        args = [tiny_target_dir, str(tmp_path / "seqs.json"), str(tmp_path / out), str(pause)]
        return [sys.executable, "-c", EXTRACT_SCRIPT, *args]

    ref = subprocess.run(cmd("ref", 0), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-2000:]
    proc = subprocess.Popen(cmd("run", 0.5), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    meta = tmp_path / "run" / "meta.json"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if meta.exists() and json.loads(meta.read_text()).get("done", 0) >= 6:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the extraction finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = json.loads(meta.read_text())["done"]
    assert 6 <= done < 24 and not json.loads(meta.read_text())["complete"]
    again = subprocess.run(cmd("run", 0), env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert again.returncode == 0, again.stderr[-2000:]
    assert int(again.stdout.split()[-1]) == 24 - done  # only what the killed run had not written
    a, b = FeatureStore(str(tmp_path / "ref")), FeatureStore(str(tmp_path / "run"))
    assert a.meta["response_tokens"] == b.meta["response_tokens"] == 24 * 20
    for name in a.arrays:
        assert np.array_equal(np.asarray(a.arrays[name]), np.asarray(b.arrays[name])), name
    assert np.array_equal(a.counts, b.counts)


def test_simulated_path_mal_is_the_engines_greedy_mal(default_model, tmp_path):
    """On the target's own greedy replies the simulator's `path_mal` (only the chain starts that
    greedy decoding visits) forecasts what the engine measures, per position too; `sim_mal` (every
    position a start) is the drafter's average quality. Real model, shipped EAGLE-3, ShareGPT."""
    from specjax.drafters import make_drafter
    from specjax.runtime.engine import Engine
    from specjax.sampling import SamplingParams
    from train.data import conversations, encode_prompts, regen_replies

    k = 5
    prompts = encode_prompts(default_model, conversations(6, seed=0, offset=5000), 96)
    seqs = regen_replies(default_model, prompts, 48, 8)[:4]
    drafter = make_drafter("eagle3@0", k, default_model)
    store = extract_features(default_model, seqs, drafter.feature_layers, str(tmp_path / "eval"), 160, 4)
    task = Eagle3Task(default_model, store.counts, eval_k=k)
    task.d2t, task.graphdef = drafter.weights.d2t, drafter.weights.graphdef  # the shipped drafter's maps
    sim = task.evaluate(drafter.weights.params, store)
    rows = Engine(default_model).generate(
        [ids[:p] for ids, p in seqs],
        [SamplingParams(max_new_tokens=len(ids) - p) for ids, p in seqs],
        drafter=drafter,
        eos_ids=default_model.config.eos_token_ids,
    )
    assert [r.token_ids for r in rows] == [ids[p:] for ids, p in seqs]
    engine_mal = sum(len(r.token_ids) - 1 for r in rows) / sum(r.steps for r in rows)  # token 1: prefill
    assert abs(sim["path_mal"] - engine_mal) < 0.06, (sim, engine_mal)
    checked, accepted = np.sum([r.checked for r in rows], 0), np.sum([r.accepted for r in rows], 0)
    assert abs(sim["path_per_position"][0] - accepted[0] / checked[0]) < 0.06
    assert sim["path_steps"] > 0.9 * sum(r.steps for r in rows)


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.steps=-5", "optim.steps must be >= 1"),
        ("optim.steps=0", "optim.steps must be >= 1"),
        ("optim.lr=-1", "optim.lr must be > 0"),
        ("optim.lr=0", "optim.lr must be > 0"),
        ("optim.lr=.nan", "optim.lr must be a finite number"),
        ("optim.batch_size=0", "optim.batch_size must be >= 1"),
        ("optim.end_lr_fraction=2", "in [0, 1]"),
        ("optim.clip=0", "optim.clip must be > 0"),
        ("optim.steps=true", "optim.steps must be int"),
        ("data.num_prompts=0", "data.num_prompts must be >= 1"),
        ("data.seq_len=16", "must exceed data.max_prompt_tokens"),
        ("data.seed=-1", "data.seed must be"),
        ("export_dtype=int8", "export_dtype must be one of"),
        ("data.source=7", "data.source must be a string"),
    ],
)
def test_recipe_values_are_range_checked(tmp_path, override, match):
    p = tmp_path / "r.yaml"
    p.write_text("drafter: eagle3\nout_dir: x\ndata: {}\nmodel: {}\noptim: {}\n")
    with pytest.raises(RecipeError, match=re.escape(match)):
        load_recipe(str(p), [override])


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.steps=-5", "optim.steps must be >= 1"),
        ("model.ttt_step=2", "unknown key model.ttt_step"),
        ("out_dir=/proc/specjax-run", "cannot create files in /proc"),
    ],
)
def test_cli_bad_recipe_values_fail_before_the_target_loads(tmp_path, capsys, monkeypatch, override, match):
    """`specjax train ... optim.steps=-5` used to load the target and start regenerating."""
    import specjax.models.loading
    from specjax.cli import main

    monkeypatch.setattr(specjax.models.loading, "load_model", lambda *a, **k: pytest.fail("the target loaded"))
    p = tmp_path / "r.yaml"
    p.write_text(f"drafter: eagle3\nout_dir: {tmp_path / 'run'}\ndata: {{}}\nmodel: {{}}\noptim: {{}}\n")
    assert main(["train", "--config", str(p), override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "run").exists()


def test_override_that_is_not_yaml_is_a_recipe_error(tmp_path):
    """Found by tests/test_fuzz.py: a control character in an override value was exit 1."""
    p = tmp_path / "r.yaml"
    p.write_text("drafter: eagle3\nout_dir: x\ndata: {}\nmodel: {}\noptim: {}\n")
    for bad in ("optim.steps=\x1f", "optim.lr=[1", "data.source={a"):
        with pytest.raises(RecipeError, match="not a YAML value"):
            load_recipe(str(p), [bad])
