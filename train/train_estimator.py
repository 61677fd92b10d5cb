"""Pretrain the learned importance estimator offline, on traces of the training split.

Run ``python -m flsmem.train.train_estimator --help`` for the options; the shipped checkpoint's
command is in ``checkpoints/estimator/README.md``.

Offline pretraining is the online rule run over many more streams than one serving
run sees: batches of training-split windows are streamed through a model under the
``learned`` policy at a budget, the estimator takes its optax step whenever labels
mature, and what it learned is carried to the next batch
(:func:`flsmem.estimator.carry_over`, the layers' copies averaged). Sources take
turns: the task model on the controlled tasks (``tasks``), the tiny model on prose
(``tiny``), SmolLM2-135M and Gemma 3 270M on prose (``smollm2``, ``gemma3``) and SmolLM2
on RULER's needle tasks,
teacher-forced (``ruler``: :mod:`flsmem.harness.ruler.forced`, haystacks of the
training split, seeds no evaluation uses); budgets take turns too, and a
budget of 1 (the whole window, nothing evicted) gives every slot its label, where
smaller budgets show the estimator the memories its own policy keeps. With ``--flush``
the snapshots still in flight when a batch's stream ends are labelled with what they
gathered up to the end (:func:`flsmem.estimator.flush`): with ``--horizon`` as long as
the windows and ``--snapshots`` several, every label is the peak use over the rest of
the stream, which reaches past the long gaps between two reads of an item that a short
horizon labels 0.

Orbax checkpoints in ``--workdir`` every ``--save-every`` batches hold the parameters,
the optimizer state and the batch count; batch ``i`` is drawn from a generator seeded
with ``(seed, i)``, so a killed run started again with the same command continues from
the last checkpoint exactly. ``--out DIR`` writes the final parameters and optimizer state
(:func:`flsmem.estimator.save`), read back by :func:`flsmem.estimator.load` and
:func:`flsmem.estimator.load_optimizer`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from flsmem import estimator as E
from flsmem import policies as P
from flsmem.harness.arguments import checking, make_parser
from flsmem.train.resumable import Checkpoints, resumed_step, stop_on_sigterm

__all__ = ["EstimatorOptions", "SOURCES", "train", "check_run", "main"]

PROG = "python -m flsmem.train.train_estimator"
SOURCES = ("tasks", "tiny", "smollm2", "gemma3", "ruler")
# Seeds of the RULER samples that pretraining draws: evaluations use seeds below this.
RULER_SEEDS = 2**20
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "flsmem" / "train_estimator"
CHUNK = 16


@dataclasses.dataclass(frozen=True)
class EstimatorOptions:
    """Settings of one pretraining run (the command-line options).

    Attributes:
      batches: window batches streamed in the whole run.
      sources: the sources that take turns (see :data:`SOURCES`).
      fractions: budgets as fractions of the window, taking turns per round of sources.
      horizon, snapshots, label, loss, prior, learning_rate, hidden: the estimator's
        (see :func:`flsmem.estimator.learned`).
      flush: after each batch's stream, label the snapshots still in flight and take
        one step on them (:func:`flsmem.estimator.flush`).
      guide: "oracle" runs the memories behind the oracle (it decides what is kept; the
        estimator gathers and learns as it would, :func:`flsmem.estimator.guided`), so
        the labels cover what a good memory holds; None lets the estimator decide.
      recent: the recent window, as a fraction of the budget (the harness gives the
        learned policy half the budget, as it gives h2o and rmm).
      windows: windows per batch (tiny models); the real models stream a quarter as many.
      task_context, text_context: tokens per window of the tasks and of the prose.
      seed: seeds the fresh network and the data.
      workdir, resume, save_every, keep: orbax checkpoints, as in train_decoder.
      out: write the final parameters here (must not exist).
      progress: show the progress bar.
    """

    batches: int = 48
    sources: tuple[str, ...] = ("tasks", "tiny")
    fractions: tuple[float, ...] = (1 / 8, 1 / 4, 1 / 2, 1.0)
    horizon: int = 32
    snapshots: int = 1
    flush: bool = False
    guide: str | None = None
    label: str = "peak"
    loss: str = "squared"
    prior: str | None = None
    learning_rate: float = 3e-3
    hidden: int = 32
    recent: float = 0.5
    windows: int = 32
    task_context: int = 256
    text_context: int = 256
    seed: int = 0
    workdir: str = str(DEFAULT_WORKDIR)
    resume: bool = True
    save_every: int = 8
    keep: int = 2
    out: str | None = None
    progress: bool = True

    def __post_init__(self):
        for name in ("batches", "windows", "save_every", "keep", "horizon", "hidden"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        unknown = sorted(set(self.sources) - set(SOURCES))
        if not self.sources or unknown:
            raise ValueError(f"sources must be a non-empty subset of {SOURCES}, got {self.sources}")
        if not 0 <= self.recent < 1:
            raise ValueError(f"recent must lie in [0, 1), got {self.recent}")
        if not self.fractions or not all(0 < f <= 1 for f in self.fractions):
            raise ValueError(f"fractions must lie in (0, 1], got {self.fractions}")
        for name in ("task_context", "text_context"):
            if getattr(self, name) < CHUNK or getattr(self, name) % CHUNK:
                raise ValueError(f"{name} must be a positive multiple of {CHUNK}, got {getattr(self, name)}")
        if self.guide not in (None, "oracle"):
            raise ValueError(f"guide must be None or 'oracle', got {self.guide!r}")
        if not isinstance(self.flush, bool):
            raise ValueError(f"flush must be a bool, got {self.flush!r}")
        if self.out is not None and Path(self.out).exists():
            raise ValueError(f"out {self.out!r} exists; choose a new directory")
        E.learned(horizon=self.horizon, snapshots=self.snapshots, label=self.label, loss=self.loss,
                  prior=self.prior, learning_rate=self.learning_rate, hidden=self.hidden)

    def run_settings(self) -> dict:
        """The options that decide the trajectory: a resumed run must share them."""
        # Nothing depends on the total: a run may be extended by raising --batches.
        skip = {"batches", "workdir", "resume", "save_every", "keep", "out", "progress"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


class _Source:
    """A model and how to draw a batch of training windows for it."""

    def __init__(self, name: str, options: EstimatorOptions):
        from flsmem.models.data import ByteTokenizer, load_split

        self.name = name
        text = load_split("train")
        if name == "tasks":
            from flsmem.models.tiny import TASKS_CHECKPOINT_DIR, load_tiny

            self.model = load_tiny(TASKS_CHECKPOINT_DIR)[0]
            self.tokens, self.context, self.count = ByteTokenizer().encode(text), options.task_context, options.windows
        elif name == "tiny":
            from flsmem.models.tiny import load_tiny

            self.model = load_tiny()[0]
            self.tokens, self.context, self.count = ByteTokenizer().encode(text), options.text_context, options.windows
        else:
            from flsmem.models import catalog

            self.model, self.tokenizer = catalog.load("gemma3-270m" if name == "gemma3" else "smollm2-135m")
            self.context, self.count = options.text_context, max(1, options.windows // 4)
            if name in ("smollm2", "gemma3"):
                self.tokens = np.asarray(self.tokenizer.encode(text), np.int32)
            else:
                from flsmem.harness.ruler.forced import fits
                from flsmem.harness.ruler.tasks import NIAH

                # Every needle task whose prompt and answer fit the window.
                self.ruler_tasks = [task for task in NIAH if fits(task, self.context, self.tokenizer)]

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        from flsmem.models.data import random_windows
        from flsmem.models.tasks import TASKS, make_tasks

        if self.name == "tasks":
            kind = TASKS[int(rng.integers(len(TASKS)))]
            return make_tasks(kind, self.tokens, self.count, self.context, seed=int(rng.integers(2**31))).tokens
        if self.name == "ruler":
            from flsmem.harness.ruler.forced import forced_window

            return np.stack([forced_window(self.ruler_tasks[int(rng.integers(len(self.ruler_tasks)))], self.context,
                                           int(rng.integers(2**20)), self.tokenizer,
                                           seed=int(rng.integers(RULER_SEEDS, 2**31)), split="train")[0]
                             for _ in range(self.count)])
        return random_windows(self.tokens, self.count, self.context, rng)


def _plan(options: EstimatorOptions, batch: int) -> tuple[str, float]:
    turn = len(options.sources)
    return options.sources[batch % turn], options.fractions[(batch // turn) % len(options.fractions)]


def _budget(fraction: float, context: int) -> int:
    """Slots kept at ``fraction`` of a ``context``-token window, at least one chunk."""
    return max(CHUNK, int(round(float(Fraction(fraction).limit_denominator(64)) * context)))


def _fresh(options: EstimatorOptions):
    """``(policy, learned)``: the learned policy of the options and its fresh state in
    :func:`flsmem.estimator.carry_over` form."""
    policy = E.learned(horizon=options.horizon, snapshots=options.snapshots, label=options.label,
                       loss=options.loss, prior=options.prior, learning_rate=options.learning_rate,
                       hidden=options.hidden, seed=options.seed)
    fresh = policy.init_aux(policy, 1, 1, 1)
    return policy, E.carry_over(fresh, layers_axis=False)


def _stream(options: EstimatorOptions, policy, source: _Source, windows: np.ndarray, budget: int,
            learned: dict) -> dict:
    """Stream ``windows`` through the source's model under the learned policy at ``budget``,
    starting from ``learned``; returns what the estimator learned, carried over."""
    from flsmem.harness.evaluate import evaluate_windows, future_attention

    protected = policy.replace(recent=int(options.recent * budget))
    futures = None
    if options.guide == "oracle":
        protected = E.guided(protected, P.oracle())
        futures = future_attention(source.model, windows, CHUNK)
    _, _, stats = evaluate_windows(source.model, windows, protected, budget, chunk=CHUNK, aux=learned,
                                   futures=futures)
    aux = E.flush(policy, stats["aux"]) if options.flush else stats["aux"]
    return E.carry_over(aux)


def _batches(options: EstimatorOptions, policy, learned: dict, start: int, checkpoints: Checkpoints,
             should_stop: Callable[[], bool] | None) -> tuple[dict, bool]:
    """Stream the batches from ``start`` on, logging each and saving checkpoints; returns
    ``(learned, interrupted)``."""
    sources: dict[str, _Source] = {}
    log = (checkpoints.workdir / "metrics.jsonl").open("a" if start else "w")
    bar = tqdm(total=options.batches, initial=start, disable=not options.progress, desc="estimator", unit="batch")
    started = time.perf_counter()
    interrupted = False
    try:
        for batch in range(start, options.batches):
            name, fraction = _plan(options, batch)
            if name not in sources:
                sources[name] = _Source(name, options)
            source = sources[name]
            windows = source.draw(np.random.default_rng([options.seed, batch]))
            budget = _budget(fraction, source.context)
            learned = _stream(options, policy, source, windows, budget, learned)
            loss = float(learned["loss"])
            record = {"batch": batch + 1, "source": name, "budget": budget, "loss": loss,
                      "labels": int(learned["labels"]), "skipped": int(learned["skipped"])}
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(source=name, budget=budget, loss=f"{loss:.3f}")
            stopping = should_stop is not None and should_stop()
            if (batch + 1) % options.save_every == 0 or batch + 1 == options.batches or stopping:
                checkpoints.save(batch + 1, learned, {"batch": batch + 1})
            if stopping and batch + 1 < options.batches:
                interrupted = True
                break
    finally:
        bar.close()
        log.close()
    if options.batches > start:
        print(f"streamed batches {start}..{options.batches} in {time.perf_counter() - started:.0f} s; "
              f"last loss {float(learned['loss']):.4f}")
    return learned, interrupted


def check_run(options: EstimatorOptions) -> None:
    """What would stop the run before its first batch, checked before anything is written.

    Raises:
      ValueError: checkpoints in ``workdir`` written with other settings, or having
        streamed more than ``batches`` (when resuming).
    """
    start = resumed_step(options.workdir, options.run_settings(), options.resume)
    if start > options.batches:
        # Its parameters have seen more batches than asked for: exporting them would mislabel them.
        raise ValueError(f"batches {options.batches} is below the {start} batches the checkpoint in "
                         f"{Path(options.workdir).absolute()} has streamed; raise batches, or start afresh "
                         f"(--no-resume)")


def train(options: EstimatorOptions, *, should_stop: Callable[[], bool] | None = None) -> dict:
    """Pretrain (or resume pretraining) the estimator; returns the learned state
    (:func:`flsmem.estimator.carry_over` form, with ``"interrupted": True`` added when
    ``should_stop`` ended it early).

    ``should_stop`` is asked after every batch; when it returns True the run saves a
    checkpoint there and returns early (without ``--out``), so a job told to stop
    (SIGTERM, see :func:`main`) loses nothing; one killed outright resumes from its
    last checkpoint, at most ``save_every`` batches back."""
    check_run(options)
    policy, learned = _fresh(options)
    checkpoints = Checkpoints(Path(options.workdir).absolute(), options.keep, options.run_settings())
    start, learned, _ = checkpoints.resume(learned, options.resume)
    learned, interrupted = _batches(options, policy, learned, start, checkpoints, should_stop)
    if interrupted:
        print("stopped early; the same command resumes from the checkpoint just saved")
        learned["interrupted"] = True
    elif options.out is not None:
        E.save(options.out, learned["params"], options.run_settings(), optimizer_state=learned["opt"])
        print(f"wrote the estimator to {options.out}")
    return learned


def _parser() -> argparse.ArgumentParser:
    d = EstimatorOptions()
    p = make_parser(PROG, __doc__)
    p.add_argument("--batches", type=int, default=d.batches, help="window batches in the whole run")
    p.add_argument("--sources", default=",".join(d.sources), help=f"comma-separated, from {SOURCES}")
    p.add_argument("--fractions", default="1/8,1/4,1/2,1", help="budgets as fractions of the window, in turn")
    p.add_argument("--horizon", type=int, default=d.horizon, help="queries each label looks ahead")
    p.add_argument("--snapshots", type=int, default=d.snapshots,
                   help="snapshots in flight per row: one every horizon/snapshots queries, each labelled horizon later")
    p.add_argument("--flush", action="store_true",
                   help="at the end of each batch's stream, label the snapshots in flight with what they gathered")
    p.add_argument("--guide", default=None, choices=("oracle",),
                   help="run the memories behind this policy (off-policy labels)")
    p.add_argument("--label", default=d.label, choices=("peak", "sum"), help="label kind")
    p.add_argument("--loss", default=d.loss, choices=("squared", "ranking"), help="loss of the online step")
    p.add_argument("--prior", default=None, choices=tuple(E.PRIORS), help="start ranking as this heuristic")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate, help="Adam step size")
    p.add_argument("--hidden", type=int, default=d.hidden, help="network width")
    p.add_argument("--recent", type=float, default=d.recent, help="recent window, as a fraction of the budget")
    p.add_argument("--windows", type=int, default=d.windows, help="windows per batch (real models: a quarter)")
    p.add_argument("--task-context", type=int, default=d.task_context, help="tokens per task window")
    p.add_argument("--text-context", type=int, default=d.text_context, help="tokens per prose window")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the fresh network and the data")
    p.add_argument("--workdir", default=d.workdir, help="orbax checkpoints and metrics.jsonl")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from the latest checkpoint in --workdir (--no-resume deletes them)")
    p.add_argument("--save-every", type=int, default=d.save_every, help="batches between checkpoints")
    p.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    p.add_argument("--out", default=None, metavar="DIR", help="write the final parameters here")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return p


def _fractions(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(Fraction(part.strip())) for part in text.split(","))
    except (ValueError, ZeroDivisionError) as error:
        raise ValueError(f"--fractions must be comma-separated fractions like 1/8,1/2,1, got {text!r}") from error


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point.

    SIGTERM (what schedulers and preemption send before killing a job) makes the run
    finish its batch, save a checkpoint and exit with status 143; the same command
    then resumes there.
    """
    args = vars(_parser().parse_args(argv))
    with checking(PROG):
        args["sources"] = tuple(s.strip() for s in args["sources"].split(","))
        args["fractions"] = _fractions(args["fractions"])
        options = EstimatorOptions(**args)
        check_run(options)
    learned = stop_on_sigterm(lambda should_stop: train(options, should_stop=should_stop))
    if learned.get("interrupted"):
        raise SystemExit(128 + signal.SIGTERM)
    return learned


if __name__ == "__main__":
    main()
