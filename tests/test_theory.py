"""flsmem.theory against brute force, and the drift experiment against flsmem.theory.

* The steady-state gain is checked against the filter itself: the Riccati recursion
  iterated to convergence from several starting variances, the kalman policy's own
  variance after many queries, and a Monte-Carlo run of the local-level model whose
  empirical error variances must be the Riccati fixed point.
* ``flsmem.harness.drift --quick`` must reproduce its three claims: the measured error of
  every EMA decay is theory's, the crossover between an accumulating and a measuring
  decay is where theory puts it, and the adaptive filter is within 2% of the best fixed
  decay at every q/r.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P
from flsmem import theory
from flsmem.harness import drift

RATIOS = (0.0, 1e-4, 0.01, 0.3, 1.0, 10.0, 1e3)


def test_closed_forms_and_bad_input():
    gain = theory.steady_state_gain(jnp.array([0.0, 1.0, 1e6]))
    assert float(gain[0]) == 0.0
    assert float(gain[1]) == pytest.approx((-1 + 5**0.5) / 2, rel=1e-6)  # the golden ratio
    assert float(gain[2]) == pytest.approx(1.0, abs=1e-5)
    decay = theory.steady_state_decay(theory.q_over_r_for_decay(jnp.array([0.5, 0.9, 0.99])))
    np.testing.assert_allclose(decay, [0.5, 0.9, 0.99], rtol=1e-5)
    # Decays 0.9 and 0.5 cross where (.81x + .01)/.19 = (.25x + .25)/.75, at q/r = 1/14:
    # the more accumulating 0.9 wins below, the more measuring 0.5 above.
    assert float(theory.crossover(0.9, 0.5)) == pytest.approx(1 / 14, rel=1e-5)
    assert theory.ema_error_variance(0.9, 0.05) < theory.ema_error_variance(0.5, 0.05)
    assert theory.ema_error_variance(0.9, 0.2) > theory.ema_error_variance(0.5, 0.2)
    for bad, name in [(lambda: theory.steady_state_gain(-1.0), "q_over_r"),
                      (lambda: theory.ema_error_variance(1.0, 0.1), "decay"),
                      (lambda: theory.crossover(0.5, 1.5), "decay_b"),
                      (lambda: theory.riccati_gains(0.1, 0.0, 3), "r")]:
        with pytest.raises(ValueError, match=name):
            bad()


@pytest.mark.parametrize("q_over_r", RATIOS)
def test_gain_is_the_limit_of_the_riccati_recursion(q_over_r):
    # In float64, from variances far below and far above the fixed point, and at
    # several scales of r: the limit depends on q / r only.
    expected = float(theory.steady_state_gain(q_over_r))
    for r in (0.01, 1.0, 250.0):
        q = q_over_r * r
        for start in (0.0, r, 1e4 * r):
            var = start
            # Converges geometrically at rate (1 - gain)^2; q = 0 only as 1 / steps.
            for _ in range(100_000 if q_over_r == 0 else 20_000):
                pred = var + q
                var = pred * r / (pred + r)
            gain = (var + q) / (var + q + r)
            assert gain == pytest.approx(expected, rel=1e-5, abs=2e-5)
    assert float(theory.riccati_gains(q_over_r, 1.0, 3000)[-1]) == pytest.approx(expected, rel=1e-4, abs=1e-3)


def test_gain_matches_the_kalman_policys_own_variance():
    # The policy's variance after 300 queries gives its gain P_pred / (P_pred + r).
    for q, r in [(0.01, 1.0), (0.5, 0.1), (2.0, 0.5)]:
        config = flsmem.MemoryConfig(policy=P.kalman(q=q, r=r), budget=1)
        state = flsmem.init(config, 1, 1, {"v": ()})
        state = flsmem.write(state, {"v": jnp.zeros((1, 1))}, jnp.array([0]))
        state = jax.jit(flsmem.observe)(state, jnp.full((1, 1, 300, state.slots), 0.5))
        pred = state.evidence[1][0, 0, 0] + q
        assert float(pred / (pred + r)) == pytest.approx(float(theory.steady_state_gain(q / r)), rel=1e-4)


@pytest.mark.parametrize("q_over_r", (1e-3, 0.1, 1.0, 10.0))
def test_monte_carlo_error_variances_are_the_riccati_fixed_point(q_over_r):
    """Simulate the local level and the filter with the steady-state gain over many
    independent streams: after the transient the error of the filtered level is
    P = gain * r, that of the predicted level P + q, and innovations are white with
    variance P + q + r."""
    streams, steps, r = 100_000, 250, 1.0
    q = q_over_r * r
    gain = float(theory.steady_state_gain(q_over_r))
    rng = np.random.default_rng(0)
    level = np.zeros(streams)
    mean = level + rng.normal(0.0, np.sqrt(r), streams)
    innovation = previous = None
    for _ in range(steps):  # the transient decays as (1 - gain)^(2t): gone long before
        level = level + rng.normal(0.0, np.sqrt(q), streams)
        z = level + rng.normal(0.0, np.sqrt(r), streams)
        predicted_error = level - mean
        previous, innovation = innovation, z - mean
        mean = mean + gain * innovation
    # 1e5 independent streams: a variance's relative standard error is sqrt(2 / 1e5) ~ 0.45%.
    filtered = gain * r
    assert np.mean((level - mean) ** 2) == pytest.approx(filtered, rel=0.03)
    assert np.mean(predicted_error**2) == pytest.approx(filtered + q, rel=0.03)
    assert np.mean(innovation**2) == pytest.approx(filtered + q + r, rel=0.03)
    lag_one = np.mean(innovation * previous) / (filtered + q + r)
    assert abs(lag_one) < 0.015  # ~ 3 standard errors of a correlation from 1e5 pairs
    # The steady-state filter is an EMA with decay 1 - gain: its error is theory's.
    assert np.mean((level - mean) ** 2) == pytest.approx(
        float(theory.ema_error_variance(1.0 - gain, q_over_r)) * r, rel=0.03)


@pytest.fixture(scope="module")
def quick_drift():
    return drift.run(quick=True)


def test_drift_errors_match_theory(quick_drift):
    # Every decay at every q/r within 5% of theory (the quick run's standard errors
    # reach about 1%); the best decay on the grid is theory's optimal one.
    assert quick_drift["theory_fit"]["max_relative_deviation"] < 0.05
    for row in quick_drift["rows"]:
        assert row["best_decay"] == round(row["optimal_decay"], 3)


def test_drift_crossover_is_where_theory_puts_it(quick_drift):
    c = quick_drift["crossover"]
    measured, se = c["measured"]
    assert c["decays"] == [0.99, 0.5]
    assert measured == pytest.approx(c["theory"], rel=0.05)
    assert se < 0.02 * c["theory"]


def test_drift_adaptive_filter_within_2_percent_of_the_best_decay(quick_drift):
    beta = str(drift.QUICK.betas[0])
    for row in quick_drift["rows"]:
        ratio, se = row["adaptive"][beta]["ratio"]
        assert ratio < 1.02, (row["q_over_r"], ratio, se)
        # It found the noise ratio, within a factor 1.5.
        assert row["adaptive"][beta]["q_over_r_estimate"] == pytest.approx(row["q_over_r"], rel=0.5)


def test_drift_bad_input():
    with pytest.raises(ValueError, match="quick"):
        drift.run(quick="yes")
    with pytest.raises(ValueError, match="burn_in"):
        drift.Plan((1.0,), (0.01,), slots=8, replicates=2, steps=10, burn_in=10)
    with pytest.raises(ValueError, match="q_over_r"):
        drift.Plan((1.0, 0.1), (0.01,), slots=8, replicates=2, steps=17, burn_in=8)
