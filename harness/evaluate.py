"""Streaming teacher-forced evaluation of eviction policies on a decoder.

Every policy runs the same windows of held-out text with the same model, side by side.
A window of ``context + 1`` tokens is fed in chunks of ``evict_every`` tokens: the
decoder writes each chunk into its per-layer memories, predicts every token of the chunk,
and then ``flsmem.update`` folds each query's attention (weighted by how correct its
prediction was) and evicts when the memory reaches ``budget + evict_every``. With
budgets that are multiples of the chunk, this is exactly what per-token decode with the
same ``evict_every`` computes.

Two protocols:

* ``stream``: the whole window is streamed under the budget (a long generation);
* ``prefill``: the first ``prefill_fraction`` of the window is prefilled with the full
  cache, compressed once to the budget (``flsmem.evict(state, budget=...)``), and the
  rest is scored with the compressed cache plus its own new tokens, the way kvpress
  evaluates compression.

The oracle scores each slot by the attention it will receive from later queries in a
full-cache run of the same window.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flsmem
from flsmem import estimator as E
from flsmem import policies as P
from flsmem.models.decoder import Decoder, DecoderConfig, init_memories
from flsmem.oracle_future import discounted_future

__all__ = [
    "CORRECTNESS",
    "LEARNED_NAMES",
    "POLICY_NAMES",
    "SLOT_COUNTS",
    "learned_policy",
    "estimator_for",
    "check_estimator",
    "make_policy",
    "is_policy_name",
    "split_settings",
    "split_policies",
    "check_policies",
    "PEER_NAMES",
    "BUDGET_WRAPPERS",
    "evaluate_nll",
    "evaluate_windows",
    "future_attention",
    "run_comparison",
]

LN2 = math.log(2.0)
# The oracle's look-ahead: future attention discounted by this per step (about 50
# steps), so what the next queries need outranks what every later query only glances at.
ORACLE_DISCOUNT = 0.98


def _hard(logp, targets, key):
    return (jnp.argmax(logp, axis=-1) == targets).astype(jnp.float32)


def _soft(logp, targets, key):
    return jnp.exp(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])


def _confidence(logp, targets, key):
    return jnp.exp(jnp.max(logp, axis=-1))


def _certainty(logp, targets, key):
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return 1.0 - entropy / math.log(logp.shape[-1])


def _sampled(logp, targets, key):
    emitted = jax.random.categorical(key, logp, axis=-1)
    return jnp.exp(jnp.take_along_axis(logp, emitted[..., None], axis=-1)[..., 0])


def _ones(logp, targets, key):
    return jnp.ones(targets.shape, jnp.float32)


# Correctness weights ``f(log_probs [.., V], targets [..], key) -> [..]`` in [0, 1]:
# teacher-forced (they need the target) and serving proxies (they do not).
CORRECTNESS: dict[str, Callable] = {
    "hard": _hard,  # argmax equals the target
    "soft": _soft,  # probability of the target
    "confidence": _confidence,  # maximum probability (= the emitted token's, under greedy decoding)
    "certainty": _certainty,  # 1 - entropy / log V
    "sampled": _sampled,  # probability of a token sampled at temperature 1 (the emitted one, when sampling)
    "none": _ones,
}

POLICY_NAMES = (
    "full", "oracle", "streaming_llm", "window", "h2o", "tova", "scissorhands", "snapkv",
    "key_norm", "random", "ema", "rmm", "kalman", "adaptive", "lag_window", "use_recency", "surprise",
    "surprise_reserve",
)
# Names of the comparison that are a registry policy under settings of their own.
REGISTRY_NAMES = {"surprise_reserve": "surprise"}
# The learned estimator at H = 0: pretrained and still learning, pretrained and frozen,
# and learning from a fresh network. Not in the default comparison: they need the
# pretrained checkpoint (checkpoints/estimator).
LEARNED_NAMES = ("learned", "learned_offline", "learned_scratch")
# kvpress's peers that are not in the default comparison: ExpectedAttention (built for
# the model at hand), and the budget wrappers that take any of the names, "adakv(rmm)".
PEER_NAMES = ("expected_attention",)
BUDGET_WRAPPERS = ("adakv", "pyramid")
ADAKV_FLOOR = 0.2
ESTIMATOR_DIR = Path(str(resources.files("flsmem.checkpoints"))) / "estimator"
# Estimators pretrained on one model's own traces; every other model gets ESTIMATOR_DIR.
MODEL_ESTIMATORS = {"smollm2-135m": ESTIMATOR_DIR.parent / "estimator-smollm2"}


def estimator_for(model: str) -> Path:
    """The shipped estimator checkpoint that the learned policies use on ``model`` (a name
    of :data:`flsmem.models.catalog.MODELS` or a GGUF path): its own where one was
    pretrained on its traces (:data:`MODEL_ESTIMATORS`), else :data:`ESTIMATOR_DIR`."""
    return MODEL_ESTIMATORS.get(model, ESTIMATOR_DIR)


def check_estimator(path: str | None) -> None:
    """The ``--estimator`` option: None (the shipped one) or a checkpoint folder.

    Raises:
      ValueError: naming ``--estimator``, when ``path`` holds no ``params/`` folder.
    """
    if path is not None and not (Path(path) / "params").is_dir():
        raise ValueError(f"--estimator must be a folder holding an estimator checkpoint (a params/ folder), "
                         f"got {path!r}")


def learned_policy(name: str, path: str = str(ESTIMATOR_DIR)) -> P.Policy:
    """One of :data:`LEARNED_NAMES`, with the settings of the pretrained estimator at
    ``path`` (the scratch variant too, so the three differ only in their start and in
    whether they learn)."""
    variants = {"learned": {}, "learned_offline": {"online": False}, "learned_scratch": {"fresh": True}}
    if name not in variants:
        raise ValueError(f"learned policy must be one of {LEARNED_NAMES}, got {name!r}")
    return E.from_checkpoint(path, learning_rate=ONLINE_LEARNING_RATE, **variants[name])


# Serving updates move the pretrained estimator more gently than pretraining did.
ONLINE_LEARNING_RATE = 1e-4


def split_policies(text: str) -> list[str]:
    """The names of a comma-separated list; commas inside parentheses do not split
    (``adaptive(horizon=256, forget=0.999),h2o`` is two names)."""
    return [p.strip() for p in re.split(r",(?![^()]*\))", text) if p.strip()]


def split_settings(name: str) -> tuple[str, dict]:
    """``(base, settings)`` of a policy name that sets keywords of its factory,
    ``adaptive(horizon=256)`` -> ``("adaptive", {"horizon": 256})``; any other name is
    ``(name, {})``. Values are Python literals (numbers, booleans, strings, tuples).

    Raises:
      ValueError: naming the policy, when the parentheses hold keyword settings that are
        not ``keyword=literal`` pairs.
    """
    found = re.fullmatch(r"(\w+)\((\s*\w+\s*=.*)\)", name)
    if not found:
        return name, {}
    base, body = found.groups()
    try:
        call = ast.parse(f"f({body})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise ValueError
        settings = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError):
        raise ValueError(f"policy {name!r}: settings must be keyword=value pairs of literals, "
                         f"as in adaptive(horizon=256, forget=0.999)") from None
    return base, settings


def is_policy_name(name: str) -> bool:
    """Whether :func:`make_policy` knows ``name``: one of :data:`POLICY_NAMES`,
    :data:`LEARNED_NAMES` or :data:`PEER_NAMES`, one of :data:`POLICY_NAMES` with settings
    of its factory (``adaptive(horizon=256)``), or one of those wrapped by
    :data:`BUDGET_WRAPPERS` (``adakv(h2o)``, ``pyramid(snapkv)``). The settings' keywords
    and values are checked when the policy is made."""
    wrapped = re.fullmatch(r"(\w+)\((.+)\)", name)
    if wrapped and wrapped.group(1) in BUDGET_WRAPPERS:
        return is_policy_name(wrapped.group(2))
    try:
        base, settings = split_settings(name)
    except ValueError:
        return False
    return base in POLICY_NAMES if settings else name in POLICY_NAMES + LEARNED_NAMES + PEER_NAMES


def check_policies(option: str, names: Sequence[str], budget: int) -> None:
    """Build each name of ``names`` that has settings at ``budget``, so that a bad keyword
    or value is reported before any model is loaded.

    Raises:
      ValueError: naming ``option`` and the policy, with the factory's complaint (its
        keywords, or the value's allowed range).
    """
    for name in names:
        if "=" in name:
            try:
                make_policy(name, budget)
            except (ValueError, TypeError) as error:
                raise ValueError(f"{option} {name}: {error}") from None


# Settings that count slots of the memory: a fraction in (0, 1) is a share of the budget.
SLOT_COUNTS = ("recent", "lag", "sinks", "reserve", "history", "window")


def _slots(key: str, value, budget: int):
    """``value`` of the setting ``key``, a share of ``budget`` turned into slots when
    ``key`` counts slots and ``value`` is a fraction in (0, 1); otherwise as given."""
    if key in SLOT_COUNTS and isinstance(value, float) and 0.0 < value < 1.0:
        return int(value * budget)
    return value


def make_policy(name: str, budget: int, lag: int = 16, estimator: str | None = None,
                model: DecoderConfig | None = None) -> P.Policy:
    """The policy ``name`` with protection scaled to the budget.

    ``estimator`` is the checkpoint directory of the learned variants (default: the
    shipped one, :data:`ESTIMATOR_DIR`); ``model`` is the decoder's configuration, which
    ``expected_attention`` needs (its attention shape and RoPE) and ``adakv`` reads for
    its number of KV heads.

    Accumulating policies keep a recent window of half the budget, as H2O's paper does;
    ``rmm`` gets the same window so that its only difference from ``h2o`` is the
    correctness weighting, and so do ``adaptive`` (which mixes the two with EMA),
    ``surprise`` (h2o's sum behind the model's surprise), the oracle and the learned
    estimator (which has no commit lag); lags are capped at half
    the budget. ``surprise_reserve`` is ``surprise`` with a reserve of an eighth of the
    budget (a quarter of the slots the ranking fills): at most that many items are kept
    for their surprise, the others by h2o's ranking. ``expected_attention`` protects
    four sinks and no recent window, as kvpress does. ``adakv(name)`` shares each
    sequence's budget among its KV heads with kvpress's floor (0.2) and a ceiling that
    never binds (``K - 0.2 (K - 1)``); ``pyramid(name)`` spreads the budget over the
    layers when the prefix is compressed. A name with settings, ``adaptive(horizon=256)``
    or ``adakv(surprise(reserve=64))``, passes them to the factory over these defaults; a
    count of slots among them (:data:`SLOT_COUNTS`) given as a fraction in (0, 1),
    ``rmm(recent=0.875)``, is that share of the budget, rounded down, so one name is one
    policy at every budget.
    """
    wrapped = re.fullmatch(r"(\w+)\((.+)\)", name)
    if wrapped and wrapped.group(1) in BUDGET_WRAPPERS:
        inner = make_policy(wrapped.group(2), budget, lag, estimator, model)
        if wrapped.group(1) == "pyramid":
            return P.pyramid(inner)
        heads = model.kv_heads if model is not None else 2
        return P.adakv(inner, floor=ADAKV_FLOOR, ceiling=max(1.0, heads - ADAKV_FLOOR * (heads - 1)))
    if name == "expected_attention":
        if model is None:
            raise ValueError("expected_attention needs the model's configuration (model=...) for its "
                             "attention shape and RoPE")
        return P.expected_attention(head_dim=model.head_dim, group=model.group, rope_theta=model.rope_theta,
                                    rope_factors=model.rope_factors, sinks=min(4, budget))
    half = budget // 2
    lag = min(lag, half)
    name, overrides = split_settings(name)
    overrides = {key: _slots(key, value, budget) for key, value in overrides.items()}
    if overrides and name not in POLICY_NAMES:
        raise ValueError(f"policy settings apply to {POLICY_NAMES}, got {name!r} with {overrides}")
    if name in LEARNED_NAMES:
        # Decides at H = 0 (no commit lag) behind the same recent window as h2o and rmm.
        return learned_policy(name, str(estimator or ESTIMATOR_DIR)).replace(recent=half)
    if name not in POLICY_NAMES:
        raise ValueError(f"policy must be one of {POLICY_NAMES + LEARNED_NAMES + PEER_NAMES}, or one of those "
                         f"wrapped by {', '.join(BUDGET_WRAPPERS)} (adakv(h2o)), got {name!r}")
    # Keywords of each factory of flsmem.policies.REGISTRY, scaled to the budget.
    settings = {
        "streaming_llm": {"sinks": min(4, budget)},
        "h2o": {"recent": half},
        "surprise": {"recent": half},
        "surprise_reserve": {"recent": half, "reserve": budget // 8},
        "scissorhands": {"history": 32, "recent": half},
        "snapkv": {"window": max(1, min(32, half))},
        "ema": {"decay": 0.9, "recent": half},
        "rmm": {"lag": lag, "recent": half},
        "kalman": {"q": 0.01, "r": 1.0, "adaptive": True, "recent": half},
        "adaptive": {"lag": lag, "recent": half},
        "lag_window": {"lag": lag},
        "use_recency": {"lag": lag},
    }
    policy = P.make(REGISTRY_NAMES.get(name, name), **(settings.get(name, {}) | overrides))
    return policy.replace(recent=half) if name == "oracle" else policy


def _split(model: Decoder):
    graphdef, params = nnx.split(model)
    return graphdef, params


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "chunk", "correctness", "prefill", "collect"))
def _run(graphdef, params, windows, futures, aux, *, config, chunk, correctness, prefill, collect):
    """Per-token NLL and argmax hits ``[W, T]`` of a window batch, the attention (if
    collected), the memory summary and the policy's final state per layer."""
    model = nnx.merge(graphdef, params)
    w, length = windows.shape
    steps = length - 1
    inputs, targets = windows[:, :-1], windows[:, 1:]
    memories = init_memories(model.cfg, config, w)
    if aux is not None:
        layers = len(model.cfg.global_layers)
        per_layer = jax.tree.map(lambda x: jnp.broadcast_to(x, (layers,) + jnp.shape(x)), aux)
        evictable = memories.evictable
        merged = evictable.aux | per_layer if isinstance(aux, dict) else per_layer
        memories = memories.replace(evictable=evictable.replace(aux=merged))
    weigh = CORRECTNESS[correctness]
    nll_parts, hit_parts = [], []
    # The sampled correctness signal draws the same tokens in every run of a window.
    sample_key = jax.random.key(0)

    def gather_future(memories, t0, q):
        """Rows t0 .. t0+q of the future table read at each slot's position."""
        if futures is None:
            return None
        rows = jax.lax.dynamic_slice_in_dim(futures, t0, q, axis=3)  # [L, W, K, q, T]
        held = memories.evictable
        pos = jnp.clip(held.position, 0, steps - 1)[:, :, :, None, :]
        pos = jnp.broadcast_to(pos, rows.shape[:4] + pos.shape[-1:])
        return jnp.where(held.valid[:, :, :, None, :], jnp.take_along_axis(rows, pos, axis=-1), 0.0)

    def forward(memories, t0, q):
        tokens = jax.lax.dynamic_slice_in_dim(inputs, t0, q, axis=1)
        target = jax.lax.dynamic_slice_in_dim(targets, t0, q, axis=1)
        positions = jnp.broadcast_to(t0 + jnp.arange(q, dtype=jnp.int32)[None, :], (w, q))
        logits, memories, attention = model(tokens, positions, memories)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        hit = jnp.argmax(logp, axis=-1) == target
        return memories, attention, (nll, hit), weigh(logp, target, jax.random.fold_in(sample_key, t0))

    start = 0
    if prefill:
        # The prefix in chunks, each chunk's evidence folded and nothing evicted, then
        # cut to the budget at once: what compressing the whole prefix's attention
        # gives, with memory bounded by one chunk's attention and logits.
        def prefix(memories, t0):
            memories, attention, out, weight = forward(memories, t0, chunk)
            return memories.observe(attention, weight, gather_future(memories, t0, chunk)), out

        memories, (nll, hit) = jax.lax.scan(prefix, memories, jnp.arange(0, prefill, chunk, dtype=jnp.int32))
        memories = memories.compress(budget=config.budget)
        nll_parts.append(jnp.moveaxis(nll, 0, 1).reshape(w, -1))
        hit_parts.append(jnp.moveaxis(hit, 0, 1).reshape(w, -1))
        start = prefill

    def body(memories, t0):
        memories, attention, nll, weight = forward(memories, t0, chunk)
        memories = memories.fold(attention, weight, gather_future(memories, t0, chunk))
        return memories, (nll, attention if collect else None)

    starts = jnp.arange(start, steps, chunk, dtype=jnp.int32)
    memories, ((nll, hit), attention) = jax.lax.scan(body, memories, starts)
    nll_parts.append(jnp.moveaxis(nll, 0, 1).reshape(w, -1))
    hit_parts.append(jnp.moveaxis(hit, 0, 1).reshape(w, -1))
    held = memories.evictable
    stats = jax.vmap(flsmem.summary)(held)
    stats["held"] = jnp.where(held.valid, held.position, -1)  # [L, W, K, S]
    return jnp.concatenate(nll_parts, axis=1), jnp.concatenate(hit_parts, axis=1), attention, stats, held.aux


