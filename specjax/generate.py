"""Public generation API: `specjax.generate(prompts, model=..., sampling=...)`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from specjax.drafters.base import NoDrafter
from specjax.errors import InvalidPromptError, InvalidSamplingError
from specjax.models.loading import Model, get_model
from specjax.policy.batch import draft_variants, plan_call
from specjax.policy.costs import cost_key
from specjax.policy.rows import AUTO
from specjax.prompts import Prompt, check_fits, encode_prompt
from specjax.runtime.cached import get_engine
from specjax.sampling import SamplingParams
from specjax.stats import AcceptanceStats, zero_extend

_AUTO_PLAN: dict[str, tuple] = {}  # (K, cost table or None: plain) per `_key`, measured once


@dataclasses.dataclass
class GenerationStats:
    steps: int  # draft+verify steps (plain decoding: one per token)
    mean_accepted_length: float  # tokens emitted per step, bonus included (plain: 1.0)
    acceptance_rate: float | None  # accepted / draft positions checked (None without a drafter)
    # P(draft i accepted | drafts < i accepted), K entries; None where never checked
    per_position_acceptance: list[float | None]
    tokens_per_second: float  # generated tokens / (prefill + decode) seconds, compile excluded
    drafter: str
    num_draft: int
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    verified_steps: int = 0  # steps in which the row verified drafts (the others were plain steps)
    spec_policy: str = "always"  # "auto": rows fall back to plain steps where verifying does not pay
    tree: str = "chain"  # the proposal's shape: "chain" or "k x depth" (e.g. "4x5": a dynamic tree)
    off_chain_steps: int = 0  # tree steps that accepted more than the drafter's top-1 chain would have


@dataclasses.dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    stats: GenerationStats

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": dataclasses.asdict(self.stats),
        }


def generate(
    prompts: Prompt | Sequence[Prompt],
    model: Model | str | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_new_tokens: int | None = None,
    drafter: str | None = None,
    num_draft: int | str = 0,
    raw: bool = False,
    dtype: str | None = None,
    mesh=None,
    spec_policy: str = "auto",
    spec_costs: Sequence[float] | None = None,
    tree_topk: int = 1,
    tree_depth: int = 0,
) -> list[GenerationResult]:
    """Generate a continuation for each prompt, batched.

    `prompts`: one prompt or a list (strings get the chat template unless `raw`; message lists;
    token-id lists). `sampling`: one `SamplingParams` for all rows or one per row; each row
    draws from its own stream of its `seed` (a fresh random one when None), whatever its
    batch-mates.
    `max_new_tokens` overrides the sampling params' value. `mesh`: a `jax.sharding.Mesh` with a
    `data` axis to shard rows over (the number of prompts must be a multiple of its size).
    `spec_policy`: "auto" (each row verifies only while its measured acceptance makes a verify
    step beat a plain one at this machine's step costs: specjax/policy/rows.py; a batch of
    several rows, or `num_draft` "auto", first has the drafter's measured gain on these rows
    decide K and whether to speculate at all: `policy.batch.plan_call`) or "always" (verify
    whatever the drafter proposes). Both keep the target's output law. `spec_costs`: the
    [K + 1] cost table `auto` decides with (a verify of L drafts in plain steps), skipping the
    batch's gain check; None measures both on these prompts, once per model, drafter, batch
    bucket and greedy/sampled in this process (step costs also cached on disk: policy/costs.py).
    `tree_topk` > 1 drafts token trees of `num_draft` nodes, `tree_topk` children per expanded
    node over `tree_depth` levels (default min(K, 5); EAGLE-2 dynamic trees, for drafters that
    draft trees), K in the cost table then being the depth.
    """
    if spec_policy not in ("auto", "always"):
        raise InvalidSamplingError(f"spec_policy must be 'auto' or 'always', got {spec_policy!r}")
    prompts, rows_sampling = _rows(prompts, sampling, max_new_tokens)
    m = get_model(model, dtype)
    ids = [encode_prompt(m, p, raw) for p in prompts]
    for x, p in zip(ids, rows_sampling):
        check_fits(m, len(x), p.max_new_tokens)
    engine = get_engine(m, mesh)
    variants = draft_variants(drafter, num_draft, m, tree_topk, tree_depth)
    eos = m.config.eos_token_ids
    d = variants[max(variants)]
    if spec_policy == "always" or d.num_draft == 0:
        d = _pick_variant(engine, m, ids, rows_sampling, variants, drafter, num_draft)
        rows = engine.generate(ids, rows_sampling, eos_ids=eos, drafter=d)
        return [_result(m, x, row, d, d.label(drafter), spec_policy) for x, row in zip(ids, rows)]
    if spec_costs is not None:
        d = _pick_variant(engine, m, ids, rows_sampling, variants, drafter, num_draft)
        if len(spec_costs) != d.accept_width + 1:
            raise InvalidSamplingError(f"spec_costs needs K + 1 = {d.accept_width + 1} entries, got {len(spec_costs)}")
        costs = list(spec_costs)
    else:
        k, costs = _plan(engine, m, ids, rows_sampling, variants, drafter, num_draft)
        d = variants[k]
    if costs is None:  # the batch as a whole does not gain: plain steps, the drafter idle
        rows = engine.generate(ids, rows_sampling, eos_ids=eos, drafter=NoDrafter())
    else:
        costs = np.asarray(costs, np.float32)
        rows = engine.generate(ids, rows_sampling, eos_ids=eos, drafter=d, spec_mode=AUTO, costs=costs)
    return [_result(m, x, row, d, d.label(drafter), spec_policy) for x, row in zip(ids, rows)]


def _rows(prompts, sampling, max_new_tokens: int | None) -> tuple[list, list[SamplingParams]]:
    """The prompts as a list and one `SamplingParams` per prompt; one-line errors for bad input."""
    if not isinstance(prompts, (str, list, tuple)):
        raise InvalidPromptError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
        prompts = [prompts]
    if not prompts:
        raise InvalidPromptError("no prompts given")
    sampling = sampling if sampling is not None else SamplingParams()
    per_row = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(per_row) != len(prompts):
        raise InvalidSamplingError(f"{len(per_row)} sampling params for {len(prompts)} prompts")
    if max_new_tokens is not None:
        per_row = [dataclasses.replace(p, max_new_tokens=max_new_tokens) for p in per_row]
    return list(prompts), per_row


def _key(m: Model, variants: dict, drafter: str | None, num_draft, rows_sampling) -> str:
    """A decision's cache key: model, drafter, candidates, batch bucket, greedy or sampled."""
    d = variants[max(variants)]
    greedy = all(p.greedy for p in rows_sampling)
    return f"{cost_key(m, d, d.label(drafter), len(rows_sampling))}|{num_draft}|{'greedy' if greedy else 'sampled'}"


