"""`specjax train DRAFTER --config RECIPE [key=value ...]`: data, features, training, export.

Every stage is resumable, so rerunning the same command after a kill continues where it stopped:
regenerated replies are added to a corpus batch by batch (`data.replies_dir`, train/replies.py),
feature stores are reused when complete (under `data.cache_dir`, default out_dir, which recipes
may share), and training
resumes from the newest Orbax checkpoint. The trained drafter is exported (bf16 by default) to
`out_dir/drafter`, loadable with `--drafter KIND:out_dir/drafter`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from rich.console import Console

from train.config import Recipe, RecipeError, load_recipe


def sequences(target, recipe: Recipe, split: str, console: Console) -> list[tuple[list[int], int]]:
    """Token sequences of one split, in conversation order. Training: the first
    `data.num_prompts` conversations of the shuffled pool; held-out: its last `data.eval_prompts`
    (always the target's own replies, so the simulator is exact). Replies come from the corpus at
    `data.replies_dir` (train/replies.py); the missing ones are generated and added batch by batch,
    so a killed run loses at most one batch."""
    from train.data import conversations, dataset_sequences, encode_prompts, held_out_conversations, regen_replies
    from train.replies import Replies, RepliesError

    d = recipe.data
    if split == "train":
        convs = conversations(d.num_prompts, d.seed)
        if d.source == "dataset":
            return dataset_sequences(target, convs, d.max_prompt_tokens, d.seq_len)
    else:
        convs = held_out_conversations(d.eval_prompts, d.seed)
    try:
        corpus = Replies(recipe.replies_dir, target.name, d.max_new_tokens, str(target.dtype))
    except RepliesError as e:
        raise RecipeError(str(e)) from None
    prompts = encode_prompts(target, convs, d.max_prompt_tokens)
    missing = list({tuple(p): p for p in prompts if corpus.get(p) is None}.values())
    if missing:
        t0, done = time.perf_counter(), [0, 0]

        def on_batch(rows):
            corpus.add(rows)
            done[0] += len(rows)
            done[1] += sum(len(ids) - p for ids, p in rows)
            console.print(
                f"regen {split}: {done[0]}/{len(missing)} new replies ({len(corpus)} in "
                f"{corpus.path}), {done[1] / (time.perf_counter() - t0):.0f} tok/s"
            )

        regen_replies(target, missing, d.max_new_tokens, d.gen_batch_size, on_batch)
    return [corpus.get(p) for p in prompts]


def task_class(drafter: str):
    """The training task of a drafter kind (the registry's `Kind.train_task`)."""
    from specjax.drafters import KINDS, TRAINABLE

    if drafter not in TRAINABLE:
        raise RecipeError(f"unknown drafter to train {drafter!r} (known: {', '.join(TRAINABLE)})")
    return KINDS[drafter].task_class()


def make_task(recipe: Recipe, target, counts):
    cls = task_class(recipe.drafter)
    try:
        return cls(target, counts, **recipe.model)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"model section: {e}") from None


def feature_layers(recipe: Recipe, target) -> tuple[int, ...]:
    """Target layers whose hidden states the store keeps (the final hidden state is always kept)."""
    return task_class(recipe.drafter).feature_layers(target, recipe.model.get("target_layers"))


def check_before_loading(recipe: Recipe) -> None:
    """What the user can get wrong, checked before the target loads (which takes seconds to
    minutes) and before anything is written: the task, the keys of the model section (against the
    task's parameters), and that out_dir, data.cache_dir and data.replies_dir can be created and
    written."""
    import inspect

    from specjax.files import check_can_create_dir

    task = task_class(recipe.drafter)
    params = inspect.signature(task.__init__).parameters
    known = [p for p in params if p not in ("self", "target", "counts")]
    unknown = sorted(set(recipe.model) - set(known))
    if unknown:
        raise RecipeError(f"unknown key model.{unknown[0]} for drafter {recipe.drafter} (known: {', '.join(known)})")
    from train.data import pool_size

    d = recipe.data
    if d.num_prompts + d.eval_prompts > pool_size():
        raise RecipeError(
            f"data.num_prompts + data.eval_prompts must be <= {pool_size()} (the ShareGPT training "
            f"pool), got {d.num_prompts} + {d.eval_prompts}"
        )
    check_can_create_dir(recipe.out_dir, "out_dir")
    if recipe.cache_dir != recipe.out_dir:
        check_can_create_dir(recipe.cache_dir, "data.cache_dir")
    if recipe.data.replies_dir:
        check_can_create_dir(recipe.data.replies_dir, "data.replies_dir")


def split_store(target, recipe: Recipe, split: str, layers, console: Console, summary: dict):
    """The FeatureStore of one split (`train` or `eval`): its sequences (regenerating missing
    replies), then the target's features at `layers`; timings go into `summary`."""
    from train.data import extract_features

    t0 = time.perf_counter()
    seqs = sequences(target, recipe, split, console)
    t1 = time.perf_counter()
    store = extract_features(
        target,
        seqs,
        layers,
        os.path.join(recipe.cache_dir, "features", split),
        recipe.data.seq_len,
        recipe.data.feature_batch_size,
    )
    t2 = time.perf_counter()
    tokens = len(store) * recipe.data.seq_len
    summary[f"{split}_data"] = {
        "sequences": len(store),
        "response_tokens": store.num_tokens(),
        "sequence_seconds": t1 - t0,
        "feature_seconds": t2 - t1,
        "feature_tokens_per_second": tokens / max(store.meta["seconds"], 1e-9),
    }
    console.print(
        f"{split}: {len(store)} sequences, {store.num_tokens()} response tokens, features "
        f"{summary[f'{split}_data']['feature_tokens_per_second']:.0f} tok/s"
    )
    return store


def run(
    recipe: Recipe, console: Console | None = None, stop_after: int | None = None, replies_only: bool = False
) -> dict:
    """The whole pipeline; returns a summary (also written to out_dir/summary.json).
    `replies_only`: stop once both splits' replies are in the corpus; returns their counts."""
    from specjax.models.loading import load_model
    from train.loop import fit

    console = console or Console(stderr=True)
    check_before_loading(recipe)
    target = load_model(recipe.target, dtype="float32")
    if replies_only:
        counts = {split: len(sequences(target, recipe, split, console)) for split in ("train", "eval")}
        console.print(f"replies: {counts['train']} train, {counts['eval']} held-out sequences in {recipe.replies_dir}")
        return counts
    layers = feature_layers(recipe, target)
    argv = ["specjax", *sys.argv[1:]] if os.path.basename(sys.argv[0]) == "specjax" else sys.argv
    summary: dict = {"recipe": recipe.to_dict(), "command": " ".join(shlex.quote(a) for a in argv)}
    stores = {split: split_store(target, recipe, split, layers, console, summary) for split in ("train", "eval")}
    task = make_task(recipe, target, stores["train"].counts)
    params = fit(
        task,
        stores["train"],
        recipe.optim,
        recipe.out_dir,
        eval_store=stores["eval"],
        console=console,
        stop_after=stop_after,
    )
    from train.loop import read_log

    log = read_log(recipe.out_dir)
    summary["final_eval"] = task.evaluate(params, stores["eval"])
    if hasattr(task, "calibrate"):  # a confidence head (DSpark): per-slot temperatures, held-out replies
        summary["calibration"] = task.calibrate(params, stores["eval"])
    summary["train_tokens_per_second"] = log[-1]["tokens_per_second"] if log else None
    summary["first_loss"], summary["last_loss"] = (log[0]["loss"], log[-1]["loss"]) if log else (None, None)
    if log and log[-1]["step"] == recipe.optim.steps:
        import jax.numpy as jnp

        dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[recipe.export_dtype]
        meta = {k: summary[k] for k in ("command", "final_eval", "calibration") if k in summary}
        meta["trained_with"] = meta.pop("command")
        out = task.export(params, os.path.join(recipe.out_dir, "drafter"), dtype, meta)
        summary["exported"] = out
        console.print(f"exported the drafter to {out} (use --drafter {recipe.drafter}:{out})")
    with open(os.path.join(recipe.out_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    ev = summary["final_eval"]
    console.print(
        f"simulated MAL {ev['sim_mal']:.2f} over every start, per position {ev['sim_per_position']}; "
        f"{ev['path_mal']:.2f} along greedy decoding's path (the engine's MAL on these prompts), "
        f"per position {ev['path_per_position']}"
    )
    return summary


def calibrate_drafter(recipe: Recipe, path: str, console: Console | None = None) -> dict:
    """Fit the confidence temperatures of the specjax DSpark drafter at `path` on the recipe's
    held-out replies (DSparkTask.calibrate) and write them into its config.json."""
    import jax.numpy as jnp
    import numpy as np

    from specjax.drafters import dspark
    from specjax.drafters.checkpoint import CONFIG_FILE, read_config
    from specjax.models.loading import load_model

    if recipe.drafter != "dspark":
        raise RecipeError(f"--calibrate: only DSpark has a confidence head, the recipe trains {recipe.drafter}")
    console = console or Console(stderr=True)
    raw = read_config(path, "dspark", "DSpark")
    w = dspark.load(path, jnp.float32)
    target = load_model(recipe.target, dtype="float32")
    w.config.check_target(target.config, path)
    store = split_store(target, recipe, "eval", w.config.target_layers, console, {})
    task = make_task(recipe, target, np.ones(target.config.vocab_size, np.int64))
    task.cfg, task.graphdef, task.d2t = w.config, w.graphdef, w.d2t
    report = task.calibrate(w.params, store)
    raw.update(confidence_temperatures=list(task.cfg.confidence_temperatures), calibration=report)
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(raw, fh, indent=1)
    what = f"temperatures {report['temperatures']}" if report["adopted"] else "kept as trained (scaling did not pay)"
    console.print(
        f"{path}: {what}; cross-validated survival ECE per slot {report['ece_before']} -> {report['ece_after']}"
    )
    return report


def main(a) -> int:
    """Entry from `specjax train` (argparse namespace: args = [DRAFTER] KEY=VALUE..., config, stop_after,
    replies_only, calibrate)."""
    overrides = list(a.args)
    if not a.config and not overrides:
        raise RecipeError("train: give a recipe, e.g. `specjax train eagle3 --config configs/eagle3-smollm2.yaml`")
    if overrides and "=" not in overrides[0]:
        overrides[0] = f"drafter={overrides[0]}"
    if a.stop_after is not None and a.stop_after < 1:
        raise RecipeError(f"--stop-after must be >= 1, got {a.stop_after}")
    recipe = load_recipe(a.config, overrides)
    if a.calibrate:
        calibrate_drafter(recipe, a.calibrate)
        return 0
    run(recipe, stop_after=a.stop_after, replies_only=a.replies_only)
    return 0