def future_attention(model: Decoder, windows: np.ndarray, chunk: int, discount: float = ORACLE_DISCOUNT) -> jax.Array:
    """``[L, W, K, T, T]``: entry ``[t, p]`` is the attention position p gets from the
    queries after t in a full-cache run, discounted by ``discount`` per step ahead:
    ``sum_{s > t} discount^(s - t - 1) A[s, p]`` (the oracle's knowledge of the future).
    """
    steps = windows.shape[1] - 1
    config = flsmem.MemoryConfig(policy=P.full(), budget=steps, max_chunk=chunk)
    graphdef, params = _split(model)
    _, _, attention, _, _ = _run(graphdef, params, jnp.asarray(windows), None, None, config=config, chunk=chunk,
                           correctness="none", prefill=0, collect=True)
    # [chunks, L, W, K, chunk, S]; the full cache keeps position p in slot p.
    a = jnp.moveaxis(attention, 0, 3)
    a = a.reshape(a.shape[:3] + (-1, a.shape[-1]))[..., :steps]  # [L, W, K, T, T]
    return discounted_future(a, discount)


def evaluate_nll(model: Decoder, windows: np.ndarray, policy: P.Policy, budget: int, **kwargs) -> tuple[np.ndarray, dict]:
    """Per-token negative log-likelihood (nats) ``[W, T]`` of ``windows [W, T + 1]``
    under ``policy`` at ``budget``, and the memory summary; see :func:`evaluate_windows`."""
    nll, _, stats = evaluate_windows(model, windows, policy, budget, **kwargs)
    return nll, stats


