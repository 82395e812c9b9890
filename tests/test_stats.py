"""`AcceptanceStats` (specjax/stats.py), the one definition every report reads: its figures, what
an empty one says, sums of rows with different draft widths, and that `specjax.generate`'s stats
are read from it."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.stats import AcceptanceStats


def test_figures_and_the_empty_case():
    empty = AcceptanceStats()
    assert (empty.mal, empty.acceptance_rate, empty.per_position(), empty.verified_share) == (1.0, None, [], None)
    plain = AcceptanceStats.from_counts(10, 10, [], [])  # plain decoding: one token per step
    assert (plain.mal, plain.acceptance_rate, plain.verified, plain.verified_share) == (1.0, None, 0, None)
    # 10 steps, 6 verified: 6 checks of draft 0 (4 accepted), 4 of draft 1 (1 accepted), none of draft 2
    row = AcceptanceStats.from_counts(10, 15, [6, 4, 0], [4, 1, 0])
    assert row.mal == 1.5 and row.verified == 6 and row.verified_share == 0.6
    assert row.acceptance_rate == pytest.approx(5 / 10)
    assert row.per_position() == [pytest.approx(4 / 6), 0.25, None]  # None: never checked, not "always rejected"


def test_sums_over_rows_of_different_widths():
    total = AcceptanceStats()
    total.add(AcceptanceStats.from_counts(4, 8, [4, 3], [3, 1]))
    total.add(AcceptanceStats.from_counts(6, 6, [], []))  # a plain row
    total.add(AcceptanceStats.from_counts(2, 5, [2, 2, 2], [2, 2, 0]))
    assert (total.steps, total.tokens, total.verified) == (12, 19, 6)
    np.testing.assert_array_equal(total.checked, [6, 5, 2])
    np.testing.assert_array_equal(total.accepted, [5, 3, 0])
    assert total.mal == pytest.approx(19 / 12) and total.per_position()[2] == 0.0


def test_generate_reads_its_stats_from_it(default_model):
    import specjax
    from specjax.sampling import SamplingParams

    (res,) = specjax.generate(
        ["def fib(n):"],
        default_model,
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        drafter="ngram",
        num_draft=3,
        raw=True,
    )
    s = res.stats
    assert s.mean_accepted_length == pytest.approx((len(res.token_ids) - 1) / s.steps)
    assert len(s.per_position_acceptance) == 3 and s.verified_steps <= s.steps
