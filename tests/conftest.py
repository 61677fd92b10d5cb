"""Test settings shared by the suite: shape bugs fail loudly."""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
