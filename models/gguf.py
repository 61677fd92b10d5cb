"""GGUF files loaded into :class:`flsmem.models.decoder.Decoder`.

Architectures ``llama`` (SmolLM2, TinyLlama, Llama 3.x), ``qwen2`` (q/k/v biases) and
``gemma3`` (GeGLU, q/k norms, norms after attention and MLP, scaled embedding, five
sliding-window layers in six). Everything comes from the file: the shape (layers,
width, heads, grouped KV heads, MLP width), RoPE base and frequency factors, norm
epsilon, sliding window, tied or separate output matrix, and the tokenizer
(:mod:`flsmem.models.tokenizer`). Tensors are dequantised to float32 with the ``gguf``
package's own dequantisation, then cast.

Gemma 3's files leave three settings to the reader, which takes llama.cpp's values:
the local/global pattern (layer i is local unless ``i % 6 == 5``), the local layers'
RoPE base (10,000) and the logit scale (``head_dim ** -0.5``). Its norm weights are
stored with Gemma's ``1 +`` already added by the converter, so they are used as they are.

Two conversions matter when mapping GGUF tensors onto the decoder:

* GGUF stores a matrix as ``[out, in]`` (PyTorch layout); ``nnx.Linear`` kernels are
  ``[in, out]``, so every projection is transposed.
* For ``llama``, llama.cpp rotates adjacent pairs ``(2i, 2i + 1)`` and its converter
  permutes the rows of each Q and K head to match; our
  :func:`flsmem.models.decoder.rope` rotates half-split pairs ``(i, i + D/2)``, as
  Hugging Face does, so :func:`unpermute_rope` undoes the permutation. ``qwen2`` files
  already use half-split pairs.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flsmem.models.decoder import Decoder, DecoderConfig
from flsmem.models.tokenizer import Tokenizer

__all__ = ["ARCHITECTURES", "TENSOR_TYPES", "read", "decoder_config", "unpermute_rope", "load", "load_weights"]

ARCHITECTURES = ("llama", "qwen2", "gemma3")
# llama.cpp's fixed Gemma 3 settings (see the module docstring).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
_GGUF_MAGIC = b"GGUF"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError('Reading GGUF files needs the "gguf" package: pip install -e ".[real]"') from None
    return gguf


def read(path: str | pathlib.Path):
    """A ``gguf.GGUFReader`` of ``path``, with a clear error for a missing or foreign file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with {_GGUF_MAGIC!r})")
    return _open(str(path.resolve()), path.stat().st_mtime_ns)


# Parsing the metadata takes seconds for a large vocabulary (15 s for Gemma's 262,144
# tokens), and a command reads the tokenizer before the weights: the reader of the
# unchanged file is kept.
@functools.lru_cache(maxsize=2)
def _open(path: str, mtime: int):
    return _gguf().GGUFReader(path)


def _field(reader, key: str, default=None):
    """A metadata value (scalars as Python values, arrays as lists); ``default`` when
    absent, or an error naming the key if there is no default."""
    if key in reader.fields:
        return reader.fields[key].contents()
    if default is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    return default


