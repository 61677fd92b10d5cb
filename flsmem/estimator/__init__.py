"""A learned importance estimator, trained online from the labels that mature H queries
after each decision.

A small :class:`ImportanceNet` scores every slot from cheap per-slot features. The
label it learns is free: ``horizon`` queries after a snapshot of a slot's features,
the slot's demonstrated utility over those queries is known,

    label = log(1 + peak over the next ``horizon`` queries of w_s * n_s * a_s(i)),

with w_s the correctness weight of query s and n_s * a_s(i) the attention relative to
uniform (n_s the items the query could attend, so 1 means "as much as any item", and
the label means the same at every memory size); the "sum" label adds the queries up
instead. The policy ranks slots by the predicted label, so it decides at commit lag
H = 0 without paying the lag's memory.

The package, one concern a module:

* :mod:`~flsmem.estimator.network`: the :class:`ImportanceNet`, its fresh parameters
  (:func:`init_params`, :data:`PRIORS`) and :class:`Weights`, parameters frozen into a
  policy;
* :mod:`~flsmem.estimator.evidence`: the evidence each slot gathers and the
  :data:`FEATURES` read from it;
* :mod:`~flsmem.estimator.labels`: snapshots in flight, their labels and the optimizer
  step; :func:`flush` at a stream's end and :func:`carry_over` between runs;
* :mod:`~flsmem.estimator.learner`: the :func:`learned` policy and its typed
  :class:`LearnedParams`, and :func:`guided` (a learner behind another policy);
* :mod:`~flsmem.estimator.io`: :func:`save`, :func:`load`, :func:`load_settings`,
  :func:`load_optimizer` and :func:`from_checkpoint`.
"""

from flsmem.estimator.evidence import FEATURES, features
from flsmem.estimator.io import from_checkpoint, load, load_optimizer, load_settings, save
from flsmem.estimator.labels import carry_over, flush
from flsmem.estimator.learner import GuidedParams, LearnedParams, guided, learned
from flsmem.estimator.network import PRIORS, ImportanceNet, Weights, init_params, predict

__all__ = [
    "FEATURES",
    "GuidedParams",
    "ImportanceNet",
    "LearnedParams",
    "PRIORS",
    "Weights",
    "carry_over",
    "features",
    "flush",
    "from_checkpoint",
    "guided",
    "init_params",
    "learned",
    "load",
    "load_optimizer",
    "load_settings",
    "predict",
    "save",
]
