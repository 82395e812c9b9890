"""The proposer protocol every drafter implements.

A drafter is a static Python object (its settings are compile-time constants) plus two pytrees
that travel through the compiled loop: its parameters (`dparams`, may be None) and its state. All
three methods are pure functions of pytrees, traced into the engine's single `lax.while_loop`:

* `init(dparams, ctx: InitContext) -> state` once after the target's prefill;
* `propose(dparams, state, ctx: StepContext) -> (Proposal, state)`: draft tokens `[B, K]`, their
  probabilities `q [B, K, V]` after the same temperature/top-k/top-p processing as the target's
  (None means the drafts are deterministic, q one-hot, which is exact for rejection sampling),
  and optionally `active [B]`: whether the drafter believes in this row's drafts at all. When no
  live row is active, the engine skips verification and runs a plain one-token step, which costs
  far less than checking K + 1 tokens (e.g. the n-gram drafter without a real match); and
  optionally `length [B]`, how many leading drafts the row believes in, for drafters whose
  `verify_lengths` lists several: the engine then verifies the shortest listed prefix that holds
  every live active row's length (one compiled pass per listed length), and each row checks the
  drafts it would check alone (none when inactive; the rest are masked), so a row's output does not
  depend on its batch-mates. Any draft, and any prefix of it, is lossless; `active` and `length`
  only decide what is worth the verify cost;
* `commit(dparams, state, ctx: CommitContext) -> state` after acceptance, e.g. to roll a draft
  KV cache back to the accepted prefix or to keep the target hidden states of accepted positions.

Positions: `history [B, S]` holds prompt + emitted tokens; `hist_len[b]` counts them. The last
emitted token `history[b, hist_len[b] - 1]` is not yet in the target's KV cache; the verify pass
feeds it followed by the K drafts.
"""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.sampling import SamplingArrays, derive, sample, target_probs

DEFAULT_TREE_DEPTH = 5  # levels of a tree when only its node count and k are given


@struct.dataclass
class Proposal:
    draft: jax.Array  # [B, K] int32
    q: Any = None  # [B, K, V] draft probabilities, or None for deterministic drafts
    active: Any = None  # [B] bool, or None: every row's drafts are worth verifying
    length: Any = None  # [B] int32: how many leading drafts the row wants verified, or None: all K
    parents: Any = None  # [B, K] int32 token-tree parents (specjax/models/tree.py), or None: a chain


@struct.dataclass
class InitContext:
    prompt: jax.Array  # [B, T] int32, right-padded
    prompt_len: jax.Array  # [B] int32
    history: jax.Array  # [B, S] int32, prompt + first emitted token
    hist_len: jax.Array  # [B] int32 (= prompt_len + 1)
    sampling: SamplingArrays
    features: Any  # [n, B, T, D] target features: outputs of the `feature_layers` over the prompt, or None
    final_hidden: Any  # [B, T, D] the target's final normed hidden state over the prompt, or None
    cache_size: int = struct.field(pytree_node=False)  # the drafter's cache: >= S (room for catch-ups)
    all_greedy: bool = struct.field(pytree_node=False)


@struct.dataclass
class StepContext:
    history: jax.Array  # [B, S] int32
    hist_len: jax.Array  # [B] int32
    sampling: SamplingArrays
    seeds: jax.Array  # [B] uint32, each row's seed for this step's drafts (`draft_token(..., i)`)
    all_greedy: bool = struct.field(pytree_node=False)
    # Rows the engine lets verify this step (live, and allowed by the speculation policy), and
    # whether it verifies every live row regardless (timing). None: unknown (e.g. timing propose
    # alone). Gated drafters ask `verifies(active)` rather than re-deriving the engine's rule.
    verify_rows: Any = None  # [B] bool
    force_verify: Any = False  # bool or traced [] bool
    # The speculation policy's step costs `[K + 1]` f32 (verifying L drafts costs costs[L] plain
    # steps), for drafters that choose their own verify length; None: no policy, no table.
    costs: Any = None

    def verifies(self, active):
        """Whether this step's verify pass runs, given the drafter's `active` [B] bool rows: the
        engine runs it iff some row it lets verify is active, or it forces verification. Returns
        a [] bool, or None when the engine did not say (`verify_rows` None: draft everything)."""
        if self.verify_rows is None:
            return None
        return jnp.any(active & self.verify_rows) | self.force_verify