def _pick_variant(engine, m: Model, ids, rows_sampling, variants: dict, drafter: str | None, num_draft):
    """`always` (or a given cost table): the drafter at the K (or tree size) to run: the only one,
    or with `num_draft` "auto" the fastest of the candidates, as `_plan` measures it (no plain
    fallback)."""
    if len(variants) == 1:
        return variants[max(variants)]
    return variants[_plan(engine, m, ids, rows_sampling, variants, drafter, num_draft)[0]]


def _plan(engine, m: Model, ids, rows_sampling, variants: dict, drafter: str | None, num_draft):
    """`auto`: (K, cost table; None: plain decoding) by `policy.batch.plan_call` on these rows,
    decided once per `_key` in this process (as a batch job decides once per class)."""
    key = _key(m, variants, drafter, num_draft, rows_sampling)
    if key not in _AUTO_PLAN:
        labels = {k: v.label(drafter) for k, v in variants.items()}
        _AUTO_PLAN[key] = plan_call(engine, ids, rows_sampling, m.config.eos_token_ids, variants, labels)
    return _AUTO_PLAN[key]


def _result(m: Model, ids: list[int], row, d, label: str, spec_policy: str) -> GenerationResult:
    """One row's `GenerationResult` from the engine's `RowOutput`."""
    seconds = row.prefill_seconds + row.decode_seconds
    text = m.tokenizer.decode(row.token_ids, skip_special_tokens=True) if m.tokenizer else ""
    # the prefill emits the first token; MAL counts the tokens of draft-verify steps
    w = d.accept_width  # a row that ran plainly under `auto` reports the drafter's K, nothing checked
    checked, accepted = zero_extend(row.checked, w), zero_extend(row.accepted, w)
    acc = AcceptanceStats.from_counts(row.steps, len(row.token_ids) - 1, checked, accepted, row.off_chain)
    stats = GenerationStats(
        steps=row.steps,
        mean_accepted_length=acc.mal,
        acceptance_rate=acc.acceptance_rate,
        per_position_acceptance=acc.per_position(),
        tokens_per_second=len(row.token_ids) / seconds if seconds > 0 else 0.0,
        drafter=label,
        num_draft=d.num_draft,
        prefill_seconds=row.prefill_seconds,
        decode_seconds=row.decode_seconds,
        verified_steps=acc.verified,
        spec_policy=spec_policy if d.num_draft else "always",
        tree=f"{d.tree_topk}x{d.tree_depth}" if d.tree_topk > 1 else "chain",
        off_chain_steps=acc.off_chain,
    )
    return GenerationResult(text, row.token_ids, ids, row.finish_reason, stats)
