"""Tests for flsmem.kernels.topk: Pallas radix select vs. jnp reference."""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flsmem.kernels.topk import _topk_mask_pallas, topk_mask, topk_mask_reference

NAN, INF = float("nan"), float("inf")
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def pallas_interpret(scores, k, tiebreak=None):
    return topk_mask(scores, k, tiebreak=tiebreak, implementation="pallas", interpret=True)


def brute_force(scores, k, tiebreak=None):
    """The documented rule, written directly in Python."""
    scores = np.asarray(scores)
    rows, cols = scores.shape
    ks = np.broadcast_to(np.asarray(k), (rows,))
    tiebreak = np.zeros((rows, cols), int) if tiebreak is None else np.asarray(tiebreak)
    mask = np.zeros((rows, cols), bool)
    for r in range(rows):
        row = [float(v) for v in scores[r]]
        tb = [int(v) for v in tiebreak[r]]
        # NaN last; otherwise descending value (-0.0 == 0.0 in Python); then descending
        # tiebreak; then ascending index.
        order = sorted(
            range(cols),
            key=lambda i: (math.isnan(row[i]), 0.0 if math.isnan(row[i]) else -row[i], -tb[i], i),
        )
        mask[r, order[: max(0, min(int(ks[r]), cols))]] = True
    return mask


def messy_scores(rng, shape):
    """Small integers (many ties) sprinkled with NaN, +-inf and -0.0."""
    x = rng.integers(-3, 4, size=shape).astype(np.float32)
    for value, p in ((NAN, 0.1), (INF, 0.05), (-INF, 0.05), (-0.0, 0.1)):
        x[rng.random(shape) < p] = value
    return x