def evaluate_windows(
    model: Decoder,
    windows: np.ndarray,
    policy: P.Policy,
    budget: int,
    *,
    chunk: int = 16,
    correctness: str = "hard",
    prefill: int = 0,
    futures: jax.Array | None = None,
    aux=None,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Teacher-forced evaluation of ``windows [W, T + 1]`` under ``policy`` at ``budget``.

    ``aux``, when given, replaces the policy's initial state in every layer's memory
    (for a dict state, the entries it names: a learned estimator carried over from
    earlier batches with :func:`flsmem.estimator.carry_over`).

    Returns:
      ``(nll, hit, stats)``: per-token negative log-likelihood (nats) ``[W, T]``, whether
      the argmax prediction was the target ``[W, T]``, and the memory summary (``[L, W]``
      per figure) with ``stats["held"]``, the positions each memory holds at the end
      ``[L, W, K, S]`` (-1 for a free slot), and ``stats["aux"]``, the policy's final
      state per layer.
    """
    steps = windows.shape[1] - 1
    if (steps - prefill) % chunk or prefill % chunk:
        raise ValueError(f"the prefix ({prefill}) and the scored length ({steps - prefill}) must be multiples of "
                         f"evict_every ({chunk})")
    if correctness not in CORRECTNESS:
        raise ValueError(f"correctness must be one of {tuple(CORRECTNESS)}, got {correctness!r}")
    if policy.needs_future and futures is None:
        raise ValueError("futures (from future_attention) are required by the oracle")
    if policy.layer_schedule is not None and not prefill:
        raise ValueError(f"{policy.name}: layer budgets apply when a prefix is compressed (the prefill protocol), "
                         "as PyramidKV does; streamed, every layer keeps the same budget")
    if not policy.evicts:
        budget = steps
    if prefill:
        # No eviction after the cut (evict_every past the scored tokens), and room for the
        # whole prefix before it: the capacity, budget + evict_every + max_chunk - 1, is
        # at least the prefix.
        every = steps - prefill + 1
        config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=every,
                                     max_chunk=max(chunk, prefill - budget - every + 1))
    else:
        config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=chunk, max_chunk=chunk)
    graphdef, params = _split(model)
    nll, hit, _, stats, final_aux = _run(
        graphdef, params, jnp.asarray(windows), futures if policy.needs_future else None, aux,
        config=config, chunk=chunk, correctness=correctness, prefill=prefill, collect=False)
    stats = jax.device_get(stats)
    stats["aux"] = final_aux
    return np.asarray(nll), np.asarray(hit), stats


@dataclasses.dataclass
class Row:
    """One policy at one budget: mean NLL (nats/token) of the scored tokens, bits per
    byte, the NLL of each window (the unit that paired comparisons pair on), and the
    difference to the full cache and the gap closed between streaming_llm and the oracle."""

    policy: str
    budget: int
    nll: float
    bits_per_byte: float
    window_nll: list[float] = dataclasses.field(default_factory=list)
    delta_vs_full: float = float("nan")
    gap_closed: float = float("nan")


def run_comparison(
    model: Decoder,
    windows: np.ndarray,
    bytes_per_window: np.ndarray,
    budgets: Sequence[int],
    policy_names: Sequence[str] = POLICY_NAMES,
    *,
    chunk: int = 16,
    correctness: str = "hard",
    protocol: str = "stream",
    prefill_fraction: float = 0.75,
    progress: Callable[[str], None] | None = None,
    on_stats: Callable[[str, int, dict], None] | None = None,
    estimator: str | None = None,
) -> list[Row]:
    """Every policy at every budget on the same windows; full cache once.

    ``on_stats(policy, budget, stats)``, when given, receives each run's memory summary
    (see :func:`evaluate_windows`), so monitoring needs no second run. ``estimator`` is
    the learned policies' checkpoint (see :func:`make_policy`)."""
    if protocol not in ("stream", "prefill"):
        raise ValueError(f"protocol must be 'stream' or 'prefill', got {protocol!r}")
    steps = windows.shape[1] - 1
    prefill = 0
    if protocol == "prefill":
        prefill = int(round(steps * prefill_fraction / chunk)) * chunk
        if not 0 < prefill < steps:
            raise ValueError(f"prefill_fraction {prefill_fraction} leaves no prefix or no continuation")
    scored = slice(prefill, steps)
    scored_bytes = bytes_per_window[:, 1] if protocol == "prefill" else bytes_per_window[:, 0]
    futures = future_attention(model, windows, chunk) if "oracle" in policy_names else None

    def measure(name: str, budget: int) -> Row:
        if progress:
            progress(f"{name} @ {budget}")
        policy = make_policy(name, budget, estimator=estimator, model=model.cfg)
        nll, stats = evaluate_nll(model, windows, policy, budget, chunk=chunk, correctness=correctness,
                                  prefill=prefill, futures=futures)
        if on_stats:
            on_stats(name, budget, stats)
        nll = nll[:, scored]
        bpb = float(nll.sum() / LN2 / scored_bytes.sum())
        return Row(name, budget, float(nll.mean()), bpb, [float(x) for x in nll.mean(axis=1)])

    full = measure("full", steps)
    rows = [full]
    for budget in budgets:
        at = {name: measure(name, budget) for name in policy_names if name != "full"}
        floor = at.get("streaming_llm")
        ceiling = at.get("oracle")
        for row in at.values():
            row.delta_vs_full = row.nll - full.nll
            if floor and ceiling and ceiling.nll != floor.nll:
                row.gap_closed = (floor.nll - row.nll) / (floor.nll - ceiling.nll)
            rows.append(row)
    full.delta_vs_full = 0.0
    return rows
