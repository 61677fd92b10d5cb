"""Trace-time argument checks: wrong shapes and dtypes fail before any work, with a
message that names the argument and what was expected."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_state", "write_args", "observe_args"]


def _fail(message: str):
    raise ValueError(message)


def check_state(state) -> None:
    """The state is a :class:`~flsmem.MemoryState` whose arrays agree with each other and
    with its config (a state edited by hand, restored from elsewhere or taken apart by
    a transformation fails here, not deep inside a policy). The payload may be None:
    per-query loops carry the state without it."""
    from flsmem.state import MemoryState

    if not isinstance(state, MemoryState):
        _fail(f"state must be a flsmem.MemoryState (from flsmem.init), got {type(state).__name__}")
    valid = state.valid
    if np.ndim(valid) != 3 or jnp.result_type(valid) != jnp.bool_:
        _fail(f"state.valid must be a bool array [B, K, S], got {jnp.result_type(valid)}{list(_shape(valid))} "
              "(a memory stacked over layers must be mapped over, e.g. with jax.vmap or lax.map)")
    rows = _shape(valid)
    capacity = state.config.capacity
    if rows[2] != capacity:
        _fail(f"state has {rows[2]} slots per row but its config's capacity is {capacity} "
              "(budget + evict_every + max_chunk - 1); build the state with flsmem.init(config, ...)")
    num_evidence = state.config.policy.num_evidence
    fields = (
        ("position", state.position, rows, jnp.int32),
        ("birth", state.birth, rows, jnp.int32),
        ("score", state.score, rows, jnp.float32),
        ("evidence", state.evidence, rows + (num_evidence,), jnp.float32),
        ("step", state.step, rows[:1], jnp.int32),
    )
    for name, value, shape, dtype in fields:
        if _shape(value) != shape or jnp.result_type(value) != dtype:
            _fail(f"state.{name} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                  f"{jnp.result_type(value)}{list(_shape(value))}")
    for field in dataclasses.fields(state.stats):
        value = getattr(state.stats, field.name)
        per_head = field.name in state.stats.PER_HEAD
        shape, dims = (rows[:2], "[B, K]") if per_head else (rows[:1], "[B]")
        if _shape(value) != shape:
            _fail(f"state.stats.{field.name} must have shape {dims} = {list(shape)}, got {list(_shape(value))}")
    if state.payload is not None:
        for path, value in jax.tree_util.tree_flatten_with_path(state.payload)[0]:
            if _shape(value)[:3] != rows:
                _fail(f"state.payload{jax.tree_util.keystr(path)} must be [B, K, S, ...] with [B, K, S] = "
                      f"{list(rows)}, got {list(_shape(value))}")


def _shape(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def write_args(state, payload, position, mask):
    """Normalise ``write``'s arguments to a chunk: payload leaves ``[B, K, Q, ...]``,
    position ``[B, Q]`` int32, mask ``[B, Q]`` bool; returns them and Q."""
    check_state(state)
    b, k, s = state.valid.shape
    if jax.tree.structure(payload) != jax.tree.structure(state.payload):
        _fail(
            f"payload must have the memory's structure {jax.tree.structure(state.payload)}, "
            f"got {jax.tree.structure(payload)}"
        )
    single = None
    q = 1
    for new, old in zip(jax.tree.leaves(payload), jax.tree.leaves(state.payload)):
        item = old.shape[3:]
        shape = _shape(new)
        if shape == (b, k) + item:
            is_single = True
        elif len(shape) == 3 + len(item) and shape[:2] == (b, k) and shape[3:] == item:
            is_single, q = False, shape[2]
        else:
            _fail(
                f"payload leaves must be [B, K, ...item] = {(b, k) + item} or "
                f"[B, K, Q, ...item] = {(b, k, 'Q') + item}, got {shape}"
            )
        if single is not None and single != is_single:
            _fail("payload leaves must all be single items or all be chunks of Q items")
        single = is_single
        if _is_float(old) != _is_float(new) or _is_int(old) != _is_int(new):
            _fail(f"payload leaf dtype must be like the memory's {old.dtype}, got {jnp.result_type(new)}")
    if not single and (q < 1 or q > state.config.max_chunk):
        _fail(f"payload chunk length Q must be in [1, max_chunk={state.config.max_chunk}], got {q}")
    expected = (b,) if single else (b, q)
    if _shape(position) != expected or not _is_int(position):
        _fail(f"position must be an int array of shape {expected}, got "
              f"{jnp.result_type(position)}{list(_shape(position))}")
    if mask is None:
        mask = jnp.ones(expected, jnp.bool_)
    elif _shape(mask) != expected or jnp.result_type(mask) != jnp.bool_:
        _fail(f"mask must be a bool array of shape {expected}, got "
              f"{jnp.result_type(mask)}{list(_shape(mask))}")
    if single:
        payload = jax.tree.map(lambda x: jnp.expand_dims(x, 2), payload)
        position, mask = position[:, None], mask[:, None]
    payload = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), payload, state.payload)
    return payload, jnp.asarray(position, jnp.int32), jnp.asarray(mask), q


def observe_args(state, attention, correctness, future):
    """Normalise ``observe``'s arguments to a chunk: attention ``[B, K, Q, S]``,
    correctness ``[B, Q]``, future ``[B, K, Q, S]`` or None; returns them and Q."""
    check_state(state)
    b, k, s = state.valid.shape
    shape = _shape(attention)
    if shape == (b, k, s):
        single, q = True, 1
    elif len(shape) == 4 and shape[:2] == (b, k) and shape[3] == s:
        single, q = False, shape[2]
    else:
        _fail(f"attention must be [B, K, S] = {[b, k, s]} or [B, K, Q, S] = {[b, k, 'Q', s]}, "
              f"got {list(shape)}")
    if not _is_float(attention):
        _fail(f"attention must be a float array, got {jnp.result_type(attention)}")
    expected = (b,) if single else (b, q)
    if correctness is None:
        correctness = jnp.ones(expected, jnp.float32)
    elif _shape(correctness) != expected or not _is_float(correctness):
        _fail(f"correctness must be a float array of shape {list(expected)} with values in "
              f"[0, 1], got {jnp.result_type(correctness)}{list(_shape(correctness))}")
    policy = state.config.policy
    if policy.needs_future:
        if future is None:
            _fail(f"future is required by the {policy.name} policy: the future utility of "
                  f"each slot, shaped like attention {list(shape)}")
        if _shape(future) != shape or not _is_float(future):
            _fail(f"future must be a float array shaped like attention {list(shape)}, got "
                  f"{jnp.result_type(future)}{list(_shape(future))}")
    else:
        future = None
    attention = jnp.asarray(attention, jnp.float32)
    correctness = jnp.asarray(correctness, jnp.float32)
    if single:
        attention, correctness = attention[:, :, None], correctness[:, None]
        if future is not None:
            future = future[:, :, None]
    if future is not None:
        future = jnp.asarray(future, jnp.float32)
    return attention, correctness, future, q