def tied_tiebreak(rng, shape):
    """Tiebreaks with many duplicates, and the int32 extremes (the sign bit matters)."""
    tb = rng.integers(-2, 3, size=shape).astype(np.int32)
    tb[rng.random(shape) < 0.1] = I32_MIN
    tb[rng.random(shape) < 0.1] = I32_MAX
    return tb


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (8, 100), (11, 129), (5, 300)])
def test_pallas_matches_reference_random(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    for scores in (rng.standard_normal((rows, cols)).astype(np.float32),
                   messy_scores(rng, (rows, cols))):
        for k in (0, 1, cols // 2, cols, cols + 3):
            np.testing.assert_array_equal(
                pallas_interpret(scores, k), topk_mask_reference(scores, k)
            )
        per_row = jnp.asarray(rng.integers(-2, cols + 3, size=rows), jnp.int32)
        got = pallas_interpret(scores, per_row)
        np.testing.assert_array_equal(got, topk_mask_reference(scores, per_row))
        np.testing.assert_array_equal(got, brute_force(scores, per_row))


@pytest.mark.parametrize("rows,cols", [(3, 5), (11, 129)])
def test_pallas_matches_reference_random_with_tiebreak(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols + 1)
    for _ in range(3):
        # Small integers: nearly every score is tied with others.
        scores = rng.integers(-1, 2, size=(rows, cols)).astype(np.float32)
        for tb in (tied_tiebreak(rng, (rows, cols)),
                   rng.integers(I32_MIN, I32_MAX, size=(rows, cols), endpoint=True, dtype=np.int32)):
            tb = jnp.asarray(tb)
            for k in (0, 1, cols // 2, cols):
                got = pallas_interpret(scores, k, tb)
                np.testing.assert_array_equal(got, topk_mask_reference(scores, k, tb))
                np.testing.assert_array_equal(got, brute_force(scores, k, tb))
            per_row = jnp.asarray(rng.integers(-2, cols + 3, size=rows), jnp.int32)
            got = pallas_interpret(scores, per_row, tb)
            np.testing.assert_array_equal(got, topk_mask_reference(scores, per_row, tb))
            np.testing.assert_array_equal(got, brute_force(scores, per_row, tb))
        # With NaN, +-inf and -0.0 in the scores too.
        scores = messy_scores(rng, (rows, cols))
        tb = jnp.asarray(tied_tiebreak(rng, (rows, cols)))
        per_row = jnp.asarray(rng.integers(0, cols + 1, size=rows), jnp.int32)
        got = pallas_interpret(scores, per_row, tb)
        np.testing.assert_array_equal(got, topk_mask_reference(scores, per_row, tb))
        np.testing.assert_array_equal(got, brute_force(scores, per_row, tb))


def test_constant_tiebreak_changes_nothing():
    rng = np.random.default_rng(5)
    scores = messy_scores(rng, (11, 129))
    k = jnp.asarray(rng.integers(0, 130, size=11), jnp.int32)
    for value in (0, I32_MIN, I32_MAX):
        tb = jnp.full(scores.shape, value, jnp.int32)
        np.testing.assert_array_equal(pallas_interpret(scores, k, tb), brute_force(scores, k))
        np.testing.assert_array_equal(topk_mask_reference(scores, k, tb), brute_force(scores, k))


def test_pallas_other_block_rows_and_traced_k():
    rng = np.random.default_rng(1)
    scores = messy_scores(rng, (19, 40))
    k = jnp.asarray(rng.integers(0, 41, size=19), jnp.int32)
    got = topk_mask(scores, k, implementation="pallas", interpret=True, block_rows=16)
    np.testing.assert_array_equal(got, brute_force(scores, k))
    traced = jax.jit(lambda s, kk: pallas_interpret(s, kk * 1))(scores, k)
    np.testing.assert_array_equal(traced, got)


HAND_CASES = [
    # (scores row, k, expected mask)
    ([2.0, 2.0, 2.0, 2.0], 2, [1, 1, 0, 0]),
    ([2.0, 2.0, 2.0, 2.0], 0, [0, 0, 0, 0]),
    ([2.0, 2.0, 2.0, 2.0], 4, [1, 1, 1, 1]),
    ([2.0, 2.0, 2.0, 2.0], 9, [1, 1, 1, 1]),
    ([1.0, 5.0, 3.0, 5.0, 0.0], 2, [0, 1, 0, 1, 0]),
    ([1.0, 5.0, 3.0, 5.0, 0.0], 3, [0, 1, 1, 1, 0]),
    ([-INF, 0.0, -INF, -1.0], 3, [1, 1, 0, 1]),
    ([-INF, -INF, -INF], 2, [1, 1, 0]),
    ([1.0, INF, 3e38, INF], 1, [0, 1, 0, 0]),
    ([1.0, INF, 3e38, INF], 3, [0, 1, 1, 1]),
    ([NAN, -INF, NAN, -1.0], 1, [0, 0, 0, 1]),
    ([NAN, -INF, NAN, -1.0], 2, [0, 1, 0, 1]),
    ([NAN, -INF, NAN, -1.0], 3, [1, 1, 0, 1]),
    ([NAN, NAN, NAN], 2, [1, 1, 0]),
    ([-0.0, 0.0, -0.0], 1, [1, 0, 0]),
    ([0.0, -0.0, 0.0], 2, [1, 1, 0]),
    ([-0.0, -1e-45, 1e-45], 2, [1, 0, 1]),
]


@pytest.mark.parametrize("row,k,expected", HAND_CASES)
@pytest.mark.parametrize("impl", ["reference", "pallas", "brute_force"])
def test_hand_cases(row, k, expected, impl):
    scores = np.asarray([row], np.float32)
    fn = {"reference": topk_mask_reference, "pallas": pallas_interpret,
          "brute_force": brute_force}[impl]
    np.testing.assert_array_equal(np.asarray(fn(scores, k)), np.asarray([expected], bool))


TIEBREAK_CASES = [
    # (scores row, tiebreak row, k, expected mask)
    ([2.0, 2.0, 2.0, 2.0], [3, 1, 3, 2], 1, [1, 0, 0, 0]),
    ([2.0, 2.0, 2.0, 2.0], [3, 1, 3, 2], 2, [1, 0, 1, 0]),
    ([2.0, 2.0, 2.0, 2.0], [3, 1, 3, 2], 3, [1, 0, 1, 1]),
    ([2.0, 2.0, 2.0, 2.0], [3, 1, 3, 2], 0, [0, 0, 0, 0]),
    ([2.0, 2.0, 2.0, 2.0], [3, 1, 3, 2], 4, [1, 1, 1, 1]),
    # The tiebreak only orders equal scores.
    ([1.0, 2.0, 2.0, 3.0], [9, 0, 5, -9], 2, [0, 0, 1, 1]),
    ([1.0, 2.0, 2.0, 3.0], [9, 0, 5, -9], 3, [0, 1, 1, 1]),
    # Signed order: INT32_MIN < -1 < 0 < INT32_MAX.
    ([0.0, 0.0, 0.0, 0.0], [I32_MIN, I32_MAX, -1, 0], 1, [0, 1, 0, 0]),
    ([0.0, 0.0, 0.0, 0.0], [I32_MIN, I32_MAX, -1, 0], 2, [0, 1, 0, 1]),
    ([0.0, 0.0, 0.0, 0.0], [I32_MIN, I32_MAX, -1, 0], 3, [0, 1, 1, 1]),
    ([0.0, -0.0, 0.0], [1, 2, 3], 1, [0, 0, 1]),
    ([-0.0, 0.0, -0.0], [1, 2, 3], 2, [0, 1, 1]),
    ([NAN, NAN, -INF, NAN], [1, 7, 0, 7], 2, [0, 1, 1, 0]),
    ([NAN, NAN, -INF, NAN], [1, 7, 0, 7], 3, [0, 1, 1, 1]),
    ([INF, 1.0, INF, INF], [I32_MIN, 5, I32_MIN, 4], 2, [1, 0, 0, 1]),
]


@pytest.mark.parametrize("row,tiebreak,k,expected", TIEBREAK_CASES)
@pytest.mark.parametrize("impl", ["reference", "pallas", "brute_force"])
def test_hand_cases_with_tiebreak(row, tiebreak, k, expected, impl):
    scores = np.asarray([row], np.float32)
    tb = jnp.asarray([tiebreak], jnp.int32)
    fn = {"reference": topk_mask_reference, "pallas": pallas_interpret,
          "brute_force": brute_force}[impl]
    np.testing.assert_array_equal(np.asarray(fn(scores, k, tb)), np.asarray([expected], bool))


def test_hand_cases_per_row_k():
    scores = np.asarray([[3.0, 1.0, 2.0], [NAN, 0.0, -0.0], [1.0, 1.0, 1.0]], np.float32)
    k = jnp.asarray([1, 2, -5], jnp.int32)
    expected = np.asarray([[1, 0, 0], [0, 1, 1], [0, 0, 0]], bool)
    np.testing.assert_array_equal(topk_mask_reference(scores, k), expected)
    np.testing.assert_array_equal(pallas_interpret(scores, k), expected)


def test_reference_matches_brute_force():
    rng = np.random.default_rng(7)
    for rows, cols in ((6, 1), (6, 9), (6, 64)):
        for _ in range(5):
            scores = messy_scores(rng, (rows, cols))
            k = rng.integers(-2, cols + 3, size=rows)
            np.testing.assert_array_equal(
                topk_mask_reference(scores, jnp.asarray(k, jnp.int32)), brute_force(scores, k)
            )
            kk = int(rng.integers(0, cols + 2))
            np.testing.assert_array_equal(topk_mask_reference(scores, kk), brute_force(scores, kk))


# Few distinct shapes so that the interpret-mode kernel compiles only a few times.
_VALUES = st.sampled_from([NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 2.5, 1e-45, -1e-45, -3e38])


@st.composite
def _problems(draw):
    rows, cols = draw(st.sampled_from([(2, 7), (9, 16), (3, 130)]))
    scores = draw(hnp.arrays(np.float32, (rows, cols), elements=_VALUES))
    k = draw(hnp.arrays(np.int32, (rows,), elements=st.integers(-3, cols + 3)))
    return scores, k


@settings(max_examples=200, deadline=None)
@given(_problems())
def test_property_pallas_equals_reference(problem):
    scores, k = problem
    got = np.asarray(pallas_interpret(scores, jnp.asarray(k)))
    np.testing.assert_array_equal(got, np.asarray(topk_mask_reference(scores, jnp.asarray(k))))
    np.testing.assert_array_equal(got.sum(axis=1), np.clip(k, 0, scores.shape[1]))


_TIEBREAKS = st.sampled_from([I32_MIN, I32_MIN + 1, -1, 0, 1, 2, I32_MAX])


@st.composite
def _problems_with_tiebreak(draw):
    scores, k = draw(_problems())
    tiebreak = draw(hnp.arrays(np.int32, scores.shape, elements=_TIEBREAKS))
    return scores, k, tiebreak


@settings(max_examples=100, deadline=None)
@given(_problems_with_tiebreak())
def test_property_pallas_equals_reference_with_tiebreak(problem):
    scores, k, tiebreak = problem
    k, tiebreak = jnp.asarray(k), jnp.asarray(tiebreak)
    got = np.asarray(pallas_interpret(scores, k, tiebreak))
    np.testing.assert_array_equal(got, np.asarray(topk_mask_reference(scores, k, tiebreak)))
    np.testing.assert_array_equal(got, brute_force(scores, k, tiebreak))


@st.composite
def _few_dropped_problems(draw):
    scores, _, tiebreak = draw(_problems_with_tiebreak())
    cols = scores.shape[1]
    max_dropped = draw(st.integers(0, cols + 1))
    # Mostly rows that keep the promise (k >= N - max_dropped), sometimes one that
    # does not (then the sort must take over).
    low = draw(st.sampled_from([max(cols - max_dropped, 0), max(cols - max_dropped - 2, 0)]))
    k = draw(hnp.arrays(np.int32, (scores.shape[0],), elements=st.integers(low, cols + 2)))
    return scores, k, tiebreak, max_dropped


@settings(max_examples=200, deadline=None)
@given(_few_dropped_problems(), st.booleans())
def test_property_max_dropped_gives_the_same_mask(problem, with_tiebreak):
    scores, k, tiebreak, max_dropped = problem
    tiebreak = jnp.asarray(tiebreak) if with_tiebreak else None
    got = topk_mask(scores, jnp.asarray(k), tiebreak=tiebreak, implementation="xla", max_dropped=max_dropped)
    np.testing.assert_array_equal(got, brute_force(scores, k, tiebreak))


def test_max_dropped_typical_eviction_and_ties():
    rng = np.random.default_rng(7)
    # Distinct scores (the tied group is the one threshold entry) and heavy ties
    # (the exact keys settle them), as evict meets them: 8 of 40 left out.
    for scores in (rng.normal(size=(6, 40)).astype(np.float32), np.round(rng.normal(size=(6, 40))).astype(np.float32)):
        tb = rng.integers(0, 5, size=(6, 40)).astype(np.int32)
        got = topk_mask(scores, 32, tiebreak=jnp.asarray(tb), implementation="xla", max_dropped=8)
        np.testing.assert_array_equal(got, brute_force(scores, 32, tb))
        # One left out (evict_every 1): the lowest is found by a min, not lax.top_k.
        got = topk_mask(scores, 39, tiebreak=jnp.asarray(tb), implementation="xla", max_dropped=1)
        np.testing.assert_array_equal(got, brute_force(scores, 39, tb))
    # Under jit with a traced k, and under vmap (where the branches become selects).
    k = jnp.asarray([40, 39, 32, 35, 33, 38], jnp.int32)
    few = jax.jit(lambda s, k: topk_mask(s, k, implementation="xla", max_dropped=8))
    np.testing.assert_array_equal(few(scores, k), brute_force(scores, k))
    batched = jax.vmap(lambda s: topk_mask(s, 36, implementation="xla", max_dropped=4))(scores.reshape(2, 3, 40))
    np.testing.assert_array_equal(batched.reshape(6, 40), brute_force(scores, 36))


def test_reference_jit_and_vmap():
    rng = np.random.default_rng(3)
    scores = messy_scores(rng, (4, 5, 12))
    k = jnp.asarray(rng.integers(-1, 14, size=(4, 5)), jnp.int32)
    batched = jax.jit(jax.vmap(topk_mask_reference))(scores, k)
    for b in range(4):
        np.testing.assert_array_equal(batched[b], brute_force(scores[b], k[b]))
    static_k = jax.vmap(lambda s: topk_mask_reference(s, 3))(scores)
    np.testing.assert_array_equal(static_k.sum(-1), np.full((4, 5), 3))
    tb = jnp.asarray(np.random.default_rng(4).integers(-2, 3, size=(4, 5, 12)), jnp.int32)
    batched = jax.jit(jax.vmap(topk_mask_reference))(scores, k, tb)
    for b in range(4):
        np.testing.assert_array_equal(batched[b], brute_force(scores[b], k[b], tb[b]))


def test_default_implementation_and_huge_k():
    scores = messy_scores(np.random.default_rng(4), (3, 10))
    np.testing.assert_array_equal(topk_mask(scores, 4), brute_force(scores, 4))
    assert bool(topk_mask(scores, 2**40, implementation="xla").all())


def test_empty_inputs():
    assert topk_mask_reference(jnp.zeros((0, 4)), 2).shape == (0, 4)
    assert pallas_interpret(jnp.zeros((2, 0)), 2).shape == (2, 0)
    assert pallas_interpret(jnp.zeros((2, 0)), 2, jnp.zeros((2, 0), jnp.int32)).shape == (2, 0)


@pytest.mark.parametrize(
    "scores,k,kwargs,match",
    [
        (jnp.zeros((4,)), 1, {}, "scores"),
        (jnp.zeros((2, 3, 4)), 1, {}, "scores"),
        (jnp.zeros((2, 4), jnp.int32), 1, {}, "scores"),
        (jnp.zeros((2, 4), jnp.float16), 1, {}, "scores"),
        (jnp.zeros((2, 4)), -1, {}, "k"),
        (jnp.zeros((2, 4)), jnp.ones((3,), jnp.int32), {}, "k"),
        (jnp.zeros((2, 4)), jnp.ones((2,), jnp.float32), {}, "k"),
        (jnp.zeros((2, 4)), 1.5, {}, "k"),
        (jnp.zeros((2, 4)), 1, {"implementation": "cuda"}, "implementation"),
        (jnp.zeros((2, 4)), 1, {"block_rows": 12}, "block_rows"),
        (jnp.zeros((2, 4)), 1, {"block_rows": 0}, "block_rows"),
        (jnp.zeros((2, 4)), 1, {"max_dropped": -1}, "max_dropped"),
        (jnp.zeros((2, 4)), 1, {"max_dropped": 1.5}, "max_dropped"),
        (jnp.zeros((2, 4)), 1, {"implementation": "pallas"}, "interpret=True"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((2, 4))}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": np.zeros((2, 4), np.int64)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((2, 4), jnp.uint32)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((2, 4), jnp.bool_)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((4, 2), jnp.int32)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((2, 4, 1), jnp.int32)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": jnp.zeros((4,), jnp.int32)}, "tiebreak"),
        (jnp.zeros((2, 4)), 1, {"tiebreak": [[0, 1, 2, 3], [0, 1, 2, 3]]}, "tiebreak"),
    ],
)
def test_validation(scores, k, kwargs, match):
    if jax.default_backend() != "cpu" and kwargs.get("implementation") == "pallas":
        pytest.skip("pallas without interpret is valid on accelerators")
    with pytest.raises(ValueError, match=match):
        topk_mask(scores, k, **kwargs)
    if set(kwargs) <= {"tiebreak"}:
        with pytest.raises(ValueError, match=match):
            topk_mask_reference(scores, k, **kwargs)


@pytest.mark.parametrize(
    "platform,backend,custom_call,disabled",
    [
        ("tpu", "tpu", "tpu_custom_call", []),
        # Triton IR has no stability guarantee, so export needs an explicit opt-in.
        ("cuda", "gpu", "__gpu$xla.gpu.triton",
         [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]),
    ],
)
@pytest.mark.parametrize("with_tiebreak", [False, True], ids=["no_tiebreak", "tiebreak"])
def test_export_lowers_for_accelerators(platform, backend, custom_call, disabled, with_tiebreak):
    fn = functools.partial(_topk_mask_pallas, interpret=False, block_rows=8, backend=backend)
    args = [jax.ShapeDtypeStruct((16, 1000), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32)]
    if with_tiebreak:
        args.append(jax.ShapeDtypeStruct((16, 1000), jnp.int32))
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(*args)
    assert exported.out_avals[0].shape == (16, 1000)
    assert exported.out_avals[0].dtype == jnp.bool_
    assert f"custom_call @{custom_call}" in exported.mlir_module()
