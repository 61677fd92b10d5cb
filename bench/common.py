"""What every benchmark shares: interleaved timing, the machine, models, results files.

Timings on a shared 2-core machine are noisy, so no bare time is ever reported: a
variant and its baseline run back to back, round after round, each pair gives one
ratio, and the median over rounds is reported (with the lowest and highest beside it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

RESULTS = pathlib.Path("results") / "bench"


def block(x):
    """Wait for every array of ``x``."""
    return jax.block_until_ready(x)


def time_once(fn) -> float:
    """Seconds one call of ``fn`` takes. ``fn`` is a callable, or a pair
    ``(prepare, run)``: ``prepare()`` makes the arguments (untimed; a fresh copy of a
    cache that ``run`` donates) and ``run(*args)`` is timed."""
    prepare, run = fn if isinstance(fn, tuple) else (lambda: (), fn)
    args = block(prepare())
    start = CLOCKS[_clock]()
    block(run(*args))
    return CLOCKS[_clock]() - start


# "wall": elapsed time. "cpu": CPU time of this process, all its threads: steadier
# when other jobs share the cores, since time spent waiting for a core is not counted.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = "wall"


def set_clock(name: str) -> None:
    """Choose the clock of :func:`time_once`: "wall" or "cpu"."""
    global _clock
    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {tuple(CLOCKS)}, got {name!r}")
    _clock = name


def pin_cores(cores: int | None) -> None:
    """Run this process (and the threads XLA starts later) on the first ``cores`` of
    the cores it may use; None leaves it on all of them.

    Call it before the first JAX computation: XLA sizes its thread pool from the cores
    it may use when the backend starts. Why a benchmark may want one core: on a 2-core
    CPU the time of a decode step depends on how quickly XLA's second thread wakes up
    for each parallel operation, and a loop that does more work can run faster than a
    loop that does less (measured in bench/NOTES.md); on one core a ratio compares
    the work the two loops do.
    """
    if cores is None:
        return
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= cores <= len(allowed):
        raise ValueError(f"cores must be between 1 and the {len(allowed)} cores this process may use, got {cores}")
    os.sched_setaffinity(0, allowed[:cores])


def add_timing_options(parser: argparse.ArgumentParser) -> None:
    """The timing options every benchmark takes: ``--clock`` and ``--cores``."""
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine)")
    parser.add_argument("--cores", type=_cores, default=None,
                        help="run on this many cores, or all (the default but for --quick); 1 times the "
                             "work alone, without the effects of waking a second thread")


def _cores(text: str) -> int:
    """argparse type: a number of cores this process may run on."""
    available = len(os.sched_getaffinity(0))
    if text == "all":
        return available
    try:
        cores = int(text)
    except ValueError:
        cores = 0
    if not 1 <= cores <= available:
        raise argparse.ArgumentTypeError(f"--cores must be between 1 and {available}, or all, got {text!r}")
    return cores


def set_timing(args: argparse.Namespace) -> None:
    """Apply the options of :func:`add_timing_options`; call right after parsing."""
    set_clock(args.clock)
    pin_cores(args.cores)


def fresh(tree):
    """A pair's ``prepare``: a new copy of ``tree`` for a call that donates it."""
    return lambda: (jax.tree.map(jnp.copy, tree),)


def interleaved(fns: dict[str, object], rounds: int, *, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each function (see :func:`time_once`), ``rounds`` times,
    the variants interleaved.

    The order of the variants rotates from round to round so that none always runs
    right after the same neighbour (caches, frequency, other jobs on the machine).
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            time_once(fns[name])
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_once(fns[name]))
    return times


