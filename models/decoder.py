"""A Llama-style decoder in ``flax.nnx`` whose KV cache is a flsmem memory per layer.

RMSNorm, rotary position embeddings (half-split, as in Hugging Face Llama),
grouped-query attention and a gated MLP; options add what Gemma 3 has on top: q/k
norms, norms after attention and MLP, a scaled embedding, GeGLU, and sliding-window
(local) layers with their own RoPE base. One code path serves two uses:

* ``model(tokens)``: plain causal self-attention over the sequence (training, and the
  reference that the memory path must reproduce with the ``full`` policy);
* ``model(tokens, positions, memories)``: each layer hands its queries, keys and values
  to :func:`flsmem.attend`, the same public door a user's own attention layer uses,
  and returns the attention (query heads reduced per KV head by the memory's policy)
  that :func:`flsmem.update_layers` folds in once the caller knows how correct the
  predictions were.

The cache goes in and out explicitly: ``(tokens, memories) -> (logits, memories,
attention)``, where ``memories`` is a :class:`Memories`: the global layers' memories
under the caller's policy and budget (``evictable``), and the local layers' memories,
which keep exactly their window and are not evicted by the policy (``windows``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

import flsmem
from flsmem.typing import Array, Float, Int

__all__ = ["DecoderConfig", "Decoder", "Memories", "LayerInfo", "TINY", "SMOLLM2_135M", "ACTIVATIONS", "init_memories", "rope"]

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


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
      activation: the gated MLP's activation, a key of :data:`ACTIVATIONS` ("silu":
        SwiGLU; "gelu_tanh": GeGLU, Gemma).
      qk_norm: queries and keys are RMS-normed per head before the rotation (Gemma 3).
      post_norms: the attention and MLP outputs are RMS-normed before the residual
        add (Gemma 2 and 3).
      embed_scale: the embeddings are multiplied by this (Gemma: sqrt(width)).
      attention_scale: logit scale (``head_dim ** -0.5`` if None).
      sliding_window: the local layers' window: a query sees itself and the
        ``sliding_window - 1`` positions before it.
      local_layers: indices of the sliding-window layers (the others are global).
      local_rope_theta: RoPE base of the local layers (``rope_theta`` if None).
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
    activation: str = "silu"
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: float = 1.0
    attention_scale: float | None = None
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None

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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        object.__setattr__(self, "local_layers", tuple(self.local_layers))
        if sorted(set(self.local_layers)) != list(self.local_layers) or not set(self.local_layers) <= set(
                range(self.depth)):
            raise ValueError(f"local_layers must be increasing layer indices below depth {self.depth}, "
                             f"got {self.local_layers}")
        if len(self.local_layers) == self.depth:
            raise ValueError("at least one layer must be global: local_layers names every layer")
        if bool(self.local_layers) != (self.sliding_window is not None):
            raise ValueError("sliding_window and local_layers go together: give both or neither")
        if self.sliding_window is not None and not (isinstance(self.sliding_window, int) and self.sliding_window >= 1):
            raise ValueError(f"sliding_window must be an int >= 1, got {self.sliding_window!r}")

    @classmethod
    def from_dict(cls, fields: dict) -> "DecoderConfig":
        """The config saved as ``dataclasses.asdict`` (JSON); fields it lacks take their defaults."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields {sorted(unknown)}")
        factors = fields.get("rope_factors")
        return cls(**{**fields, "rope_factors": None if factors is None else tuple(factors),
                      "local_layers": tuple(fields.get("local_layers", ()))})

    @property
    def group(self) -> int:
        """G, query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to the whole context: the ones eviction controls."""
        return tuple(i for i in range(self.depth) if i not in self.local_layers)


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


@struct.dataclass
class Memories:
    """Every layer's KV memory.

    Attributes:
      evictable: the global layers' memories, stacked ``[L_global, ...]``, under the
        caller's :class:`flsmem.MemoryConfig` (policy, budget, schedule).
      windows: the local (sliding-window) layers' memories, stacked, each keeping
        exactly its window under the ``window`` policy; None when every layer is global.
    """

    evictable: flsmem.MemoryState
    windows: flsmem.MemoryState | None = None

    def fold(self, attention, correctness=None, future=None) -> "Memories":
        """The global layers' step folded in (:func:`flsmem.update_layers`); the local
        layers folded theirs already."""
        return self.replace(evictable=flsmem.update_layers(self.evictable, attention, correctness, future))

    def observe(self, attention, correctness=None, future=None) -> "Memories":
        """The global layers' evidence of a prefill chunk folded in, nothing evicted
        (:func:`flsmem.observe_layers`); :meth:`compress` cuts them at the end."""
        return self.replace(evictable=flsmem.observe_layers(self.evictable, attention, correctness, future))

    def compress(self, attention=None, correctness=None, future=None, budget=None) -> "Memories":
        """The global layers cut to ``budget`` after a prefill (:func:`flsmem.compress`);
        ``attention`` None when the prefill's evidence was observed chunk by chunk."""
        return self.replace(evictable=flsmem.compress(self.evictable, attention, correctness, future, budget=budget))


