"""A deliberately naive reference of the eviction process, in plain Python.

Nothing here imports jax or flsmem: every rule is re-derived from the published rule
of its policy (the docstrings of ``flsmem.policies``), one item at a time, with Python
floats (float64), so the test that compares the two shares no code with the library.
It is slow on purpose and meant for streams of a few dozen steps.

The process, per row (one batch row and KV head):

* at step t an item arrives at a caller-given position. Where it is stored does not
  matter: exact ties of scores go to the newer item (the later arrival step), as in
  the library, whatever its slot layout;
* query t gives attention a_t(p) to every item p the row holds, with correctness
  weight w_t; every item records the observation (``n``, the items the query could
  attend, is recorded too);
* scores are committed. ``age`` = queries seen since arrival (1 right after the query
  of the arrival step); a normalised policy divides its score by age + 1;
* when the row holds ``budget + evict_every`` items it is cut back to ``budget``:
  protected items (position < sinks, or age <= max(recent, lag)) stay, then the
  highest scores, equal scores by the newer item.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

__all__ = [
    "Observation", "Item", "Rule", "Row",
    "window", "streaming_llm", "h2o", "tova", "ema", "rmm", "scissorhands", "snapkv",
    "key_norm", "kalman", "oracle", "lag_window", "use_recency", "surprise", "RULES",
]


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one query showed one item."""

    step: int
    attention: float
    weight: float
    attended: int  # n: items the query could attend
    future: float | None


@dataclasses.dataclass
class Item:
    position: int
    birth: int
    key_norm: float | None
    history: list[Observation] = dataclasses.field(default_factory=list)
    # Scalar Kalman filter of the item (kalman rules only).
    mean: float = 0.0
    var: float = 0.0
    count: int = 0
    # Derivatives of mean and of var / r with respect to log(q / r) (adaptive only).
    dmean: float = 0.0
    dvar: float = 0.0


@dataclasses.dataclass(frozen=True)
class Rule:
    """A policy: its scoring rule and what it protects."""

    name: str
    score: Callable[["Rule", Item, "Row"], float]
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sinks: int = 0
    recent: int = 0
    lag: int = 0
    normalise_by_age: bool = False

    @property
    def p(self) -> Mapping[str, Any]:
        return self.params

    def replace(self, **changes) -> "Rule":
        return dataclasses.replace(self, **changes)


def _w(rule: Rule, o: Observation) -> float:
    return o.weight if rule.p.get("weighted", False) else 1.0


# ------------------------------------------------------------------ scoring rules


def _by_arrival(rule, item, row):
    return float(item.birth)


def _accumulated(rule, item, row):
    # H2O: every attention since arrival, summed.
    return sum(o.attention for o in item.history)


def _current(rule, item, row):
    # TOVA: the latest query's attention only.
    return item.history[-1].attention


def _decayed(rule, item, row):
    # sum_s decay^(t - s) (w_s) a_s; Python has 0.0 ** 0 == 1, so decay 0 is TOVA.
    now = row.step - 1
    d = rule.p["decay"]
    return sum(d ** (now - o.step) * _w(rule, o) * o.attention for o in item.history)


def _below_uniform_count(rule, item, row):
    # Scissorhands: minus the number of recent queries that gave less than 1/n.
    first = row.step - rule.p["history"]
    return -float(sum(1 for o in item.history if o.step >= first and o.attention < 1.0 / o.attended))


def _snapkv_votes(rule, item, row):
    first = row.step - rule.p["window"]
    return sum(_w(rule, o) * o.attention for o in item.history if o.step >= first)


