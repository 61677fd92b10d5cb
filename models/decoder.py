"""A Llama-style decoder in ``flax.nnx`` whose KV cache is a flsmem memory per layer.

RMSNorm, rotary position embeddings (half-split, as in Hugging Face Llama),
grouped-query attention and a SwiGLU MLP. One code path serves two uses:

* ``model(tokens)``: plain causal self-attention over the sequence (training, and the
  reference that the memory path must reproduce with the ``full`` policy);
* ``model(tokens, positions, memories)``: each layer hands its queries, keys and values
  to :func:`flsmem.attend`, the same public door a user's own attention layer uses,
  and returns the attention (query heads reduced per KV head by the memory's policy)
  that :func:`flsmem.update_layers` folds in once the caller knows how correct the
  predictions were.

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

__all__ = ["DecoderConfig", "Decoder", "TINY", "SMOLLM2_135M", "init_memories", "rope"]


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
      qkv_bias: the q, k and v projections have biases (Qwen2).
      rope_factors: per-frequency divisors of the rotary frequencies (Llama 3.1's
        long-context scaling), D/2 of them, or None.
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
    qkv_bias: bool = False
    rope_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "width", "depth", "q_heads", "kv_heads", "head_dim", "hidden", "max_len"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_factors is not None and len(self.rope_factors) != self.head_dim // 2:
            raise ValueError(f"rope_factors must hold head_dim / 2 = {self.head_dim // 2} values, "
                             f"got {len(self.rope_factors)}")

    @classmethod
    def from_dict(cls, fields: dict) -> "DecoderConfig":
        """The config saved as ``dataclasses.asdict`` (JSON); fields it lacks take their defaults."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields {sorted(unknown)}")
        factors = fields.get("rope_factors")
        return cls(**{**fields, "rope_factors": None if factors is None else tuple(factors)})

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


def rope(x: Float[Array, "B T *H D"], positions: Int[Array, "B T"], theta: float,
         factors: tuple[float, ...] | None = None) -> Float[Array, "B T *H D"]:
    """Rotary embedding, half-split convention: pairs are (i, i + D/2); ``factors``
    divide the D/2 frequencies (long-context scaling)."""
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    if factors is not None:
        freq = freq / jnp.asarray(factors, jnp.float32)
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
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
        self.q = linear(cfg.width, cfg.q_heads * cfg.head_dim, cfg.qkv_bias)
        self.k = linear(cfg.width, cfg.kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v = linear(cfg.width, cfg.kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o = linear(cfg.q_heads * cfg.head_dim, cfg.width)

    def __call__(self, x, positions, memories: flsmem.MemoryState | None, window: int | None = None,
                 layer=None, placed=None):
        """Attention of ``x``; with ``memories`` (all layers', stacked) the new keys and
        values go into layer ``layer``'s memory and the queries attend over it
        (:func:`flsmem.attend`). ``placed``: this layer's placement from
        :func:`flsmem.place` when the bookkeeping was done for all layers at once."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = rope(self.q(x).reshape(b, t, cfg.kv_heads, cfg.group, cfg.head_dim), positions, cfg.rope_theta,
                 cfg.rope_factors)
        k = rope(self.k(x).reshape(b, t, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta, cfg.rope_factors)
        v = self.v(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        scale = cfg.head_dim ** -0.5
        if memories is None:
            logits = jnp.einsum("BTKGD,BSKD->BKGTS", q, k) * scale
            gap = positions[:, None, None, :, None] - positions[:, None, None, None, :]
            causal = (gap >= 0) if window is None else (gap >= 0) & (gap <= window)
            probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
            out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v)
            return self.o(out.reshape(b, t, -1)), None, None
        out, memories, attention = flsmem.attend(memories, q, k, v, positions, fold=False, layer=layer,
                                                 placement=placed)
        return self.o(out.reshape(b, t, -1)), memories, attention


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
          ``[L, B, K, T, S]`` for :func:`flsmem.update_layers`; else both are None.
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
            memories, placed = flsmem.place(memories, positions)

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
    return flsmem.init_kv(config, batch, cfg.kv_heads, cfg.head_dim, layers=cfg.depth, dtype=dtype)
