"""Calibration of a drafter's confidence head: sequential temperature scaling (DSpark, §3.2.1).

The head's c_k estimates P(draft k survives | drafts < k survived), so the probability that the
first k drafts all survive is the product c_1 ... c_k, and that product is what the verify-length
schedule weighs against step costs (specjax/drafters/dspark.py). A head trained against
1 - TV is typically overconfident. Sequential temperature scaling fits one temperature T_k per slot,
left to right: c_k becomes sigmoid(logit_k / T_k), with T_k the grid point minimising the expected
calibration error (ECE) of the product up to k against whether the first k drafts survived, the
temperatures of earlier slots held fixed. Dividing a logit by T > 0 keeps the order of the
confidences: it changes their magnitudes, not their ranking.

`fit_temperatures` decides whether to scale at all by two-fold cross-validation over the held-out
rows (fit on one half, measure on the other, both ways): a head trained against 1 - TV with a
proper loss may already be calibrated, and on a few thousand chain starts the ECE-optimal grid
point of the late slots (whose survival products are tiny) is mostly noise. The temperatures are
adopted, fitted on all rows, only when they lower the cross-validated mean survival ECE.
"""

from __future__ import annotations

import numpy as np

GRID = np.exp(np.linspace(-np.log(8.0), np.log(8.0), 161))  # temperatures tried: 1/8 .. 8, log-spaced, 1 included
BINS = 15


def ece(p: np.ndarray, y: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error of probabilities `p [M]` against outcomes `y [M]` (0/1): the
    count-weighted mean |mean p - mean y| over `bins` equal-width bins of p."""
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)  # [M]
    n = np.bincount(idx, minlength=bins).astype(np.float64)
    gap = np.bincount(idx, p, bins) - np.bincount(idx, y.astype(np.float64), bins)  # [bins] sums
    return float(np.abs(gap).sum() / max(n.sum(), 1.0))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def sequential_temperature_scaling(logits: np.ndarray, hits: np.ndarray, grid: np.ndarray = GRID) -> list[float]:
    """Per-slot temperatures `[K]` from confidence logits `[M, K]` and whether each draft equalled
    the target's token `[M, K]` (M chain starts)."""
    survive = np.cumprod(hits.astype(np.float64), axis=1)  # [M, K] the first k + 1 drafts all survive
    prefix = np.ones(len(logits))  # [M] calibrated product of the earlier slots
    temps = []
    for k in range(logits.shape[1]):
        errs = [ece(prefix * _sigmoid(logits[:, k] / t), survive[:, k]) for t in grid]
        temps.append(float(grid[int(np.argmin(errs))]))
        prefix = prefix * _sigmoid(logits[:, k] / temps[-1])
    return temps


def survival_ece(logits: np.ndarray, hits: np.ndarray, temps) -> list[float]:
    """ECE of the survival product at each slot `[K]` under temperatures `temps [K]`."""
    survive = np.cumprod(hits.astype(np.float64), axis=1)  # [M, K]
    prod = np.cumprod(_sigmoid(logits / np.asarray(temps, np.float64)[None]), axis=1)  # [M, K]
    return [ece(prod[:, k], survive[:, k]) for k in range(logits.shape[1])]


def fit_temperatures(parts) -> dict:
    """Per-row (confidence logits `[S, K]`, hits `[S, K]`) of held-out replies -> report:
    `temperatures` (fitted on all rows, or [] when scaling does not pay), `adopted`, and the
    two-fold cross-validated survival ECE per slot `ece_before` / `ece_after`, `starts`."""
    half = max(len(parts) // 2, 1)
    folds = [[np.concatenate(x) for x in zip(*p)] for p in (parts[:half], parts[half:] or parts[:half])]
    before, after = [], []
    for (fz, fy), (tz, ty) in ((folds[0], folds[1]), (folds[1], folds[0])):
        before.append(survival_ece(tz, ty, [1.0] * tz.shape[1]))
        after.append(survival_ece(tz, ty, sequential_temperature_scaling(fz, fy)))
    before, after = np.mean(before, axis=0), np.mean(after, axis=0)  # [K] each
    adopted = bool(after.mean() < before.mean())
    z, y = (np.concatenate(x) for x in zip(*parts))
    return {
        "temperatures": [round(t, 4) for t in sequential_temperature_scaling(z, y)] if adopted else [],
        "adopted": adopted,
        "ece_before": [round(float(e), 4) for e in before],
        "ece_after": [round(float(e), 4) for e in after],
        "starts": len(z),
    }
