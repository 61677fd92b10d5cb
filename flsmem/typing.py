"""The one legend of dimension letters used across flsmem.

Einsum strings, jaxtyping annotations and docstrings all use these letters:

====  =====================================================================
B     batch (independent sequences)
K     key/value heads: each (batch, KV head) pair is one *row* of memory
G     query heads per KV head (grouped-query attention)
Q     queries (or items) in a chunk fed at once
S     slots of the memory (its capacity: ``budget + evict_every + max_chunk - 1``)
D     head dimension of a key or value
R     rows given to the top-k kernel (``B * K``)
N     entries per row given to the top-k kernel
====  =====================================================================
"""

from typing import Any

import jax
from jaxtyping import Array, Bool, Float, Int

__all__ = ["Array", "Bool", "Float", "Int", "PyTree", "PRNGKey"]

PyTree = Any
PRNGKey = jax.Array