def ratios(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Per variant, the median, lowest and highest over rounds of its time divided by
    the baseline's time in the same round."""
    out = {}
    for name, ts in times.items():
        per_round = [t / b for t, b in zip(ts, times[baseline])]
        out[name] = {"median": statistics.median(per_round), "low": min(per_round), "high": max(per_round)}
    return out


def paired(baseline, variants: dict[str, object], rounds: int) -> dict[str, dict[str, float]]:
    """Time ratio of each variant to the baseline, from back-to-back pairs.

    Each round times, for every variant, the baseline and the variant right after one
    another (in alternating order), so that both see the same load; the ratio of the
    pair is one sample. Returns per variant the median, lowest and highest sample.
    """
    for fn in [baseline, *variants.values()]:
        time_once(fn)  # compile and warm up
    samples = {name: [] for name in variants}
    for r in range(rounds):
        for name, fn in variants.items():
            if r % 2:
                t_var, t_base = time_once(fn), time_once(baseline)
            else:
                t_base, t_var = time_once(baseline), time_once(fn)
            samples[name].append(t_var / t_base)
    return {name: summarise(v) for name, v in samples.items()}


def summarise(ratios: list[float]) -> dict[str, object]:
    """The median of per-round ratios, the lowest and highest round, a 95% interval for
    the median (:func:`median_interval`) and the rounds themselves."""
    low, high = median_interval(ratios)
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "median_low": low, "median_high": high, "rounds": list(ratios)}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics
    ``(x_(j), x_(n+1-j))`` with the largest ``j`` whose coverage, from the binomial
    distribution of the rounds above and below the median, is at least ``level``. With
    fewer than 6 rounds no such ``j`` exists and the interval is the whole range."""
    x = sorted(values)
    n = len(x)
    j = 1
    # P(x_(j) <= median <= x_(n+1-j)) = 1 - 2 P(Bin(n, 1/2) <= j - 1)
    while j < n + 1 - j and 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2**n >= level:
        j += 1
    return x[j - 1], x[n - j]


def machine() -> dict[str, object]:
    """The machine in words (no paths, no host names)."""
    return {
        "cpu_cores": os.cpu_count(),
        # The cores this process ran on (--cores).
        "cores_used": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "jax": jax.__version__,
        "python": platform.python_version(),
        "os": platform.system(),
    }


def command() -> str:
    """The command line that is running, as typed from the repository root."""
    module = sys.modules["__main__"].__spec__
    head = f"python -m {module.name}" if module is not None else f"python {pathlib.Path(sys.argv[0]).name}"
    return " ".join([head] + sys.argv[1:])


@functools.cache
def commit() -> str:
    """The git commit the code ran at, with "+changes" if the working tree differed:
    read once, when the benchmark starts (see the end of this module), not when a long
    run saves its figures."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "bench", "flsmem", "models"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def save(name: str, payload: dict) -> pathlib.Path:
    """Write ``results/bench/<name>.json`` with the command and the machine added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"command": command(), "commit": commit(), "machine": machine(), "clock": _clock, **payload}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


class Partial:
    """The finished parts of a long benchmark, saved as each part ends, so that a run
    stopped before its end keeps them: ``results/bench/partial/<name>.json``.

    Rerunning the same command at the same commit (with no uncommitted changes to the
    code) skips the parts already saved; any other partial file is set aside with a
    message, since its figures came from other code or other settings. :meth:`finish`,
    called once the whole record is saved, removes it.
    """

    def __init__(self, name: str):
        self.path = RESULTS / "partial" / f"{name}.json"
        self.key = {"command": command(), "commit": commit()}
        self.parts: dict[str, list] = {}
        if self.path.exists():
            record = json.loads(self.path.read_text())
            reusable = not self.key["commit"].endswith("+changes") and self.key["commit"] != "unknown"
            if reusable and all(record.get(k) == v for k, v in self.key.items()):
                self.parts = record["parts"]
            else:
                print(f"{self.path}: not reused (saved by another command or commit, or the code has "
                      "uncommitted changes)", file=sys.stderr)

    def get(self, part: str) -> list | None:
        """The rows saved for ``part``, or None if it has not finished."""
        return self.parts.get(part)

    def put(self, part: str, rows: list) -> None:
        self.parts[part] = rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.key, "parts": self.parts}, indent=1) + "\n")
        tmp.replace(self.path)  # a run stopped while writing leaves the previous file whole

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive ints."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def choices(allowed: tuple[str, ...]):
    """argparse type: a comma-separated list of names from ``allowed``."""

    def parse(text: str) -> list[str]:
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return values

    return parse


def load_model(name: str):
    """The decoder by name: "tiny" (bundled checkpoint) or "smollm2" (SmolLM2-135M)."""
    if name == "tiny":
        from flsmem.models.tiny import load_tiny

        return load_tiny()[0]
    if name == "smollm2":
        from flsmem.models.smollm2 import load_smollm2

        return load_smollm2()[0]
    raise ValueError(f"model must be 'tiny' or 'smollm2', got {name!r}")


def random_kv(key, shape, dtype=jnp.float32):
    """Keys and values for a cache filled without running the model: a decode step's
    cost does not depend on the values it reads."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype)


commit()  # the code this process runs is the code checked out now