@struct.dataclass
class CommitContext:
    n_accepted: jax.Array  # [B] int32, leading drafts the target kept
    tokens: jax.Array  # [B, K + 1] int32, emitted tokens (first n_accepted + 1 valid)
    history: jax.Array  # [B, S] int32, after this step
    hist_len: jax.Array  # [B] int32, after this step
    live: jax.Array  # [B] bool, rows that were running this step
    features: Any  # [n, B, K + 1, D] verify-pass target features (`feature_layers` outputs), or None
    final_hidden: Any  # [B, K + 1, D] verify-pass final normed hidden state, or None


class Drafter:
    """Base class: a drafter proposing `num_draft` tokens per step."""

    name: str = "drafter"
    feature_layers: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads
    needs_final_hidden: bool = False  # whether it reads the target's final hidden state
    # Whether `commit` gives the same state from a context cut to the emitted width (tokens
    # [B, 1] and hidden states of one position) after a plain step: the engine then skips its
    # work on the K positions a plain step did not emit.
    narrow_commit: bool = False
    # Whether `commit` keeps the state current on a plain step whether or not `propose` ran in it
    # (propose writes nothing commit reads): the engine then skips proposing on steps where the
    # speculation policy lets no row verify (specjax/policy/rows.py).
    proposal_optional: bool = False
    # Whether the engine may defer `commit` after plain steps under a speculation policy: it keeps
    # up to P plain steps' target states (`Pending`, specjax/runtime/step.py) and hands them to
    # `catch_up` in one context before the next proposal or once P have gathered, so a row that
    # does not verify pays its drafter's upkeep once per P steps, in one wider pass.
    lazy_commit: bool = False
    # Whether the state's layout or currency depends on K (MTP keeps one cache per draft depth), so
    # that one state cannot serve several K (runtime/slots.py).
    k_dependent_state: bool = False
    # Token trees (`with_tree`): `tree_topk` > 1 makes each proposal a tree of `num_draft` nodes
    # over at most `tree_depth` levels (`Proposal.parents`); one step then accepts at most
    # `tree_depth` drafts. 1: chains.
    tree_topk: int = 1
    tree_depth: int = 0
    # The per-row rule's (longest wait, probe loss) for rows that turned speculation off
    # (specjax/policy/rows.py), or None for its defaults.
    probe_wait: tuple[int, float] | None = None

    def __init__(self, num_draft: int):
        self.num_draft = int(num_draft)

    def max_tree_nodes(self, topk: int, depth: int) -> int:
        """How many nodes a tree of `topk` children per node over `depth` levels can hold, for
        drafters that draft trees; 0 for those that do not."""
        return 0

    def default_tree_depth(self) -> int:
        """Levels of a tree when only its node count and k are given."""
        return min(self.num_draft, DEFAULT_TREE_DEPTH)

    def check_shape(self) -> None:
        """A one-line DrafterError when this drafter cannot draft `accept_width` tokens a step
        (e.g. more than an MTP drafter's modules); `make_drafter` calls it once built and shaped."""

    def with_tree(self, topk: int, depth: int) -> "Drafter":
        """This drafter drafting trees of `num_draft` nodes, `topk` children per expanded node,
        `depth` levels (topk 1: the chain of `num_draft`); one-line DrafterErrors for shapes it
        cannot draft."""
        from specjax.errors import DrafterError

        if topk <= 1:
            return self
        room = self.max_tree_nodes(topk, depth)
        if not room:
            raise DrafterError(f"drafter {self.name} drafts chains only (--tree-topk 1)")
        if depth < 1 or not depth <= self.num_draft <= room:
            raise DrafterError(
                f"a tree of --tree-topk {topk} --tree-depth {depth} needs depth >= 1 and "
                f"depth <= --num-draft <= {room} nodes, got --num-draft {self.num_draft}"
            )
        d = copy.copy(self)
        d.tree_topk, d.tree_depth = int(topk), int(depth)
        return d

    @property
    def accept_width(self) -> int:
        """The most drafts one step can accept: K for a chain, the depth of a tree. The emitted
        width of a step (and of commits, statistics and cost tables) is this + 1."""
        return self.tree_depth if self.tree_topk > 1 else self.num_draft

    def with_num_draft(self, k: int) -> "Drafter":
        """This drafter drafting `k` tokens per step: a new object (the same weights), never a
        changed one; everything derived from K is derived on use. A tree keeps its k and at most
        its depth (a tree of fewer nodes than levels is that many levels deep); K = 0 drafts nothing
        and is no tree."""
        d = copy.copy(self)
        d.num_draft = int(k)
        if self.tree_topk > 1:
            d.tree_depth = min(self.tree_depth, d.num_draft)
            d.tree_topk = self.tree_topk if d.num_draft else 1
        return d

    def label(self, spec: str | None) -> str:
        """How reports name it: the spec as given (a path tells two draft models apart), with the
        tree shape when it drafts trees (`eagle3/tree4x5`)."""
        return self.tree_label((spec or self.name).strip())

    def tree_label(self, label: str) -> str:
        return f"{label}/tree{self.tree_topk}x{self.tree_depth}" if self.tree_topk > 1 else label

    def cache_key(self) -> tuple:
        """Everything static that changes the compiled code."""
        return (
            type(self).__name__,
            self.num_draft,
            self.verify_lengths,
            self.proposal_optional,
            self.lazy_commit,
            self.tree_topk,
            self.tree_depth,
        )

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        """Draft counts the engine may verify per step (ascending, the last = K); each gets its
        own compiled verify pass and `Proposal.length` picks among them."""
        return (self.num_draft,) if self.num_draft else ()

    def params(self) -> Any:
        return None

    def init(self, dparams, ctx: InitContext) -> Any:
        return ()

    def propose(self, dparams, state, ctx: StepContext):
        raise NotImplementedError

    def commit(self, dparams, state, ctx: CommitContext) -> Any:
        return state

    def catch_up(self, dparams, state, ctx: CommitContext) -> Any:
        """The state after deferred plain steps (`lazy_commit`): `ctx` is shaped as a verify step's
        but T >= K + 1 wide (tokens [B, T], target states over T positions; the drafter's cache
        has room for T positions past the history, `InitContext.cache_size`) and holds each row's
        last `n_accepted + 1` emitted tokens and their target states, which `propose` never saw.
        Must equal committing those steps one at a time (up to float rounding). Default: `commit`,
        for drafters whose commit takes any width and reads only the history and target states."""
        return self.commit(dparams, state, ctx)