def _snapkv(rule, item, row):
    # Pool the votes over the neighbouring items in position order: the window
    # [i - k//2, i + (k-1)//2] of the sorted held items; missing neighbours count as 0
    # for "avg" (divided by the full kernel size) and are skipped for "max".
    k = rule.p["kernel_size"]
    order = sorted(row.items.values(), key=lambda it: it.position)
    votes = [_snapkv_votes(rule, it, row) for it in order]
    i = next(j for j, it in enumerate(order) if it is item)
    lo, hi = max(0, i - k // 2), min(len(order), i + (k - 1) // 2 + 1)
    if rule.p["pooling"] == "max":
        return max(votes[lo:hi])
    return sum(votes[lo:hi]) / k


def _neg_key_norm(rule, item, row):
    return -item.key_norm


def _future(rule, item, row):
    return item.history[-1].future


def _lag_window(rule, item, row):
    # Inside the lag window (query ages 1 .. H + 1) add gamma^(H + 1 - age) (w) a;
    # each later query multiplies the frozen sum by decay_after.
    h, gamma, rho = rule.lag, rule.p["gamma"], rule.p["decay_after"]
    total, later = 0.0, 0
    for o in item.history:
        query_age = o.step + 1 - item.birth
        if query_age <= h + 1:
            total += gamma ** (h + 1 - query_age) * _w(rule, o) * o.attention
        else:
            later += 1
    return total * rho**later


def _use_recency(rule, item, row):
    # sum over uses of decay^(queries since the use); a use is attention above
    # uniform (1/n) or above the threshold when one is given.
    now = row.step - 1
    threshold = rule.p["use_threshold"]

    def used(o):
        return o.attention > (1.0 / o.attended if threshold is None else threshold)

    return sum(rule.p["decay"] ** (now - o.step) for o in item.history if used(o))


def _attended(item):
    # A / (1 + A), A the attention summed since arrival.
    total = sum(o.attention for o in item.history)
    return total / (1.0 + total)


def _surprise(item, row):
    # 1 - w of the query before the item's arrival (the prediction of the item; 1 for
    # the first item), plus A / (1 + A).
    produced = row.weights[item.birth - 1] if item.birth > 0 else 1.0
    return (1.0 - produced) + _attended(item)


def _surprise_first(rule, item, row):
    # Without a reserve, the surprise. With one, the `reserve` unprotected items of
    # highest surprise (equal ones by the newer) score 1 + surprise, the rest A / (1 + A).
    reserve = rule.p.get("reserve")
    if reserve is None:
        return _surprise(item, row)
    protected = row.protected()
    ranked = sorted((it for p, it in row.items.items() if p not in protected),
                    key=lambda it: (-_surprise(it, row), -it.birth))
    if item in ranked[:reserve]:
        return 1.0 + _surprise(item, row)
    return _attended(item)


def _kalman_mean(rule, item, row):
    return item.mean


# ---------------------------------------------------------------------- policies


def window() -> Rule:
    return Rule("window", _by_arrival)


def streaming_llm(sinks: int) -> Rule:
    return Rule("streaming_llm", _by_arrival, sinks=sinks)


def h2o(recent: int) -> Rule:
    return Rule("h2o", _accumulated, recent=recent)


def tova(recent: int) -> Rule:
    return Rule("tova", _current, recent=recent)


def ema(decay: float, *, weighted: bool, recent: int, lag: int) -> Rule:
    return Rule("ema", _decayed, {"decay": decay, "weighted": weighted}, recent=recent, lag=lag)


def rmm(lag: int, *, recent: int, decay: float) -> Rule:
    # Demonstrated utility: correctness-weighted accumulated attention.
    return Rule("rmm", _decayed, {"decay": decay, "weighted": True}, recent=recent, lag=lag)


def scissorhands(history: int, *, recent: int) -> Rule:
    return Rule("scissorhands", _below_uniform_count, {"history": history}, recent=recent)


def snapkv(window: int, *, kernel_size: int, pooling: str) -> Rule:
    # The observation window's own items are protected.
    return Rule("snapkv", _snapkv, {"window": window, "kernel_size": kernel_size,
                                    "pooling": pooling}, recent=window)


def key_norm(leaf: str = "k") -> Rule:
    return Rule("key_norm", _neg_key_norm, {"leaf": leaf})


def oracle() -> Rule:
    return Rule("oracle", _future)


def lag_window(lag: int, *, gamma: float, decay_after: float, weighted: bool) -> Rule:
    return Rule("lag_window", _lag_window,
                {"gamma": gamma, "decay_after": decay_after, "weighted": weighted}, lag=lag)


def use_recency(lag: int, *, decay: float, use_threshold: float | None) -> Rule:
    return Rule("use_recency", _use_recency, {"decay": decay, "use_threshold": use_threshold},
                lag=lag)


def surprise(recent: int, reserve: int | None = None) -> Rule:
    return Rule("surprise", _surprise_first, {"reserve": reserve}, recent=recent)


def kalman(q: float, r: float, *, adaptive: bool, beta: float, weighted: bool,
           recent: int, lag: int) -> Rule:
    return Rule("kalman", _kalman_mean, {"q": q, "r": r, "adaptive": adaptive, "beta": beta,
                                         "weighted": weighted}, recent=recent, lag=lag)


RULES = {f.__name__: f for f in (window, streaming_llm, h2o, tova, ema, rmm, scissorhands,
                                 snapkv, key_norm, oracle, lag_window, use_recency, kalman, surprise)}


# --------------------------------------------------------------------------- a row


class Row:
    """One row of memory under a rule, advanced one item and one query at a time."""

    def __init__(self, rule: Rule, budget: int, evict_every: int, slots: int):
        self.rule = rule
        self.budget = budget
        self.evict_every = evict_every
        self.slots = slots
        self.items: dict[int, Item] = {}
        self.step = 0
        self.weights: list[float] = []  # each query's correctness weight, by step
        if rule.name == "kalman" and rule.p["adaptive"]:
            q, r = rule.p["q"], rule.p["r"]
            # The estimate: log(q / r) (kept in [1e-8, 1e4]), r, and the running mean
            # of dmean^2, started from the given q and r.
            log_x = min(max(math.log(max(q / r, 1e-30)), math.log(1e-8)), math.log(1e4))
            self.estimate = [log_x, r, 0.0]

    # -- arrivals and queries

    def arrive(self, position: int, key: list[float] | None = None) -> None:
        assert len(self.items) < self.slots, (
            "the reference row overflowed: eviction was not run on schedule")
        assert position not in self.items, f"position {position} arrived twice"
        norm = None if key is None else math.sqrt(sum(float(x) ** 2 for x in key))
        self.items[position] = Item(position, self.step, norm)

    def query(self, attention: Mapping[int, float], weight: float = 1.0,
              future: Mapping[int, float] | None = None) -> None:
        n = len(self.items)
        for p, item in self.items.items():
            item.history.append(Observation(
                self.step, float(attention[p]), float(weight), n,
                None if future is None else float(future[p])))
        if self.rule.name == "kalman":
            self._kalman_query()
        self.weights.append(float(weight))
        self.step += 1

    def _kalman_query(self) -> None:
        """Predict P += q, update with z: K = P / (P + r), m += K (z - m),
        P = (1 - K) P; the first measurement sets m = z, P = r.

        Adaptive: each item also tracks dmean = d m / d theta, theta = log(q / r), from
        the same recursion in units of r (P / r becomes K, so d(P / r) = dK, with
        dK = (d(P / r) + q / r) / ((P + q + r) / r)^2). After the query theta moves by
        beta * mean(innovation * dmean) / max(curvature, this query's mean(dmean^2)),
        at most 1 either way, the curvature being the running mean of mean(dmean^2);
        r by the running mean of innovation^2 / ((P + q + r) / r). Means are over the
        items that had a prediction (count >= 1).
        """
        rule = self.rule
        if rule.p["adaptive"]:
            # This query is filtered with the estimate made before it.
            log_x, r, _ = self.estimate
            r = max(r, 1e-12)
            q = math.exp(log_x) * r
        else:
            q, r = rule.p["q"], rule.p["r"]
        grads, infos, scaled = [], [], []
        for item in self.items.values():
            o = item.history[-1]
            z = _w(rule, o) * o.attention
            if item.count == 0:
                item.mean, item.var, item.dmean, item.dvar = z, r, 0.0, 0.0
            else:
                predicted = item.var + q
                spread = predicted + r
                gain = predicted / spread
                innovation = z - item.mean
                grads.append(innovation * item.dmean)
                infos.append(item.dmean ** 2)
                scaled.append(innovation ** 2 * r / spread)
                dgain = (item.dvar + q / r) * (r / spread) ** 2
                item.mean += gain * innovation
                item.var = (1.0 - gain) * predicted
                item.dmean = (1.0 - gain) * item.dmean + dgain * innovation
                item.dvar = dgain
            item.count += 1
        if rule.p["adaptive"] and grads:
            beta = rule.p["beta"]
            log_x, r_est, info = self.estimate
            now = sum(infos) / len(infos)
            info = (1 - beta) * info + beta * now
            step = beta * (sum(grads) / len(grads)) / max(info, now, 1e-30)
            step = min(max(step, -1.0), 1.0)
            log_x = min(max(log_x + step, math.log(1e-8)), math.log(1e4))
            r_est = (1 - beta) * r_est + beta * sum(scaled) / len(scaled)
            self.estimate = [log_x, r_est, info]

    # -- scores and eviction

    def age(self, item: Item) -> int:
        return self.step - item.birth

    def scores(self) -> dict[int, float]:
        """Committed score of every item the row holds."""
        out = {}
        for p, item in self.items.items():
            s = self.rule.score(self.rule, item, self)
            if self.rule.normalise_by_age:
                s = s / (self.age(item) + 1)
            out[p] = s
        return out

    def protected(self) -> set[int]:
        limit = max(self.rule.recent, self.rule.lag)
        return {p for p, it in self.items.items()
                if p < self.rule.sinks or self.age(it) <= limit}

    def select(self, budget: int | None = None) -> set[int]:
        """The positions eviction keeps now: all when not due; else the protected ones,
        then the highest scores (equal scores by the newer item) up to the budget."""
        held = set(self.items)
        if budget is None:
            if len(held) < self.budget + self.evict_every:
                return held
            budget = self.budget
        elif len(held) <= budget:
            return held
        keep = self.protected()
        assert len(keep) <= budget, "more protected items than the budget"
        scores = self.scores()
        rest = sorted(held - keep, key=lambda p: (-scores[p], -self.items[p].birth))
        return keep | set(rest[: budget - len(keep)])

    def keep(self, positions: set[int]) -> None:
        """Free every item not in ``positions``."""
        assert positions <= set(self.items)
        self.items = {p: it for p, it in self.items.items() if p in positions}

    def update(self, attention, weight=1.0, future=None) -> set[int]:
        """One query, then eviction when due; returns the kept positions."""
        self.query(attention, weight, future)
        kept = self.select()
        self.keep(kept)
        return kept
