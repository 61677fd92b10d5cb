"""Faults: the training scripts, killed for real in a child process, resume from their
last checkpoint and lose at most one checkpoint interval (nothing on SIGTERM, which
train_decoder takes as "save and stop")."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
SAVE_EVERY = 5
STEPS = 20


def _finished_checkpoints(workdir: Path) -> list[int]:
    """Steps of the finished checkpoints in an orbax workdir (unfinished saves live in
    temporary directories with a suffix and do not count)."""
    return sorted(int(p.name) for p in workdir.iterdir() if p.is_dir() and p.name.isdigit()) if workdir.is_dir() else []


def _start(module: str, args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _interrupt_after(process: subprocess.Popen, workdir: Path, step: int, signum: int, timeout: float = 300) -> str:
    """Send ``signum`` once a checkpoint of at least ``step`` is finished; the output."""
    deadline = time.monotonic() + timeout
    while not (_finished_checkpoints(workdir) and _finished_checkpoints(workdir)[-1] >= step):
        if process.poll() is not None:
            pytest.fail(f"the run ended before its step-{step} checkpoint:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no step-{step} checkpoint after {timeout} s")
        time.sleep(0.02)
    process.send_signal(signum)
    return process.communicate(timeout=timeout)[0]


def _run(module: str, args: list[str]) -> str:
    process = _start(module, args)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output
    return output


def _decoder_args(workdir: Path, export: Path) -> list[str]:
    return ["--steps", str(STEPS), "--batch", "2", "--length", "32", "--save-every", str(SAVE_EVERY),
            "--eval-every", "0", "--final-eval-windows", "0", "--no-progress",
            "--workdir", str(workdir), "--export", str(export)]


def _params(path: Path):
    from models.decoder import TINY
    from models.tiny import load_params

    return jax.tree.leaves(nnx.state(load_params(path, TINY), nnx.Param))


def test_train_decoder_resumes_after_sigterm_and_sigkill(tmp_path):
    workdir, export = tmp_path / "work", tmp_path / "export"
    args = _decoder_args(workdir, export)
    # SIGTERM: the run finishes its step, saves it, exits with 143 and resumes there.
    process = _start("train.train_decoder", args)
    output = _interrupt_after(process, workdir, SAVE_EVERY, signal.SIGTERM)
    assert process.returncode == 128 + signal.SIGTERM, output
    stopped = int(output.split("stopped at step ")[1].split(";")[0])
    assert _finished_checkpoints(workdir)[-1] == stopped, "the step it stopped at was not saved"

    # SIGKILL: nothing runs after it; the next run starts from the last finished
    # checkpoint, so at most one interval of work is redone.
    process = _start("train.train_decoder", args)
    output = _interrupt_after(process, workdir, stopped + 1, signal.SIGKILL)
    assert f"trained steps {stopped}.." not in output  # it never got to the end
    last = _finished_checkpoints(workdir)[-1]
    assert stopped < last < STEPS and last % SAVE_EVERY == 0

    output = _run("train.train_decoder", args)
    assert f"trained steps {last}..{STEPS}" in output, output
    assert len(_params(export)) > 0  # exported once finished
    # Bit-exact continuation across a resume is tested in process, cheaper, in
    # test_data_and_training.py::test_resume_after_kill_continues_bit_exactly.


def test_train_estimator_resumes_after_sigkill(tmp_path):
    from flsmem import estimator as E

    workdir, out = tmp_path / "work", tmp_path / "estimator"
    batches = 6
    args = ["--batches", str(batches), "--sources", "tasks", "--fractions", "1", "--horizon", "8", "--windows", "2",
            "--task-context", "128", "--save-every", "1", "--no-progress", "--workdir", str(workdir), "--out", str(out)]
    _interrupt_after(_start("train.train_estimator", args), workdir, 2, signal.SIGKILL)
    last = _finished_checkpoints(workdir)[-1]
    assert 2 <= last < batches
    output = _run("train.train_estimator", args)
    assert f"streamed batches {last}..{batches}" in output, output
    weights = E.load(out)  # complete and finite, or load raises
    assert weights.params["inner"]["kernel"].shape[0] == len(E.FEATURES)
