"""Offline replay of a history-only drafter (the n-gram drafter) against the target's greedy replies.

Greedy speculative output equals plain greedy output, so what a step accepts is fixed by the
reply alone: from prompt + reply[:p], the drafter proposes; the step accepts the deepest path of
the nodes the row checks (a chain's leading drafts, a tree's leading nodes: `verify_lengths`, as
the engine schedules a row alone) whose every token is the reply's next one, and emits that path
plus one token. Walking each reply this way gives the engine's own step counts at batch 1
(tests/test_replay.py checks it against `Engine.generate`) for any proposal shape in seconds,
without running the target: the way to ask what a drafter design could gain before timing it.

The speedup estimate prices a step that verifies L nodes at `1 + position_cost * L` plain steps (a
plain step: L = 0), the batch-1 verify costs measured in the engine being close to linear at
these widths (docs/performance.md); drafting itself is not priced.

    python -m specjax.bench.replay humaneval-raw,sharegpt --shapes chain:5,chain:8,4x5:8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax.datasets import load_suite
from specjax.drafters.base import Drafter, StepContext
from specjax.errors import SpecjaxError


@dataclasses.dataclass(frozen=True)
class ReplayFigures:
    steps: np.ndarray  # [R] loop steps per reply (the prefill's first token is not one)
    tokens: np.ndarray  # [R] tokens the steps emitted
    nodes: np.ndarray  # [R] nodes the steps' passes verified (each pass's width minus one)
    verify_steps: np.ndarray  # [R] steps that verified at least one node

    @property
    def mal(self) -> float:
        return float(self.tokens.sum() / self.steps.sum())

    @property
    def verified_share(self) -> float:
        return float(self.verify_steps.sum() / self.steps.sum())

    def speedup(self, position_cost: float) -> float:
        """Tokens per plain step of cost, a verified node costing `position_cost` plain steps."""
        return float(self.tokens.sum() / (self.steps.sum() + position_cost * self.nodes.sum()))


def replay(drafter: Drafter, rows: list[tuple[list[int], list[int]]]) -> ReplayFigures:
    """Walk every (prompt ids, greedy reply ids) row with `drafter`'s proposals (its `propose`
    must read the history only: dparams and state None) and count what batch-1 steps would do."""
    r = len(rows)
    plen = np.array([len(p) for p, _ in rows])  # [R]
    rlen = np.array([len(t) for _, t in rows])  # [R]
    s = int(np.max(plen + rlen)) + 1
    full = np.zeros((r, s + drafter.num_draft + 1), np.int32)  # [R, S + N + 1] prompt + reply, padded
    for i, (p, t) in enumerate(rows):
        full[i, : len(p) + len(t)] = p + t
    propose = jax.jit(lambda h, n: drafter.propose(None, None, StepContext(h, n, None, None, True))[0])
    lengths = np.asarray(drafter.verify_lengths)
    pos = np.minimum(1, rlen)  # [R] reply tokens emitted: the prefill emits the first
    steps, tokens, nodes, verify_steps = (np.zeros(r, np.int64) for _ in range(4))
    every = np.arange(r)
    while np.any(pos < rlen):
        live = pos < rlen  # [R]
        hist_len = plen + pos  # [R]
        hist = np.where(np.arange(s)[None] < hist_len[:, None], full[:, :s], 0)  # [R, S]
        pr = propose(jnp.asarray(hist), jnp.asarray(hist_len, jnp.int32))
        draft = np.asarray(pr.draft)  # [R, N]
        n = draft.shape[1]
        active = np.ones(r, bool) if pr.active is None else np.asarray(pr.active)  # [R]
        want = np.full(r, n) if pr.length is None else np.minimum(np.asarray(pr.length), n)  # [R]
        own = np.where(active & (want > 0), lengths[np.searchsorted(lengths, want)], 0)  # [R]
        parents = np.broadcast_to(np.arange(n) - 1, (r, n)) if pr.parents is None else np.asarray(pr.parents)
        depth, ok = np.zeros((r, n), np.int64), np.zeros((r, n), bool)  # [R, N] each
        for i in range(n):  # parents come first: a node's parent is settled before it
            par = parents[:, i]  # [R]
            above = np.maximum(par, 0)
            depth[:, i] = np.where(par >= 0, depth[every, above] + 1, 0)
            reached = np.where(par >= 0, ok[every, above], par == -1)  # -2: never accepted
            ok[:, i] = reached & (i < own) & (draft[:, i] == full[every, plen + pos + depth[:, i]])
        accepted = np.max(np.where(ok, depth + 1, 0), axis=1)  # [R]
        emit = np.where(live, np.minimum(accepted + 1, rlen - pos), 0)  # [R]
        pos = pos + emit
        steps += live
        tokens += emit
        nodes += np.where(live, own, 0)
        verify_steps += live & (own > 0)
    return ReplayFigures(steps, tokens, nodes, verify_steps)


def greedy_replies(model, suite: str, limit: int | None, max_new: int, batch: int = 16) -> list:
    """(prompt ids, plain greedy reply ids) of a packaged suite's prompts, stopping at EOS: the
    training recipes' regeneration (`train.data.regen_replies`) over the suite's prompts."""
    from specjax.bench.speculative import encode_suites
    from train.data import regen_replies

    prompts = encode_suites(model, {suite: load_suite(suite, limit)})[suite]
    return [(ids[:n], ids[n:]) for ids, n in regen_replies(model, prompts, max_new, batch)]


def _shape(spec: str, **ngram) -> tuple[str, Drafter]:
    """`chain:K` or `KxD:N` (a tree of N nodes, k children per node, D levels) -> an n-gram drafter."""
    from specjax.drafters.ngram import NgramDrafter

    form, _, n = spec.strip().partition(":")
    try:
        if form == "chain":
            return spec, NgramDrafter(int(n), **ngram)
        k, d = (int(x) for x in form.split("x"))
        return spec, NgramDrafter(int(n), **ngram).with_tree(k, d)
    except ValueError as e:
        raise SpecjaxError(f"--shapes: {spec!r} is not chain:K or KxD:N ({e})") from None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specjax.bench.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", help="comma-separated packaged suites (humaneval, humaneval-raw, mtbench, sharegpt)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts of each suite")
    ap.add_argument("--shapes", default="chain:3,chain:5,chain:8,4x5:5,4x5:8", help="chain:K or KxD:N, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--position-cost", type=float, default=0.1, help="plain steps per verified node")
    ap.add_argument("--active-n", type=int, default=2, help="the n-gram drafter's active_n")
    ap.add_argument("--long-n", type=int, default=5, help="its long_n (1: every active row wants all nodes)")
    ap.add_argument("--cache-dir", default="runs/replay", help="where the greedy replies are kept")
    args = ap.parse_args(argv)
    from specjax.models.loading import load_model

    model = None
    try:
        shapes = [_shape(s, active_n=args.active_n, long_n=args.long_n) for s in args.shapes.split(",")]
        for suite in args.suites.split(","):
            load_suite(suite, 1)  # unknown names fail here, before anything runs
    except SpecjaxError as e:
        ap.error(str(e))
    for suite in args.suites.split(","):
        path = os.path.join(args.cache_dir, f"{suite}-{args.limit or 'all'}-{args.max_new_tokens}.json")
        if os.path.exists(path):
            with open(path) as fh:
                rows = [tuple(r) for r in json.load(fh)]
        else:
            model = model or load_model(quiet=True)
            rows = greedy_replies(model, suite, args.limit, args.max_new_tokens)
            os.makedirs(args.cache_dir, exist_ok=True)
            with open(path, "w") as fh:
                json.dump(rows, fh)
        for name, drafter in shapes:
            f = replay(drafter, rows)
            print(
                f"{suite:14s} {name:12s} MAL {f.mal:.3f}  verified {f.verified_share:.1%}  "
                f"estimated {f.speedup(args.position_cost):.3f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
