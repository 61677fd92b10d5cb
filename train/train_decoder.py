"""Train the byte-level ``TINY`` decoder on the Austen training books.

Run ``python -m flsmem.train.train_decoder --help`` for the options. The defaults are the
settings of the shipped checkpoint; this reproduces it (about 14 minutes on 2 CPU cores)::

    python -m flsmem.train.train_decoder --export checkpoints/tiny-austen

What it does:

* next-byte cross-entropy on random windows of the train split (:mod:`flsmem.models.data`),
  AdamW with linear warmup, cosine decay and gradient clipping, in one jitted step over
  the pure parameter state (``nnx.split`` once, ``nnx.merge`` inside the step);
* validation loss and bits per byte on Northanger Abbey every ``--eval-every`` steps,
  and validation and test (Persuasion) at the end, on evenly spaced windows;
* orbax checkpoints in ``--workdir`` every ``--save-every`` steps holding parameters,
  optimizer state, step and the numpy RNG state of the data sampler, so a killed run
  started again with the same command continues exactly where the last checkpoint was
  (bit for bit the same parameters as a run that was never stopped);
* ``--export DIR`` writes the final parameters alone, read back by
  :func:`flsmem.models.tiny.load_tiny`.

``--data tasks`` trains on the controlled recall tasks of :mod:`flsmem.models.tasks` instead
(prose of the train split with pairs and queries inserted), with the answer digits
weighted ``1 + --answer-weight`` in the loss, usually starting from a text model given
by ``--init``; validation then also reports each task's answer accuracy on Northanger
Abbey. ``checkpoints/tiny-tasks/README.md`` gives the two runs that made the shipped
task model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from flsmem.models.data import ByteTokenizer, cut_windows, load_split, random_windows
from flsmem.models.decoder import TINY, Decoder, DecoderConfig
from flsmem.models.tasks import LATE, TASKS, make_tasks, mixed_tasks
from flsmem.harness.arguments import checking, make_parser
from flsmem.models.tiny import check_params, load_params, save_params
from flsmem.train.resumable import Checkpoints, resumed_step, stop_on_sigterm

__all__ = ["TrainOptions", "TrainResult", "DEFAULT_WORKDIR", "train", "check_run", "evaluate", "task_accuracy",
           "bits_per_byte", "main"]

PROG = "python -m flsmem.train.train_decoder"
# Outside the repository, so checkpoints never end up among tracked files.
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "flsmem" / "train_decoder"


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Settings of one training run (the command-line options).

    Attributes:
      steps: optimizer updates in the whole run; the schedule spans them.
      batch: windows per step (B).
      length: bytes per window (T); the model sees ``T`` inputs and ``T`` targets.
      lr: peak learning rate.
      warmup: linear warmup steps; None takes 5% of ``steps``.
      end_lr_ratio: the cosine decays to ``lr * end_lr_ratio``.
      weight_decay: AdamW decay, applied to matrices only (not to norm scales).
      clip: global gradient-norm clip.
      seed: seeds the parameters and the data sampler.
      workdir: folder of the orbax checkpoints and ``metrics.jsonl``.
      resume: continue from the latest checkpoint in ``workdir``; else start afresh,
        deleting the checkpoints there.
      save_every: steps between checkpoints (one is also written where the run stops).
      keep: checkpoints kept.
      eval_every: steps between validation evaluations; 0 turns them off.
      eval_windows: windows per periodic validation evaluation.
      final_eval_windows: windows for the final validation and test evaluation; 0 skips it.
      stop_at: stop after this step (the schedule still follows ``steps``), to split a
        run into pieces; None runs to ``steps``.
      export: where to write the final parameters for ``load_tiny``; None writes none.
      progress: show the tqdm progress bar.
      data: ``"text"`` (plain windows of the train split) or ``"tasks"`` (the controlled
        recall tasks of :mod:`flsmem.models.tasks` embedded in train-split prose).
      init: start from the parameters saved in this folder (:func:`flsmem.models.tiny.save_params`)
        instead of a random initialisation; None starts from scratch.
      answer_weight: extra loss weight of answer digits in ``"tasks"`` data (each answer
        byte counts ``1 + answer_weight`` bytes).
      task_eval: validation examples per task for the answer accuracy (``"tasks"`` only).
      tasks: the task kinds of ``"tasks"`` data (names from :data:`flsmem.models.tasks.TASKS`).
      fresh_tokens: bytes whose embeddings are drawn afresh after ``init`` is loaded. The
        task symbols never occur in the books, so a text model has learnt nearly the same
        embedding for all of them (the softmax only ever pushed them down together); new
        rows, as for tokens added to a vocabulary, tell them apart.
    """

    steps: int = 240
    batch: int = 16
    length: int = 512
    lr: float = 6e-3
    warmup: int | None = None
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    workdir: str = str(DEFAULT_WORKDIR)
    resume: bool = True
    save_every: int = 40
    keep: int = 3
    eval_every: int = 40
    eval_windows: int = 16
    final_eval_windows: int = 256
    stop_at: int | None = None
    export: str | None = None
    progress: bool = True
    data: str = "text"
    init: str | None = None
    answer_weight: float = 20.0
    task_eval: int = 64
    fresh_tokens: str = ""
    tasks: tuple[str, ...] = TASKS

    def __post_init__(self):
        for name in ("steps", "batch", "length", "save_every", "keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "eval_windows", "final_eval_windows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup must lie in [0, steps={self.steps}], got {self.warmup}")
        if self.data not in ("text", "tasks"):
            raise ValueError(f"data must be 'text' or 'tasks', got {self.data!r}")
        if not self.tasks or not set(self.tasks) <= set(TASKS):
            raise ValueError(f"tasks must be a non-empty selection of {TASKS}, got {self.tasks}")
        if not (self.fresh_tokens.isascii() and self.fresh_tokens.isprintable()):
            raise ValueError(f"fresh_tokens must be printable ASCII characters, got {self.fresh_tokens!r}")
        if not self.answer_weight >= 0:
            raise ValueError(f"answer_weight must be >= 0, got {self.answer_weight}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in [1, steps={self.steps}], got {self.stop_at}")

    def run_settings(self) -> dict[str, Any]:
        """The options that decide the trajectory: a resumed run must share them."""
        keys = ("steps", "batch", "length", "lr", "warmup", "end_lr_ratio", "weight_decay", "clip", "seed",
                "data", "init", "answer_weight", "fresh_tokens", "tasks")
        return {k: list(v) if isinstance(v := getattr(self, k), tuple) else v for k in keys}


@dataclasses.dataclass
class TrainResult:
    """What a run returns.

    Attributes:
      model: the decoder with the final parameters.
      start_step: the step the run started from (0, or where it resumed).
      step: the step it stopped at.
      train_losses: ``(step, loss)`` for every step this run took (nats per byte).
      val: ``(step, loss)`` of each validation evaluation.
      final: ``{"val": loss, "test": loss}`` at the end of the run (empty if skipped).
      interrupted: ``should_stop`` stopped the run early (a checkpoint was saved at ``step``).
    """

    model: Decoder
    start_step: int
    step: int
    train_losses: list[tuple[int, float]]
    val: list[tuple[int, float]]
    final: dict[str, float]
    interrupted: bool = False


def bits_per_byte(loss: float) -> float:
    """Cross-entropy in nats per byte as bits per byte."""
    return loss / math.log(2.0)


def _optimizer(steps, lr, warmup, end_lr_ratio, weight_decay, clip) -> optax.GradientTransformation:
    """AdamW with linear warmup to ``lr``, cosine decay over ``steps``, and global-norm clipping."""
    warmup = max(1, steps // 20) if warmup is None else warmup
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr * end_lr_ratio
    )
    return optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(
            schedule,
            b1=0.9,
            b2=0.95,
            weight_decay=weight_decay,
            # Decaying norm scales towards 0 only fights the normalisation.
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def _next_byte_losses(graphdef, params, windows, weights=None):
    """Mean next-byte cross-entropy of each window: ``[B]`` from ``windows [B, T+1]``,
    weighted per target by ``weights [B, T]`` when given."""
    logits, _, _ = nnx.merge(graphdef, params)(windows[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
    if weights is None:
        return losses.mean(axis=-1)
    return (losses * weights).sum(axis=-1) / weights.sum(axis=-1)


def _fresh_embeddings(model: Decoder, tokens: str, seed: int) -> None:
    """Redraw the embedding rows of ``tokens`` (ASCII characters) with the spread of the
    existing rows."""
    ids = np.frombuffer(tokens.encode("ascii"), np.uint8).astype(np.int32)
    table = model.embed.embedding.get_value()
    rows = jax.random.normal(jax.random.key(seed), (ids.size, table.shape[1]), table.dtype) * table.std()
    model.embed.embedding.set_value(table.at[ids].set(rows))


def _hits(graphdef, params, windows):
    """``[B, T]``: the argmax prediction equals the next byte."""
    logits, _, _ = nnx.merge(graphdef, params)(windows[:, :-1])
    return logits.argmax(axis=-1) == windows[:, 1:]


def task_accuracy(model: Decoder, batches, batch: int = 16) -> dict[str, float]:
    """Full-context answer accuracy (every digit right) after the gap, per task.

    Args:
      model: the decoder.
      batches: :class:`flsmem.models.tasks.TaskBatch` values, one per task.
      batch: windows per forward pass.
    """
    graphdef, params = nnx.split(model)
    return _task_accuracy(jax.jit(functools.partial(_hits, graphdef)), params, batches, batch)


def _task_accuracy(hits_fn, params, batches, batch) -> dict[str, float]:
    out = {}
    for tasks in batches:
        hits = np.concatenate([np.asarray(hits_fn(params, tasks.tokens[i:i + batch]))
                               for i in range(0, len(tasks.tokens), batch)])
        out[tasks.kind] = float(tasks.accuracy(hits, LATE).mean())
    return out


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, optimizer: tuple) -> tuple[optax.GradientTransformation, Any, Any, Any]:
    """``(tx, train_step, window_losses, hits)`` for a model structure and optimizer settings.

    Cached, so runs with the same settings in one process (a resumed run, the tests)
    reuse the compiled step instead of tracing and compiling it again.
    """
    tx = _optimizer(*optimizer)

    def loss_fn(params, windows, weights):
        return _next_byte_losses(graphdef, params, windows, weights).mean()

    @jax.jit
    def train_step(params, opt_state, windows, weights):
        loss, grads = jax.value_and_grad(loss_fn)(params, windows, weights)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    window_losses = jax.jit(functools.partial(_next_byte_losses, graphdef))
    hits = jax.jit(functools.partial(_hits, graphdef))
    return tx, train_step, window_losses, hits


def evaluate(model: Decoder, tokens: np.ndarray, *, length: int, count: int | None, batch: int = 16) -> float:
    """Mean next-byte loss (nats) over evenly spaced windows of ``tokens``.

    Args:
      model: the decoder.
      tokens: 1-D byte ids of the text to score.
      length: window length T.
      count: windows (:func:`flsmem.models.data.cut_windows`); None takes every window that fits.
      batch: windows per forward pass.

    Returns:
      The loss averaged over all ``count * T`` predictions.
    """
    graphdef, params = nnx.split(model)
    return _evaluate(jax.jit(functools.partial(_next_byte_losses, graphdef)), params, tokens, length, count, batch)


def _evaluate(losses_fn, params, tokens, length, count, batch) -> float:
    windows = cut_windows(tokens, length, count)
    n = len(windows)
    batch = min(batch, n)
    # Pad the last chunk to a full batch so that one compiled shape serves every chunk.
    padded = np.concatenate([windows, np.zeros((-n % batch, length + 1), np.int32)])
    per_window = [np.asarray(losses_fn(params, padded[i : i + batch])) for i in range(0, len(padded), batch)]
    return float(np.concatenate(per_window)[:n].mean())


def _initial_model(options: TrainOptions, cfg: DecoderConfig) -> Decoder:
    """A fresh decoder, or the one saved in ``options.init``, with ``options.fresh_tokens`` redrawn."""
    model = Decoder(cfg, rngs=nnx.Rngs(options.seed)) if options.init is None else load_params(options.init, cfg)
    if options.fresh_tokens:
        _fresh_embeddings(model, options.fresh_tokens, options.seed)
    return model


def _task_examples(options: TrainOptions, tokens: np.ndarray) -> list:
    """The evaluation examples of each task of the run, cut from ``tokens``."""
    return [make_tasks(kind, tokens, options.task_eval, options.length, seed=0) for kind in options.tasks]


def _batch(options: TrainOptions, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One step's ``(windows [B, T+1], float32 loss weights [B, T])``, drawn from ``rng``."""
    if options.data == "tasks":
        windows, answer = mixed_tasks(tokens, options.batch, options.length, rng, options.tasks)
        weights = 1.0 + options.answer_weight * (answer > 0)
    else:
        windows = random_windows(tokens, options.batch, options.length, rng)
        weights = np.ones((options.batch, options.length))
    return windows, weights.astype(np.float32)


def _settings(options: TrainOptions, cfg: DecoderConfig) -> dict[str, Any]:
    """What a checkpoint of the run records, and a resumed run must share."""
    return {"options": options.run_settings(), "model": dataclasses.asdict(cfg)}


def check_run(options: TrainOptions, cfg: DecoderConfig = TINY) -> None:
    """What would stop the run before its first step, checked before anything is written.

    Raises:
      ValueError: windows longer than the model's ``max_len``; ``init`` holding no
        parameters, or parameters saved for another configuration; checkpoints in
        ``workdir`` written with other settings (when resuming).
    """
    if options.length > cfg.max_len:
        raise ValueError(f"length ({options.length}) exceeds the model's max_len ({cfg.max_len})")
    if options.init is not None:
        try:
            check_params(options.init, cfg)
        except (FileNotFoundError, ValueError) as error:
            raise ValueError(f"init: {error}") from None
    resumed_step(options.workdir, _settings(options, cfg), options.resume)


def _restore(options: TrainOptions, cfg: DecoderConfig, workdir: Path, params, opt_state):
    """The run's checkpoints and where it starts: ``(checkpoints, start, params, opt_state,
    data_rng)``, from the latest checkpoint when resuming, else as given."""
    # The sampler's own generator, seeded apart from the parameters; its state is checkpointed.
    data_rng = np.random.default_rng([options.seed, 1])
    checkpoints = Checkpoints(workdir, options.keep, _settings(options, cfg))
    start, state, meta = checkpoints.resume({"params": params, "opt_state": opt_state}, options.resume)
    if meta is not None:
        data_rng.bit_generator.state = meta["data_rng"]
    return checkpoints, start, state["params"], state["opt_state"], data_rng


@dataclasses.dataclass(frozen=True)
class _Run:
    """What the steps and evaluations of one run share besides the changing state.

    Attributes:
      options: the run's settings.
      workdir: the resolved ``options.workdir``.
      train_tokens: byte ids of the train split.
      val_tokens: byte ids of the validation split.
      val_tasks: task examples for the validation answer accuracy (empty for text data).
      train_step: the jitted step of :func:`_compiled`.
      losses_fn: per-window losses, jitted.
      hits_fn: per-target argmax hits, jitted.
      checkpoints: the run's checkpoints.
      metrics: the open ``metrics.jsonl``.
    """

    options: TrainOptions
    workdir: Path
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    val_tasks: list
    train_step: Callable
    losses_fn: Callable
    hits_fn: Callable
    checkpoints: Checkpoints
    metrics: Any

    def save(self, step: int, params, opt_state, data_rng: np.random.Generator) -> None:
        self.checkpoints.save(step, {"params": params, "opt_state": opt_state},
                              {"step": step, "data_rng": data_rng.bit_generator.state})

    def log(self, **record) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def validate(self, params, step: int, count: int, bar) -> float:
        """Validation loss (and answer accuracy for task data) on ``count`` windows, printed and logged."""
        options = self.options
        loss = _evaluate(self.losses_fn, params, self.val_tokens, options.length, count, options.batch)
        message = f"step {step}: validation loss {loss:.4f} ({bits_per_byte(loss):.3f} bits/byte)"
        accuracy = _task_accuracy(self.hits_fn, params, self.val_tasks, options.batch) if self.val_tasks else {}
        if accuracy:
            message += "; answer accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items())
        (bar.write if bar is not None else print)(message)
        self.log(step=step, split="validation", loss=loss, bits_per_byte=bits_per_byte(loss), windows=count,
                 accuracy=accuracy)
        return loss


class _Trained(NamedTuple):
    """Where the step loop ended.

    Attributes:
      params: the parameters after the last step.
      train_losses: ``(step, loss)`` for every step taken.
      val: ``(step, loss)`` of each periodic validation.
      stop: the step the loop stopped at.
      interrupted: ``should_stop`` stopped it before the planned stop.
    """

    params: Any
    train_losses: list[tuple[int, float]]
    val: list[tuple[int, float]]
    stop: int
    interrupted: bool


def _step_loop(run: _Run, start: int, params, opt_state, data_rng: np.random.Generator,
               should_stop: Callable[[], bool] | None) -> _Trained:
    """Steps from ``start`` to the stop step, with logging, checkpoints and periodic validation."""
    options = run.options
    stop = options.steps if options.stop_at is None else options.stop_at
    train_losses: list[tuple[int, float]] = []
    val: list[tuple[int, float]] = []
    bar = tqdm(total=stop, initial=min(start, stop), disable=not options.progress, desc="train", unit="step")
    started = time.perf_counter()
    interrupted = False
    try:
        for step in range(start, stop):
            windows, weights = _batch(options, run.train_tokens, data_rng)
            params, opt_state, loss = run.train_step(params, opt_state, windows, weights)
            done = step + 1
            train_losses.append((done, float(loss)))
            bar.update(1)
            bar.set_postfix(loss=f"{train_losses[-1][1]:.3f}")
            if done % 10 == 0:
                run.log(step=done, split="train", loss=train_losses[-1][1])
            if done % options.save_every == 0 or done == stop:
                run.save(done, params, opt_state, data_rng)
            if options.eval_every and options.eval_windows and done % options.eval_every == 0:
                val.append((done, run.validate(params, done, options.eval_windows, bar)))
            if should_stop is not None and should_stop() and done < stop:
                if done % options.save_every:
                    run.save(done, params, opt_state, data_rng)
                interrupted, stop = True, done
                bar.write(f"stopped at step {done}; checkpoint saved in {run.workdir}")
                break
    finally:
        bar.close()
    if train_losses:
        elapsed = time.perf_counter() - started
        print(f"trained steps {start}..{stop} in {elapsed:.0f} s ({len(train_losses) / elapsed:.2f} steps/s)")
    return _Trained(params, train_losses, val, stop, interrupted)


def _final_evaluation(run: _Run, params, step: int, tokenizer: ByteTokenizer) -> dict[str, float]:
    """Validation and test (Persuasion) losses at the end of the run, and for task data the
    test answer accuracy; printed and logged."""
    options = run.options
    final = {"val": run.validate(params, step, options.final_eval_windows, None)}
    test_tokens = tokenizer.encode(load_split("test"))
    count = options.final_eval_windows
    final["test"] = _evaluate(run.losses_fn, params, test_tokens, options.length, count, options.batch)
    print(f"step {step}: test loss {final['test']:.4f} ({bits_per_byte(final['test']):.3f} bits/byte)")
    run.log(step=step, split="test", loss=final["test"], bits_per_byte=bits_per_byte(final["test"]), windows=count)
    if run.val_tasks:
        accuracy = _task_accuracy(run.hits_fn, params, _task_examples(options, test_tokens), options.batch)
        print(f"step {step}: test answer accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
        run.log(step=step, split="test", accuracy=accuracy)
        final.update({f"test_accuracy_{k}": v for k, v in accuracy.items()})
    return final


def train(options: TrainOptions, cfg: DecoderConfig = TINY, *,
          should_stop: Callable[[], bool] | None = None) -> TrainResult:
    """Train (or resume training) a decoder on the Austen train split.

    Args:
      options: the run's settings.
      cfg: the model's shape (tests pass a smaller one).
      should_stop: asked after every step; when it returns True the run saves a
        checkpoint at that step and returns (``interrupted``), so a job told to stop
        (SIGTERM, see :func:`main`) loses nothing. A run killed outright (SIGKILL)
        resumes from its last checkpoint, at most ``save_every`` steps back.

    Returns:
      The model and the losses seen; see :class:`TrainResult`.

    Raises:
      ValueError: see :func:`check_run`.
    """
    check_run(options, cfg)
    tokenizer = ByteTokenizer()
    train_tokens = tokenizer.encode(load_split("train"))
    val_tokens = tokenizer.encode(load_split("validation"))
    workdir = Path(options.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    graphdef, params = nnx.split(_initial_model(options, cfg), nnx.Param)
    optimizer = (options.steps, options.lr, options.warmup, options.end_lr_ratio, options.weight_decay, options.clip)
    tx, train_step, losses_fn, hits_fn = _compiled(graphdef, optimizer)
    val_tasks = _task_examples(options, val_tokens) if options.data == "tasks" else []
    checkpoints, start, params, opt_state, data_rng = _restore(options, cfg, workdir, params, tx.init(params))
    # A fresh run starts a fresh log; a resumed one carries on with its own.
    metrics = (workdir / "metrics.jsonl").open("a" if start else "w")
    run = _Run(options, workdir, train_tokens, val_tokens, val_tasks, train_step, losses_fn, hits_fn,
               checkpoints, metrics)

    trained = _step_loop(run, start, params, opt_state, data_rng, should_stop)
    final: dict[str, float] = {}
    if trained.stop == options.steps and options.final_eval_windows and not trained.interrupted:
        final = _final_evaluation(run, trained.params, trained.stop, tokenizer)
    metrics.close()

    model = nnx.merge(graphdef, trained.params)
    if options.export is not None and not trained.interrupted:
        print(f"exported parameters to {save_params(model, options.export)}")
    return TrainResult(model=model, start_step=start, step=trained.stop, train_losses=trained.train_losses,
                       val=trained.val, final=final, interrupted=trained.interrupted)


def _parser() -> argparse.ArgumentParser:
    defaults = TrainOptions()
    p = make_parser(PROG, __doc__)
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps in the whole run")
    p.add_argument("--batch", type=int, default=defaults.batch, help="windows per step")
    p.add_argument("--length", type=int, default=defaults.length, help="bytes per window")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (None: 5%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW decay of matrices")
    p.add_argument("--clip", type=float, default=defaults.clip, help="gradient global-norm clip")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seeds the parameters and the data sampler")
    p.add_argument("--workdir", default=defaults.workdir, help="checkpoints and metrics.jsonl")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue from the latest checkpoint in --workdir (--no-resume deletes them)")
    p.add_argument("--save-every", type=int, default=defaults.save_every, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=defaults.keep, help="checkpoints kept")
    p.add_argument("--eval-every", type=int, default=defaults.eval_every, help="steps between validations (0: none)")
    p.add_argument("--eval-windows", type=int, default=defaults.eval_windows, help="windows per validation")
    p.add_argument("--final-eval-windows", type=int, default=defaults.final_eval_windows,
                   help="windows for the final validation and test losses (0: skip)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step; the schedule still follows --steps")
    p.add_argument("--export", default=None, metavar="DIR", help="write the final parameters here for load_tiny")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    p.add_argument("--data", default=defaults.data, choices=("text", "tasks"),
                   help="plain prose, or the controlled recall tasks of flsmem.models.tasks")
    p.add_argument("--init", default=None, metavar="DIR", help="start from parameters saved here (else random)")
    p.add_argument("--answer-weight", type=float, default=defaults.answer_weight,
                   help="extra loss weight of answer digits (--data tasks)")
    p.add_argument("--fresh-tokens", default=defaults.fresh_tokens,
                   help="characters whose embeddings are redrawn after --init (the task symbols)")
    p.add_argument("--tasks", type=lambda text: tuple(text.split(",")), default=defaults.tasks,
                   help="comma-separated task kinds of --data tasks (default: all of flsmem.models.tasks.TASKS)")
    p.add_argument("--task-eval", type=int, default=defaults.task_eval,
                   help="validation examples per task for the answer accuracy (--data tasks)")
    return p


def main(argv: list[str] | None = None) -> TrainResult:
    """Command-line entry point.

    SIGTERM (what schedulers and preemption send before killing a job) makes the run
    finish its step, save a checkpoint and exit with status 143; the same command
    then resumes there.
    """
    args = vars(_parser().parse_args(argv))
    with checking(PROG):
        options = TrainOptions(**args)
        check_run(options)
    result = stop_on_sigterm(lambda should_stop: train(options, should_stop=should_stop))
    if result.interrupted:
        raise SystemExit(128 + signal.SIGTERM)
    return result


if __name__ == "__main__":
    main()
