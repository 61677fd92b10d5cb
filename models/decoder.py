"""A Llama-style decoder in ``flax.nnx`` whose KV cache is a flsmem memory per layer.

RMSNorm, rotary position embeddings (half-split, as in Hugging Face Llama),
grouped-query attention and a SwiGLU MLP. One code path serves two uses:

* ``model(tokens)``: plain causal self-attention over the sequence (training, and the
  reference that the memory path must reproduce with the ``full`` policy);
* ``model(tokens, positions, memories)``: each layer writes its new keys and values
  into its memory, attends over the memory's visible slots, and returns the attention
  (query heads reduced per KV head by the memory's policy) that ``flsmem.update``
  folds in once the caller knows how correct the predictions were.

The cache goes in and out explicitly: ``(tokens, memories) -> (logits, memories,
attention)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import flsmem
from flsmem.typing import Array, Float, Int
from flsmem.write import write_slots

__all__ = ["DecoderConfig", "Decoder", "TINY", "SMOLLM2_135M", "init_memories", "update_memories", "rope"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape of a decoder.

    Attributes:
      vocab_size: tokens in the vocabulary.
      width: model width.
      depth: number of blocks.
      q_heads: query heads.
      kv_heads: key/value heads (K); ``q_heads`` must be a multiple (G per KV head).
      head_dim: D.
      hidden: SwiGLU hidden width.
      rope_theta: base of the rotary frequencies.
      norm_eps: RMSNorm epsilon.
      max_len: longest context trained or supported.
      tie_embeddings: the output projection is the embedding matrix.
    """

    vocab_size: int
    width: int
    depth: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_len: int = 512
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "width", "depth", "q_heads", "kv_heads", "head_dim", "hidden", "max_len"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group(self) -> int:
        """G, query heads per KV head."""
        return self.q_heads // self.kv_heads


# Byte-level: trained here on CPU in minutes.
TINY = DecoderConfig(vocab_size=256, width=128, depth=4, q_heads=4, kv_heads=2, head_dim=32,
                     hidden=384, rope_theta=10000.0, max_len=512)
# SmolLM2-135M(-Instruct), loaded from its GGUF file by flsmem.models.smollm2.
SMOLLM2_135M = DecoderConfig(vocab_size=49152, width=576, depth=30, q_heads=9, kv_heads=3, head_dim=64,
                             hidden=1536, rope_theta=100000.0, max_len=8192)