class LayerInfo(struct.PyTreeNode):
    """What the scan hands each block: its index in its own stack (global or local),
    whether it is local, and its RoPE base."""

    slot: Int[Array, ""]
    local: Array
    theta: Array


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
        self.q = linear(cfg.width, cfg.q_heads * cfg.head_dim, cfg.qkv_bias)
        self.k = linear(cfg.width, cfg.kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v = linear(cfg.width, cfg.kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o = linear(cfg.q_heads * cfg.head_dim, cfg.width)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def __call__(self, x, positions, memories: Memories | None, layer: LayerInfo, window: int | None = None,
                 placed=None):
        """Attention of ``x``; with ``memories`` the new keys and values go into this
        layer's memory (global or local, by ``layer``) and the queries attend over it
        (:func:`flsmem.attend`). ``placed``: the global layers' placements from
        :func:`flsmem.place` when the bookkeeping was done for all of them at once."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q(x).reshape(b, t, cfg.kv_heads, cfg.group, cfg.head_dim)
        k = self.k(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q, positions, layer.theta, cfg.rope_factors)
        k = rope(k, positions, layer.theta, cfg.rope_factors)
        v = self.v(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        scale = cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale
        if memories is None:
            out = self._causal(q, k, v, positions, scale, layer, window)
            return self.o(out.reshape(b, t, -1)), None, None
        out, memories, attention = _attend_memories(cfg, memories, q, k, v, positions, scale, layer, placed)
        return self.o(out.reshape(b, t, -1)), memories, attention

    def _causal(self, q, k, v, positions, scale, layer: LayerInfo, window: int | None):
        """Plain causal attention over the sequence; local layers see their window only."""
        logits = jnp.einsum("BTKGD,BSKD->BKGTS", q, k) * scale
        gap = positions[:, None, None, :, None] - positions[:, None, None, None, :]
        allowed = (gap >= 0) if window is None else (gap >= 0) & (gap <= window)
        if self.cfg.sliding_window is not None:
            allowed = allowed & ((gap < self.cfg.sliding_window) | ~layer.local)
        probs = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
        return jnp.einsum("BKGTS,BSKD->BTKGD", probs, v)


def _attend_memories(cfg: DecoderConfig, memories: Memories, q, k, v, positions, scale, layer: LayerInfo, placed):
    """One layer's :func:`flsmem.attend`: a global layer writes into and attends over its
    evictable memory and returns its evidence for the caller to fold; a local layer
    does so in its window memory, folding there (its policy needs no correctness), and
    returns zero evidence in the global layers' shape."""

    def global_layer(memories):
        mine = None if placed is None else jax.tree.map(lambda a: a[layer.slot], placed)
        out, evictable, attention = flsmem.attend(memories.evictable, q, k, v, positions, fold=False, scale=scale,
                                                  layer=layer.slot, placement=mine)
        return out, memories.replace(evictable=evictable), attention

    if memories.windows is None:
        return global_layer(memories)

    def local_layer(memories):
        out, windows, _ = flsmem.attend(memories.windows, q, k, v, positions, scale=scale, layer=layer.slot,
                                        window=cfg.sliding_window)
        evidence = jax.eval_shape(global_layer, memories)[2]
        return out, memories.replace(windows=windows), jnp.zeros(evidence.shape, evidence.dtype)

    return jax.lax.cond(layer.local, local_layer, global_layer, memories)


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.width, cfg.hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.width, use_bias=False, rngs=rngs)
        self.activation = cfg.activation

    def __call__(self, x):
        return self.down(ACTIVATIONS[self.activation](self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)
        self.attn_post_norm = RMSNorm(cfg.width, cfg.norm_eps) if cfg.post_norms else None
        self.mlp_post_norm = RMSNorm(cfg.width, cfg.norm_eps) if cfg.post_norms else None

    def __call__(self, x, positions, memories, layer: LayerInfo, window=None, placed=None):
        h, memories, attention = self.attn(self.attn_norm(x), positions, memories, layer, window, placed)
        x = x + (h if self.attn_post_norm is None else self.attn_post_norm(h))
        h = self.mlp(self.mlp_norm(x))
        return x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h)), memories, attention


