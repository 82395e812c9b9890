"""Sequential temperature scaling (train/calibration.py) against a known answer: confidences that
are the true conditional survival probabilities with logits scaled by a known factor per slot
(overconfident, then underconfident) get that factor back as their temperature, and the survival
product's ECE falls to sampling noise on fresh draws; without scaling it stays large. Cross-validation
adopts the temperatures there, and keeps an already calibrated head as it is."""

import numpy as np

from train.calibration import ece, fit_temperatures, sequential_temperature_scaling, survival_ece

SCALES = (3.0, 2.0, 0.5)  # logit multipliers per slot: c_k = sigmoid(scale_k * logit(true p_k))


def draws(seed: int, m: int = 40_000):
    rng = np.random.default_rng(seed)
    z = rng.normal(0.5, 1.5, size=(m, len(SCALES)))  # true logits of P(draft k survives | earlier did)
    hits = rng.random(z.shape) < 1 / (1 + np.exp(-z))  # [M, K]
    return z * np.asarray(SCALES), hits


def test_ece_of_calibrated_and_of_constant_predictions():
    rng = np.random.default_rng(0)
    p = rng.random(200_000)
    assert ece(p, rng.random(p.shape) < p) < 0.01
    assert abs(ece(np.full(1000, 0.9), np.zeros(1000)) - 0.9) < 1e-12


def test_temperatures_recover_the_logit_scale_and_fix_the_survival_product():
    logits, hits = draws(1)
    temps = sequential_temperature_scaling(logits, hits)
    assert np.allclose(temps, SCALES, rtol=0.15), temps
    test_logits, test_hits = draws(2)
    before = survival_ece(test_logits, test_hits, [1.0] * len(SCALES))
    after = survival_ece(test_logits, test_hits, temps)
    assert max(after) < 0.015 and min(before) > 0.04, (before, after)


def test_cross_validation_adopts_scaling_only_where_it_pays():
    logits, hits = draws(3)
    rows = [(logits[i : i + 1000], hits[i : i + 1000]) for i in range(0, len(logits), 1000)]
    report = fit_temperatures(rows)
    assert report["adopted"] and np.allclose(report["temperatures"], SCALES, rtol=0.15), report
    assert np.mean(report["ece_after"]) < 0.3 * np.mean(report["ece_before"]), report
    calibrated = [(z / np.asarray(SCALES), h) for z, h in rows]  # the true probabilities
    report = fit_temperatures(calibrated)
    assert not report["adopted"] and report["temperatures"] == [], report
