"""Place a memory on a device mesh: shard it over batch rows and KV heads.

Every memory operation treats each (batch row, KV head) pair on its own, so the
natural layout splits ``B`` over one mesh axis and ``K`` over another and keeps the
slots ``S`` (which eviction ranks) whole on each device. Two ways to run sharded:

* **jit with shardings** (the default): put the state on the mesh with :func:`shard`
  (and the inputs with :func:`row_sharding`), then call the usual jitted functions;
  XLA partitions them (GSPMD) with the program's global meaning, so every policy
  computes what it computes on one device, bit for bit. Per-row work needs no
  communication; the only cross-device steps are the "is any row due" flags of
  ``write`` and ``evict`` and, for the ``learned`` policy, its training step: once
  per horizon the snapshot's features are gathered to every device, which each run
  the gradient over all rows as one device would (a float sum split over devices
  would round differently). Head-adaptive budgets (``adakv``) rank a sequence's KV
  heads together, so with heads split over devices each eviction gathers them. No float is summed across devices otherwise: the
  state's float counters are kept per (row, head). Inside a ``lax.scan`` of your
  own, :func:`constrain` keeps the carried state in place.

  One caveat is XLA's, not the memory's: a dot product may round differently for
  blocks of another shape. On the CPU backend the ``learned`` policy's scores match
  one device's bit for bit when each device holds a multiple of 8 slots
  (``B * K * S`` over the number of devices); otherwise the rows of its last,
  partial SIMD block of the network's output layer may differ in the last bit.
* **shard_map** (:func:`shard_map_update`): each device runs ``flsmem.update`` on its
  own block of batch rows. Needed where XLA cannot partition an operation, such as the
  Pallas top-k (``implementation="pallas"``) on GPU or TPU. Only for policies whose
  rows never interact: ``learned`` pools its training over rows and ``random`` hashes
  the row index, so both are refused there.

Mesh axes are named by ``batch_axis`` and ``head_axis``; either may be None (not
sharded), ``B`` and ``K`` must divide evenly by the axes' sizes, and the axes must be
of the Auto kind (:func:`make_mesh` builds one).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flsmem.state import MemoryState, aux_axes, check_state
from flsmem.update import update as _update

__all__ = ["make_mesh", "partition_specs", "shardings", "shard", "constrain", "row_sharding", "shard_map_update"]

# Policies whose rows interact (see the module docstring): shard_map would change them.
_NOT_ROW_LOCAL = {
    "learned": "it trains one network on the slots of every row",
    "random": "its scores hash the global row index",
}


def partition_specs(state: MemoryState, batch_axis: str | None = "batch", head_axis: str | None = "heads") -> MemoryState:
    """A pytree shaped like ``state`` whose leaves are the ``PartitionSpec`` of each
    array: ``[B, K, S, ...]`` and ``[B, K]`` arrays split over (``batch_axis``,
    ``head_axis``), ``[B]`` arrays (step, the counts in stats) over ``batch_axis``, the
    policy's per-row state likewise and its shared state (the learned estimator's
    parameters) replicated."""
    check_state(state)
    rows = PartitionSpec(batch_axis, head_axis)
    batch = PartitionSpec(batch_axis)
    return state.replace(
        payload=jax.tree.map(lambda _: rows, state.payload),
        position=rows, valid=rows, birth=rows, score=rows,
        evidence=tuple(rows for _ in state.evidence),
        step=batch,
        aux=aux_axes(state, batch_axis, head_axis),
        stats=state.stats.replace(**{
            field.name: rows if field.name in state.stats.PER_HEAD else batch
            for field in dataclasses.fields(state.stats)
        }),
    )


def make_mesh(batch: int, heads: int = 1, devices=None) -> Mesh:
    """A ``batch x heads`` mesh with axes named "batch" and "heads", of the Auto kind
    (XLA places what the program does not pin; see :func:`_check_mesh`)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((batch, heads), ("batch", "heads"), axis_types=auto, devices=devices)