def decoder_config(reader) -> DecoderConfig:
    """The decoder shape the file describes.

    Raises:
      ValueError: the architecture is not one of :data:`ARCHITECTURES`.
    """
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    width, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = get("vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens"))
    factors = tensors.get("rope_freqs.weight")
    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported; supported: none, or llama3-style "
                         f"rope_freqs factors")
    depth, head_dim = int(get("block_count")), int(
        get("attention.key_length", 0) or get("rope.dimension_count", 0) or width // heads)
    gemma = arch == "gemma3"
    window = int(get("attention.sliding_window", 0)) if gemma else 0
    return DecoderConfig(
        vocab_size=int(vocab),
        width=width,
        depth=depth,
        q_heads=heads,
        kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        hidden=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_len=int(get("context_length")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        rope_factors=None if factors is None else tuple(float(x) for x in _dequantize(factors)),
        activation="gelu_tanh" if gemma else "silu",
        qk_norm=gemma,
        post_norms=gemma,
        embed_scale=float(np.sqrt(width)) if gemma else 1.0,
        sliding_window=window or None,
        local_layers=tuple(i for i in range(depth) if i % _GEMMA3_PATTERN != _GEMMA3_PATTERN - 1) if window else (),
        local_rope_theta=_GEMMA3_LOCAL_THETA if window else None,
    )


def unpermute_rope(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation, back to the half-split layout.

    The converter reorders each head's ``D`` output rows from ``[2, D/2]`` (half-split
    pairs ``(i, i + D/2)``) to ``[D/2, 2]`` (adjacent pairs); swapping the two axes back
    gives the rows :func:`flsmem.models.decoder.rope` expects.

    Args:
      w: ``[heads * D, ...]`` projection (or bias) in GGUF row order.
      head_dim: D.
    """
    rows = w.shape[0]
    return w.reshape((rows // head_dim, head_dim // 2, 2) + w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    """A tensor as float32 in numpy order (the reverse of the GGUF shape)."""
    gguf = _gguf()
    kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
    if kind not in TENSOR_TYPES:
        raise ValueError(f"tensor {tensor.name} has type {kind}, which is not supported; "
                         f"supported: {', '.join(TENSOR_TYPES)}")
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def _layer(take, cfg: DecoderConfig, i: int, permute: bool) -> dict:
    """Block ``i``'s parameters, renamed to the decoder's names."""
    p = f"blk.{i}."
    rope_rows = (lambda w: unpermute_rope(w, cfg.head_dim)) if permute else (lambda w: w)  # noqa: E731

    def linear(name, rows=lambda w: w, bias=False):
        out = {"kernel": np.ascontiguousarray(rows(take(p + name + ".weight")).T)}  # [out, in] -> [in, out]
        if bias:
            out["bias"] = rows(take(p + name + ".bias"))
        return out

    attn = {
        "q": linear("attn_q", rope_rows, cfg.qkv_bias),
        "k": linear("attn_k", rope_rows, cfg.qkv_bias),
        "v": linear("attn_v", bias=cfg.qkv_bias),
        "o": linear("attn_output"),
    }
    if cfg.qk_norm:
        attn |= {"q_norm": {"scale": take(p + "attn_q_norm.weight")}, "k_norm": {"scale": take(p + "attn_k_norm.weight")}}
    block = {
        "attn_norm": {"scale": take(p + "attn_norm.weight")},
        "attn": attn,
        "mlp_norm": {"scale": take(p + "ffn_norm.weight")},
        "mlp": {"gate": linear("ffn_gate"), "up": linear("ffn_up"), "down": linear("ffn_down")},
    }
    if cfg.post_norms:
        block |= {"attn_post_norm": {"scale": take(p + "post_attention_norm.weight")},
                  "mlp_post_norm": {"scale": take(p + "post_ffw_norm.weight")}}
    return block


def load_weights(reader, cfg: DecoderConfig, dtype=jnp.float32) -> Decoder:
    """A ``Decoder(cfg)`` holding the file's tensors, dequantised and cast to ``dtype``.

    Raises:
      ValueError: a tensor is missing, left over, of another shape, or of an
        unsupported type.
    """
    raw = {t.name: t for t in reader.tensors}
    raw.pop("rope_freqs.weight", None)  # read into the config

    def take(name: str) -> np.ndarray:
        if name not in raw:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        return _dequantize(raw.pop(name))

    permute = _field(reader, "general.architecture") == "llama"
    layers = [_layer(take, cfg, i, permute) for i in range(cfg.depth)]
    weights = {"embed": {"embedding": take("token_embd.weight")}, "norm": {"scale": take("output_norm.weight")},
               "blocks": jax.tree.map(lambda *leaves: np.stack(leaves), *layers)}
    if not cfg.tie_embeddings:
        weights["head"] = {"kernel": np.ascontiguousarray(take("output.weight").T)}
    if raw:
        raise ValueError(f"GGUF tensors not mapped onto the decoder: {sorted(raw)}")
    # Built abstractly: a random init of every parameter would be wasted work.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    expected = nnx.to_pure_dict(state)
    keys = lambda tree: {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(tree)}  # noqa: E731
    want, got = keys(expected), keys(weights)
    if want != got:
        diff = sorted(f"{k}: file {got.get(k)}, model {want.get(k)}" for k in set(want) | set(got)
                      if want.get(k) != got.get(k))
        raise ValueError("GGUF tensors do not match the decoder's parameters:\n  " + "\n  ".join(diff))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: jnp.asarray(w, dtype), weights))
    return nnx.merge(graphdef, state)


def load(path: str | pathlib.Path, dtype=jnp.float32) -> tuple[Decoder, Tokenizer]:
    """The model in a GGUF file as a :class:`Decoder`, with its tokenizer.

    Args:
      path: a GGUF file of a supported architecture (:data:`ARCHITECTURES`) whose
        tensors are of supported types (:data:`TENSOR_TYPES`).
      dtype: parameter dtype (``jnp.bfloat16`` halves the memory).

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not a GGUF file, or an unsupported architecture, tensor type or
        tokenizer (each named, with what is supported).
    """
    reader = read(path)
    cfg = decoder_config(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    return load_weights(reader, cfg, dtype), tokenizer

