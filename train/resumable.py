"""What every training script here shares: orbax checkpoints that resume exactly, and a
SIGTERM that ends the run cleanly at a checkpoint instead of losing its work."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpoints", "stop_on_sigterm"]

T = TypeVar("T")


class Checkpoints:
    """The checkpoints of one run in ``workdir``: a pytree ``state`` and a JSON ``meta``
    record per saved step. ``meta["settings"]`` holds the run's settings, and a run
    resumes only from a checkpoint written with the same settings.

    Args:
      workdir: the folder (created if missing).
      keep: checkpoints kept.
      settings: JSON-able settings that decide the run's trajectory.
    """

    def __init__(self, workdir: str | Path, keep: int, settings: dict[str, Any]):
        self.workdir = Path(workdir).absolute()
        self.settings = json.loads(json.dumps(settings))  # as they read back from JSON
        self.manager = ocp.CheckpointManager(
            self.workdir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def resume(self, state: Any, resume: bool = True) -> tuple[int, Any, dict | None]:
        """``(step, state, meta)`` of the latest checkpoint, or ``(0, state, None)`` to
        start afresh; ``state`` gives the tree structure, shapes and dtypes to restore.
        Without ``resume`` the checkpoints already there are deleted.

        Raises:
          ValueError: the latest checkpoint was written with other settings.
        """
        step = self.manager.latest_step()
        if not resume or step is None:
            for old in self.manager.all_steps():
                self.manager.delete(old)
            return 0, state, None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        if restored["meta"]["settings"] != self.settings:
            raise ValueError(f"the checkpoint in {self.workdir} was written with settings "
                             f"{restored['meta']['settings']}, not {self.settings}; use another --workdir, "
                             f"or --no-resume to start afresh there")
        return step, restored["state"], restored["meta"]

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save ``state`` and ``meta`` (JSON-able; the settings are added) at ``step``."""
        record = dict(meta, settings=self.settings)
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)), force=True)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def stop_on_sigterm(train: Callable[[Callable[[], bool]], T]) -> T:
    """Run ``train(should_stop)`` with SIGTERM (what schedulers and preemption send
    before killing a job) turned into ``should_stop() == True``, so the run can finish
    its step and save; the previous handler comes back afterwards."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        return train(stop.is_set)
    finally:
        signal.signal(signal.SIGTERM, previous)