def rope(x: Float[Array, "B T *H D"], positions: Int[Array, "B T"], theta: float) -> Float[Array, "B T *H D"]:
    """Rotary embedding, half-split convention: pairs are (i, i + D/2)."""
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angle = positions.astype(jnp.float32)[..., None] * freq[None, None, :]  # [B, T, D/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[2:])
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, width: int, eps: float):
        self.scale = nnx.Param(jnp.ones((width,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        ms = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        scale = self.scale[...].reshape((1,) * (x.ndim - 1) + (-1,))
        return (x * jax.lax.rsqrt(ms + self.eps) * scale).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.q = linear(cfg.width, cfg.q_heads * cfg.head_dim)
        self.k = linear(cfg.width, cfg.kv_heads * cfg.head_dim)
        self.v = linear(cfg.width, cfg.kv_heads * cfg.head_dim)
        self.o = linear(cfg.q_heads * cfg.head_dim, cfg.width)

    def __call__(self, x, positions, memories: flsmem.MemoryState | None, window: int | None = None,
                 layer=None, placed=None):
        """Attention of ``x``; with ``memories`` (all layers', stacked) the new keys and
        values go into layer ``layer``'s memory and the queries attend over it.
        ``placed``: this layer's ``(target slots, visible mask)`` when the memory's
        bookkeeping was done for all layers at once (:func:`_place`), else None."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = rope(self.q(x).reshape(b, t, cfg.kv_heads, cfg.group, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(self.k(x).reshape(b, t, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = self.v(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        scale = cfg.head_dim ** -0.5
        if memories is None:
            logits = jnp.einsum("BTKGD,BSKD->BKGTS", q, k) * scale
            gap = positions[:, None, None, :, None] - positions[:, None, None, None, :]
            causal = (gap >= 0) if window is None else (gap >= 0) & (gap <= window)
            probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
            out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v)
            return self.o(out.reshape(b, t, -1)), None, None
        kv = {"k": jnp.swapaxes(k, 1, 2), "v": jnp.swapaxes(v, 1, 2)}  # [B, K, T, D]
        if placed is None:
            # This layer's bookkeeping here, since the policy's new evidence reads the
            # payload. The payload in `memory` is only read for its shapes, so its slice
            # is never made.
            memory = jax.tree.map(lambda a: a[layer], memories)
            memory, target = write_slots(memory, kv, positions)
            visible = flsmem.visible(memory, t)
            memories = jax.tree.map(
                lambda stacked, one: stacked.at[layer].set(one),
                memories.replace(payload=None), memory.replace(payload=None),
            ).replace(payload=memories.payload)
        else:
            target, visible = placed
        # The caches of all layers stay in one stacked array, carried through the layer
        # loop: the new items are written there in place. (Taking this layer's cache out
        # and putting it back would copy it twice per step.)
        bi = jnp.arange(b)[:, None, None]
        ki = jnp.arange(cfg.kv_heads)[None, :, None]
        payload = jax.tree.map(
            lambda cache, new: cache.at[layer, bi, ki, target].set(new.astype(cache.dtype), mode="drop"),
            memories.payload, kv,
        )
        logits = jnp.einsum("BTKGD,BKSD->BKGTS", q, payload["k"][layer]) * scale
        probs = jax.nn.softmax(jnp.where(visible[:, :, None], logits, -jnp.inf), axis=-1)  # visible [B, K, 1, T, S]
        out = jnp.einsum("BKGTS,BKSD->BTKGD", probs, payload["v"][layer])
        attention = flsmem.reduce_query_heads(probs, memories.config.policy)  # [B, K, T, S]
        return self.o(out.reshape(b, t, -1)), memories.replace(payload=payload), attention


def _place(memories: flsmem.MemoryState, positions):
    """The memory bookkeeping of a write in every layer at once, before the layer loop.

    Where the new items go, and what each query may see, depend on the memories only,
    not on the keys and values the layers are about to compute (for policies whose new
    evidence does not read them), so the L layers of B sequences are written as one
    memory of L * B sequences: a few operations instead of a few per layer.

    Returns:
      ``(memories, (target [L, B, K, T], visible [L, B, K, T, S]))``; the payload is
      left for each layer to write at ``target``.
    """
    depth, batch = memories.step.shape
    t = positions.shape[1]
    fold = lambda x: x.reshape((depth * batch,) + x.shape[2:])  # noqa: E731
    unfold = lambda x: x.reshape((depth, batch) + x.shape[1:])  # noqa: E731
    flat = jax.tree.map(fold, memories)
    # Read for their shapes only: nothing computed from them is kept.
    items = jax.tree.map(lambda p: jnp.zeros(p.shape[:2] + (t,) + p.shape[3:], p.dtype), flat.payload)
    flat, target = write_slots(flat, items, jnp.tile(positions, (depth, 1)))  # row l * B + b is sequence b
    visible = flsmem.visible(flat, t)
    memories = jax.tree.map(unfold, flat.replace(payload=None)).replace(payload=memories.payload)
    return memories, (unfold(target), unfold(visible))


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, memories, window=None, layer=None, placed=None):
        h, memories, attention = self.attn(self.attn_norm(x), positions, memories, window, layer, placed)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), memories, attention


class Decoder(nnx.Module):
    """The decoder. ``model(tokens)`` or ``model(tokens, positions, memories)``.

    The blocks are stored stacked (every parameter has a leading layer axis) and run
    with ``lax.scan``, so one block is compiled whatever the depth; the memories of all
    layers are one stacked :class:`flsmem.MemoryState` likewise.
    """

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)

        @nnx.split_rngs(splits=cfg.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nnx.Linear(cfg.width, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"] | None = None,
        memories: flsmem.MemoryState | None = None,
        window: int | None = None,
    ):
        """Logits for each token.

        Args:
          tokens: ``[B, T]`` token ids.
          positions: ``[B, T]`` absolute positions (default ``0 .. T-1``).
          memories: the layers' memories stacked on a leading layer axis
            (:func:`init_memories`), or None for plain causal attention over ``tokens``.
          window: plain path only: each query attends to itself and the ``window``
            positions before it (sliding-window attention).

        Returns:
          ``(logits [B, T, V], memories, attention)``; with memories, ``attention`` is
          ``[L, B, K, T, S]`` for :func:`update_memories`; else both are None.
        """
        if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
            raise ValueError(f"tokens must be an int array [B, T], got {jnp.result_type(tokens)}{list(jnp.shape(tokens))}")
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        elif jnp.shape(positions) != (b, t) or not jnp.issubdtype(jnp.result_type(positions), jnp.integer):
            raise ValueError(
                f"positions must be an int array [B, T] = {[b, t]}, got "
                f"{jnp.result_type(positions)}{list(jnp.shape(positions))}"
            )
        if memories is not None:
            depth = memories.valid.shape[0] if memories.valid.ndim == 4 else None
            if depth != self.cfg.depth:
                raise ValueError(
                    f"memories must be stacked over the {self.cfg.depth} layers (init_memories), "
                    f"got valid of shape {memories.valid.shape}"
                )
            if window is not None:
                raise ValueError("window applies to the plain path; with memories, use the window policy")
        graphdef, stacked = nnx.split(self.blocks)

        placed = None
        if memories is not None and memories.config.policy.init_evidence is None:
            memories, placed = _place(memories, positions)

        # The memories ride in the carry (updated in place at each layer's index), not
        # in the scanned inputs and outputs, which would copy every cache per step.
        def layer(carry, per_layer):
            x, memories = carry
            params, index, placed = per_layer
            x, memories, attention = nnx.merge(graphdef, params)(x, positions, memories, window, index, placed)
            return (x, memories), attention

        (x, memories), attention = jax.lax.scan(
            layer, (self.embed(tokens), memories), (stacked, jnp.arange(self.cfg.depth), placed)
        )
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32), memories, attention


def init_memories(cfg: DecoderConfig, config: flsmem.MemoryConfig, batch: int, dtype=jnp.float32) -> flsmem.MemoryState:
    """Empty KV memories of every layer, stacked on a leading layer axis ``[L, ...]``."""
    spec = {"k": (cfg.head_dim,), "v": (cfg.head_dim,)}
    one = flsmem.init(config, batch, cfg.kv_heads, spec, dtype)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (cfg.depth,) + x.shape), one)


def update_memories(memories, attention, correctness=None, future=None):
    """``flsmem.update`` for every layer of stacked memories.

    Args:
      memories: stacked memories ``[L, ...]``.
      attention: ``[L, B, K, Q, S]`` from the decoder, or ``[L, B, K, S]`` for one query.
      correctness: ``[B, Q]`` (or ``[B]``), shared by the layers.
      future: ``[L, B, K, Q, S]`` for the oracle, else None.
    """
    # No step touches the payload (the keys and values): keep it out of the loops below,
    # which would otherwise copy every layer's cache once more per step.
    payload = memories.payload
    memories = memories.replace(payload=None)
    rows = _state_is_per_row(memories)
    if jnp.ndim(attention) == 4 and rows:  # one query: [L, B, K, S]
        memories = _update_one_query(memories, attention, correctness, future)
    elif jnp.ndim(attention) == 4:
        # A policy state shared by a layer's rows (the learned estimator's network) cannot
        # be folded into rows: one query per layer, as a chunk of one.
        expand = lambda x: None if x is None else x[:, :, :, None]  # noqa: E731
        return update_memories(memories.replace(payload=payload), expand(attention),
                               None if correctness is None else jnp.reshape(correctness, (-1, 1)), expand(future))
    elif jnp.shape(attention)[3] == 1 and (correctness is None or jnp.ndim(correctness) == 2) and rows:
        squeeze = lambda x: None if x is None else x[:, :, :, 0]  # noqa: E731
        memories = _update_one_query(memories, squeeze(attention),
                                     None if correctness is None else correctness[:, 0], squeeze(future))
    else:
        # A chunk: query by query in every layer. A loop over layers (not vmap) keeps
        # each layer's eviction a real branch; each layer's memory is written back in
        # place (lax.map would stack a fresh copy of every layer's state at every step).
        def layer(i, memories):
            at = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, i, keepdims=False)  # noqa: E731
            one = flsmem.update(jax.tree.map(at, memories), at(attention), correctness, at(future))
            return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, i, 0), memories, one)

        memories = jax.lax.fori_loop(0, attention.shape[0], layer, memories)
    return memories.replace(payload=payload)


def _state_is_per_row(memories) -> bool:
    """Whether every entry of the policy state has one row per sequence (axis 1 after
    the layers), so the L layers of B sequences can be updated as L * B rows; a shared
    entry (the learned estimator's network) cannot be folded."""
    specs = flsmem.state.aux_axes(memories)
    return specs is None or all(len(spec) and spec[0] == "batch" for spec in jax.tree.leaves(specs))


def _update_one_query(memories, attention, correctness, future):
    """``flsmem.update`` of one query in every layer: the decode hot path.

    Every step of the memory treats each batch row on its own, so the L layers of B
    sequences are updated as one memory of L * B sequences: a few large operations
    instead of a few small ones per layer, and one real branch around eviction (due
    in every layer at the same steps) instead of one per layer.
    """
    depth, batch = memories.step.shape
    fold = lambda x: x.reshape((depth * batch,) + x.shape[2:])  # noqa: E731
    unfold = lambda x: x.reshape((depth, batch) + x.shape[1:])  # noqa: E731
    if correctness is not None:
        correctness = jnp.tile(jnp.asarray(correctness), depth)  # row l * B + b is sequence b
    flat = jax.tree.map(fold, memories)
    flat = flsmem.update(flat, fold(attention), correctness, None if future is None else fold(future))
    return jax.tree.map(unfold, flat)
