"""Optional runtime checks of values, with ``jax.experimental.checkify``.

Shapes and dtypes are checked while tracing (:mod:`flsmem.validate`); values can only be
checked while running. The library itself never stops on a bad value: NaN or Inf
attention or correctness is taken as no evidence and counted in ``stats``, since a
serving loop must go on. When debugging a model, or in tests, a bad value usually
means a bug upstream (a wrong attention mask, a correctness weight outside [0, 1]), and
one wants to hear about it at the step it happened. The functions here do the same
work as :func:`flsmem.write`, :func:`flsmem.observe` and :func:`flsmem.update` and also
check the inputs and the state's invariants; they return a checkify ``Error`` beside
the new state, work under ``jax.jit``, ``vmap`` and ``lax.scan``, and cost a few
reductions per call::

    err, state = jax.jit(flsmem.checks.update)(state, attention, correctness)
    err.throw()  # raises checkify.JaxRuntimeError naming the first failed check

Inside a loop of your own, call :func:`input_checks` and :func:`state_checks` and
wrap the whole loop once: ``checkify.checkify(loop)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from flsmem.observe import observe as _observe
from flsmem.observe import observe_args
from flsmem.state import MemoryState, check_state, visible
from flsmem.typing import Array, Bool, Float, Int, PyTree
from flsmem.update import update as _update
from flsmem.write import _write_args
from flsmem.write import write as _write

__all__ = ["input_checks", "write_checks", "state_checks", "write", "observe", "update"]


def _check_rows(ok_per_row: Bool[Array, "B"], message: str) -> None:
    """One check over the batch: fails naming the first batch row that broke it."""
    checkify.check(jnp.all(ok_per_row), "flsmem: " + message + " (first in batch row {row})",
                   row=jnp.argmin(ok_per_row))


def _rows(x: Array) -> Bool[Array, "B"]:
    return jnp.all(jnp.reshape(x, (x.shape[0], -1)), axis=1)


def input_checks(
    state: MemoryState,
    attention: Float[Array, "B K S"] | Float[Array, "B K Q S"],
    correctness: Float[Array, "B"] | Float[Array, "B Q"] | None = None,
    future: Float[Array, "B K S"] | Float[Array, "B K Q S"] | None = None,
) -> None:
    """Checks (``checkify.check``) of ``observe``/``update``'s inputs:

    * attention is finite and >= 0 on the slots each query can see;
    * attention is 0 on the slots it cannot see (free slots, and items written for a
      later query of the chunk): otherwise the model's attention mask and
      :func:`flsmem.visible` disagree, and the model read what the memory does not hold;
    * correctness is finite and in [0, 1];
    * future, when the policy uses it, is finite and >= 0.
    """
    attention, correctness, future, q = observe_args(state, attention, correctness, future)
    seen = visible(state, q)  # [B, K, Q, S]
    finite = jnp.isfinite(attention)
    _check_rows(_rows(finite | ~seen), "attention is NaN or Inf on a slot the query can see")
    _check_rows(_rows((attention >= 0) | ~seen | ~finite), "attention is negative")
    _check_rows(_rows((attention == 0) | seen),
                "attention is not 0 on a slot the query cannot see (free, or not yet arrived): "
                "the attention mask disagrees with flsmem.visible")
    _check_rows(_rows(jnp.isfinite(correctness)), "correctness is NaN or Inf")
    _check_rows(_rows((correctness >= 0) & (correctness <= 1) | ~jnp.isfinite(correctness)),
                "correctness is outside [0, 1]")
    if future is not None:
        _check_rows(_rows(jnp.isfinite(future) & (future >= 0) | ~seen),
                    "future is NaN, Inf or negative on a slot the query can see")


def write_checks(
    state: MemoryState,
    payload: PyTree,
    position: Int[Array, "B"] | Int[Array, "B Q"],
    mask: Bool[Array, "B"] | Bool[Array, "B Q"] | None = None,
) -> None:
    """Checks of ``write``'s inputs, on the items the mask lets through: positions are
    >= 0, differ within the chunk and from the positions the row holds (an item is
    written once), and float payloads are finite."""
    payload, position, mask, _ = _write_args(state, payload, position, mask)
    _check_rows(_rows((position >= 0) | ~mask), "a written position is negative")
    same = (position[:, :, None] == position[:, None, :]) & mask[:, :, None] & mask[:, None, :]
    q = position.shape[1]
    _check_rows(_rows(~same | jnp.eye(q, dtype=jnp.bool_)[None]), "a chunk writes the same position twice")
    # [B, K, Q, S]: heads evict on their own, so each head's slots are compared.
    held = (state.position[:, :, None, :] == position[:, None, :, None]) & state.valid[:, :, None, :]
    _check_rows(_rows(~held | ~mask[:, None, :, None]), "a written position is already held by the row")
    for leaf in jax.tree.leaves(payload):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            finite = jnp.all(jnp.isfinite(leaf), axis=tuple(range(3, leaf.ndim)))  # [B, K, Q]
            _check_rows(_rows(finite | ~mask[:, None, :]), "a written payload has NaN or Inf")


def state_checks(state: MemoryState, *, after_update: bool = False) -> None:
    """Checks of the state's invariants:

    * a slot is free exactly when its position is -1, and held positions are >= 0;
    * births are >= 0 and before the end of the chunk written last
      (``step + max_chunk``); steps are >= 0;
    * present slots have finite scores and valid slots finite evidence;
    * the counters in ``stats`` are >= 0;
    * with ``after_update``, for a policy that evicts: every row holds fewer present
      items than its high-water mark, ``budget + evict_every`` (eviction ran when due);
      with head-adaptive budgets, each head fewer than its largest share plus
      ``evict_every`` and each sequence's K heads fewer than ``K`` high-water marks.
    """
    check_state(state)
    config = state.config
    step = state.step[:, None, None]
    present = state.valid & (state.birth < step)
    _check_rows(_rows(jnp.where(state.valid, state.position >= 0, state.position == -1)),
                "a slot's position and valid flag disagree (free slots hold -1, held ones >= 0)")
    _check_rows(_rows(~state.valid | (state.birth >= 0) & (state.birth < step + config.max_chunk)),
                "a slot's birth lies outside [0, step + max_chunk)")
    _check_rows(state.step >= 0, "step is negative")
    _check_rows(_rows(~present | jnp.isfinite(state.score)), "a present slot's score is NaN or Inf")
    for array in state.evidence:
        finite = jnp.all(jnp.isfinite(array), axis=tuple(range(3, array.ndim)))
        _check_rows(_rows(~state.valid | finite), "a held slot's evidence is NaN or Inf")
    for field in dataclasses.fields(state.stats):
        _check_rows(_rows(getattr(state.stats, field.name) >= 0), f"stats.{field.name} is negative")
    if after_update and config.policy.evicts:
        n_present = jnp.sum(present, axis=-1)
        # A head with an adaptive budget may keep up to its share (see MemoryConfig).
        bound = config.head_share + config.evict_every
        _check_rows(_rows(n_present < bound),
                    f"a row holds its largest share + evict_every = {bound} present items after update")
        if config.policy.head_budget is not None:
            heads = n_present.shape[-1]
            _check_rows(jnp.sum(n_present, axis=-1) < heads * config.high_water,
                        f"a sequence's {heads} heads hold K * (budget + evict_every) = "
                        f"{heads * config.high_water} present items after update")


def _checked_write(state, payload, position, mask=None):
    write_checks(state, payload, position, mask)
    state = _write(state, payload, position, mask)
    state_checks(state)
    return state


def _checked_observe(state, attention, correctness=None, future=None):
    input_checks(state, attention, correctness, future)
    state = _observe(state, attention, correctness, future)
    state_checks(state)
    return state


def _checked_update(state, attention, correctness=None, future=None):
    input_checks(state, attention, correctness, future)
    state = _update(state, attention, correctness, future)
    state_checks(state, after_update=True)
    return state


write = checkify.checkify(_checked_write)
write.__doc__ = """:func:`flsmem.write` with :func:`write_checks` and :func:`state_checks`:
``(error, state)``."""
observe = checkify.checkify(_checked_observe)
observe.__doc__ = """:func:`flsmem.observe` with :func:`input_checks` and :func:`state_checks`:
``(error, state)``."""
update = checkify.checkify(_checked_update)
update.__doc__ = """:func:`flsmem.update` with :func:`input_checks` and
:func:`state_checks` (high-water mark included): ``(error, state)``."""
