"""Per-row top-k selection masks.

``topk_mask(scores, k, tiebreak=None)`` returns a boolean mask of shape
``[R, N]`` that marks, in every row of a float32 ``[R, N]`` array, the ``k``
largest entries. Both implementations (a Pallas radix-select kernel and a plain
``jnp`` reference) follow the same total order and agree bit for bit:

* larger values rank higher; ``+inf`` is the largest value;
* ``NaN`` ranks lowest, below ``-inf``;
* ``-0.0`` and ``+0.0`` are equal (``-0.0`` is canonicalised to ``+0.0``);
  subnormals are distinct from zero (ranking works on the bit patterns, so no
  backend's flush-to-zero can change the result);
* equal values (including NaN against NaN) are ordered by the optional int32
  ``[R, N]`` ``tiebreak``: the higher tiebreak is kept first;
* entries equal in both (or equal values without a tiebreak) are ordered by
  index: the lower index is kept first.

``k`` is either a Python int shared by all rows or an integer array ``[R]``
(possibly traced) with one value per row. Per row it is clipped to ``[0, N]``:
``k <= 0`` keeps nothing and ``k >= N`` keeps everything.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

__all__ = ["topk_mask", "topk_mask_reference"]

_INT32_MIN = -(2**31)
_IMPLEMENTATIONS = ("pallas", "xla", None)
# Counts are accumulated in float32 (float row sums lower everywhere), which is
# exact only below 2**24.
_MAX_PALLAS_COLUMNS = 2**24


def _sortable_keys(x):
    """Maps float32 values to int32 keys whose signed order is the rank order.

    Args:
      x: float32 array of any shape.

    Returns:
      int32 array of the same shape. ``-0.0`` maps to the key of ``+0.0`` and
      every NaN maps to ``INT32_MIN``, below the key of ``-inf``.
    """
    # Pure integer work on the bit pattern: float compares would flush
    # subnormals to zero on some backends and tie them with 0.0.
    bits = lax.bitcast_convert_type(x, jnp.int32)
    magnitude = bits & jnp.int32(0x7FFFFFFF)
    # Sign-magnitude to two's complement; -0.0 lands on the key of +0.0.
    keys = jnp.where(bits < 0, -magnitude, bits)
    is_nan = magnitude > jnp.int32(0x7F800000)
    return jnp.where(is_nan, jnp.int32(_INT32_MIN), keys)


def _validate(scores, k, tiebreak):
    """Checks the arguments; returns ``(scores, k, tiebreak)`` with k as int32
    ``[R]`` and tiebreak as an int32 ``[R, N]`` array or None."""
    scores = jnp.asarray(scores)
    if scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(
            "scores must be a float32 array of shape [R, N], got "
            f"{scores.dtype} array of shape {tuple(scores.shape)}"
        )
    rows, cols = scores.shape
    if tiebreak is not None:
        if (
            not hasattr(tiebreak, "dtype")
            or not hasattr(tiebreak, "shape")
            or tiebreak.dtype != jnp.int32
            or tuple(tiebreak.shape) != (rows, cols)
        ):
            got = (
                f"{tiebreak.dtype} array of shape {tuple(tiebreak.shape)}"
                if hasattr(tiebreak, "dtype") and hasattr(tiebreak, "shape")
                else repr(tiebreak)
            )
            raise ValueError(
                f"tiebreak must be None or an int32 array of shape [{rows}, {cols}] "
                f"(the shape of scores), got {got}"
            )
        tiebreak = jnp.asarray(tiebreak)
    if isinstance(k, numbers.Integral) and not isinstance(k, bool):
        if k < 0:
            raise ValueError(f"k must be a non-negative int, got {k}")
        # Clip before converting so huge Python ints cannot overflow int32.
        return scores, jnp.full((rows,), min(int(k), cols), jnp.int32), tiebreak
    if not hasattr(k, "dtype") or not hasattr(k, "shape"):
        raise ValueError(
            f"k must be a Python int or an integer array of shape [R], got {k!r}"
        )
    if not jnp.issubdtype(k.dtype, jnp.integer) or tuple(k.shape) != (rows,):
        raise ValueError(
            f"k must be a Python int or an integer array of shape [{rows}], got "
            f"{k.dtype} array of shape {tuple(k.shape)}"
        )
    return scores, jnp.clip(jnp.asarray(k), 0, cols).astype(jnp.int32), tiebreak


def _reference(scores, k, tiebreak):
    """Sort-based top-k. scores: float32 [R, N]; k: int32 [R] in [0, N];
    tiebreak: int32 [R, N] or None."""
    rows, cols = scores.shape
    if tiebreak is None:
        tiebreak = jnp.zeros((rows, cols), jnp.int32)
    col = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    # Ascending sort on (~key, ~tiebreak, index): ~ reverses the int32 order
    # without overflow, so this is score key descending, then tiebreak
    # descending, then index ascending. The index key makes the order total.
    _, _, order = lax.sort(
        (~_sortable_keys(scores), ~tiebreak, col), dimension=1, num_keys=3
    )
    keep_sorted = col < k.reshape(rows, 1)  # col doubles as the rank in the order
    row_ids = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    return jnp.zeros((rows, cols), jnp.bool_).at[row_ids, order].set(keep_sorted)


_INT32_MAX = 2**31 - 1


def _reference_few_dropped(scores, k, tiebreak, max_dropped):
    """The mask of :func:`_reference` when each row leaves out at most ``max_dropped``
    entries (``k >= N - max_dropped``), found with a ``lax.top_k`` of that size.

    On CPU sorting ``[R, N]`` on three keys costs about 40x a small ``lax.top_k``
    (measured by ``python -m bench.kernel``), and eviction on schedule leaves out only
    the ``evict_every`` newest arrivals' worth of items. Rows that break the promise
    fall back to the sort, so the result is always exact.
    """
    rows, cols = scores.shape
    m = min(max_dropped, cols)
    drop = cols - k  # [R]: entries each row leaves out, in [0, m] on the fast path
    # Counted in float32 below 2**24 entries, as flsmem.state.count does (why: there).
    count_dtype = jnp.float32 if cols < 2**24 else jnp.int32

    def count(mask):
        return jnp.sum(mask, axis=1, dtype=count_dtype).astype(jnp.int32)

    def few(_):
        # lax.top_k compares floats. NaN goes to -inf, and a float compare may tie
        # entries the exact order separates (-0.0 and +0.0, subnormals flushed to zero),
        # but never reverses two of them: entries strictly below the drop-th lowest are
        # left out, and the ones tied with it are settled on the exact keys below.
        proxy = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
        # XLA's CPU top_k sorts part of every row: for one entry a min reduction is
        # about 13x faster (90 rows of 4,097: 78 us against 1,008 us).
        lowest = jnp.min(proxy, axis=1, keepdims=True) if m == 1 else -lax.top_k(-proxy, m)[0]  # [R, m], ascending
        thresh = jnp.take_along_axis(lowest, jnp.clip(drop - 1, 0, m - 1)[:, None], axis=1)
        some = (drop > 0)[:, None]
        dropped = some & (proxy <= thresh)

        def settle(_):
            # Leave out, one at a time, the lowest tied entry in the exact order: score
            # key, then tiebreak, then the higher index.
            key = _sortable_keys(scores)
            tb = jnp.zeros((rows, cols), jnp.int32) if tiebreak is None else tiebreak
            col = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
            below = some & (proxy < thresh)
            need = drop - count(below)  # from the tied, in [1, m]

            def one(i, carry):
                out, left = carry
                lowest_key = jnp.min(jnp.where(left, key, _INT32_MAX), axis=1, keepdims=True)
                cand = left & (key == lowest_key)
                lowest_tb = jnp.min(jnp.where(cand, tb, _INT32_MAX), axis=1, keepdims=True)
                cand = cand & (tb == lowest_tb)
                last = jnp.max(jnp.where(cand, col, -1), axis=1, keepdims=True)
                take = (col == last) & (i < need)[:, None]
                return out | take, left & ~take

            return lax.fori_loop(0, m, one, (below, some & (proxy == thresh)))[0]

        # Scores rarely tie exactly at the threshold: then the entries at or below it
        # are exactly the ones to leave out.
        whole = jnp.all(count(dropped) == drop)
        return ~lax.cond(whole, lambda _: dropped, settle, None)

    if m == 0:
        return lax.cond(jnp.all(drop == 0), lambda _: jnp.ones((rows, cols), jnp.bool_),
                        lambda _: _reference(scores, k, tiebreak), None)
    return lax.cond(jnp.all(drop <= m), few, lambda _: _reference(scores, k, tiebreak), None)


def topk_mask_reference(scores, k, tiebreak=None):
    """Plain ``jnp`` top-k mask (a sort on score, tiebreak and index). jit- and
    vmap-able.

    Args:
      scores: float32 ``[R, N]``.
      k: Python int >= 0, or integer array ``[R]`` (clipped to ``[0, N]``).
      tiebreak: None, or int32 ``[R, N]``: among equal scores the higher
        tiebreak is kept first (then the lower index).

    Returns:
      bool ``[R, N]``; row ``r`` has exactly ``clip(k[r], 0, N)`` True entries.

    Raises:
      ValueError: on a malformed ``scores``, ``k`` or ``tiebreak``.
    """
    scores, k, tiebreak = _validate(scores, k, tiebreak)
    return _reference(scores, k, tiebreak)


def _radix_select_kernel(scores_ref, k_ref, *refs, num_cols):
    """Marks the k largest entries of each row of one ``[B, Np]`` block.

    ``refs`` is ``(tiebreak_ref, out_ref)`` with an int32 ``[B, Np]`` tiebreak
    block, or ``(out_ref,)`` without a tiebreak.
    Only elementwise ops, last-axis sums and fixed-trip loops are used so the
    body lowers on both Mosaic (TPU) and Triton (GPU).
    """
    *tiebreak_ref, out_ref = refs
    shape = scores_ref.shape
    index_bits = shape[1].bit_length() - 1  # shape[1] is a power of two.
    col = lax.broadcasted_iota(jnp.int32, shape, 1)
    valid = col < num_cols  # Padding columns must never be selected.
    k = k_ref[...].astype(jnp.float32)  # [B, 1]

    def count(pred):
        return jnp.sum(jnp.where(pred, 1.0, 0.0), axis=1, keepdims=True)

    def split(keys, among, need):
        """Splits the ``need`` largest ``among`` entries by int32 ``keys``.

        Returns ``(above, tied, still_need)``: the ``need`` largest are all of
        ``above`` and ``still_need`` (>= 1 when need >= 1) of ``tied``. Finds
        the largest threshold T with count(among & keys >= T) >= need, in
        the unsigned order of keys ^ INT32_MIN, built from the top bit down.
        Working on the signed candidate directly: setting bit b of the unsigned
        value is XOR-ing bit b of the signed one, and the signed comparison
        then matches the unsigned. need == 0 gives T = INT32_MAX: nothing above.
        """

        def step(i, thresh):
            trial = thresh ^ lax.shift_left(jnp.int32(1), 31 - i)
            keep = count(among & (keys >= trial)) >= need
            return jnp.where(keep, trial, thresh)

        thresh = lax.fori_loop(
            0, 32, step, jnp.full((shape[0], 1), _INT32_MIN, jnp.int32)
        )
        above = among & (keys > thresh)
        tied = among & (keys == thresh)
        return above, tied, need - count(above)

    above, tied, need = split(_sortable_keys(scores_ref[...]), valid, k)
    if tiebreak_ref:
        # Among the entries tied on the score, the higher tiebreak first.
        above_tb, tied, need = split(tiebreak_ref[0][...], tied, need)
        above = above | above_tb

    # Largest index J with count(tied & col < J) < need: the position of the
    # need-th tied entry, so lower indices win the remaining ties.
    def index_step(i, last):
        trial = last | lax.shift_left(jnp.int32(1), index_bits - 1 - i)
        keep = count(tied & (col < trial)) < need
        return jnp.where(keep, trial, last)

    last = lax.fori_loop(
        0, index_bits, index_step, jnp.zeros((shape[0], 1), jnp.int32)
    )
    selected = above | (tied & (col <= last) & (need > 0.0))
    out_ref[...] = selected.astype(jnp.int32)


def _topk_mask_pallas(scores, k, tiebreak=None, *, interpret, block_rows, backend):
    """Radix-select top-k mask with Pallas.

    Args:
      scores: float32 ``[R, N]``.
      k: int32 ``[R]``, already clipped to ``[0, N]``.
      tiebreak: int32 ``[R, N]`` or None.
      interpret: run the kernel in the Pallas interpreter (any backend).
      block_rows: rows per grid step, a positive multiple of 8.
      backend: ``"tpu"`` (Mosaic) or ``"gpu"`` (Triton); selects the compiler
        params. Ignored when ``interpret`` is true.

    Returns:
      bool ``[R, N]``.
    """
    rows, cols = scores.shape
    if rows == 0 or cols == 0:
        return jnp.zeros((rows, cols), jnp.bool_)
    if cols >= _MAX_PALLAS_COLUMNS:
        raise ValueError(f"scores must have fewer than 2**24 columns, got {cols}")
    # Triton needs power-of-two blocks; Mosaic needs lanes in multiples of 128.
    padded_cols = max(128, 1 << (cols - 1).bit_length())
    padded_rows = -(-rows // block_rows) * block_rows
    pad = ((0, padded_rows - rows), (0, padded_cols - cols))
    block = pl.BlockSpec((block_rows, padded_cols), lambda i: (i, 0))
    inputs = [
        jnp.pad(scores, pad),
        jnp.pad(k.astype(jnp.int32), (0, padded_rows - rows)).reshape(padded_rows, 1),
    ]
    in_specs = [block, pl.BlockSpec((block_rows, 1), lambda i: (i, 0))]
    if tiebreak is not None:
        inputs.append(jnp.pad(tiebreak, pad, constant_values=_INT32_MIN))
        in_specs.append(block)
    if interpret:
        compiler_params = None
    elif backend == "tpu":
        compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    elif backend == "gpu":
        compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=1)
    else:
        raise ValueError(f"backend must be 'tpu' or 'gpu', got {backend!r}")
    out = pl.pallas_call(
        functools.partial(_radix_select_kernel, num_cols=cols),
        out_shape=jax.ShapeDtypeStruct((padded_rows, padded_cols), jnp.int32),
        grid=(padded_rows // block_rows,),
        in_specs=in_specs,
        out_specs=block,
        interpret=interpret,
        compiler_params=compiler_params,
        name="topk_radix_select",
    )(*inputs)
    return out[:rows, :cols] != 0


@functools.partial(
    jax.jit,
    static_argnames=("implementation", "interpret", "block_rows", "backend", "max_dropped"),
)
def _topk_mask_jit(
    scores, k, tiebreak, *, implementation, interpret, block_rows, backend, max_dropped
):
    if implementation == "xla":
        if max_dropped is not None and max_dropped < scores.shape[1]:
            return _reference_few_dropped(scores, k, tiebreak, max_dropped)
        return _reference(scores, k, tiebreak)
    return _topk_mask_pallas(
        scores, k, tiebreak, interpret=interpret, block_rows=block_rows, backend=backend
    )


def topk_mask(
    scores,
    k,
    *,
    tiebreak=None,
    implementation=None,
    interpret=False,
    block_rows=8,
    max_dropped=None,
):
    """Boolean mask of the k largest entries per row (see module docstring).

    Args:
      scores: float32 ``[R, N]``.
      k: Python int >= 0 shared by all rows, or integer array ``[R]`` (may be
        traced); clipped per row to ``[0, N]``.
      tiebreak: None, or int32 ``[R, N]`` (may be traced): among equal scores
        the higher tiebreak is kept first; what is still tied goes to the lower
        index.
      implementation: ``"pallas"`` (radix-select kernel), ``"xla"`` (the
        ``jnp`` reference) or None: ``"xla"`` on CPU, ``"pallas"`` on TPU/GPU.
      interpret: run the Pallas kernel in interpret mode; required for
        ``"pallas"`` on CPU. Ignored by ``"xla"``.
      block_rows: rows per Pallas grid step, a positive multiple of 8 (and a
        power of two on GPU).
      max_dropped: None, or a Python int >= 0: the caller expects every row to
        leave out at most this many entries (``k >= N - max_dropped``). Then
        ``"xla"`` finds them with a ``lax.top_k`` of that size instead of a sort
        of the rows (on CPU much faster); a row that leaves out more falls back
        to the sort, so the mask is the same either way. The Pallas kernel
        ignores it.

    Returns:
      bool ``[R, N]``; row ``r`` has exactly ``clip(k[r], 0, N)`` True entries.

    Raises:
      ValueError: on malformed arguments, or ``"pallas"`` on CPU without
        ``interpret=True``.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}"
        )
    if (
        not isinstance(block_rows, numbers.Integral)
        or isinstance(block_rows, bool)
        or block_rows <= 0
        or block_rows % 8
    ):
        raise ValueError(f"block_rows must be a positive multiple of 8, got {block_rows!r}")
    if max_dropped is not None and (
        not isinstance(max_dropped, numbers.Integral)
        or isinstance(max_dropped, bool)
        or max_dropped < 0
    ):
        raise ValueError(f"max_dropped must be None or an int >= 0, got {max_dropped!r}")
    scores, k, tiebreak = _validate(scores, k, tiebreak)
    backend = jax.default_backend()
    if implementation is None:
        implementation = "pallas" if backend in ("tpu", "gpu") else "xla"
    if implementation == "pallas" and not interpret:
        if backend not in ("tpu", "gpu"):
            raise ValueError(
                f"implementation='pallas' cannot be compiled on backend {backend!r}; "
                "pass interpret=True to run the kernel in the Pallas interpreter"
            )
        if backend == "gpu" and block_rows & (block_rows - 1):
            raise ValueError(
                f"block_rows must be a power of two on GPU (Triton), got {block_rows}"
            )
    return _topk_mask_jit(
        scores,
        k,
        tiebreak,
        implementation=implementation,
        interpret=bool(interpret),
        block_rows=int(block_rows),
        backend=None if interpret else backend,
        max_dropped=None if max_dropped is None else int(max_dropped),
    )
