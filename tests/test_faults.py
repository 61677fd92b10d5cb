"""Faults and long runs: the training scripts, killed for real in a child process,
resume from their last checkpoint and lose at most one checkpoint interval (nothing on
SIGTERM, which train_decoder takes as "save and stop"); the soak's invariant checks
and the monitoring figures of ``flsmem eval --stats``."""

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

import flsmem

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
    from flsmem.models.decoder import TINY
    from flsmem.models.tiny import load_params

    return jax.tree.leaves(nnx.state(load_params(path, TINY), nnx.Param))


def test_train_decoder_resumes_after_sigterm_and_sigkill(tmp_path):
    workdir, export = tmp_path / "work", tmp_path / "export"
    args = _decoder_args(workdir, export)
    # SIGTERM: the run finishes its step, saves it, exits with 143 and resumes there.
    process = _start("flsmem.train.train_decoder", args)
    output = _interrupt_after(process, workdir, SAVE_EVERY, signal.SIGTERM)
    assert process.returncode == 128 + signal.SIGTERM, output
    stopped = int(output.split("stopped at step ")[1].split(";")[0])
    assert _finished_checkpoints(workdir)[-1] == stopped, "the step it stopped at was not saved"

    # SIGKILL: nothing runs after it; the next run starts from the last finished
    # checkpoint, so at most one interval of work is redone.
    process = _start("flsmem.train.train_decoder", args)
    output = _interrupt_after(process, workdir, stopped + 1, signal.SIGKILL)
    assert f"trained steps {stopped}.." not in output  # it never got to the end
    last = _finished_checkpoints(workdir)[-1]
    assert stopped < last < STEPS and last % SAVE_EVERY == 0

    output = _run("flsmem.train.train_decoder", args)
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
    _interrupt_after(_start("flsmem.train.train_estimator", args), workdir, 2, signal.SIGKILL)
    last = _finished_checkpoints(workdir)[-1]
    assert 2 <= last < batches
    output = _run("flsmem.train.train_estimator", args)
    assert f"streamed batches {last}..{batches}" in output, output
    weights = E.load(out)  # complete and finite, or load raises
    assert weights.params["inner"]["kernel"].shape[0] == len(E.FEATURES)


# ------------------------------------------------------------- long runs, monitoring


def test_soak_holds_its_invariants_and_catches_broken_ones():
    from bench import soak

    steps, violations = soak.soak("rmm", steps=120, block=60, budget=16, evict_every=4, batch=2, kv_heads=1,
                                  seed=0, out=open(os.devnull, "w"))
    assert (steps, violations) == (120, 0)
    # The same block length as above: the compiled block is reused.
    config = flsmem.MemoryConfig(soak.POLICIES["rmm"](), budget=16, evict_every=4)
    state = jax.jit(soak._block, static_argnames="length")(
        flsmem.init(config, 2, 1, {"k": (soak.D,), "v": (soak.D,)}), jax.random.key(0), 0, length=60)
    assert soak.check(state, 60) == []
    newest = np.argmax(state.position[0, 0])
    broken = {
        "clock drifted": (state, 61),
        "payload moved apart": (state.replace(payload={**state.payload, "v": state.payload["v"] + 1.0}), 60),
        "protected window": (state.replace(valid=state.valid.at[0, 0, newest].set(False)), 60),
        "score is NaN": (state.replace(score=state.score.at[1, 0, np.argmax(state.valid[1, 0])].set(np.nan)), 60),
        "eviction counter drifted": (state.replace(stats=state.stats.replace(evictions=state.stats.evictions + 1)), 60),
    }
    for match, (bad, steps_run) in broken.items():
        assert any(match in problem for problem in soak.check(bad, steps_run)), match


def test_eval_stats_sums_counters_and_weights_means_by_evictions():
    from flsmem.harness import report

    # Two layers by two windows; the learned policy's loss is one figure per layer.
    stats = {
        "step": np.full((2, 2), 64), "occupancy": np.full((2, 2), 32), "held": np.zeros((2, 2, 2, 4)), "aux": None,
        "evictions": np.array([[10, 0], [30, 0]]), "fallbacks": np.array([[1, 0], [0, 2]]),
        "forced_writes": np.zeros((2, 2), int), "nonfinite_inputs": np.zeros((2, 2), int),
        "mean_evicted_age": np.array([[4.0, np.nan], [8.0, np.nan]]),
        "mean_evicted_score": np.array([[1.0, np.nan], [0.0, np.nan]]),
        "estimator_loss": np.array([[0.5, 0.5], [1.5, 1.5]], np.float32),
        "estimator_updates": np.array([[3, 3], [4, 4]], np.int32),
    }
    figures = report.summarise_stats(stats)
    assert figures["evictions"] == 40 and figures["fallbacks"] == 3
    assert figures["mean_evicted_age"] == (10 * 4 + 30 * 8) / 40
    assert figures["mean_evicted_score"] == 10 / 40
    assert figures["estimator_loss"] == 1.0 and figures["estimator_updates"] == 7
    table = report.format_stats({("learned", 16): figures, ("full", 64): report.summarise_stats(
        {k: (np.zeros_like(v) if isinstance(v, np.ndarray) and k not in ("held",) else v) for k, v in stats.items()
         if not k.startswith("estimator")})})
    assert "estimator_loss" in table.splitlines()[1]
    assert table.splitlines()[3].split()[:3] == ["learned", "16", "40"]
    import argparse

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert parser.parse_args(["--stats"]).stats and not parser.parse_args([]).stats