def _check_mesh(state: MemoryState, mesh: Mesh, batch_axis, head_axis) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    for axis, kind in zip(mesh.axis_names, mesh.axis_types):
        # Explicit axes put shardings in the types, and then every scatter of the memory
        # would have to name its output sharding.
        if axis in (batch_axis, head_axis) and kind != jax.sharding.AxisType.Auto:
            raise ValueError(f"mesh axis {axis!r} is {kind}; flsmem needs Auto axes: build the mesh with "
                             "flsmem.sharding.make_mesh or jax.make_mesh(..., axis_types=(AxisType.Auto, ...))")
    b, k, _ = state.valid.shape
    for name, axis, size in (("batch_axis", batch_axis, b), ("head_axis", head_axis, k)):
        if axis is None:
            continue
        if axis not in mesh.shape:
            raise ValueError(f"{name} {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
        if size % mesh.shape[axis]:
            what = "batch B" if name == "batch_axis" else "KV heads K"
            raise ValueError(f"{what} = {size} must divide evenly over mesh axis {axis!r} of size {mesh.shape[axis]}")


def shardings(state: MemoryState, mesh: Mesh, batch_axis: str | None = "batch",
              head_axis: str | None = "heads") -> MemoryState:
    """:func:`partition_specs` as ``NamedSharding`` on ``mesh`` (for ``jax.device_put``,
    ``jax.jit(out_shardings=...)`` or :func:`flsmem.checkpoint.restore_state`'s ``like``)."""
    _check_mesh(state, mesh, batch_axis, head_axis)
    specs = partition_specs(state, batch_axis, head_axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard(state: MemoryState, mesh: Mesh, batch_axis: str | None = "batch",
          head_axis: str | None = "heads") -> MemoryState:
    """``state`` placed on ``mesh``, split over batch rows and KV heads."""
    return jax.device_put(state, shardings(state, mesh, batch_axis, head_axis))


def constrain(state: MemoryState, mesh: Mesh, batch_axis: str | None = "batch",
              head_axis: str | None = "heads") -> MemoryState:
    """Inside ``jit``: ask XLA to keep ``state`` split over batch rows and KV heads
    (``with_sharding_constraint``), for example on the carry of a decode scan."""
    return jax.lax.with_sharding_constraint(state, shardings(state, mesh, batch_axis, head_axis))


def row_sharding(mesh: Mesh, ndim: int, *, per_head: bool, batch_axis: str | None = "batch",
                 head_axis: str | None = "heads") -> NamedSharding:
    """Sharding of an input of ``ndim`` dimensions that leads with the batch axis:
    ``[B, K, ...]`` when ``per_head`` (attention, payload), else ``[B, ...]``
    (correctness, positions, write masks)."""
    lead = (batch_axis, head_axis) if per_head else (batch_axis,)
    if ndim < len(lead):
        raise ValueError(f"ndim must be >= {len(lead)} for per_head={per_head}, got {ndim}")
    return NamedSharding(mesh, PartitionSpec(*lead, *([None] * (ndim - len(lead)))))


def shard_map_update(mesh: Mesh, batch_axis: str = "batch"):
    """``flsmem.update`` run by ``jax.shard_map``: each device updates its own block of
    batch rows (all their KV heads). Returns ``update(state, attention,
    correctness=None, future=None)``, to be called under ``jax.jit`` with a state from
    :func:`shard` (``head_axis=None``).

    Use it where XLA cannot partition a step by itself (the Pallas top-k on GPU or
    TPU); elsewhere plain ``jit`` on a sharded state does the same and can split KV
    heads too. KV heads stay whole here because the state's counters are per batch row,
    summed over heads. Refused for policies whose rows interact (``learned``,
    ``random``).
    """
    if not isinstance(batch_axis, str):
        raise ValueError(f"batch_axis must be a mesh axis name, got {batch_axis!r}")

    def run(state: MemoryState, attention, correctness=None, future=None) -> MemoryState:
        name = state.config.policy.name
        if name in _NOT_ROW_LOCAL:
            raise ValueError(f"shard_map_update cannot run the {name} policy: {_NOT_ROW_LOCAL[name]}; "
                             "use jax.jit on the sharded state instead")
        _check_mesh(state, mesh, batch_axis, None)
        rows = PartitionSpec(batch_axis)
        specs = partition_specs(state, batch_axis, None)
        # check_vma off: Pallas calls do not declare how their outputs vary over the
        # mesh, and every row's update is local anyway.
        local = jax.shard_map(_update, mesh=mesh, in_specs=(specs, rows, rows, rows), out_specs=specs,
                              check_vma=False)
        return local(state, attention, correctness, future)

    return run
