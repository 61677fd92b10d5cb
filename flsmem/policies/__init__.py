"""Eviction policies: how evidence is folded and how a slot's score is committed.

What a policy is and what every policy shares lives in :mod:`~flsmem.policies.base`;
the policies come in families, one module each: :mod:`~flsmem.policies.recency`
(full, window, StreamingLLM), :mod:`~flsmem.policies.accumulate` (H2O, TOVA, EMA, RMM
and the two presets), :mod:`~flsmem.policies.windowed` (Scissorhands, SnapKV),
:mod:`~flsmem.policies.at_write` (key norm, random), :mod:`~flsmem.policies.kalman`,
:mod:`~flsmem.policies.adaptive` (measure or accumulate, chosen online),
:mod:`~flsmem.policies.expected` (ExpectedAttention), :mod:`~flsmem.policies.surprise`
(the model's surprise at an item first) and :mod:`~flsmem.policies.oracle`;
:mod:`~flsmem.policies.budgets` wraps any of them with budgets per KV head (AdaKV) or
per layer (PyramidKV). :data:`REGISTRY` maps each name to its factory and
:func:`make` builds one by name. The learned estimator's policy lives in
:mod:`flsmem.estimator`.
"""

from flsmem.policies.accumulate import (
    DecayParams,
    LagWindowParams,
    UseRecencyParams,
    ema,
    h2o,
    lag_window,
    rmm,
    tova,
    use_recency,
)
from flsmem.policies.adaptive import AdaptiveParams, adaptive
from flsmem.policies.at_write import KeyNormParams, RandomParams, key_norm, random
from flsmem.policies.base import HEAD_REDUCTIONS, Observation, Params, Policy, SlotView, with_columns
from flsmem.policies.budgets import HeadBudget, LayerSchedule, adakv, layer_budgets, pyramid
from flsmem.policies.expected import ExpectedAttentionParams, expected_attention
from flsmem.policies.kalman import KalmanParams, kalman
from flsmem.policies.oracle import oracle
from flsmem.policies.recency import full, streaming_llm, window
from flsmem.policies.registry import REGISTRY, WRAPPERS, make
from flsmem.policies.surprise import SurpriseParams, surprise
from flsmem.policies.windowed import SnapKVParams, scissorhands, snapkv

__all__ = [
    "AdaptiveParams",
    "adaptive",
    "DecayParams",
    "ExpectedAttentionParams",
    "HeadBudget",
    "LayerSchedule",
    "WRAPPERS",
    "adakv",
    "expected_attention",
    "layer_budgets",
    "pyramid",
    "HEAD_REDUCTIONS",
    "KalmanParams",
    "KeyNormParams",
    "LagWindowParams",
    "Observation",
    "Params",
    "Policy",
    "REGISTRY",
    "RandomParams",
    "SlotView",
    "SnapKVParams",
    "SurpriseParams",
    "UseRecencyParams",
    "ema",
    "full",
    "h2o",
    "kalman",
    "key_norm",
    "lag_window",
    "make",
    "oracle",
    "random",
    "rmm",
    "scissorhands",
    "snapkv",
    "streaming_llm",
    "surprise",
    "tova",
    "use_recency",
    "window",
    "with_columns",
]
