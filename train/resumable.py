"""What every training script here shares: checkpoints that resume exactly, and a
SIGTERM that ends the run cleanly at a checkpoint instead of losing its work."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from flsmem import checkpoint

__all__ = ["Checkpoints", "resumed_step", "stop_on_sigterm"]

T = TypeVar("T")
_WHAT = "training checkpoint"


class Checkpoints:
    """The checkpoints of one run in ``workdir``: per saved step, a folder named by the
    step holding a pytree ``state`` and a JSON ``meta`` record, written atomically by
    :func:`flsmem.checkpoint.save_tree` (a run killed mid-save leaves no step folder).
    ``meta["settings"]`` holds the run's settings, and a run resumes only from a
    checkpoint written with the same settings.

    Args:
      workdir: the folder (created if missing).
      keep: checkpoints kept (the latest ones).
      settings: JSON-able settings that decide the run's trajectory.
    """

    def __init__(self, workdir: str | Path, keep: int, settings: dict[str, Any]):
        self.workdir = Path(workdir).absolute()
        self.keep = keep
        self.settings = _as_read_back(settings)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Saves a kill interrupted: never renamed into place, never to be read.
        for partial in self.workdir.glob(f"*{checkpoint.PARTIAL}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def steps(self) -> list[int]:
        """The steps of the finished checkpoints, oldest first."""
        return _finished_steps(self.workdir)

    def resume(self, state: Any, resume: bool = True) -> tuple[int, Any, dict | None]:
        """``(step, state, meta)`` of the latest checkpoint, or ``(0, state, None)`` to
        start afresh; ``state`` gives the tree structure, shapes and dtypes to restore.
        Without ``resume`` the checkpoints already there are deleted.

        Raises:
          ValueError: the latest checkpoint was written with other settings, or cannot be read.
        """
        step = resumed_step(self.workdir, self.settings, resume)
        if not step:
            for old in self.steps():
                shutil.rmtree(self.workdir / str(old))
            return 0, state, None
        path = self.workdir / str(step)
        return step, checkpoint.restore_tree(path, state, what=_WHAT), checkpoint.read_manifest(path, what=_WHAT)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save ``state`` and ``meta`` (JSON-able; the settings are added) at ``step``,
        replacing a checkpoint of that step, then drop all but the latest ``keep``."""
        record = dict(meta, settings=self.settings)
        checkpoint.save_tree(self.workdir / str(step), state, manifest=record, overwrite=True, what=_WHAT)
        for old in self.steps()[:-self.keep]:
            shutil.rmtree(self.workdir / str(old))


def resumed_step(workdir: str | Path, settings: dict[str, Any], resume: bool = True) -> int:
    """The step a run with ``settings`` would resume from in ``workdir``: its latest
    checkpoint's, or 0 when it starts afresh (``resume`` False, or no checkpoint there).
    Reads only the checkpoint's record, so a command can check its arguments with it
    before it writes anything.

    Raises:
      ValueError: the latest checkpoint was written with other settings, or cannot be read.
    """
    workdir = Path(workdir).absolute()
    steps = _finished_steps(workdir) if workdir.is_dir() else []
    if not resume or not steps:
        return 0
    meta = checkpoint.read_manifest(workdir / str(steps[-1]), what=_WHAT)
    settings = _as_read_back(settings)
    if meta.get("settings") != settings:
        raise ValueError(f"the checkpoint in {workdir} was written with settings "
                         f"{meta.get('settings')}, not {settings}; use another --workdir, "
                         f"or --no-resume to start afresh there")
    return steps[-1]


def _finished_steps(workdir: Path) -> list[int]:
    """The steps of the finished checkpoints in ``workdir``, oldest first."""
    return sorted(int(p.name) for p in workdir.iterdir() if p.is_dir() and p.name.isdigit())


def _as_read_back(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` as they read back from a checkpoint's JSON record (tuples as lists)."""
    return json.loads(json.dumps(settings))


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