class NoDrafter(Drafter):
    """K = 0: plain decoding through the same loop."""

    name = "none"

    def __init__(self):
        super().__init__(0)


def head_rows(head: jax.Array, d2t) -> jax.Array:
    """The LM-head rows a drafter drafts from: `head [V, D]` restricted to its draft vocabulary
    `d2t [N]` -> `[N, D]`, or the whole head when `d2t` is None. With N = 8192 of SmolLM2's
    49152 tokens the head product is a sixth of the full one, which dominates a small drafter's
    cost (FR-Spec's observation)."""
    return head if d2t is None else jnp.take(head, d2t, axis=0)


def draft_token(seeds, i: int, logits: jax.Array, d2t, vocab_size: int, sampling, all_greedy: bool):
    """Draft i of a step. Logits over the drafter's vocabulary (`[B, N]` for a draft vocabulary
    `d2t [N]`, `[B, V]` when `d2t` is None) -> target-vocabulary token `[B]`, drawn from the rows'
    step seeds `[B]`, and q `[B, V]` (None when all rows are greedy). Tokens outside the draft
    vocabulary get q = 0: a valid proposal, so rejection sampling stays lossless; they are only
    never drafted."""
    seeds = derive(seeds, i)
    if d2t is None:
        return sample(seeds, logits, sampling), None if all_greedy else target_probs(logits, sampling)
    if all_greedy:
        return d2t[jnp.argmax(logits, axis=-1)], None
    full = jnp.full((logits.shape[0], vocab_size), -jnp.inf, jnp.float32)
    full = full.at[:, d2t].set(logits)  # [B, V]
    return sample(seeds, full, sampling), target_probs(full, sampling)


def vocab_maps(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draft vocabulary = the `size` most frequent target tokens (ties: lower id first).

    Returns `d2t [N]` (draft index -> target id, ascending target ids) and `t2d [V]` (target id ->
    draft index, -1 outside the draft vocabulary); `t2d[d2t] == arange(N)`.
    """
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))[:size]
    d2t = np.sort(order).astype(np.int32)
    t2d = np.full(len(counts), -1, np.int32)
    t2d[d2t] = np.arange(size, dtype=np.int32)
    return d2t, t2d