class Decoder(nnx.Module):
    """The decoder. ``model(tokens)`` or ``model(tokens, positions, memories)``.

    The blocks are stored stacked (every parameter has a leading layer axis) and run
    with ``lax.scan``, so one block is compiled whatever the depth; the memories of all
    layers are stacked likewise (:class:`Memories`).
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
        memories: Memories | None = None,
        window: int | None = None,
    ):
        """Logits for each token.

        Args:
          tokens: ``[B, T]`` token ids.
          positions: ``[B, T]`` absolute positions (default ``0 .. T-1``).
          memories: every layer's memories (:func:`init_memories`), or None for plain
            causal attention over ``tokens``.
          window: plain path only: each query attends to itself and the ``window``
            positions before it (sliding-window attention on every layer).

        Returns:
          ``(logits [B, T, V], memories, attention)``; with memories, ``attention`` is
          the global layers' ``[L_global, B, K, T, S]`` for :meth:`Memories.fold`;
          else both are None.
        """
        positions = self._check(tokens, positions, memories, window)
        graphdef, stacked = nnx.split(self.blocks)

        placed = None
        if memories is not None and memories.evictable.config.policy.init_evidence is None:
            evictable, placed = flsmem.place(memories.evictable, positions)
            memories = memories.replace(evictable=evictable)

        # The memories ride in the carry (updated in place at each layer's index), not
        # in the scanned inputs and outputs, which would copy every cache per step.
        def layer(carry, per_layer):
            x, memories = carry
            params, info = per_layer
            x, memories, attention = nnx.merge(graphdef, params)(x, positions, memories, info, window, placed)
            return (x, memories), attention

        x = self.embed(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embed_scale, x.dtype)
        (x, memories), attention = jax.lax.scan(layer, (x, memories), (stacked, _layers(self.cfg)))
        if attention is not None and self.cfg.local_layers:
            attention = attention[jnp.asarray(self.cfg.global_layers)]
        x = self.norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return logits.astype(jnp.float32), memories, attention

    def _check(self, tokens, positions, memories, window):
        """``positions`` (the default ``0 .. T-1`` if None), after checking every argument."""
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
            if not isinstance(memories, Memories):
                raise ValueError(f"memories must be the decoder's Memories (init_memories), got {type(memories).__name__}")
            for name, layers in (("evictable", self.cfg.global_layers), ("windows", self.cfg.local_layers)):
                stack = getattr(memories, name)
                depth = None if stack is None else stack.valid.shape[0] if stack.valid.ndim == 4 else -1
                if depth != (len(layers) or None):
                    raise ValueError(
                        f"memories.{name} must be stacked over the {len(layers)} "
                        f"{'global' if name == 'evictable' else 'local'} layers (init_memories), got "
                        f"{'None' if stack is None else f'valid of shape {stack.valid.shape}'}")
            if window is not None:
                raise ValueError("window applies to the plain path; with memories, use the window policy")
        return positions


def _layers(cfg: DecoderConfig) -> LayerInfo:
    """Per-layer scan inputs: index within its own stack, local or not, RoPE base."""
    local = [i in cfg.local_layers for i in range(cfg.depth)]
    slots, counts = [], [0, 0]
    for is_local in local:
        slots.append(counts[is_local])
        counts[is_local] += 1
    local_theta = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    return LayerInfo(slot=jnp.asarray(slots, jnp.int32), local=jnp.asarray(local),
                  theta=jnp.asarray([local_theta if f else cfg.rope_theta for f in local], jnp.float32))


def init_memories(cfg: DecoderConfig, config: flsmem.MemoryConfig, batch: int, dtype=jnp.float32, *,
                  window_chunk: int | None = None) -> Memories:
    """Empty KV memories of every layer: the global layers' under ``config``, stacked
    ``[L_global, ...]``; the local layers', each holding exactly its window (the
    ``window`` policy at ``budget = sliding_window``, on ``config``'s schedule).

    ``window_chunk``: the most items one write adds to a window (default:
    ``config.max_chunk``). A caller that sizes ``max_chunk`` so that the global layers
    hold a whole prompt until one cut passes the pieces it feeds: the windows evict as
    they go, so slots beyond those would only be attended over masked."""
    if window_chunk is not None and (isinstance(window_chunk, bool) or not isinstance(window_chunk, int)
                                     or window_chunk < 1):
        raise ValueError(f"window_chunk must be None or an int >= 1, got {window_chunk!r}")
    kv = functools.partial(flsmem.init_kv, batch=batch, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=dtype)
    windows = None
    if cfg.local_layers:
        local = config.replace(policy=flsmem.policies.window(), budget=cfg.sliding_window,
                               max_chunk=config.max_chunk if window_chunk is None else window_chunk)
        windows = kv(local, layers=len(cfg.local_layers))
    return Memories(evictable=kv(config, layers=len(cfg.global_layers)), windows=windows)
