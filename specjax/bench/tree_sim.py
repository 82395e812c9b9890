"""Greedy acceptance of EAGLE-3 chains and dynamic trees, replayed on the target's own replies.

`python -m specjax.bench.tree_sim --suites mtbench,humaneval --limit 12`: the target answers each
prompt greedily (plain decoding); at every reply position the drafter, fed the target's true
features up to there, proposes a chain or a tree, and greedy verification would accept the
longest path that matches the reply. MAL = accepted + 1 per step, averaged over positions: the
acceptance the engine would see with the same weights, without its speed (no timing here).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle3_tree import dynamic_tree, greedy_accepted

CONFIGS = {"chain K=5": (1, 5, 5), "chain K=8": (1, 8, 8), "tree k=2 D=5 N=8": (2, 5, 8),
           "tree k=4 D=5 N=16": (4, 5, 16), "tree k=4 D=6 N=32": (4, 6, 32), "tree k=8 D=6 N=64": (8, 6, 64)}


def replies(model, suite: str, limit: int, max_new: int) -> list[tuple[list[int], int]]:
    """(prompt + greedy reply ids, prompt length) per prompt."""
    from specjax import datasets, generate
    from specjax.generate import encode_prompt

    prompts = datasets.load_suite(suite, limit)
    raw = suite.endswith("-raw")
    ids = [encode_prompt(model, p if not hasattr(p, "text") else p.text, raw=raw) for p in prompts]
    out = generate(ids, model=model, max_new_tokens=max_new, spec_policy="always")
    return [(i + r.token_ids, len(i)) for i, r in zip(ids, out)]


def replay(model, weights, seq: list[int], prompt_len: int, configs: dict, chunk: int = 32) -> dict[str, list[int]]:
    """Accepted drafts per reply position for each config (name -> list)."""
    net = weights.module()
    x = jnp.asarray([seq], jnp.int32)
    m = model.module()
    size = 1 << (len(seq) + 64).bit_length()
    _, _, feats = m.hidden(x, m.new_cache(1, size), collect=weights.config.target_layers)
    embed = model.params["embed"][...]
    nxt = jnp.concatenate([x[:, 1:], x[:, -1:]], axis=1)
    g, cache = net.step(jnp.take(embed, nxt, axis=0), net.fuse(feats), net.new_cache(1, size))
    positions = list(range(prompt_len, len(seq) - 1))  # prefix x_0..x_p; the reply continues x_{p+1}..
    truth = np.asarray(seq + [-1] * 16)
    out = {name: [] for name in configs}
    for lo in range(0, len(positions), chunk):
        ps = jnp.asarray(positions[lo : lo + chunk])
        b = len(ps)
        rows = jax.tree.map(lambda a: jnp.repeat(a, b, axis=0), cache).with_lengths(ps)
        g_last = g[0, ps - 1]  # [b, D]
        target_next = jnp.asarray(np.stack([truth[p + 1 : p + 1 + 16] for p in positions[lo : lo + chunk]]))
        for name, (k, depth, n) in configs.items():
            tok, par, dep, _ = dynamic_tree(net, embed, weights.d2t, rows, g_last, k, depth, n)
            out[name] += np.asarray(greedy_accepted(tok, par, dep, target_next)).tolist()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", default="mtbench,humaneval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    from specjax.drafters import shipped_path
    from specjax.drafters.eagle3 import load
    from specjax.models.loading import load_model

    model = load_model(dtype="float32", quiet=True)
    weights = load(shipped_path("eagle3"), jnp.float32)
    report = {}
    for suite in a.suites.split(","):
        acc = {name: [] for name in CONFIGS}
        for seq, p in replies(model, suite, a.limit, a.max_new_tokens):
            for name, v in replay(model, weights, seq, p, CONFIGS).items():
                acc[name] += v
        report[suite] = {name: {"mal": 1 + float(np.mean(v)), "steps": len(v)} for name, v in acc.items()}
        for name, r in report[suite].items():
            print(f"{suite:12s} {name:20s} MAL {r['mal']:.3f} over {r['steps']} positions", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
